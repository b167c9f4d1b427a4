"""The embed pass with either decode (embed.decode cpu | device, the device path run on CPU
here) and any forward batch: the same samples, embeddings and labels within stated
tolerances. In-process (`embed_shards_on_cpu`, as a pooled Ray worker runs it): no Ray."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import EmbedConfig
from pipeline.core.mixture.fit import clean_posterior, fit_mixture
from pipeline.data.synthetic import make_corpus
from pipeline.models import ModelSpec
from pipeline.stages.embed import EmbedSpec, embed_shards_on_cpu

# Image embeddings of the two decodes: cosine >= IMAGE_COSINE per pair (pixels differ by up to
# 2 uint8 levels after the resize: tests/test_pixels.py). Labels: the GMM's clean posterior of
# the per-sample loss within POSTERIOR_GAP, and the clean/noisy split the same wherever the
# posterior is not within POSTERIOR_GAP of the 0.5 threshold.
IMAGE_COSINE = 0.999
POSTERIOR_GAP = 0.02
# Another forward batch changes only float rounding.
ROUNDING = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # 80 px images: the 64 px model resizes them, where the two decodes differ most.
    return make_corpus(
        tmp_path_factory.mktemp("decode") / "c",
        samples=160,
        noise=0.4,
        partial=0.0,
        seed=2,
        samples_per_shard=160,
        test_samples=0,
        image_size=80,
        corrupt=0.05,
    )


def _embed(corpus, out, **embed) -> tuple[pq.Table, pq.Table]:
    spec = EmbedSpec(
        output=str(out),
        round_index=0,
        views={"a": ModelSpec("ncl-tiny", None, seed=0)},
        seed=0,
        embed=EmbedConfig(batch_size=32, decode_threads=2, **embed),
        device="cpu",
    )
    rows = embed_shards_on_cpu({"path": np.array([str(corpus.shards[0])])}, spec)
    assert rows["error"].tolist() == [""]
    run = out / "rounds" / "0"
    return pq.read_table(run / "embeddings" / "00000.parquet"), pq.read_table(
        out / "quarantine" / "00000.parquet"
    )


def _matrix(table, column) -> np.ndarray:
    return np.stack(table.column(column).to_numpy(zero_copy_only=False)).astype(np.float32)


def _posterior(table) -> np.ndarray:
    loss = (table.column("loss_i2t_a").to_numpy() + table.column("loss_t2i_a").to_numpy()) / 2
    return clean_posterior(fit_mixture(loss, "gmm"), loss)


@pytest.fixture(scope="module")
def cpu_pass(corpus, tmp_path_factory):
    return _embed(corpus, tmp_path_factory.mktemp("cpu"), decode="cpu", forward_batch_size=32)


def test_device_decode_gives_the_same_samples_and_labels(corpus, cpu_pass, tmp_path):
    cpu, cpu_quarantine = cpu_pass
    device, device_quarantine = _embed(corpus, tmp_path, decode="device", forward_batch_size=64)
    assert device.column("key").to_pylist() == cpu.column("key").to_pylist()
    assert cpu_quarantine.num_rows > 0  # the corrupt samples
    assert sorted(device_quarantine.column("key").to_pylist()) == sorted(
        cpu_quarantine.column("key").to_pylist()
    )
    image_cos = (_matrix(cpu, "image_embedding_a") * _matrix(device, "image_embedding_a")).sum(1)
    assert image_cos.min() >= IMAGE_COSINE, image_cos.min()
    np.testing.assert_allclose(
        _matrix(device, "text_embedding_a"), _matrix(cpu, "text_embedding_a"), atol=1e-3
    )  # fp16 storage: identical text embeddings up to its rounding
    p_cpu, p_device = _posterior(cpu), _posterior(device)
    assert np.abs(p_cpu - p_device).max() <= POSTERIOR_GAP
    decided = np.abs(p_cpu - 0.5) > POSTERIOR_GAP
    np.testing.assert_array_equal((p_cpu > 0.5)[decided], (p_device > 0.5)[decided])


def test_forward_batch_changes_only_rounding(corpus, cpu_pass, tmp_path):
    cpu, _ = cpu_pass
    other, _ = _embed(corpus, tmp_path, decode="cpu", forward_batch_size=7)
    for column in ("image_embedding_a", "text_embedding_a"):
        np.testing.assert_allclose(_matrix(other, column), _matrix(cpu, column), atol=1e-3)
    for column in ("cosine_a", "loss_i2t_a", "loss_t2i_a"):
        np.testing.assert_allclose(
            other.column(column).to_numpy(), cpu.column(column).to_numpy(), atol=ROUNDING
        )
