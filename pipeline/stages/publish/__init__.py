"""Publish stage: the final `labels/` from the last round's two views (docs/architecture.md
§4.4 says how the two views combine).

Contract:
- `publish_labels(sources, shards, out_dir, ...)` reads `rounds/<r>/labels_a/<shard>.parquet` and
  `rounds/<r>/labels_b/<shard>.parquet` and writes `out_dir/gen-<n>/<shard>.parquet` in
  `labels.v4`, one Ray task per shard, so no per-sample data reaches the driver (except the
  ground-truth quality arrays of the demo).
- Only once every table and `_label_pass.json` of the new generation are written does
  `out_dir/_CURRENT` switch to it (`pipeline.io.generations`): a reader sees the previous run's
  labels or this run's, never a mix. The generation before stays until the next publish.
- Combining: score columns are the mean of the two views (`AVERAGED`, from the label-method
  registry), `subset` the more cautious view's, the stable ids from the round's embeddings.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.core.labels import SCORE_COLUMNS
from pipeline.core.partition.decisions import combined_subsets
from pipeline.io.ground_truth import quality_arrays, quality_from_parts
from pipeline.io.labels import LABELS_SCHEMA, LABELS_SCHEMA_NAME, SUBSET_VALUES, uid_of
from pipeline.io.layout import LABEL_PASS_SUMMARY, RUN_STATE_FIELD
from pipeline.io.tables import read_json, read_table, write_json_atomic, write_table_atomic
from pipeline.runtime.preflight import Request, more_cpus, resources_of
from pipeline.runtime.progress import Progress, as_completed

__all__ = ["TASK_OPTIONS", "LabelViewMismatchError", "publish_labels", "ray_requests"]

logger = logging.getLogger(__name__)

SUMMARY_NAME = LABEL_PASS_SUMMARY
# The registry's score columns are averaged too: a new method's column needs no change here.
AVERAGED = ("soft_label", "clean_prob", "loss", "cosine", *SCORE_COLUMNS)
ID_COLUMNS = ("uid", "image_sha256")  # labels.v2: filled from the embeddings table
TASK_OPTIONS = {"num_cpus": 1, "max_retries": 2}  # one task per shard, written atomically


def ray_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What publishing asks of Ray: 1-CPU tasks."""
    return [Request("publish task", "", resources_of(TASK_OPTIONS), fix=more_cpus(job))]


class LabelViewMismatchError(ValueError):
    """The two views' tables of a shard do not list the same keys in the same order."""


def _read(path: str) -> tuple[pa.Table, dict[str, str]]:
    """One view's table and its file metadata, in one read."""
    table = read_table(path)
    raw = table.schema.metadata or {}
    return table, {k.decode(): v.decode() for k, v in raw.items()}


def _mean_column(a: pa.ChunkedArray, b: pa.ChunkedArray) -> pa.Array:
    """Element-wise mean; null where either view has no value."""
    left = a.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls -> NaN
    right = b.to_numpy(zero_copy_only=False).astype(np.float64)
    mean = 0.5 * (left + right)
    return pa.array(mean.astype(np.float32), pa.float32(), from_pandas=True)


def _subset_codes(column: pa.ChunkedArray) -> np.ndarray:
    codes = {name: code for code, name in enumerate(SUBSET_VALUES)}
    return np.array([codes[s] for s in column.to_pylist()], dtype=np.int8)


def default_embeddings_dir(label_folder: str) -> str:
    """`rounds/<r>/embeddings` beside a round's `rounds/<r>/labels_<view>` folder."""
    return f"{label_folder.rstrip('/').rsplit('/', 1)[0]}/embeddings"


def _id_columns(keys: pa.ChunkedArray, embeddings: str) -> dict[str, pa.Array]:
    """uid and image_sha256 for `keys` (N,), joined by key from an embeddings table.

    Returns:
        {"uid": (N,) string, "image_sha256": (N,) string, null where unknown}. uid falls back to
        `uid_of(key)` for keys or tables without one.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.io.tables import file_exists

    n = len(keys)
    found: dict[str, pa.Array] = {}
    if file_exists(embeddings):
        import fsspec

        fs, fs_path = fsspec.core.url_to_fs(embeddings)
        names = pq.read_schema(fs_path, filesystem=fs).names
        wanted = ["key", *(c for c in ID_COLUMNS if c in names)]
        table = pq.read_table(fs_path, columns=wanted, filesystem=fs)
        rows = pc.index_in(keys, value_set=table.column("key"))  # (N,) int32, null if absent
        for name in wanted[1:]:
            found[name] = pc.take(table.column(name), rows).combine_chunks()
    uids = found.get("uid")
    if uids is None or uids.null_count:
        # Fill only the gaps: the json's uid, when the embed pass saw one, must win.
        given = uids.to_pylist() if uids is not None else [None] * n
        pairs = zip(given, keys.to_pylist(), strict=True)
        found["uid"] = pa.array([u if u is not None else uid_of(k) for u, k in pairs], pa.string())
    if "image_sha256" not in found:
        found["image_sha256"] = pa.nulls(n, pa.string())
    return found


def combine_shard(
    shard: str,
    sources: dict[str, str],
    out_dir: str,
    ground_truth: str | None,
    embeddings_dir: str | None = None,
) -> dict[str, Any]:
    """Combine one shard's view tables (see the module contract); returns its summary."""
    started = time.perf_counter()
    (view_a, folder_a), (view_b, folder_b) = sorted(sources.items())
    embeddings_dir = embeddings_dir or default_embeddings_dir(folder_a)
    path_a, path_b = f"{folder_a}/{shard}.parquet", f"{folder_b}/{shard}.parquet"
    (table_a, meta_a), (table_b, meta_b) = _read(path_a), _read(path_b)
    keys = table_a.column("key")
    if not keys.equals(table_b.column("key")):
        raise LabelViewMismatchError(
            f"shard {shard}: {path_a} and {path_b} do not list the same keys in the same order "
            "(were they written from different embeddings? rerun the round's label pass)"
        )
    present = set(table_a.schema.names)
    columns = {name: table_a.column(name) for name in LABELS_SCHEMA.names if name in present}
    ids = None
    for name in ID_COLUMNS:
        if name not in columns or columns[name].null_count == len(keys):
            ids = ids or _id_columns(keys, f"{embeddings_dir}/{shard}.parquet")
            columns[name] = ids[name]
    names_b = set(table_b.schema.names)
    for name in AVERAGED:
        if name in present and name in names_b:
            columns[name] = _mean_column(table_a.column(name), table_b.column(name))
        else:  # a view table older than this score column: null, as a reader would see it
            columns[name] = pa.nulls(len(keys), LABELS_SCHEMA.field(name).type)
    subset = combined_subsets(
        _subset_codes(table_a.column("subset")), _subset_codes(table_b.column("subset"))
    )
    columns["subset"] = pa.DictionaryArray.from_arrays(
        pa.array(subset, pa.int8()), pa.array(SUBSET_VALUES, pa.string())
    )
    metadata = {
        **meta_a,
        "ncl.schema": LABELS_SCHEMA_NAME,  # the columns written below, whatever the views had
        "ncl.view": f"{view_a}+{view_b}",
        "ncl.combined": "mean",
        "ncl.sources": json.dumps([folder_a, folder_b]),
        "ncl.model_id": json.dumps(
            {view_a: meta_a.get("ncl.model_id"), view_b: meta_b.get("ncl.model_id")}
        ),
    }
    schema = LABELS_SCHEMA.with_metadata(metadata)
    table = pa.table([columns[name] for name in schema.names], schema=schema)
    write_table_atomic(table, f"{out_dir}/{shard}.parquet", schema)
    summary: dict[str, Any] = {
        "shard": shard,
        "rows": table.num_rows,
        "subsets": {name: int((subset == code).sum()) for code, name in enumerate(SUBSET_VALUES)},
        "seconds": time.perf_counter() - started,
    }
    if ground_truth:
        summary["quality"] = quality_arrays(
            ground_truth,
            keys.to_pylist(),
            {
                "combined": columns["soft_label"].to_numpy(zero_copy_only=False),
                f"view_{view_a}": table_a.column("soft_label").to_numpy(),
                f"view_{view_b}": table_b.column("soft_label").to_numpy(),
                "cosine": columns["cosine"].to_numpy(zero_copy_only=False),
            },
            {"combined": subset == 0},
        )
    return summary


def publish_labels(
    sources: dict[str, str],
    shards: list[str] | tuple[str, ...],
    out_dir: str,
    *,
    round_index: int,
    job_hash: str,
    ground_truth: str | None = None,
    embeddings_dir: str | None = None,
    run_state: dict | None = None,
    diagnose: dict[int, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """Write the final label tables from two views' tables of one round.

    Args:
        sources: {view: folder of that view's label tables}, exactly two views.
        shards: shard names to combine (every shard with embedded samples).
        out_dir: the run's `labels/` (the pointer's folder; tables go to a new generation).
        round_index: the round the views come from (recorded in the summary).
        job_hash: recorded in the summary (lineage).
        ground_truth: ground_truth.parquet -> quality of the combined labels.
        embeddings_dir: the round's embeddings folder (uid, image_sha256); default
            `rounds/<r>/embeddings` beside the view folders.
        run_state: the run-state key of the publish stage, recorded in the summary
            (`pipeline.io.layout.RUN_STATE_FIELD`); None outside a run.
        diagnose: {labels round: (view a's folder, view b's folder)} of every round to
            describe without ground truth (`pipeline.stages.publish.diagnostics`); None: none.

    Returns:
        The summary written to `out_dir/gen-<n>/_label_pass.json` (`generation`: its name).
    """
    import fsspec
    import ray

    from pipeline.io.generations import next_generation, remove_stale_generations, switch_generation

    if len(sources) != 2:
        raise ValueError(f"publish_labels combines two views, got {sorted(sources)}")
    started = time.perf_counter()
    out_dir = out_dir.rstrip("/")
    fs, root = fsspec.core.url_to_fs(out_dir)
    generation = next_generation(fs, root)
    folder = f"{out_dir}/{generation}"
    task = ray.remote(combine_shard).options(**TASK_OPTIONS)
    refs = [task.remote(s, sources, folder, ground_truth, embeddings_dir) for s in shards]
    results: list = [None] * len(refs)
    with Progress("publish labels", len(refs), "shards", log=logger) as progress:
        for index, result in as_completed(refs):
            results[index] = result
            progress.advance()
    views = {view: read_json(f"{folder}/{SUMMARY_NAME}") or {} for view, folder in sources.items()}
    summary = {
        "round": round_index,
        "generation": generation,
        "view": "+".join(sorted(sources)),
        "combined": "mean",
        "sources": dict(sources),
        "method": next(iter(views.values())).get("method"),
        "job_hash": job_hash,
        "ground_truth": ground_truth,
        "shards_labelled": list(shards),
        "samples": sum(r["rows"] for r in results),
        "subsets": {name: sum(r["subsets"][name] for r in results) for name in SUBSET_VALUES},
        "partition": {view: s.get("partition") for view, s in views.items()},
        "quality": quality_from_parts([r["quality"] for r in results if "quality" in r]),
    }
    if diagnose:
        from pipeline.stages.publish.diagnostics import label_diagnostics

        summary["diagnostics"] = label_diagnostics(diagnose, shards)
    summary["seconds"] = time.perf_counter() - started
    if run_state is not None:
        summary[RUN_STATE_FIELD] = run_state
    write_json_atomic(summary, f"{folder}/{SUMMARY_NAME}")
    previous = switch_generation(fs, root, generation)
    remove_stale_generations(fs, root, generation, previous)
    return summary
