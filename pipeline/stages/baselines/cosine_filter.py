"""CLIP-score filtering, the baseline users would otherwise pick (train.mode: cosine_filter).

Contract:
- `write_cosine_filter(embeddings, out_dir, fraction, columns)` keeps the `fraction` of the
  embedded pairs with the highest cosine: the mean of `columns`, either the initial model's
  ``cosine_a`` of round 0 (DataComp: a fixed scorer that never saw the corpus) or the two
  warmed models' ``cosine_a`` and ``cosine_b`` of round 1 (the co-teaching inference rule). It
  writes, per shard, `out_dir/<shard>.parquet` with the kept keys and
  soft_label 1 (the trainer then fine-tunes on exactly those pairs, as DataComp's CLIP-score
  baseline does). Ties are broken by global sample id, so the kept set does not depend on
  sharding. Returns the kept pairs per shard (the trainer's samples per shard).
- `write_score_filter(sources, out_dir, fraction)` is the same over any per-pair score: the mean
  of (table, column) pairs per shard, e.g. the two views' `soft_label` of a round's label
  tables (`train.filter_scorer: labels`: our labels used the way a CLIP score is).
- One Ray task per shard reads its cosines; the cut is found by the distributed radix select
  of `pipeline.core.partition.select`; only digit histograms and counts reach the driver.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.core.partition.select import at_or_below, order_keys, radix_select, select_round
from pipeline.io.tables import read_table, write_table_atomic
from pipeline.runtime.preflight import Request, more_cpus, resources_of

__all__ = [
    "FILTER_SCHEMA",
    "TASK_OPTIONS",
    "ray_requests",
    "write_cosine_filter",
    "write_score_filter",
]

logger = logging.getLogger(__name__)

FILTER_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("soft_label", pa.float32(), nullable=False),
    ],
    metadata={"ncl.schema": "filter_labels.v0"},
)
TASK_OPTIONS = {"num_cpus": 1, "max_retries": 3}  # read-only tasks, and atomic writes


def ray_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What the filter asks of Ray: 1-CPU tasks."""
    return [Request("cosine-filter task", "", resources_of(TASK_OPTIONS), fix=more_cpus(job))]


Sources = tuple[tuple[str, str], ...]  # one shard's (table, column) pairs to average


def _scores(sources: Sources, offset: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(keys, order keys of -mean score: ascending = highest first, global ids). Every table
    of `sources` lists the shard's pairs in the same order (checked)."""
    keys, scores = None, []
    for path, column in sources:
        table = read_table(path, ["key", column])
        names = table.column("key").to_pylist()
        if keys is not None and names != keys:
            raise ValueError(f"{path} does not list {sources[0][0]}'s pairs in the same order")
        keys = names
        scores.append(table.column(column).to_numpy(zero_copy_only=False).astype(np.float32))
    mean = (sum(scores) / np.float32(len(scores))).astype(np.float32)
    mean = np.where(np.isfinite(mean), mean, np.float32(-2.0))  # never above a real score
    ids = offset + np.arange(len(keys or []), dtype=np.int64)
    return keys or [], order_keys(-mean), ids


def _rows_task(sources: Sources) -> int:
    return read_table(sources[0][0], ["key"]).num_rows


def _select_task(sources: Sources, offset: int, prefix: tuple[int, ...], fetch: bool):
    _, keys, ids = _scores(sources, offset)
    return select_round(keys, ids, prefix, fetch)


def _write_task(sources: Sources, offset: int, cut, out_path: str) -> int:
    names, keys, ids = _scores(sources, offset)
    kept = at_or_below(keys, ids, cut) if cut is not None else np.zeros(len(names), bool)
    table = pa.table(
        [
            pa.array([n for n, k in zip(names, kept, strict=True) if k], pa.string()),
            pa.array(np.ones(int(kept.sum()), np.float32), pa.float32()),
        ],
        schema=FILTER_SCHEMA,
    )
    write_table_atomic(table, out_path, FILTER_SCHEMA)
    return int(kept.sum())


def write_cosine_filter(
    embeddings: dict[str, str],
    out_dir: str,
    fraction: float,
    columns: tuple[str, ...] = ("cosine_a", "cosine_b"),
    fetch_limit: int = 65536,
) -> dict[str, int]:
    """Keep the top `fraction` of pairs by the mean of the cosine `columns`.

    Args:
        embeddings: {shard name: its embeddings table (with `columns`)}, in order.
        out_dir: where `<shard>.parquet` (key, soft_label = 1) go.
        fraction: share of the embedded pairs to keep, in (0, 1].
        columns: the embeddings' cosine columns to average, one per scoring model.

    Returns:
        {shard: pairs kept}.
    """
    sources = {shard: tuple((path, c) for c in columns) for shard, path in embeddings.items()}
    return write_score_filter(sources, out_dir, fraction, fetch_limit=fetch_limit)


def write_score_filter(
    sources: dict[str, Sources], out_dir: str, fraction: float, fetch_limit: int = 65536
) -> dict[str, int]:
    """Keep the top `fraction` of pairs by a score: per shard, the mean of the (table, column)
    `sources` (embeddings' cosines, or label tables' soft labels), ties by global sample id."""
    import ray

    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the filter keeps a fraction in (0, 1] of the pairs, got {fraction}")
    shards, parts = list(sources), list(sources.values())
    rows = ray.get([ray.remote(_rows_task).options(**TASK_OPTIONS).remote(p) for p in parts])
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64).tolist()
    total = int(sum(rows))
    k = min(total, max(1, round(fraction * total))) if total else 0
    select = ray.remote(_select_task).options(**TASK_OPTIONS)

    def run_round(prefix, fetch):
        return ray.get(
            [select.remote(p, o, prefix, fetch) for p, o in zip(parts, offsets, strict=True)]
        )

    cut = None
    if k:
        key, sample, _ = radix_select(run_round, k, total, with_id=True, fetch_limit=fetch_limit)
        cut = (key, sample)
    write = ray.remote(_write_task).options(**TASK_OPTIONS)
    kept = ray.get(
        [
            write.remote(p, o, cut, f"{out_dir}/{s}.parquet")
            for s, p, o in zip(shards, parts, offsets, strict=True)
        ]
    )
    named = sorted({column for part in parts for _, column in part})
    logger.info(
        f"filter: kept {sum(kept)} of {total} pairs ({fraction:.1%}, highest mean of "
        f"{', '.join(named)}) -> {out_dir}"
    )
    return dict(zip(shards, kept, strict=True))
