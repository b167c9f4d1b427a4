"""`pipeline.clients.loaders` with the real clients: webdataset's `.select` and open_clip's
`ClipLoss`."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from export_fixtures import truth_labelled_corpus

from pipeline.clients.loaders import LabelSelect, label_weighted_clip_loss


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    return truth_labelled_corpus(tmp_path_factory.mktemp("loaders_corpus"))


def test_select_keeps_pairs_whose_label_passes(corpus):
    import webdataset as wds

    rows = corpus["labels"].to_pylist()
    expected = {r["key"] for r in rows if r["soft_label"] >= 0.4}
    assert 0 < len(expected) < len(rows)
    urls = [str(p) for p in sorted(corpus["corpus"].glob("*.tar"))]
    select = LabelSelect(corpus["run"], min_label=0.4)
    # Pickled first, as DataLoader workers receive it; it loads each shard's table lazily.
    dataset = wds.WebDataset(urls, shardshuffle=False).select(pickle.loads(pickle.dumps(select)))
    samples = list(dataset)
    keys = [s["__key__"] for s in samples]
    assert len(keys) == len(set(keys)) and set(keys) == expected
    # Corrupt samples have no label row: dropped, whatever their bytes.
    unlabelled = {s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)} - {
        r["key"] for r in rows
    }
    assert unlabelled and not unlabelled & set(keys)
    labels = {r["key"]: r["soft_label"] for r in rows}
    assert all(select.label(s) == labels[s["__key__"]] for s in samples)


def test_select_by_subset(corpus):
    import webdataset as wds

    rows = corpus["labels"].to_pylist()
    expected = {r["key"] for r in rows if r["subset"] == "quasi_clean"}
    urls = [str(p) for p in sorted(corpus["corpus"].glob("*.tar"))]
    select = LabelSelect(corpus["run"], min_label=0.0, subsets=["quasi_clean"], cache_shards=1)
    keys = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False).select(select)]
    assert set(keys) == expected and len(keys) == len(expected)


def _features(batch: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(batch, dim, generator=generator), dim=1)
    text = torch.nn.functional.normalize(torch.randn(batch, dim, generator=generator), dim=1)
    return image.requires_grad_(), text.requires_grad_()


def test_weighted_loss_is_open_clips_clip_loss_when_every_label_is_one():
    from open_clip.loss import ClipLoss

    image, text = _features(16, 32, seed=0)
    scale = torch.tensor(14.3, requires_grad=True)
    ours = label_weighted_clip_loss(image, text, scale, torch.ones(16))
    theirs = ClipLoss()(image, text, scale)
    assert torch.allclose(ours, theirs, atol=1e-6)
    ours.backward()
    assert image.grad is not None and scale.grad is not None


def test_weighted_loss_scales_each_pairs_positive_terms():
    from open_clip.loss import ClipLoss

    image, text = _features(8, 16, seed=1)
    scale = 10.0
    labels = np.array([1, 0, 0.5, 1, 0.25, 1, 0, 0.75], dtype=np.float32)
    loss = label_weighted_clip_loss(image, text, scale, labels)
    # Per-pair terms from open_clip's own logits: ½(CE over row i + CE over column i).
    logits_i, logits_t = ClipLoss().get_logits(image, text, scale)
    target = torch.arange(8)
    per_pair = 0.5 * (
        torch.nn.functional.cross_entropy(logits_i, target, reduction="none")
        + torch.nn.functional.cross_entropy(logits_t, target, reduction="none")
    )
    assert torch.allclose(loss, (torch.from_numpy(labels) * per_pair).mean(), atol=1e-6)
    # A label-0 pair still shapes the others as a negative: its text gets a gradient.
    loss.backward()
    assert text.grad[1].abs().sum() > 0
