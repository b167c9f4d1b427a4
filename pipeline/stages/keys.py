"""Corpus-wide key check after the round-0 embed pass (docs/architecture.md §4.1).

Contract:
- Keys are unique in the corpus: a key found in several shards is kept in the first of them in
  sorted shard-name order and quarantined everywhere else as `duplicate_key`, its `detail`
  naming the shard that kept it. (A key repeated inside one tar is the reader's business: the
  first group is kept there.)
- Applied to the round-0 embeddings, the admission record of each shard (`pipeline.io.admitted`):
  the losing shard's quarantine table gains the rows first, then its embeddings table is
  rewritten without them, each atomically. A rerun finds the same duplicates as long as the
  second write has not happened and replaces (never repeats) the quarantine rows, so a crash
  between the writes is harmless. Later rounds and training read only admitted keys, so the
  rows dropped here reach no later stage; stale later-round embeddings of a rewritten shard (an
  earlier run's) are deleted.

How it runs (no key reaches the driver): one map task per shard reads the `key` column and
splits it by a hash of the key into P partitions, returned as P objects in the object store;
one reduce task per partition groups its keys with Arrow (`group_by`, min shard index) and
returns the per-shard count of losers (to the driver) and the losers themselves (stays in the
object store); one task per losing shard gathers its rows from the partitions that hold some
and rewrites that shard. Memory per reduce task is (corpus keys / P); P grows with the corpus
(`partitions_for`), so 1e9 keys run as ~1000 reduce tasks of ~1e6 keys (~100 MB) each, and the
driver holds O(shards x partitions) counts.
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.io.layout import RUN_STATE_FIELD, RunLayout
from pipeline.io.tables import (
    QUARANTINE_SCHEMA,
    file_exists,
    remove_path,
    write_json_atomic,
    write_table_atomic,
)

__all__ = ["KEYS_PER_PARTITION", "partitions_for", "run_key_check"]

logger = logging.getLogger(__name__)

KEYS_PER_PARTITION = 1_000_000  # keys one reduce task groups (~100 MB of Arrow strings)


def partitions_for(total_keys: int, shards: int) -> int:
    """Hash partitions for `total_keys` keys over `shards` shards (at least 1)."""
    return max(1, min(-(-total_keys // KEYS_PER_PARTITION), 4096, max(shards, 1) * 4))


def _split_keys(embeddings_path: str, shard_index: int, parts: int):
    """Map: the shard's keys split into `parts` tables (key, shard index) by key hash."""
    import pyarrow.parquet as pq

    keys = pq.read_table(embeddings_path, columns=["key"]).column("key").to_pylist()
    bucket = np.array([zlib.crc32(k.encode()) % parts for k in keys], dtype=np.int64)
    key_array = pa.array(keys, pa.string())
    out = []
    for part in range(parts):
        rows = np.flatnonzero(bucket == part)
        out.append(
            pa.table(
                {
                    "key": key_array.take(pa.array(rows)),
                    "shard": pa.array(np.full(len(rows), shard_index, np.int32)),
                }
            )
        )
    return out[0] if parts == 1 else tuple(out)


def _find_losers(*tables: pa.Table):
    """Reduce: the rows of keys seen in several shards that are not in the first of them.

    Returns ({shard index: losers}, table of key, shard, keeper).
    """
    table = pa.concat_tables(tables)
    empty = pa.table(
        {"key": pa.array([], pa.string()), "shard": pa.array([], pa.int32()),
         "keeper": pa.array([], pa.int32())}
    )  # fmt: skip
    if table.num_rows == 0:
        return {}, empty
    grouped = table.group_by("key").aggregate([("shard", "min"), ("shard", "count")])
    repeated = grouped.filter(pc.greater(grouped["shard_count"], 1))
    if repeated.num_rows == 0:
        return {}, empty
    keepers = repeated.select(["key", "shard_min"]).rename_columns(["key", "keeper"])
    joined = table.join(keepers, "key", join_type="inner")
    losers = joined.filter(pc.not_equal(joined["shard"], joined["keeper"]))
    losers = losers.select(["key", "shard", "keeper"])
    counts = Counter(losers.column("shard").to_pylist())
    return dict(counts), losers


def _quarantine_rows(keys: list[str], shard: str, keepers: list[str]) -> pa.Table:
    return pa.table(
        {
            "key": keys,
            "shard": [shard] * len(keys),
            "member": [None] * len(keys),
            "reason": ["duplicate_key"] * len(keys),
            "detail": [
                f"key {key!r} is also in shard {keeper!r}, which keeps it (the first shard in "
                "sorted order)"
                for key, keeper in zip(keys, keepers, strict=True)
            ],
        },
        schema=QUARANTINE_SCHEMA,
    )


def _drop_losers(output: str, shard: str, shard_index: int, names: list[str], *losers: pa.Table):
    """Apply task: quarantine, then drop from the round-0 embeddings, this shard's losers."""
    import fsspec
    import pyarrow.parquet as pq

    layout = RunLayout(output)
    mine = pa.concat_tables(losers)
    mine = mine.filter(pc.equal(mine["shard"], shard_index))
    keys = mine.column("key").to_pylist()
    keepers = [names[i] for i in mine.column("keeper").to_pylist()]
    dropped = pa.array(keys, pa.string())

    quarantine_path = layout.quarantine(shard)
    rows = _quarantine_rows(keys, shard, keepers)
    if file_exists(quarantine_path):  # small: a shard's quarantine rows
        replaced = set(keys)
        earlier = [
            row
            for row in pq.read_table(quarantine_path).to_pylist()
            if not (
                row["reason"] == "duplicate_key"
                and row["member"] is None
                and row["key"] in replaced
            )
        ]
        rows = pa.concat_tables([pa.Table.from_pylist(earlier, schema=QUARANTINE_SCHEMA), rows])
    write_table_atomic(rows, quarantine_path, QUARANTINE_SCHEMA)

    embeddings_path = layout.embeddings(0, shard)
    table = pq.read_table(embeddings_path)
    kept = table.filter(pc.invert(pc.is_in(table["key"], value_set=dropped)))
    write_table_atomic(kept, embeddings_path, table.schema)

    fs, _, _ = fsspec.get_fs_token_paths(embeddings_path)
    for stale in fs.glob(f"{layout.output}/rounds/*/embeddings/{shard}.parquet"):
        if not stale.rstrip("/").endswith(f"rounds/0/embeddings/{shard}.parquet"):
            fs.rm(stale)
    return len(keys)


def run_key_check(output: str, shards: list[str], run_state: dict | None = None) -> dict:
    """Quarantine corpus-wide duplicate keys among `shards` (names with round-0 embeddings).

    Args:
        run_state: the run-state key of the check; with it, the summary is written last to
            `rounds/0/_keys.json` with the key (`pipeline.io.layout.RUN_STATE_FIELD`).

    Returns {"duplicates": n, "by_shard": {shard: n}, "partitions": P}.
    """
    layout = RunLayout(output)
    if run_state is not None:
        remove_path(layout.keys_summary)  # an earlier check's; this one's is written last
    summary = _key_check(layout, sorted(shards))
    if run_state is not None:
        summary[RUN_STATE_FIELD] = run_state
        write_json_atomic(summary, layout.keys_summary)
    return summary


def _key_check(layout: RunLayout, names: list[str]) -> dict:
    import pyarrow.parquet as pq
    import ray

    output = layout.output
    if not names:
        return {"duplicates": 0, "by_shard": {}, "partitions": 0}
    paths = [layout.embeddings(0, name) for name in names]
    total = sum(pq.read_metadata(p).num_rows for p in paths)
    parts = partitions_for(total, len(names))
    split = ray.remote(num_cpus=1, max_retries=3)(_split_keys)
    find = ray.remote(num_cpus=1, max_retries=3)(_find_losers)
    drop = ray.remote(num_cpus=1, max_retries=3)(_drop_losers)

    mapped = [split.options(num_returns=parts).remote(p, i, parts) for i, p in enumerate(paths)]
    if parts == 1:
        mapped = [[ref] for ref in mapped]
    reduced = [
        find.options(num_returns=2).remote(*[m[part] for m in mapped]) for part in range(parts)
    ]
    counts = ray.get([counts_ref for counts_ref, _ in reduced])
    holders: dict[int, list] = {}
    for part, part_counts in enumerate(counts):
        for shard_index in part_counts:
            holders.setdefault(shard_index, []).append(reduced[part][1])
    applied = [
        drop.remote(output, names[i], i, names, *refs) for i, refs in sorted(holders.items())
    ]
    dropped = ray.get(applied)
    by_shard = {names[i]: n for i, n in zip(sorted(holders), dropped, strict=True)}
    if by_shard:
        logger.warning(
            "duplicate keys: "
            + ", ".join(f"{n} in {shard}" for shard, n in by_shard.items())
            + " also appear in an earlier shard; quarantined as duplicate_key there"
        )
    return {"duplicates": sum(by_shard.values()), "by_shard": by_shard, "partitions": parts}
