"""Label-free diagnostics of every labels round, computed when the labels are published.

Contract:
- `label_diagnostics(folders, shards)` takes {labels round: (view a's folder, view b's
  folder)} and the shard names, runs one Ray task per shard (`shard_diagnostics`: it reads
  `key`, `soft_label` and `subset` of each round's two tables) and returns {round (str):
  `pipeline.core.diagnostics.summarize_parts`}, so only counts reach the driver.
- A round's published label is the mean of its views and its subset the more cautious one,
  as `pipeline.stages.publish` writes them; "kept" is what `ncl-pipeline export` keeps at
  its defaults. The change from the previous round compares the published labels of the pairs
  both rounds labelled, matched by key.
- A shard missing from a round (left out, or its table gone) contributes nothing to it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.diagnostics import label_parts, merge_parts, summarize_parts
from pipeline.core.partition.decisions import SUBSETS, combined_subsets
from pipeline.io.labels import DEFAULT_MIN_LABEL, DEFAULT_SUBSETS
from pipeline.io.tables import file_exists, read_table
from pipeline.runtime.progress import Progress, as_completed

__all__ = ["label_diagnostics", "shard_diagnostics"]

logger = logging.getLogger(__name__)

TASK_OPTIONS = {"num_cpus": 1, "max_retries": 2}
_CODES = {name: code for code, name in enumerate(SUBSETS)}


def _view(path: str) -> tuple[pa.ChunkedArray, np.ndarray, np.ndarray]:
    """A view table's keys, soft labels (N,) and subset codes (N,)."""
    table = read_table(path, ["key", "soft_label", "subset"])
    codes = np.array([_CODES[s] for s in table.column("subset").to_pylist()], np.int64)
    soft = table.column("soft_label").to_numpy().astype(np.float64)
    return table.column("key"), soft, codes


def shard_diagnostics(
    shard: str,
    folders: dict[int, tuple[str, str]],
    min_label: float,
    subsets: tuple[str, ...],
) -> dict[int, dict[str, Any]]:
    """One shard's `label_parts` per labels round (rounds whose tables it lacks left out)."""
    import pyarrow.compute as pc

    kept_codes = [_CODES[name] for name in subsets]
    parts: dict[int, dict[str, Any]] = {}
    previous = None  # (keys, published label, published subset) of the round before
    for round_index in sorted(folders):
        paths = [f"{folder}/{shard}.parquet" for folder in folders[round_index]]
        if not all(file_exists(path) for path in paths):
            previous = None
            continue
        (keys, soft_a, codes_a), (_, soft_b, codes_b) = _view(paths[0]), _view(paths[1])
        soft = (soft_a + soft_b) / 2
        subset = combined_subsets(codes_a, codes_b)
        kept = int(np.count_nonzero((soft >= min_label) & np.isin(subset, kept_codes)))
        before = None
        if previous is not None:
            rows = pc.index_in(keys, value_set=previous[0]).to_numpy(zero_copy_only=False)
            found = ~np.isnan(rows.astype(np.float64))
            if found.all():  # the same pairs (a shard is labelled whole or not at all)
                at = rows.astype(np.int64)
                before = (previous[1][at], previous[2][at])
        parts[round_index] = label_parts(soft_a, soft_b, codes_a, codes_b, kept, before)
        previous = (keys, soft, subset)
    return parts


def label_diagnostics(
    folders: dict[int, tuple[str, str]],
    shards: list[str] | tuple[str, ...],
) -> dict[str, dict[str, Any]]:
    """{labels round (str): its diagnostics} over `shards` (see the module contract)."""
    import ray

    task = ray.remote(shard_diagnostics).options(**TASK_OPTIONS)
    refs = [task.remote(s, folders, DEFAULT_MIN_LABEL, DEFAULT_SUBSETS) for s in shards]
    merged: dict[int, dict[str, Any]] = {}
    with Progress("label diagnostics", len(refs), "shards", log=logger) as progress:
        for _, result in as_completed(refs):
            for round_index, part in result.items():
                merged[round_index] = merge_parts([merged.get(round_index, {}), part])
            progress.advance()
    return {str(r): summarize_parts(merged[r]) for r in sorted(merged)}
