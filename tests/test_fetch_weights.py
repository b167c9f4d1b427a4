"""The driver fetches a pretrained tag's weights once, before any worker starts
(pipeline.models.fetch): a real open_clip download of a tag whose URL is a local file (open_clip
reads file:// URLs as it reads https), registered in open_clip's tag table as the built-in tags
are, into a cache under a temporary HOME. Offline, the tag is refused before the fetch and
loads from the cache after it."""

from __future__ import annotations

import os
from pathlib import Path

import open_clip
import pytest
import torch

from pipeline.models import ModelLoadError, ModelSpec, check_weights_available, load_clip
from pipeline.models.fetch import fetch_weights


@pytest.fixture
def tiny_tag(tmp_path, monkeypatch):
    """A tag 'unit' of ncl-tiny whose weights (seed 7) live at a file:// URL."""
    source = tmp_path / "published" / "ncl-tiny-unit.pt"
    source.parent.mkdir()
    weights = load_clip(ModelSpec("ncl-tiny", None, seed=7), "cpu").model.state_dict()
    torch.save(weights, source)
    tags = {"unit": open_clip.pretrained._pcfg(url=source.as_uri())}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, "ncl-tiny", tags)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # open_clip's default cache: ~/.cache/clip
    return source, weights


def test_a_tag_is_fetched_once_and_then_loads_offline(tiny_tag):
    source, weights = tiny_tag
    spec = ModelSpec("ncl-tiny", "unit")
    with pytest.raises(ModelLoadError, match="unit"):
        check_weights_available(spec)  # offline and not cached yet
    path = fetch_weights(spec)
    assert path == os.path.expanduser("~/.cache/clip/ncl-tiny-unit.pt")
    assert Path(path).read_bytes() == source.read_bytes()
    source.unlink()  # a second fetch (view B, a rerun) reads the cache, downloads nothing
    assert fetch_weights(spec) == path
    check_weights_available(spec)
    loaded = load_clip(spec, "cpu").model.state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in weights.items())


def test_a_tag_is_fetched_into_model_cache_dir(tiny_tag, tmp_path):
    source, _ = tiny_tag
    spec = ModelSpec("ncl-tiny", "unit", cache_dir=str(tmp_path / "shared"))
    path = fetch_weights(spec)
    assert path == str(tmp_path / "shared" / "ncl-tiny-unit.pt")
    assert Path(path).read_bytes() == source.read_bytes()
    assert not os.path.exists(os.path.expanduser("~/.cache/clip"))  # nothing in the default
    check_weights_available(spec)  # offline: found in model.cache_dir


def test_nothing_to_fetch_for_random_init_or_a_file(tiny_tag):
    source, _ = tiny_tag
    assert fetch_weights(ModelSpec("ncl-tiny", None)) is None
    assert fetch_weights(ModelSpec("ncl-tiny", str(source))) is None
    assert not os.path.exists(os.path.expanduser("~/.cache/clip"))
