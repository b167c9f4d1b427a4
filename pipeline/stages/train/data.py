"""Training data: the deterministic per-epoch order, the label join by key at read time, and
the per-row targets of the epoch's co-teaching phase (see the package docstring)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.core.coteach import Phase, coteach_phase, training_targets
from pipeline.io.admitted import ShardChangedError, fingerprint_change, read_reference
from pipeline.io.layout import RunLayout
from pipeline.io.shards import (
    DecodeOptions,
    Rejection,
    ShardReadStats,
    decode_record,
    iter_shard_records,
    shard_name,
)
from pipeline.models import ModelSpec, load_transforms
from pipeline.stages.train.spec import TrainSpec, ViewSpec

__all__ = [
    "epoch_batches",
    "epoch_phase",
    "epoch_shard_order",
    "read_training_batches",
    "steps_per_epoch",
]

TARGET_STATS = ("pairs", "weight", "reliable", "proxy")  # per-epoch sums, in the history

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
    proxy_caption: list[str | None] | None = None  # SPS: the caption paired with the image
    proxy_label: np.ndarray | None = None  # (N,) float32 y_p (NaN: no proxy)


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
            f"{view.proxies_dir}/{shard}.parquet", columns=["key", "image_proxy_caption", "y_p_img"]
        )
        labels.proxy_caption = [None] * len(keys)
        labels.proxy_label = np.full(len(keys), np.nan, dtype=np.float32)
        for key, caption, y_p in zip(
            proxies.column("key").to_pylist(),
            proxies.column("image_proxy_caption").to_pylist(),
            proxies.column("y_p_img").to_pylist(),
            strict=True,
        ):
            row = labels.row.get(key)
            if row is not None and caption is not None:
                labels.proxy_caption[row] = caption
                labels.proxy_label[row] = y_p
    return labels


def _targets(
    view: ViewSpec, phase: Phase, labels: _ShardLabels, keys: list[str]
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """(weights, reliable flags, proxy captions or None) of the shard's samples, in order."""
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
    for i in np.flatnonzero(targets.use_proxy):
        captions[i] = labels.proxy_caption[rows[i]]
    return targets.weight, targets.reliable, captions


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
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data UDF: shard paths in, decoded + preprocessed + labelled rows out (streamed).

    Only the keys the round-0 embed pass admitted (`admitted_dir`/<shard>.parquet: not
    quarantined, not a corpus-wide duplicate) are used; a decodable sample whose key is missing
    from the label table is skipped (it has no label to train on: the oracle's table lists the
    clean pairs only). A shard whose bytes differ from what the embed pass read raises
    `ShardChangedError` before any of its rows is used.
    """
    preprocess, tokenizer = load_transforms(model)
    for path in batch["path"]:
        path = str(path)
        shard = shard_name(path)
        labels = _read_shard_labels(view, shard)
        reference = read_reference(f"{admitted_dir}/{shard}.parquet") if admitted_dir else None
        samples = []
        stats = ShardReadStats()
        for record in iter_shard_records(path, stats):
            if isinstance(record, Rejection):
                continue
            if reference is not None and record.key not in reference.keys:
                continue
            sample = decode_record(record, decode)
            if isinstance(sample, Rejection):
                continue
            if labels is not None and sample.key not in labels.row:
                continue
            samples.append(sample)
        changed = reference and fingerprint_change(path, reference, stats.size, stats.sha256)
        if changed:
            raise ShardChangedError(f"{changed}; rerun to embed it again")
        if labels is None:
            weights = np.ones(len(samples), dtype=np.float32)
            reliable = np.zeros(len(samples), dtype=bool)
            proxy_captions: list[str | None] = [None] * len(samples)
        else:
            weights, reliable, proxy_captions = _targets(
                view, phase, labels, [s.key for s in samples]
            )
        order = np.random.default_rng([view.seed, epoch, zlib.crc32(shard.encode())]).permutation(
            len(samples)
        )
        for start in range(0, len(order), rows_per_batch):
            chunk = order[start : start + rows_per_batch]
            captions = [proxy_captions[i] or samples[i].caption for i in chunk]
            yield {
                "pixels": torch.stack([preprocess(samples[i].image) for i in chunk]).numpy(),
                "tokens": tokenizer(captions).numpy(),
                "weight": weights[chunk],
                "reliable": reliable[chunk].astype(np.float32),
                "proxy": np.array([proxy_captions[i] is not None for i in chunk], np.float32),
            }


def epoch_phase(spec: TrainSpec, view: ViewSpec, epoch: int) -> Phase:
    """The co-teaching subsets of this run's `epoch` (every subset outside co-teaching)."""
    before, total = spec.coteach_epochs
    if spec.mode != "labels" or total == 0:
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


def epoch_batches(spec: TrainSpec, view: ViewSpec, epoch: int, rank: int, world: int):
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the seeded order must survive the pipeline
    ctx.enable_progress_bars = False
    shards = epoch_shard_order(spec.shards, view.seed, epoch)[rank::world]
    dataset = ray.data.from_items([{"path": p} for p in shards], override_num_blocks=len(shards))
    dataset = dataset.map_batches(
        read_training_batches,
        batch_size=1,
        fn_kwargs={
            "model": view.init,
            "decode": spec.decode,
            "view": view,
            "epoch": epoch,
            "phase": epoch_phase(spec, view, epoch),
            "admitted_dir": _admitted_dir(spec),
        },
    )
    return dataset.iter_torch_batches(
        batch_size=spec.train.batch_size,
        drop_last=True,
        prefetch_batches=2,
        dtypes={
            "pixels": torch.float32,
            "tokens": torch.int64,
            "weight": torch.float32,
            "reliable": torch.float32,
            "proxy": torch.float32,
        },
    )


def steps_per_epoch(spec: TrainSpec, world: int) -> int:
    """Full batches every rank can make (ranks must take the same number of DDP steps)."""
    per_rank = [0] * world
    for index, path in enumerate(spec.shards):
        per_rank[index % world] += spec.shard_sizes.get(shard_name(path), 0)
    return max(min(per_rank) // spec.train.batch_size, 0)
