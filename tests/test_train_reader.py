"""The training reader ships uint8 pixels at model resolution, decoded a chunk at a time, and
after normalisation they are the eval transform's float32 pixels bit for bit, so training on
CPU sees exactly the batches of the float32 reader before it (tolerance 0), with or without
the embed pass's admission record."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from shard_fixtures import write_tar
from test_pixels import SIZES, scene_jpeg

from pipeline.core.coteach import Phase
from pipeline.io.admitted import (
    SHARD_BYTES_KEY,
    SHARD_SHA256_KEY,
    ShardChangedError,
    file_signature,
)
from pipeline.io.decode import DecodeOptions
from pipeline.io.pixel_cache import PixelCache
from pipeline.models import ModelSpec, load_transforms
from pipeline.models.encode import normalize_pixels, pixel_spec
from pipeline.stages.train.data import read_training_batches
from pipeline.stages.train.spec import ViewSpec

MODEL = ModelSpec("ncl-tiny", None)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """One tar of scene JPEGs of several sizes (some larger than the model's 64 px), one of
    them broken, and the expected float32 pixels by caption."""
    preprocess, _ = load_transforms(MODEL)
    members, expected = [], {}
    for i in range(12):
        blob = scene_jpeg(SIZES[i % len(SIZES)], seed=i)
        caption = f"caption number {i}"
        members += [(f"k{i:02d}.jpg", blob), (f"k{i:02d}.txt", caption.encode())]
        expected[caption] = preprocess(Image.open(io.BytesIO(blob)).convert("RGB"))
    members += [("bad.jpg", b"\xff\xd8 not a jpeg"), ("bad.txt", b"broken image")]
    path = tmp_path_factory.mktemp("reader") / "00000.tar"
    write_tar(str(path), members)
    return str(path), expected


def _batches(path, admitted_dir=None, rows_per_batch=5, cache=None):
    """The reader's batches of one shard (streamed), as a Ray Data task would get them."""
    return read_training_batches(
        {"path": np.array([path])},
        model=MODEL,
        decode=DecodeOptions(),
        view=ViewSpec(name="A", init=MODEL, seed=3),
        epoch=1,
        phase=Phase(noisy=True, quasi_clean=True),
        admitted_dir=admitted_dir,
        rows_per_batch=rows_per_batch,
        pixel_cache=cache,
    )


def _read(path, admitted_dir=None, rows_per_batch=5):
    return list(_batches(path, admitted_dir, rows_per_batch))


def _check(batches, expected) -> list[str]:
    _, tokenizer = load_transforms(MODEL)
    spec = pixel_spec(load_transforms(MODEL)[0])
    by_tokens = {tuple(tokenizer([c]).numpy()[0]): c for c in expected}
    seen = []
    for batch in batches:
        assert batch["pixels"].dtype == np.uint8 and batch["pixels"].shape[1:] == (3, 64, 64)
        pixels = normalize_pixels(torch.from_numpy(batch["pixels"]), spec)
        for row, tokens in enumerate(batch["tokens"]):
            caption = by_tokens[tuple(tokens)]
            assert torch.equal(pixels[row], expected[caption]), caption
            seen.append(caption)
    return seen


def test_reader_pixels_are_the_eval_transform_bit_for_bit(shard):
    path, expected = shard
    batches = _read(path)
    assert [len(b["tokens"]) for b in batches] == [5, 5, 2]  # the broken sample is left out
    assert sorted(_check(batches, expected)) == sorted(expected)


def test_admitted_samples_are_decoded_per_chunk_with_the_same_pixels(shard, tmp_path):
    path, expected = shard
    keys = [f"k{i:02d}" for i in range(12) if i != 4]  # k04 was not admitted (a duplicate)
    data = Path(path).read_bytes()
    meta = {SHARD_BYTES_KEY: str(len(data)), SHARD_SHA256_KEY: hashlib.sha256(data).hexdigest()}
    table = pa.table({"key": keys}).replace_schema_metadata(meta)
    pq.write_table(table, tmp_path / "00000.parquet")
    order_free = _read(path)
    admitted = _read(path, admitted_dir=str(tmp_path))
    seen = _check(admitted, expected)
    assert sorted(seen) == sorted(c for c in expected if c != "caption number 4")
    assert len(seen) == sum(len(b["tokens"]) for b in order_free) - 1


# ------------------------------------------------------------------------- the pixel cache


def _cached_read(path, cache, admitted_dir=None):
    return list(_batches(path, admitted_dir, cache=cache))


def _same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            assert np.array_equal(x[name], y[name]), name


class _Decoded(BaseException):
    """Raised by the spy: a BaseException, so the reader's handler for images that do not
    decode (`except Exception`) cannot take it for a bad image."""


def _refuse_decode(_data):
    raise _Decoded("the reader decoded an image the cache holds")


def test_second_read_comes_from_the_cache_bit_for_bit(shard, tmp_path, monkeypatch):
    path, expected = shard
    cache = PixelCache(str(tmp_path / "cache"), 10**9)
    first = _cached_read(path, cache)
    entries = list((tmp_path / "cache").glob("00000-64px-*.parquet"))
    assert len(entries) == 1
    _same_batches(first, _read(path))  # the cache changes nothing in the first read
    monkeypatch.setattr("pipeline.stages.train.data.decode_image", _refuse_decode)
    second = _cached_read(path, cache)  # the broken sample is known to fail: not decoded
    _same_batches(first, second)
    assert sorted(_check(second, expected)) == sorted(expected)


def test_admitted_reads_fill_the_cache_after_the_shard(shard, tmp_path, monkeypatch):
    path, _ = shard
    data = Path(path).read_bytes()
    meta = {SHARD_BYTES_KEY: str(len(data)), SHARD_SHA256_KEY: hashlib.sha256(data).hexdigest()}
    pq.write_table(
        pa.table({"key": [f"k{i:02d}" for i in range(12)]}).replace_schema_metadata(meta),
        tmp_path / "00000.parquet",
    )
    cache = PixelCache(str(tmp_path / "cache"), 10**9)
    first = _cached_read(path, cache, admitted_dir=str(tmp_path))
    monkeypatch.setattr("pipeline.stages.train.data.decode_image", _refuse_decode)
    _same_batches(first, _cached_read(path, cache, admitted_dir=str(tmp_path)))
    # The entry's recorded fingerprint is checked as the tar's would be.
    meta[SHARD_SHA256_KEY] = "0" * 64
    pq.write_table(
        pa.table({"key": ["k00"]}).replace_schema_metadata(meta), tmp_path / "00000.parquet"
    )
    with pytest.raises(ShardChangedError, match="changed after its embed pass"):
        _cached_read(path, cache, admitted_dir=str(tmp_path))


def test_an_entry_is_for_one_shard_file_size_and_decoder(tmp_path):
    cache = PixelCache(str(tmp_path), 10**9)
    base = cache.path("/data/00000.tar", "00000", "1234-5678", 64, "auto|txt|50000000")
    assert base.name.startswith("00000-64px-") and base.parent == tmp_path
    others = [
        cache.path("/data/00000.tar", "00000", "1234-9999", 64, "auto|txt|50000000"),  # rewritten
        cache.path("/other/00000.tar", "00000", "1234-5678", 64, "auto|txt|50000000"),
        cache.path("/data/00000.tar", "00000", "1234-5678", 224, "auto|txt|50000000"),
        cache.path("/data/00000.tar", "00000", "1234-5678", 64, "png|txt|50000000"),
    ]
    assert len({base, *others}) == 5


def test_a_rewritten_shard_is_read_again(shard, tmp_path, monkeypatch):
    path, _ = shard
    copy = tmp_path / "00000.tar"
    copy.write_bytes(Path(path).read_bytes())
    cache = PixelCache(str(tmp_path / "cache"), 10**9)
    first = _cached_read(str(copy), cache)
    os.utime(copy, ns=(1, 1))  # same bytes, another signature: a new entry
    monkeypatch.setattr("pipeline.stages.train.data.decode_image", _refuse_decode)
    with pytest.raises(_Decoded):
        _cached_read(str(copy), cache)
    monkeypatch.undo()
    _same_batches(first, _cached_read(str(copy), cache))
    assert len(list((tmp_path / "cache").glob("*.parquet"))) == 2


def test_a_broken_entry_is_decoded_again_and_rewritten(shard, tmp_path, caplog):
    path, _ = shard
    cache = PixelCache(str(tmp_path), 10**9)
    first = _cached_read(path, cache)
    (entry,) = tmp_path.glob("*.parquet")
    entry.write_bytes(entry.read_bytes()[:1000])  # cut, as a full disk or a crash would
    _same_batches(first, _cached_read(path, cache))
    assert "does not load" in caplog.text
    assert cache.load(entry) is not None


def _store(cache: PixelCache, path, keys=("k", "bad")) -> bool:
    """Write an entry of one 64 px image (12,288 bytes) and one that did not decode."""
    writer = cache.writer(path, len(keys), 64)
    if writer is None:
        return False
    writer.put(0, np.full((3, 64, 64), 7, np.uint8))
    return writer.commit(list(keys), ["a caption\x00", "x"], 10, "ab")


def test_the_budget_evicts_unused_entries_least_recently_used_first(tmp_path):
    cache = PixelCache(str(tmp_path), 60_000)  # two entries of 24,576 bytes of pixels fit
    paths = [tmp_path / f"s{i}-64px-x.parquet" for i in range(3)]
    for i, path in enumerate(paths[:2]):
        assert _store(cache, path)
        os.utime(path, (1000 + i, 1000 + i))  # last used in 1970: stale
    back = cache.load(paths[0])  # used now: s1 is the least recently used, and stale
    assert back.keys == ["k", "bad"] and back.captions == ["a caption\x00", "x"]
    assert back.ok.tolist() == [True, False] and back.pixels[0].max() == 7
    assert isinstance(back.pixels, np.memmap) and (back.size, back.sha256) == (10, "ab")
    assert _store(cache, paths[2])
    assert [p.exists() for p in paths] == [True, False, True]
    assert not paths[1].with_suffix(".npy").exists()  # an entry goes with its pixels
    assert not _store(PixelCache(str(tmp_path), 10_000), tmp_path / "big.parquet")
    # Entries in use (read within STALE_S) stay: a corpus larger than the budget does not churn.
    assert not _store(cache, tmp_path / "s3-64px-x.parquet")
    assert [p.exists() for p in paths] == [True, False, True]
    assert not [f for f in tmp_path.iterdir() if ".tmp-" in f.name]  # nothing left half-written
    off = PixelCache(str(tmp_path), 0)
    assert not off.enabled and off.load(paths[0]) is None and off.writer(paths[0], 1, 64) is None


def test_no_signature_no_cache(tmp_path):
    assert file_signature("pipe:cat /data/00000.tar") is None
    assert file_signature(str(tmp_path / "missing.tar")) is None
    (tmp_path / "a.tar").write_bytes(b"x" * 10)
    assert file_signature(str(tmp_path / "a.tar")).startswith("10-")


def test_a_reader_stopped_mid_shard_leaves_no_entry(shard, tmp_path):
    path, _ = shard
    cache = PixelCache(str(tmp_path), 10**9)
    batches = _batches(path, cache=cache)
    next(batches)
    batches.close()  # as Ray Data closes a pipeline the warm-up no longer needs
    assert list(tmp_path.iterdir()) == []
