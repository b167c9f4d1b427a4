"""Training data: the deterministic per-epoch order, the label join by key at read time, and
the per-row targets of the epoch's co-teaching phase (see the package docstring).

A reader task holds one shard's admitted samples as their encoded bytes (a pipeline run: the
round-0 embed pass decoded them) or, without an embed pass, as model-resolution uint8 pixels
(decoded once to check them), never as full-size images; it decodes a chunk of the epoch's
order at a time, resized and cropped to the model's resolution, and ships uint8 pixels
(4x fewer bytes than float32). Once a shard's images are all decoded they go to the node's
pixel cache (`pipeline.io.pixel_cache`, `train.pixel_cache_gb`), which the next epoch's,
view's and round's readers of that shard read instead of decoding. `round_batches` normalises
them on the training worker's device: the eval transform's own operations, so the pixels are
bit-identical to the transform's (tests/test_pixels.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pipeline.core.coteach import (
    PROXY_TARGETS,
    Phase,
    coteach_phase,
    proxy_image_weights,
    training_targets,
)
from pipeline.io.admitted import (
    ShardChangedError,
    file_signature,
    fingerprint_change,
    read_reference,
)
from pipeline.io.decode import decode_image
from pipeline.io.layout import RunLayout
from pipeline.io.pixel_cache import PixelCache, PixelWriter
from pipeline.io.shards import (
    DecodeOptions,
    Rejection,
    ShardReadStats,
    decode_record,
    iter_shard_records,
    shard_name,
)
from pipeline.models import ModelSpec, load_transforms
from pipeline.models.encode import PixelSpec, normalize_pixels, pil_pixels, pixel_spec
from pipeline.stages.train.spec import TrainSpec, ViewSpec

__all__ = [
    "READER_TASK_OPTIONS",
    "cut_epoch_batches",
    "epoch_phase",
    "epoch_shard_order",
    "read_round_batches",
    "read_training_batches",
    "round_batches",
    "reader_tasks_per_view",
    "source_id",
    "text_proxy_pairs",
    "steps_per_epoch",
]

TARGET_STATS = ("pairs", "weight", "reliable", "proxy")  # per-epoch sums, in the history
# Reader tasks (one CPU each) a GPU training worker's views run at once, shared by its views:
# a CPU decodes and resizes a few hundred JPEGs a second with PIL, and one GPU trains a
# ViT-B-32 on a few thousand, so a GPU node needs about this many free CPUs per GPU besides
# the training worker's own.
READER_CPUS_PER_GPU = 8
READER_TASK_OPTIONS = {"num_cpus": 1}  # one reader task: a shard's chunks, decoded in turn

logger = logging.getLogger(__name__)


def reader_tasks_per_view(views: int) -> int:
    """Reader tasks one view of a GPU training worker runs at once (at least one)."""
    return max(1, READER_CPUS_PER_GPU // views)


# ------------------------------------------------------------------------------------------
# Data: deterministic per-epoch order, label join by key at read time


def epoch_shard_order(shards: tuple[str, ...], seed: int, epoch: int) -> list[str]:
    """The view's shard order for an epoch: a seeded permutation."""
    order = np.random.default_rng([seed, epoch, 7]).permutation(len(shards))
    return [shards[i] for i in order]


@dataclass
class _ShardLabels:
    """One shard's label rows, by key (what the trainer joins at read time)."""

    row: dict[str, int]  # key -> row
    label: np.ndarray  # (N,) float32
    subset: np.ndarray  # (N,) int8 codes (CLEAN when the table has no subset column)
    proxy_caption: list[str | None] | None = None  # SPS, assign: the caption for the image
    proxy_label: np.ndarray | None = None  # (N,) float32 y_p (NaN: no proxy)
    proxy_key: list[str | None] | None = None  # SPS, assign: the pair the proxy caption is from


def _read_shard_labels(view: ViewSpec, shard: str) -> _ShardLabels | None:
    if view.labels_dir is None:
        return None
    import pyarrow.parquet as pq

    from pipeline.io.labels import SUBSET_VALUES

    path = f"{view.labels_dir}/{shard}.parquet"
    names = pq.read_schema(path).names
    columns = ["key", view.label_column] + (["subset"] if "subset" in names else [])
    table = pq.read_table(path, columns=columns)
    keys = table.column("key").to_pylist()
    labels = _ShardLabels(
        row={key: i for i, key in enumerate(keys)},
        label=table.column(view.label_column).to_numpy(zero_copy_only=False).astype(np.float32),
        subset=np.zeros(len(keys), dtype=np.int8),
    )
    if "subset" in names:
        codes = {name: code for code, name in enumerate(SUBSET_VALUES)}
        labels.subset = np.array(
            [codes[s] for s in table.column("subset").to_pylist()], dtype=np.int8
        )
    if view.proxies_dir is not None:
        proxies = pq.read_table(
            f"{view.proxies_dir}/{shard}.parquet",
            columns=["key", "image_proxy_key", "image_proxy_caption", "y_p_img"],
        )
        labels.proxy_caption = [None] * len(keys)
        labels.proxy_key = [None] * len(keys)
        labels.proxy_label = np.full(len(keys), np.nan, dtype=np.float32)
        for key, proxy_key, caption, y_p in zip(
            *(proxies.column(name).to_pylist() for name in proxies.column_names), strict=True
        ):
            row = labels.row.get(key)
            if row is not None and caption is not None:
                labels.proxy_caption[row] = caption
                labels.proxy_key[row] = proxy_key
                labels.proxy_label[row] = y_p
    return labels


@functools.lru_cache(maxsize=4)
def text_proxy_pairs(
    labels_dir: str, proxies_dir: str, shards: tuple[str, ...]
) -> dict[str, list[tuple[str, str, float, str]]]:
    """SPS text-direction proxy pairs by the shard that holds the proxy image Ï:
    (Ï's key, the noisy caption T_n, y_p^t, the noisy pair's key), for y_p^t > 0.

    The proxy image usually lives in another shard than the noisy pair. Rather than open that
    shard's tar, the row is attached to it: the shard's reader emits Ï once more with T_n. This
    reads every proxies table and the key column of every label table once per training run
    (cached; labels do not change within a run).
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = []
    for shard in shards:
        path = f"{proxies_dir}/{shard}.parquet"
        if "caption" not in pq.read_schema(path).names:
            logger.warning(
                "%s is an sps_proxies.v1 table (no noisy caption): the text-direction proxy "
                "pairs are not trained; rerun the label pass to write sps_proxies.v2",
                path,
            )
            return {}
        table = pq.read_table(path, columns=["key", "caption", "text_proxy_key", "y_p_txt"])
        wanted.append(table.filter(pc.greater(table.column("y_p_txt"), 0.0)))
    rows = [r for t in wanted for r in zip(*(c.to_pylist() for c in t.columns), strict=True)]
    images = {image for _, _, image, _ in rows if image is not None}
    home: dict[str, str] = {}
    for shard in shards:
        keys = pq.read_table(f"{labels_dir}/{shard}.parquet", columns=["key"]).column("key")
        present = keys.filter(pc.is_in(keys, value_set=pa.array(sorted(images), pa.string())))
        home.update(dict.fromkeys(present.to_pylist(), shard))
    out: dict[str, list[tuple[str, str, float, str]]] = defaultdict(list)
    for key, caption, image, y_p in rows:
        if image in home and caption is not None:
            out[home[image]].append((image, caption, float(y_p), key))
    return dict(out)


def _text_proxies(spec: TrainSpec, view: ViewSpec, phase: Phase, shards: list[str]) -> dict:
    """This rank's shards' text-direction proxy rows (empty outside the noisy phase of a
    target that trains proxies: sps, rematch)."""
    if view.proxies_dir is None or view.labels_dir is None or view.target not in PROXY_TARGETS:
        return {}
    if not phase.noisy:
        return {}
    every = tuple(shard_name(p) for p in spec.shards)
    pairs = text_proxy_pairs(view.labels_dir, view.proxies_dir, every)
    return {shard_name(p): pairs[shard_name(p)] for p in shards if shard_name(p) in pairs}


def _targets(view: ViewSpec, phase: Phase, labels: _ShardLabels, keys: list[str]):
    """(weights, reliable flags, proxy captions or None, their source keys or None, added
    image-direction rows) of the shard's samples, in order. SPS swaps a noisy row's caption for
    its proxy caption; the rematch target keeps the row and adds (sample, proxy caption,
    weight, proxy source key) rows."""
    rows = np.array([labels.row[k] for k in keys], dtype=np.int64)
    proxy = labels.proxy_label[rows] if labels.proxy_label is not None else None
    targets = training_targets(
        view.target,
        phase,
        labels.subset[rows],
        labels.label[rows],
        proxy,
        weight_cut=view.weight_cut,
    )
    captions: list[str | None] = [None] * len(keys)
    sources: list[str | None] = [None] * len(keys)
    added: list[tuple[int, str | None, float, str | None]] = []
    # Without proxies the targets use none (use_proxy and proxy_row are all off).
    if labels.proxy_caption is not None and labels.proxy_key is not None:
        proxy_caption, proxy_key = labels.proxy_caption, labels.proxy_key
        for i in np.flatnonzero(targets.use_proxy):
            captions[i] = proxy_caption[rows[i]]
            sources[i] = proxy_key[rows[i]]
        added = [
            (int(i), proxy_caption[rows[i]], float(targets.proxy_row[i]), proxy_key[rows[i]])
            for i in np.flatnonzero(targets.proxy_row > 0)
        ]
    return targets.weight, targets.reliable, captions, sources, added


def source_id(key: str) -> int:
    """A 63-bit id of a pair's key: rows whose image (or text) comes from the same pair are
    co-positives in the loss (`pipeline.core.losses.training.co_positive_mask`)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def _shard_rows(view, phase, labels, samples, extras) -> dict:
    """The shard's training rows: one per sample (SPS: a noisy image with its proxy caption),
    plus the proxy rows of the targets that add them: a noisy image with its rematched caption
    (rematch) and a sample's image with a noisy caption T_n (the text direction: sps, rematch)."""
    keys = [s.key for s in samples]
    n = len(samples)
    if labels is None:
        weights, reliable = np.ones(n, dtype=np.float32), np.zeros(n, dtype=bool)
        proxy_captions: list[str | None] = [None] * n
        proxy_sources: list[str | None] = [None] * n
        added: list[tuple[int, str, float, str]] = []
    else:
        weights, reliable, proxy_captions, proxy_sources, added = _targets(
            view, phase, labels, keys
        )
    rows: dict[str, Any] = {
        "sample": list(range(n)),
        "caption": [c or s.caption for c, s in zip(proxy_captions, samples, strict=True)],
        "weight": list(weights),
        "reliable": list(reliable),
        "proxy": [c is not None for c in proxy_captions],
        "image_source": list(keys),
        "text_source": [p or k for p, k in zip(proxy_sources, keys, strict=True)],
    }
    # Image direction (rematch): the noisy pair's image once more, with its rematched caption.
    proxy_rows = [(i, caption, w, keys[i], source or keys[i]) for i, caption, w, source in added]
    # Text direction: the proxy image Ï (a sample of this shard) with the noisy caption T_n.
    where = {k: i for i, k in enumerate(keys)}
    extra_weights = proxy_image_weights(
        view.target, phase, np.asarray([e[2] for e in extras], np.float32)
    )
    for (image_key, caption, _, noisy_key), weight in zip(extras, extra_weights, strict=True):
        if weight > 0 and image_key in where:  # else Ï not admitted or not decodable
            proxy_rows.append((where[image_key], caption, weight, image_key, noisy_key))
    for sample, caption, weight, image_source, text_source in proxy_rows:
        for name, value in (
            ("sample", sample),
            ("caption", caption),
            ("weight", weight),
            ("reliable", False),
            ("proxy", True),
            ("image_source", image_source),
            ("text_source", text_source),
        ):
            rows[name].append(value)
    rows["weight"] = np.asarray(rows["weight"], dtype=np.float32)
    rows["reliable"] = np.asarray(rows["reliable"], dtype=np.float32)
    rows["proxy"] = np.asarray(rows["proxy"], dtype=np.float32)
    for side in ("image", "text"):
        rows[f"{side}_group"] = np.array(
            [source_id(k) for k in rows.pop(f"{side}_source")], dtype=np.int64
        )
    return rows


@functools.lru_cache(maxsize=4)
def _transforms(model: ModelSpec) -> tuple[Callable, Callable, PixelSpec | None]:
    """(eval transform, tokenizer, its PixelSpec or None when it is not the usual resize +
    crop + normalise: then readers ship the transform's float32 pixels)."""
    preprocess, tokenizer = load_transforms(model)
    try:
        return preprocess, tokenizer, pixel_spec(preprocess)
    except ValueError:
        return preprocess, tokenizer, None


def _model_pixels(image, model: ModelSpec) -> np.ndarray:
    """(3, H, W) at the model's resolution: uint8, or float32 for an unusual transform."""
    preprocess, _, spec = _transforms(model)
    return pil_pixels(image, spec) if spec is not None else preprocess(image).numpy()


class _Sample(NamedTuple):
    """What the rows of one sample need: its key and caption."""

    key: str
    caption: str


@dataclass
class _Shard:
    """A shard's samples in tar order (those that pass the record checks) and, per sample,
    its image: bytes until decoded, then model-resolution pixels, None when it does not
    decode; `size` and `sha256` of the tar as read (None: not read completely)."""

    samples: list[_Sample]
    held: list
    size: int | None
    sha256: str | None


def _read_shard(path: str, decode: DecodeOptions) -> _Shard:
    """The shard's samples with their image bytes (not decoded)."""
    samples, held = [], []
    stats = ShardReadStats()
    for record in iter_shard_records(path, stats):
        if isinstance(record, Rejection):
            continue
        sample = decode_record(record, decode, pixels=False)
        if isinstance(sample, Rejection):
            continue
        samples.append(_Sample(sample.key, sample.caption))
        held.append(sample.image_bytes)
    return _Shard(samples, held, stats.size, stats.sha256)


class _Images:
    """A shard's images, decoded on demand: bytes until then, model-resolution pixels after
    (None: they do not decode on CPU; the round-0 decode may have been a GPU's). Decoded images
    are kept when `keep` (a shard read without an embed pass, whose samples are all checked
    first) or when a pixel-cache entry is being written (then as rows of its memory-mapped
    file); otherwise a chunk's images are decoded, shipped and dropped."""

    def __init__(self, shard: _Shard, name: str, model: ModelSpec, writer, keep: bool):
        self.shard, self.name, self.model = shard, name, model
        self.writer: PixelWriter | None = writer
        self.keep = keep

    def get(self, i: int, warn: bool = True):
        item = self.shard.held[i]
        if not isinstance(item, bytes):
            return item
        try:
            pixels = _model_pixels(decode_image(item), self.model)
        except Exception as exc:
            if warn:
                logger.warning(
                    "shard %s, sample %s: image does not decode on CPU (%s: %s); row left out",
                    self.name,
                    self.shard.samples[i].key,
                    type(exc).__name__,
                    exc,
                )
            pixels = None
        if self.writer is not None:
            self.shard.held[i] = None if pixels is None else self.writer.put(i, pixels)
        elif self.keep:
            self.shard.held[i] = pixels
        return pixels

    def finish(self) -> None:
        """Complete and publish the cache entry being written (decoding what the epoch did not
        need: samples without a label or not admitted)."""
        if self.writer is None:
            return
        for i in range(len(self.shard.held)):
            self.get(i, warn=False)
        shard = self.shard
        keys = [s.key for s in shard.samples]
        captions = [s.caption for s in shard.samples]
        assert shard.size is not None and shard.sha256 is not None  # else no writer
        self.writer.commit(keys, captions, shard.size, shard.sha256)
        self.writer = None

    def discard(self) -> None:
        if self.writer is not None:
            self.writer.discard()
            self.writer = None


class _CachedReads:
    """A reader's shards through the pixel cache (uint8 models only): `read` returns the
    entry when there is one (the tar not opened), else reads the tar and starts its entry."""

    def __init__(self, cache: PixelCache | None, model: ModelSpec, decode: DecodeOptions):
        _, _, spec = _transforms(model)
        self.cache = cache if cache is not None and cache.enabled and spec is not None else None
        self.size = spec.size if spec is not None else 0
        self.tag = f"{decode.image_key}|{decode.caption_key}|{decode.max_image_pixels}"
        self.model, self.decode = model, decode

    def read(self, path: str, keep: bool) -> _Images:
        name = shard_name(path)
        signature = file_signature(path) if self.cache is not None else None
        if self.cache is None or signature is None:
            return _Images(_read_shard(path, self.decode), name, self.model, None, keep)
        entry_path = self.cache.path(path, name, signature, self.size, self.tag)
        entry = self.cache.load(entry_path)
        if entry is not None:
            samples = [_Sample(k, c) for k, c in zip(entry.keys, entry.captions, strict=True)]
            held = [p if ok else None for p, ok in zip(entry.pixels, entry.ok, strict=True)]
            cached = _Shard(samples, held, entry.size, entry.sha256)
            return _Images(cached, name, self.model, None, keep)
        shard = _read_shard(path, self.decode)
        writer = None
        if shard.sha256 is not None and shard.size is not None:
            writer = self.cache.writer(entry_path, len(shard.samples), self.size)
        return _Images(shard, name, self.model, writer, keep)


def read_training_batches(
    batch: dict[str, np.ndarray],
    *,
    model: ModelSpec,
    decode: DecodeOptions,
    view: ViewSpec,
    epoch: int,
    phase: Phase,
    admitted_dir: str | None = None,
    rows_per_batch: int = 256,
    text_proxies: dict[str, list] | None = None,
    pixel_cache: PixelCache | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data UDF: shard paths in, labelled rows with model-resolution pixels out (streamed).

    Only the keys the round-0 embed pass admitted (`admitted_dir`/<shard>.parquet: not
    quarantined, not a corpus-wide duplicate) are used; a decodable sample whose key is missing
    from the label table is skipped (it has no label to train on: the oracle's table lists the
    clean pairs only). `text_proxies` (shard -> SPS text-direction proxy pairs whose proxy image
    is in that shard, `text_proxy_pairs`) adds rows: the image once more, with a noisy caption.
    A shard whose bytes differ from what the embed pass read raises `ShardChangedError` before
    any of its rows is used. "pixels" are (B, 3, H, W) uint8 (float32, normalised, for a model
    whose transform `pixel_spec` does not describe); images are decoded a chunk at a time,
    or read from `pixel_cache` (`pipeline.io.pixel_cache`), which the shard's reader fills.
    """
    _, tokenizer, _ = _transforms(model)
    reads = _CachedReads(pixel_cache, model, decode)
    for path in batch["path"]:
        path = str(path)
        shard = shard_name(path)
        labels = _read_shard_labels(view, shard)
        reference = read_reference(f"{admitted_dir}/{shard}.parquet") if admitted_dir else None
        images = reads.read(path, keep=reference is None)
        try:
            extras = (text_proxies or {}).get(shard, [])
            rows = (view, epoch, phase, labels, extras)
            yield from _shard_batches(images, path, reference, rows, tokenizer, rows_per_batch)
            images.finish()
        finally:
            images.discard()  # an entry left unfinished (an error, or the pipeline closed)


def _shard_batches(images: _Images, path: str, reference, rows: tuple, tokenizer, size: int):
    """One shard's training batches of at most `size` rows (see `read_training_batches`);
    `rows`: what its rows are made of, (view, epoch, phase, labels, text proxy rows)."""
    (view, epoch, phase, labels, extras), read, shard = rows, images.shard, images.name
    changed = reference and fingerprint_change(path, reference, read.size, read.sha256)
    if changed:
        raise ShardChangedError(f"{changed}; rerun to embed it again")
    picks = [
        i
        for i, s in enumerate(read.samples)
        if (reference is None or s.key in reference.keys)
        and (labels is None or s.key in labels.row)
    ]
    if reference is None:  # no embed pass checked them: decode now, keep what decodes
        picks = [i for i in picks if images.get(i, warn=False) is not None]
    samples = [read.samples[i] for i in picks]
    table = _shard_rows(view, phase, labels, samples, extras)
    rng = np.random.default_rng([view.seed, epoch, zlib.crc32(shard.encode())])
    order = rng.permutation(len(table["sample"]))
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        pixels = [images.get(picks[table["sample"][row]]) for row in chunk]
        kept = np.array([p is not None for p in pixels], dtype=bool)
        chunk = chunk[kept]
        if not len(chunk):
            continue
        out = {
            "pixels": np.stack([p for p in pixels if p is not None]),
            "tokens": tokenizer([table["caption"][i] for i in chunk]).numpy(),
        }
        for name in ("weight", "reliable", "proxy", "image_group", "text_group"):
            out[name] = table[name][chunk]
        yield out


def epoch_phase(spec: TrainSpec, view: ViewSpec, epoch: int) -> Phase:
    """The co-teaching subsets of this run's `epoch` (every subset outside co-teaching)."""
    before, total = spec.coteach_epochs
    if spec.round_kind != "labels" or total == 0:
        return Phase(noisy=True, quasi_clean=True)
    return coteach_phase(
        before + epoch,
        total,
        bicro_noisy_start=spec.train.bicro.noisy_start,
        sps_quasi_start=spec.train.sps.quasi_start,
        sps_noisy_start=spec.train.sps.noisy_start,
        target=view.target,
    )


def _admitted_dir(spec: TrainSpec) -> str | None:
    """The round-0 embeddings (each shard's admission record) of a pipeline run; None for a
    trainer run on shards that had no embed pass (then every decodable sample is used)."""
    from pipeline.io.tables import file_exists

    folder = RunLayout(spec.output).embeddings_dir(0)
    return folder if file_exists(folder) else None


def read_round_batches(
    batch: dict[str, np.ndarray], *, phases: dict[int, Phase], **options: Any
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data UDF over (path, epoch) rows: `read_training_batches` of each row's shard in its
    epoch's phase, with an "epoch" column added (`options`: its other keywords)."""
    for path, epoch in zip(batch["path"], batch["epoch"], strict=True):
        epoch = int(epoch)
        rows = {"path": np.array([path])}
        for out in read_training_batches(rows, epoch=epoch, phase=phases[epoch], **options):
            out["epoch"] = np.full(len(out["tokens"]), epoch, dtype=np.int64)
            yield out


BATCH_DTYPES = {
    "tokens": torch.int64,
    "weight": torch.float32,
    "reliable": torch.float32,
    "proxy": torch.float32,
    "image_group": torch.int64,
    "text_group": torch.int64,
}


def round_batches(
    spec: TrainSpec, view: ViewSpec, first_epoch: int, rank: int, world: int, device=None
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(epoch, batch) for every epoch of the round from `first_epoch` on, from one Ray Data
    pipeline: its readers run on into the next epoch while this one trains, where a pipeline
    per epoch paid Ray Data's start-up at each epoch boundary. Each epoch's batches are those
    of its own order cut into `train.batch_size` rows, its last partial batch dropped, as
    before; pixels are normalised on `device` (uint8 until then)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the seeded order must survive the pipeline
    ctx.enable_progress_bars = False
    epochs = range(first_epoch, spec.max_epochs)
    orders = {e: epoch_shard_order(spec.shards, view.seed, e)[rank::world] for e in epochs}
    items = [{"path": p, "epoch": e} for e, paths in orders.items() for p in paths]
    phases = {e: epoch_phase(spec, view, e) for e in epochs}
    shards = sorted({p for paths in orders.values() for p in paths})  # they change by epoch
    # The proxies' rows weigh 0 outside the noisy phase: one table serves every epoch.
    proxies = {}
    if any(phase.noisy for phase in phases.values()):
        proxies = _text_proxies(spec, view, Phase(noisy=True, quasi_clean=True), shards)
    dataset = ray.data.from_items(items, override_num_blocks=max(len(items), 1))
    dataset = dataset.map_batches(
        read_round_batches,
        batch_size=1,
        **READER_TASK_OPTIONS,
        # On CPU the trainer shares the node's cores with its readers: Ray Data's default.
        compute=(
            ray.data.TaskPoolStrategy(size=reader_tasks_per_view(len(spec.views)))
            if spec.use_gpu
            else None
        ),
        fn_kwargs={
            "phases": phases,
            "model": view.init,
            "decode": spec.decode,
            "view": view,
            "admitted_dir": _admitted_dir(spec),
            "text_proxies": proxies,
            "pixel_cache": PixelCache(
                spec.train.pixel_cache_dir, int(spec.train.pixel_cache_gb * 1e9)
            ),
        },
    )
    _, _, pixels = _transforms(view.init)
    blocks = dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
    for epoch, batch in cut_epoch_batches(blocks, spec.train.batch_size):
        out = {name: torch.as_tensor(batch[name], dtype=t) for name, t in BATCH_DTYPES.items()}
        image = torch.as_tensor(batch["pixels"]).to(device or "cpu", non_blocking=True)
        out["pixels"] = normalize_pixels(image, pixels) if pixels is not None else image.float()
        yield epoch, out


def cut_epoch_batches(blocks, size: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(epoch, batch of `size` rows) from blocks of rows in order (each with an "epoch"
    column, epochs ascending): each epoch's rows cut in turn, its last partial batch dropped
    (so no batch mixes two epochs). Each batch is one copy of its rows."""
    held: list[dict[str, np.ndarray]] = []  # pieces of `current`'s rows not yet in a batch
    count, current = 0, -1
    for block in blocks:
        epochs = np.asarray(block["epoch"])
        starts = [0, *(np.flatnonzero(np.diff(epochs)) + 1).tolist(), len(epochs)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            if a == b:
                continue
            if epochs[a] != current:
                held, count, current = [], 0, int(epochs[a])
            held.append({name: column[a:b] for name, column in block.items()})
            count += b - a
            while count >= size:
                yield current, _take_rows(held, size)
                count -= size


def _take_rows(held: list[dict[str, np.ndarray]], size: int) -> dict[str, np.ndarray]:
    """The first `size` rows of the pieces `held` (which has them), removed from it."""
    parts, need = [], size
    while need:
        piece = held[0]
        if len(piece["epoch"]) <= need:
            parts.append(held.pop(0))
        else:
            parts.append({name: column[:need] for name, column in piece.items()})
            held[0] = {name: column[need:] for name, column in piece.items()}
        need -= len(parts[-1]["epoch"])
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def steps_per_epoch(spec: TrainSpec, world: int) -> int:
    """Full batches every rank can make (ranks must take the same number of DDP steps)."""
    per_rank = [0] * world
    for index, path in enumerate(spec.shards):
        per_rank[index % world] += spec.shard_sizes.get(shard_name(path), 0)
    return max(min(per_rank) // spec.train.batch_size, 0)
