"""Tests for the noisy demo corpus generator (pipeline/data/synthetic.py)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.data.scenes import draw_scene
from pipeline.data.synthetic import (
    ATTRIBUTES,
    BACKGROUNDS,
    COLOURS,
    CORRUPT_MODES,
    GROUND_TRUTH_SCHEMA,
    IMG2DATASET_SCHEMA,
    KIND_DEGREES,
    MIN_MISMATCH_DIFF,
    POSITIONS,
    SHAPES,
    SIZES,
    TEMPLATES,
    Scene,
    make_corpus,
    parse_caption,
    render_caption,
)

SMALL = {"samples": 60, "samples_per_shard": 20, "test_samples": 25, "image_size": 48}
JSON_FIELDS = {
    "url", "caption", "key", "status", "error_message", "width", "height",
    "original_width", "original_height", "exif", "sha256",
}  # fmt: skip


def read_tar(path: str | Path) -> list[tuple[str, bytes]]:
    """(member name, bytes) in archive order."""
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def group(members: list[tuple[str, bytes]]) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for name, data in members:
        key, ext = name.split(".", 1)
        samples.setdefault(key, {})[ext] = data
    return samples


def ground_truth(path: str | Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def n_diff(a: Scene, b: Scene) -> int:
    return sum(getattr(a, f) != getattr(b, f) for f in ATTRIBUTES)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), seed=7, **SMALL)


# ------------------------------------------------------------------------------------- layout


def test_layout_files_and_summary(corpus):
    out = Path(corpus.out_dir)
    assert corpus.shards == tuple(str(out / f"{i:05d}.tar") for i in range(3))
    assert corpus.test_shards == tuple(str(out / "test" / f"{i:05d}.tar") for i in range(2))
    for tar in corpus.shards + corpus.test_shards:
        stem = tar[: -len(".tar")]
        assert Path(f"{stem}.parquet").is_file() and Path(f"{stem}_stats.json").is_file()
    assert Path(corpus.ground_truth) == out / "ground_truth.parquet"
    assert Path(corpus.test_ground_truth) == out / "test" / "ground_truth.parquet"
    assert corpus.samples == 60 and corpus.test_samples == 25
    assert corpus.counts == {"clean": 30, "partial": 6, "mismatched": 24}  # floor(0.4*60) etc.
    assert corpus.corrupt == 0 and set(corpus.corrupt_counts) == set(CORRUPT_MODES)
    # No temp files left behind.
    assert not list(out.rglob("*.tmp*"))


def test_tar_members_keys_and_json(corpus):
    for shard_index, tar in enumerate(corpus.shards):
        members = read_tar(tar)
        names = [name for name, _ in members]
        assert len(names) == 3 * 20
        for i in range(20):
            key = f"{shard_index:05d}{i:04d}"  # img2dataset: shard prefix + index in shard
            assert names[3 * i : 3 * i + 3] == [f"{key}.jpg", f"{key}.txt", f"{key}.json"]
        for key, parts in group(members).items():
            assert re.fullmatch(r"\d{9}", key)
            meta = json.loads(parts["json"])
            assert set(meta) == JSON_FIELDS
            assert meta["key"] == key
            assert meta["url"] == f"https://example.invalid/img/{key}.jpg"
            assert meta["caption"] == parts["txt"].decode("utf-8")
            assert meta["status"] == "success" and meta["error_message"] is None
            assert meta["exif"] is None
            assert meta["sha256"] == hashlib.sha256(parts["jpg"]).hexdigest()
            assert meta["width"] == meta["height"] == SMALL["image_size"]
            assert meta["original_width"] >= meta["width"]
            with Image.open(io.BytesIO(parts["jpg"])) as img:
                img.load()
                assert img.format == "JPEG" and img.mode == "RGB"
                assert img.size == (SMALL["image_size"], SMALL["image_size"])


def test_parquet_and_stats_match_tar(corpus):
    for tar in corpus.shards + corpus.test_shards:
        stem = tar[: -len(".tar")]
        table = pq.read_table(f"{stem}.parquet")
        assert table.schema.equals(IMG2DATASET_SCHEMA)
        metas = [json.loads(parts["json"]) for parts in group(read_tar(tar)).values()]
        assert table.to_pylist() == metas
        stats = json.loads(Path(f"{stem}_stats.json").read_text())
        assert stats["count"] == stats["successes"] == len(metas)
        assert stats["failed_to_download"] == stats["failed_to_resize"] == 0
        assert stats["status_dict"] == {"success": len(metas)}
        assert stats["end_time"] >= stats["start_time"]
        assert math.isclose(stats["duration"], stats["end_time"] - stats["start_time"])


def test_ground_truth_schema_and_tar_agree(corpus):
    table = pq.read_table(corpus.ground_truth)
    assert table.schema.remove_metadata().equals(GROUND_TRUTH_SCHEMA.remove_metadata())
    assert table.schema.metadata[b"ncl.schema"] == b"ground_truth.v1"
    params = json.loads(table.schema.metadata[b"ncl.make_corpus"])
    assert params["seed"] == 7 and params["samples"] == 60
    rows = table.to_pylist()
    captions = {}
    for tar in corpus.shards:
        for key, parts in group(read_tar(tar)).items():
            captions[key] = parts["txt"].decode("utf-8")
    assert [r["key"] for r in rows] == list(captions)  # same keys, same order
    for row in rows:
        assert row["noisy_caption"] == captions[row["key"]]
        assert row["shard"] == row["key"][:5]
        assert row["degree"] == KIND_DEGREES[row["kind"]]
        assert row["corrupt"] is None


def test_webdataset_reads_shards(corpus):
    wds = pytest.importorskip("webdataset")
    dataset = wds.WebDataset(list(corpus.shards), shardshuffle=False).decode("pil")
    samples = list(dataset)
    assert len(samples) == 60
    assert {"jpg", "txt", "json"} <= set(samples[0])
    assert samples[0]["jpg"].size == (SMALL["image_size"], SMALL["image_size"])


# ---------------------------------------------------------------------------------- determinism


def test_same_seed_same_bytes(tmp_path):
    a = make_corpus(tmp_path / "a", seed=3, **SMALL)
    b = make_corpus(tmp_path / "b", seed=3, **SMALL)
    for x, y in zip(a.shards + a.test_shards, b.shards + b.test_shards, strict=True):
        assert Path(x).read_bytes() == Path(y).read_bytes()
        assert (
            Path(x).with_suffix(".parquet").read_bytes()
            == Path(y).with_suffix(".parquet").read_bytes()
        )
    assert Path(a.ground_truth).read_bytes() == Path(b.ground_truth).read_bytes()
    assert Path(a.test_ground_truth).read_bytes() == Path(b.test_ground_truth).read_bytes()


def test_different_seed_different_bytes(tmp_path):
    a = make_corpus(tmp_path / "a", seed=3, **SMALL)
    b = make_corpus(tmp_path / "b", seed=4, **SMALL)
    for x, y in zip(a.shards + a.test_shards, b.shards + b.test_shards, strict=True):
        assert Path(x).read_bytes() != Path(y).read_bytes()
    assert ground_truth(a.ground_truth) != ground_truth(b.ground_truth)


def test_images_are_not_byte_identical(corpus):
    jpgs = [p["jpg"] for t in corpus.shards for p in group(read_tar(t)).values()]
    assert len(set(jpgs)) == len(jpgs)


def test_corruption_does_not_reshuffle_noise(tmp_path):
    # Independent seed streams: adding corruption keeps kinds and captions of every sample.
    a = ground_truth(make_corpus(tmp_path / "a", seed=5, **SMALL).ground_truth)
    b = ground_truth(make_corpus(tmp_path / "b", seed=5, corrupt=0.2, **SMALL).ground_truth)
    strip = ("corrupt",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in a] == [
        {k: v for k, v in r.items() if k not in strip} for r in b
    ]


# -------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize(
    ("samples", "noise", "partial"),
    [(60, 0.4, 0.1), (100, 0.29, 0.0), (7, 0.5, 0.5), (10, 0.0, 0.0), (10, 1.0, 0.0), (2, 0.5, 0)],
)
def test_counts_are_floor_of_fractions(tmp_path, samples, noise, partial):
    summary = make_corpus(
        tmp_path, samples=samples, noise=noise, partial=partial, samples_per_shard=20,
        test_samples=0, image_size=32,
    )  # fmt: skip
    rows = ground_truth(summary.ground_truth)
    expected = {
        "mismatched": math.floor(round(noise * samples, 9)),
        "partial": math.floor(round(partial * samples, 9)),
    }
    expected["clean"] = samples - expected["mismatched"] - expected["partial"]
    got = {kind: sum(r["kind"] == kind for r in rows) for kind in KIND_DEGREES}
    assert got == expected == summary.counts
    assert len(rows) == samples
    assert summary.test_shards == () and summary.test_ground_truth is None


def test_clean_captions_are_true(corpus):
    for row in ground_truth(corpus.ground_truth):
        assert parse_caption(row["caption"]) is not None
        if row["kind"] == "clean":
            assert row["noisy_caption"] == row["caption"]
            assert row["changed_attribute"] is None


def test_mismatched_captions_come_from_other_samples(corpus):
    rows = ground_truth(corpus.ground_truth)
    true_captions = {r["caption"] for r in rows}
    mismatched = [r for r in rows if r["kind"] == "mismatched"]
    assert mismatched
    for row in mismatched:
        assert row["noisy_caption"] != row["caption"]
        assert row["changed_attribute"] is None
        assert row["noisy_caption"] in true_captions  # another sample's caption (NCR protocol)
        diff = n_diff(parse_caption(row["caption"]), parse_caption(row["noisy_caption"]))
        assert diff >= MIN_MISMATCH_DIFF


@pytest.mark.parametrize("seed", range(4))
def test_mismatch_holds_for_tiny_sets(tmp_path, seed):
    # One or two mismatched samples: no derangement inside the set may exist.
    for noise in (0.1, 0.2):
        summary = make_corpus(
            tmp_path / f"{noise}", samples=10, noise=noise, partial=0.0, seed=seed,
            test_samples=0, image_size=32,
        )  # fmt: skip
        for row in ground_truth(summary.ground_truth):
            if row["kind"] == "mismatched":
                true, noisy = parse_caption(row["caption"]), parse_caption(row["noisy_caption"])
                assert n_diff(true, noisy) >= MIN_MISMATCH_DIFF


def test_partial_captions_change_exactly_one_attribute(corpus):
    partial = [r for r in ground_truth(corpus.ground_truth) if r["kind"] == "partial"]
    assert partial
    for row in partial:
        true, noisy = parse_caption(row["caption"]), parse_caption(row["noisy_caption"])
        changed = [f for f in ATTRIBUTES if getattr(true, f) != getattr(noisy, f)]
        assert changed == [row["changed_attribute"]]
        if changed == ["colour"]:
            assert noisy.colour != noisy.background


# --------------------------------------------------------------------------------- test split


def test_test_split_is_clean_and_disjoint(corpus):
    train_keys = {r["key"] for r in ground_truth(corpus.ground_truth)}
    rows = ground_truth(corpus.test_ground_truth)
    assert len(rows) == 25
    assert all(r["kind"] == "clean" and r["degree"] == 1.0 for r in rows)
    assert all(r["noisy_caption"] == r["caption"] for r in rows)
    test_keys = [r["key"] for r in rows]
    assert not train_keys & set(test_keys)
    assert all(re.fullmatch(r"9\d{8}", k) for k in test_keys)
    tar_keys = [k for t in corpus.test_shards for k in group(read_tar(t))]
    assert tar_keys == test_keys
    assert tar_keys[0] == "900000000" and tar_keys[20] == "900010000"
    assert [r["shard"] for r in rows] == ["00000"] * 20 + ["00001"] * 5


def test_test_split_differs_from_train_stream(corpus):
    train = [r["caption"] for r in ground_truth(corpus.ground_truth)][:25]
    test = [r["caption"] for r in ground_truth(corpus.test_ground_truth)]
    assert train != test


def test_validation_split_is_clean_disjoint_and_leaves_the_rest_unchanged(tmp_path):
    """val/ selects the warm-up: clean, keys of its own (8xxxxxxxx), drawn from its own stream,
    and adding it changes no training or test sample."""
    options = dict(samples=40, samples_per_shard=20, test_samples=10, image_size=32, seed=3)
    without = make_corpus(tmp_path / "a", **options)
    with_val = make_corpus(tmp_path / "b", val_samples=12, **options)
    assert without.val_shards == () and without.val_ground_truth is None
    assert with_val.val_shards == (str(tmp_path / "b" / "val" / "00000.tar"),)
    rows = ground_truth(with_val.val_ground_truth)
    assert len(rows) == 12 and all(r["kind"] == "clean" for r in rows)
    assert all(re.fullmatch(r"8\d{8}", r["key"]) for r in rows)
    test_captions = {r["caption"] for r in ground_truth(with_val.test_ground_truth)}
    assert [r["caption"] for r in rows] != list(test_captions)[:12]
    for x, y in zip(
        without.shards + without.test_shards, with_val.shards + with_val.test_shards, strict=True
    ):
        assert Path(x).read_bytes() == Path(y).read_bytes()
    again = make_corpus(tmp_path / "b", **options)  # a rerun without val/ removes it
    assert again.val_shards == () and not (tmp_path / "b" / "val").exists()


# ----------------------------------------------------------------------------------- corrupt


def test_corrupt_samples_are_corrupt(tmp_path):
    summary = make_corpus(
        tmp_path, samples=40, corrupt=0.5, samples_per_shard=20, test_samples=5, image_size=32
    )
    rows = ground_truth(summary.ground_truth)
    modes = [r["corrupt"] for r in rows if r["corrupt"] is not None]
    assert summary.corrupt == len(modes) == 20
    assert summary.corrupt_counts == {m: 4 for m in CORRUPT_MODES}  # round-robin
    assert {r["kind"] for r in rows if r["corrupt"]} <= set(KIND_DEGREES)

    by_key = {r["key"]: r for r in rows}
    for tar in summary.shards:
        for key, parts in group(read_tar(tar)).items():
            mode = by_key[key]["corrupt"]
            meta = json.loads(parts["json"])
            if mode == "truncated_jpeg":
                img = Image.open(io.BytesIO(parts["jpg"]))  # the header is intact ...
                with pytest.raises(OSError, match="(?i)truncated"):
                    img.load()  # ... the pixels are not
                assert meta["sha256"] != hashlib.sha256(parts["jpg"]).hexdigest()
            elif mode == "empty_image":
                assert parts["jpg"] == b""
                with pytest.raises(OSError):
                    Image.open(io.BytesIO(parts["jpg"]))
            elif mode == "missing_txt":
                assert "txt" not in parts
                assert meta["caption"] == by_key[key]["noisy_caption"]
            elif mode == "invalid_utf8":
                with pytest.raises(UnicodeDecodeError):
                    parts["txt"].decode("utf-8")
            elif mode == "empty_caption":
                assert parts["txt"] == b"" and meta["caption"] == ""
            else:
                assert mode is None
                with Image.open(io.BytesIO(parts["jpg"])) as img:
                    img.load()
                assert parts["txt"].decode("utf-8") == by_key[key]["noisy_caption"]
    # The held-out split is never corrupted.
    for tar in summary.test_shards:
        for parts in group(read_tar(tar)).values():
            assert (
                parts["txt"]
                and hashlib.sha256(parts["jpg"]).hexdigest() == json.loads(parts["json"])["sha256"]
            )


# -------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise": 0.7, "partial": 0.5}, r"noise \+ partial must be <= 1"),
        ({"noise": -0.1}, r"noise must be a fraction in \[0, 1\]"),
        ({"partial": 1.5}, r"partial must be a fraction"),
        ({"corrupt": 2.0}, r"corrupt must be a fraction"),
        ({"noise": float("nan")}, r"noise must be a fraction"),
        ({"noise": "0.4"}, r"noise must be a number"),
        ({"samples": 1}, r"samples must be an integer >= 2"),
        ({"samples": 10.0}, r"samples must be an integer"),
        ({"test_samples": -1}, r"test_samples must be an integer >= 0"),
        ({"samples_per_shard": 0}, r"samples_per_shard must be an integer in \[1, 10000\]"),
        ({"samples_per_shard": 10_001}, r"samples_per_shard"),
        ({"image_size": 16}, r"image_size must be an integer in \[32, 1024\]"),
        ({"seed": -1}, r"seed must be a non-negative integer"),
        ({"samples": 90_001, "samples_per_shard": 1}, r"raise samples_per_shard"),
    ],
)
def test_argument_validation(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_corpus(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()  # validated before touching the disk


def test_rerun_replaces_previous_corpus(tmp_path):
    make_corpus(tmp_path, samples=60, samples_per_shard=20, test_samples=25, image_size=32)
    summary = make_corpus(tmp_path, samples=30, samples_per_shard=20, test_samples=0, image_size=32)
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["00000.tar", "00001.tar"]
    assert not (tmp_path / "00002_stats.json").exists()
    assert not list((tmp_path / "test").glob("*"))
    assert len(ground_truth(summary.ground_truth)) == 30


def test_refuses_foreign_shards(tmp_path):
    (tmp_path / "00000.tar").write_bytes(b"not ours")
    with pytest.raises(ValueError, match="choose an empty or new out_dir"):
        make_corpus(tmp_path, samples=10, test_samples=0, image_size=32)
    assert (tmp_path / "00000.tar").read_bytes() == b"not ours"


# ------------------------------------------------------------------------- captions and images

scenes = st.builds(
    Scene,
    shape=st.sampled_from(SHAPES),
    colour=st.sampled_from(list(COLOURS)),
    size=st.sampled_from(SIZES),
    position=st.sampled_from(POSITIONS),
    count=st.sampled_from((1, 2, 3)),
    background=st.sampled_from(list(BACKGROUNDS)),
)


@settings(max_examples=200, deadline=None)
@given(scene=scenes, template=st.integers(0, len(TEMPLATES) - 1), variant=st.integers(0, 1))
def test_caption_round_trip(scene, template, variant):
    caption = render_caption(scene, template, variant)
    assert parse_caption(caption) == scene
    assert caption == caption.strip() and "  " not in caption
    # Short enough for a 32-token text tower (words are a loose upper bound on BPE pieces).
    assert len(caption.split()) <= 16


def test_parse_rejects_other_text():
    assert parse_caption("a photo of a dog") is None
    assert parse_caption("") is None


def test_templates_are_varied(corpus):
    rows = ground_truth(corpus.ground_truth)
    starts = {" ".join(r["caption"].split()[:2]) for r in rows}
    assert len(starts) >= 5


@pytest.mark.parametrize("position", POSITIONS)
def test_drawn_objects_sit_where_the_caption_says(position):
    # Object pixels = far from the background colour; their centroid must lie on the named side.
    size = 64
    scene = Scene("square", "red", "small", position, 1, "white")
    img = np.asarray(draw_scene(scene, size, np.random.default_rng(0)), dtype=np.float32)
    mask = np.linalg.norm(img - np.asarray(BACKGROUNDS["white"]), axis=-1) > 100
    ys, xs = np.nonzero(mask)
    cx, cy = xs.mean() / size, ys.mean() / size
    expected = {
        "left": cx < 0.4, "right": cx > 0.6, "top": cy < 0.4, "bottom": cy > 0.6,
        "centre": 0.4 < cx < 0.6 and 0.4 < cy < 0.6,
    }  # fmt: skip
    assert expected[position], (cx, cy)
    colour = img[mask].mean(axis=0)
    assert np.linalg.norm(colour - np.asarray(COLOURS["red"])) < 40


def test_sizes_and_counts_are_visible():
    def object_pixels(size: str, count: int) -> int:
        scene = Scene("circle", "blue", size, "centre", count, "white")
        img = np.asarray(draw_scene(scene, 64, np.random.default_rng(1)), np.float32)
        return int((np.linalg.norm(img - np.asarray(BACKGROUNDS["white"]), axis=-1) > 100).sum())

    assert object_pixels("large", 1) > 2 * object_pixels("small", 1)
    assert object_pixels("small", 3) > 2 * object_pixels("small", 1)
