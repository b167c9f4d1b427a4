"""Noisy demo corpus generator: procedurally drawn scenes in the img2dataset layout.

Contract (docs/corpus.md; file names and ground-truth columns are a contract):
- `make_corpus(out_dir, ...)` writes `NNNNN.tar` shards (`{key}.jpg`, `.txt`, `.json` per
  sample), their img2dataset `.parquet` and `_stats.json`, `ground_truth.parquet`, and clean
  `test/` and `val/` splits with their own ground truth; keys are unique across the splits.
- `noise_model`: `ncr` (the NCR / BiCro protocol: mismatched pairs take another pair's caption,
  partial pairs have one attribute changed; `GROUND_TRUTH_SCHEMA`), `web` (noise that follows
  the image, `pipeline.data.web_noise`) or `teacher` (clean, blind to count and position); the
  last two write `GROUND_TRUTH_V2_SCHEMA`.
- Everything except the wall-clock fields of `*_stats.json` is a pure function of the
  arguments: the same seed gives byte-identical tars and Parquet files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.noise import (
    CORRUPT_MODES,
    KIND_DEGREES,
    MIN_MISMATCH_DIFF,
    Sample,
    apply_corruption,
    apply_noise,
    draw_samples,
    fraction_count,
)
from pipeline.data.scenes import (
    ATTRIBUTES,
    BACKGROUNDS,
    COLOURS,
    COUNTS,
    POSITIONS,
    SHAPES,
    SIZES,
    TEMPLATES,
    Scene,
    draw_scene,
    encode_jpeg,
    parse_caption,
    render_caption,
)
from pipeline.data.shards import IMG2DATASET_SCHEMA, write_shard
from pipeline.data.web_noise import (
    NOISE_TYPES,
    WebNoise,
    WebSample,
    apply_web_noise,
    draw_pages,
    draw_teacher_rows,
    noise_type_counts,
    render_jpeg,
)
from pipeline.io.tables import TEMP_SUFFIX, open_atomic

__all__ = [
    "QUICK_DEMO",
    "ATTRIBUTES",
    "BACKGROUNDS",
    "COLOURS",
    "COUNTS",
    "CORRUPT_MODES",
    "GROUND_TRUTH_SCHEMA",
    "GROUND_TRUTH_V2_SCHEMA",
    "IMG2DATASET_SCHEMA",
    "KIND_DEGREES",
    "MIN_MISMATCH_DIFF",
    "NOISE_MODELS",
    "NOISE_TYPES",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "TEMPLATES",
    "TEST_SHARD_OFFSET",
    "VAL_SHARD_OFFSET",
    "CorpusSummary",
    "Scene",
    "WebNoise",
    "make_corpus",
    "parse_caption",
    "render_caption",
]

# Held-out keys start at this shard prefix so they never collide with training keys.
TEST_SHARD_OFFSET = 90_000
VAL_SHARD_OFFSET = 80_000  # the validation split's keys, below the test split's
_MAX_PER_SHARD = 10_000  # the 4-digit in-shard part of a key

# Seed streams: independent numpy Generators per purpose, so e.g. changing `corrupt` does not
# reshuffle which samples are noisy.
_STREAM_SCENES, _STREAM_NOISE, _STREAM_CORRUPT, _STREAM_PIXELS = 1, 2, 3, 4
# The web and teacher corpora draw from streams of their own; the ncr streams stay untouched.
_STREAM_WEB_PAGES, _STREAM_WEB_NOISE, _STREAM_WEB_PIXELS, _STREAM_TEACHER = 5, 6, 7, 8
NOISE_MODELS: tuple[str, ...] = ("ncr", "web", "teacher")
_SPLIT_TRAIN, _SPLIT_TEST, _SPLIT_VAL = 0, 1, 2

_SHARD_FILE = re.compile(rf"^\d{{5}}(\.tar|\.parquet|_stats\.json)({TEMP_SUFFIX})?$")

GROUND_TRUTH_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),  # tar basename without .tar, e.g. 00003
        pa.field("kind", pa.string(), nullable=False),  # clean | partial | mismatched
        pa.field("degree", pa.float32(), nullable=False),  # 1.0 | 0.5 | 0.0
        pa.field("caption", pa.string(), nullable=False),  # true caption of the image
        pa.field("noisy_caption", pa.string(), nullable=False),  # caption written to the tar
        pa.field("changed_attribute", pa.string(), nullable=True),  # partial pairs only
        pa.field("corrupt", pa.string(), nullable=True),  # a CORRUPT_MODES entry, or null
    ],
    metadata={"ncl.schema": "ground_truth.v1"},
)
# The web and teacher corpora: v1's columns (degree per row: page captions are partial at
# 0.25) plus the noise type and the per-row subgroups of per-subgroup retrieval.
GROUND_TRUTH_V2_SCHEMA = pa.schema(
    [
        *GROUND_TRUTH_SCHEMA,
        pa.field("noise_type", pa.string(), nullable=False),  # a NOISE_TYPES entry
        pa.field("cluttered", pa.bool_(), nullable=False),  # unmentioned distractor objects
        pa.field("low_contrast", pa.bool_(), nullable=False),  # object close to the background
        pa.field("caption_style", pa.string(), nullable=True),  # full|short|alt|teacher|null
        pa.field("page", pa.int32(), nullable=True),  # page within the split; null: teacher
        pa.field("duplicate_of", pa.string(), nullable=True),  # key whose image a dup copies
    ],
    metadata={"ncl.schema": "ground_truth.v2"},
)


@dataclass(frozen=True)
class CorpusSummary:
    """What `make_corpus` wrote. Paths are strings; sequences are tuples (immutable)."""

    out_dir: str
    shards: tuple[str, ...]  # training tar paths, in key order
    test_shards: tuple[str, ...]  # held-out tar paths (empty when test_samples == 0)
    ground_truth: str  # out_dir/ground_truth.parquet
    test_ground_truth: str | None  # out_dir/test/ground_truth.parquet, or None
    samples: int  # training samples, corrupt ones included
    test_samples: int
    val_shards: tuple[str, ...]  # validation tar paths (empty when val_samples == 0)
    val_ground_truth: str | None  # out_dir/val/ground_truth.parquet, or None
    val_samples: int
    counts: dict[str, int]  # training samples per kind: clean / partial / mismatched
    corrupt: int  # training samples with a damaged member
    corrupt_counts: dict[str, int]  # per CORRUPT_MODES entry (zeros included)
    seed: int
    noise_model: str = "ncr"  # one of NOISE_MODELS
    # training samples per NOISE_TYPES entry, zeros included (web, teacher); empty for ncr
    noise_type_counts: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Writing


def _write_ground_truth(
    path: Path, samples: Sequence[Sample] | Sequence[WebSample], params: dict
) -> None:
    """Write ground_truth.v1 for ``Sample`` rows (ncr), ground_truth.v2 for ``WebSample`` rows."""
    rows = [row for row in samples if isinstance(row, WebSample)]
    web = bool(rows)
    base = [row.sample for row in rows] if web else [s for s in samples if isinstance(s, Sample)]
    if len(base) != len(samples):
        raise TypeError(f"{path}: ground truth rows are all Sample (ncr) or all WebSample (web)")
    columns: dict[str, list[Any]] = {
        "key": [s.key for s in base],
        "shard": [s.shard for s in base],
        "kind": [s.kind for s in base],
        "degree": [row.degree for row in rows] if web else [KIND_DEGREES[s.kind] for s in base],
        "caption": [row.caption for row in rows] if web else [s.caption for s in base],
        "noisy_caption": [s.noisy_caption for s in base],
        "changed_attribute": [s.changed_attribute for s in base],
        "corrupt": [s.corrupt for s in base],
    }
    if web:
        columns |= {
            "noise_type": [row.noise_type for row in rows],
            "cluttered": [bool(row.look.distractors) for row in rows],
            "low_contrast": [row.look.contrast is not None for row in rows],
            "caption_style": [row.caption_style for row in rows],
            "page": [row.page for row in rows],
            "duplicate_of": [row.duplicate_of for row in rows],
        }
    base_schema = GROUND_TRUTH_V2_SCHEMA if web else GROUND_TRUTH_SCHEMA
    schema = base_schema.with_metadata(
        {**base_schema.metadata, b"ncl.make_corpus": json.dumps(params, sort_keys=True)}
    )
    table = pa.table(columns, schema=schema)
    with open_atomic(path) as handle:
        pq.write_table(table, handle)


def _ncr_jpegs(chunk: Sequence[Sample], image_size: int, rng: np.random.Generator):
    return (encode_jpeg(draw_scene(sample.scene, image_size, rng)) for sample in chunk)


def _write_split(
    directory: Path,
    samples: list[Sample],
    samples_per_shard: int,
    image_size: int,
    seed: int,
    split: int,
) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(samples), samples_per_shard):
        chunk = samples[start : start + samples_per_shard]
        # One pixel stream per shard: a shard's bytes do not depend on how the others were made.
        rng = np.random.default_rng([seed, _STREAM_PIXELS, split, start // samples_per_shard])
        jpegs = _ncr_jpegs(chunk, image_size, rng)
        paths.append(str(write_shard(directory, chunk[0].shard, chunk, image_size, jpegs)))
    return paths


def _write_web_split(
    directory: Path,
    rows: list[WebSample],
    samples_per_shard: int,
    image_size: int,
    seed: int,
    split: int,
) -> list[str]:
    """Like `_write_split` with one pixel stream per row (``look.pixel_row``): an exact
    duplicate re-draws its source's stream and so gets the same bytes, in any shard."""
    directory.mkdir(parents=True, exist_ok=True)

    def jpegs(chunk: list[WebSample]):
        for row in chunk:
            rng = np.random.default_rng([seed, _STREAM_WEB_PIXELS, split, row.look.pixel_row])
            yield render_jpeg(row, image_size, rng)

    paths = []
    for start in range(0, len(rows), samples_per_shard):
        chunk = rows[start : start + samples_per_shard]
        samples = [row.sample for row in chunk]
        paths.append(
            str(write_shard(directory, samples[0].shard, samples, image_size, jpegs(chunk)))
        )
    return paths


def _clear_previous(out: Path) -> None:
    """Remove a previous corpus's files so no stale shard survives; refuse foreign data."""
    stale = [p for p in out.iterdir() if _SHARD_FILE.match(p.name)] if out.is_dir() else []
    if not stale:
        return
    if not (out / "ground_truth.parquet").exists():
        raise ValueError(
            f"{out} already holds shard files but no ground_truth.parquet, so it is not a corpus "
            "written by make_corpus; choose an empty or new out_dir"
        )
    splits = [out / "test", out / "val"]
    for split in splits:
        if split.is_dir():
            stale += [p for p in split.iterdir() if _SHARD_FILE.match(p.name)]
            stale += [split / "ground_truth.parquet"]
    stale += [out / "ground_truth.parquet"]
    for path in stale:
        path.unlink(missing_ok=True)
    for split in splits:
        if split.is_dir() and not any(split.iterdir()):
            split.rmdir()  # a rerun without that split must not leave an empty folder behind


def _count(fraction: float, samples: int) -> int:
    return fraction_count(fraction, samples)


def _validate(
    samples: int,
    noise: float,
    partial: float,
    seed: int,
    samples_per_shard: int,
    test_samples: int,
    image_size: int,
    corrupt: float,
) -> None:
    def is_int(x: object) -> bool:
        return isinstance(x, int | np.integer) and not isinstance(x, bool)

    for name, value in (("noise", noise), ("partial", partial), ("corrupt", corrupt)):
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if not (0.0 <= value <= 1.0):
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    if noise + partial > 1.0 + 1e-9:
        raise ValueError(
            f"noise + partial must be <= 1 (got {noise} + {partial} = {noise + partial}); "
            "lower one of them"
        )
    if not is_int(samples) or samples < 2:
        raise ValueError(f"samples must be an integer >= 2, got {samples!r}")
    if not is_int(test_samples) or test_samples < 0:
        raise ValueError(
            f"test_samples must be an integer >= 0 (0 skips test/), got {test_samples!r}"
        )
    if not is_int(samples_per_shard) or not 1 <= samples_per_shard <= _MAX_PER_SHARD:
        raise ValueError(
            f"samples_per_shard must be an integer in [1, {_MAX_PER_SHARD}] (keys keep 4 digits "
            f"for the index within a shard), got {samples_per_shard!r}"
        )
    if not is_int(image_size) or not 32 <= image_size <= 1024:
        raise ValueError(
            f"image_size must be an integer in [32, 1024] (smaller images lose the attributes), "
            f"got {image_size!r}"
        )
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if math.ceil(samples / samples_per_shard) > VAL_SHARD_OFFSET:
        raise ValueError(
            f"{samples} samples at {samples_per_shard} per shard need more than "
            f"{VAL_SHARD_OFFSET} shards; raise samples_per_shard"
        )
    if math.ceil(test_samples / samples_per_shard) > 100_000 - TEST_SHARD_OFFSET:
        raise ValueError(
            f"test_samples={test_samples} needs more than {100_000 - TEST_SHARD_OFFSET} shards; "
            "raise samples_per_shard or lower test_samples"
        )


def _noisy_train_samples(
    samples: int,
    noise: float,
    partial: float,
    corrupt: float,
    seed: int,
    samples_per_shard: int,
    image_size: int,
) -> list[Sample]:
    """The training split: clean draws, then caption noise, then damaged members."""
    train = draw_samples(
        samples,
        samples_per_shard,
        0,
        image_size,
        np.random.default_rng([seed, _STREAM_SCENES, _SPLIT_TRAIN]),
    )
    train = apply_noise(
        train,
        _count(noise, samples),
        _count(partial, samples),
        np.random.default_rng([seed, _STREAM_NOISE]),
    )
    return apply_corruption(
        train, _count(corrupt, samples), np.random.default_rng([seed, _STREAM_CORRUPT])
    )


def _write_clean_split(out: Path, params: dict, name: str) -> tuple[list[str], Path]:
    """Write a clean held-out split (``test`` or ``val``) under ``out/<name>``; returns (tar
    paths, ground truth)."""
    seed, samples_per_shard, image_size = (
        params["seed"],
        params["samples_per_shard"],
        params["image_size"],
    )
    offset, split = {
        "test": (TEST_SHARD_OFFSET, _SPLIT_TEST),
        "val": (VAL_SHARD_OFFSET, _SPLIT_VAL),
    }[name]
    samples = draw_samples(
        params[f"{name}_samples"],
        samples_per_shard,
        offset,
        image_size,
        np.random.default_rng([seed, _STREAM_SCENES, split]),
    )
    shards = _write_split(out / name, samples, samples_per_shard, image_size, seed, split)
    truth = out / name / "ground_truth.parquet"
    _write_ground_truth(truth, samples, {**params, "split": name})
    return shards, truth


_SPLITS = {
    "train": (0, _SPLIT_TRAIN),
    "test": (TEST_SHARD_OFFSET, _SPLIT_TEST),
    "val": (VAL_SHARD_OFFSET, _SPLIT_VAL),
}


def _web_rows(params: dict, name: str, web: WebNoise | None) -> list[WebSample]:
    """One split of a ``web`` or ``teacher`` corpus; training rows get noise and damage."""
    seed, per_shard, image_size = params["seed"], params["samples_per_shard"], params["image_size"]
    n = params["samples" if name == "train" else f"{name}_samples"]
    offset, split = _SPLITS[name]
    if web is None:  # teacher: the ncr drawing, clean, with captions of its own
        rng = np.random.default_rng([seed, _STREAM_TEACHER, split])
        names = params.get("teacher_names")
        rows = draw_teacher_rows(draw_samples(n, per_shard, offset, image_size, rng), names)
    else:
        rng = np.random.default_rng([seed, _STREAM_WEB_PAGES, split])
        rows = draw_pages(n, per_shard, offset, image_size, web, rng, held_out=name != "train")
        if name == "train":
            rows = apply_web_noise(rows, web, np.random.default_rng([seed, _STREAM_WEB_NOISE]))
    if name == "train":
        damaged = apply_corruption(
            [row.sample for row in rows],
            _count(params["corrupt"], n),
            np.random.default_rng([seed, _STREAM_CORRUPT]),
        )
        rows = [dataclasses.replace(r, sample=s) for r, s in zip(rows, damaged, strict=True)]
    return rows


def _write_web_corpus(
    out: Path, params: dict, web: WebNoise | None
) -> tuple[list[WebSample], list[str], dict[str, tuple[list[str], Path | None]]]:
    train = _web_rows(params, "train", web)
    shards = _write_web_split(
        out, train, params["samples_per_shard"], params["image_size"], params["seed"], 0
    )
    held_out: dict[str, tuple[list[str], Path | None]] = {"test": ([], None), "val": ([], None)}
    for name in held_out:
        if params[f"{name}_samples"]:
            rows = _web_rows(params, name, web)
            paths = _write_web_split(
                out / name,
                rows,
                params["samples_per_shard"],
                params["image_size"],
                params["seed"],
                _SPLITS[name][1],
            )
            truth = out / name / "ground_truth.parquet"
            _write_ground_truth(truth, rows, {**params, "split": name})
            held_out[name] = (paths, truth)
    _write_ground_truth(out / "ground_truth.parquet", train, {**params, "split": "train"})
    return train, shards, held_out


def _summary(
    out: Path,
    train: list[Sample],
    shards: list[str],
    held_out: dict[str, tuple[list[str], Path | None]],
    params: dict,
) -> CorpusSummary:
    counts = {kind: 0 for kind in KIND_DEGREES}
    corrupt_counts = {mode: 0 for mode in CORRUPT_MODES}
    for sample in train:
        counts[sample.kind] += 1
        if sample.corrupt is not None:
            corrupt_counts[sample.corrupt] += 1
    return CorpusSummary(
        out_dir=str(out),
        shards=tuple(shards),
        test_shards=tuple(held_out["test"][0]),
        ground_truth=str(out / "ground_truth.parquet"),
        test_ground_truth=None if held_out["test"][1] is None else str(held_out["test"][1]),
        samples=params["samples"],
        test_samples=params["test_samples"],
        val_shards=tuple(held_out["val"][0]),
        val_ground_truth=None if held_out["val"][1] is None else str(held_out["val"][1]),
        val_samples=params["val_samples"],
        counts=counts,
        corrupt=sum(corrupt_counts.values()),
        corrupt_counts=corrupt_counts,
        seed=params["seed"],
    )


def _check_model(
    noise_model: str,
    noise: float | None,
    partial: float | None,
    web: WebNoise | None,
    teacher_names: tuple[str, ...] | None,
) -> WebNoise | None:
    """The web knobs to use (None unless ``web``); refuse arguments the model does not take."""
    if teacher_names is not None and noise_model != "teacher":
        raise ValueError(f"teacher_names applies to noise_model='teacher', not {noise_model!r}")
    if noise_model not in NOISE_MODELS:
        raise ValueError(f"noise_model must be one of {NOISE_MODELS}, got {noise_model!r}")
    if noise_model != "ncr" and (noise is not None or partial is not None):
        raise ValueError(
            f"noise and partial apply to noise_model='ncr' only; the {noise_model} model takes "
            "its fractions from web=WebNoise(...)"
            if noise_model == "web"
            else "noise and partial apply to noise_model='ncr' only; the teacher corpus is clean"
        )
    if noise_model != "web" and web is not None:
        raise ValueError(f"web=WebNoise(...) applies to noise_model='web', not {noise_model!r}")
    if noise_model == "web":
        web = WebNoise() if web is None else web
        web.validate()
    return web


def _write_ncr_corpus(out: Path, params: dict) -> CorpusSummary:
    train = _noisy_train_samples(
        params["samples"],
        params["noise"],
        params["partial"],
        params["corrupt"],
        params["seed"],
        params["samples_per_shard"],
        params["image_size"],
    )
    shards = _write_split(
        out, train, params["samples_per_shard"], params["image_size"], params["seed"], _SPLIT_TRAIN
    )
    held_out: dict[str, tuple[list[str], Path | None]] = {"test": ([], None), "val": ([], None)}
    for name in held_out:
        if params[f"{name}_samples"]:
            held_out[name] = _write_clean_split(out, params, name)
    # Written last: its presence marks a complete corpus (and lets a rerun replace it).
    _write_ground_truth(out / "ground_truth.parquet", train, {**params, "split": "train"})
    return _summary(out, train, shards, held_out, params)


# The Makefile's quick demo corpus (QUICK_DATA, `make demo`): make_corpus(folder, **QUICK_DEMO).
QUICK_DEMO = {
    "samples": 2000,
    "noise": 0.4,
    "partial": 0.1,
    "seed": 0,
    "samples_per_shard": 500,
    "test_samples": 500,
    "val_samples": 250,
    "corrupt": 0.005,
}


def make_corpus(
    out_dir: str | os.PathLike,
    *,
    samples: int = 4000,
    noise: float | None = None,
    partial: float | None = None,
    seed: int = 0,
    samples_per_shard: int = 500,
    test_samples: int = 500,
    image_size: int = 64,
    corrupt: float = 0.0,
    val_samples: int = 0,
    noise_model: str = "ncr",
    web: WebNoise | None = None,
    teacher_names: tuple[str, ...] | None = None,
) -> CorpusSummary:
    """Write a noisy synthetic image-text corpus in the img2dataset layout (see module docs).

    Args:
        out_dir: local directory; created if missing. A previous make_corpus output there is
            replaced; a directory with other shard files is refused.
        samples: training pairs, >= 2.
        noise: ncr only (default 0.4): fraction of training pairs given another pair's caption
            (kind ``mismatched``); ``floor(noise * samples)`` pairs.
        partial: ncr only (default 0.1): fraction given a caption with exactly one attribute
            changed (``partial``); ``floor(partial * samples)`` pairs. ``noise + partial <= 1``.
        seed: non-negative integer; same seed, same bytes.
        samples_per_shard: pairs per tar, in [1, 10000]; the last shard may be shorter.
        test_samples: clean held-out pairs written under ``out_dir/test/``; 0 writes none.
        image_size: side of the square JPEGs in pixels, in [32, 1024].
        corrupt: fraction of training pairs with one damaged member (``CORRUPT_MODES``);
            ``floor(corrupt * samples)`` pairs, independent of their kind.
        val_samples: clean validation pairs under ``out_dir/val/`` (select the warm-up, never
            reported); 0 writes none. They change no training or test sample.
        noise_model: ``ncr`` (random swaps and one-attribute changes; ground_truth.v1), ``web``
            (pages, duplicates, page swaps, boilerplate, page captions, clutter;
            ground_truth.v2) or ``teacher`` (clean, captions without count or position;
            ground_truth.v2). docs/corpus.md describes them.
        web: the web model's knobs (default ``WebNoise()``); web only.
        teacher_names: teacher only: what its captions name (``TEACHER_NAMES``, the shape).

    Returns:
        A `CorpusSummary` of the paths written and the counts per kind (and per noise type).

    Raises:
        ValueError: an argument is out of range (the message says the allowed range), an
            argument does not apply to the noise model, or out_dir holds shard files that
            make_corpus did not write.
    """
    web = _check_model(noise_model, noise, partial, web, teacher_names)
    noise, partial = 0.4 if noise is None else noise, 0.1 if partial is None else partial
    _validate(samples, noise, partial, seed, samples_per_shard, test_samples, image_size, corrupt)
    _validate(samples, noise, partial, seed, samples_per_shard, val_samples, image_size, corrupt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    params: dict[str, Any] = {
        "samples": samples,
        "noise": noise,
        "partial": partial,
        "seed": seed,
        "samples_per_shard": samples_per_shard,
        "test_samples": test_samples,
        "val_samples": val_samples,
        "image_size": image_size,
        "corrupt": corrupt,
    }
    if noise_model == "ncr":
        return _write_ncr_corpus(out, params)
    # The ncr metadata has no noise_model key, so an ncr corpus's Parquet bytes do not depend on
    # the other models; optional knobs are recorded only when given, for the same reason.
    del params["noise"], params["partial"]
    params["noise_model"] = noise_model
    params |= {"web": asdict(web)} if web is not None else {}
    params |= {"teacher_names": list(teacher_names)} if teacher_names is not None else {}
    rows, shards, held_out = _write_web_corpus(out, params, web)
    summary = _summary(out, [row.sample for row in rows], shards, held_out, params)
    return dataclasses.replace(
        summary, noise_model=noise_model, noise_type_counts=noise_type_counts(rows)
    )
