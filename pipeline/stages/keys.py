"""Corpus-wide key check after the round-0 embed pass (docs/architecture.md §4.1.1, where the
scaling plan is described).

Contract:
- Keys are unique in the corpus: a key found in several shards is kept in the first of them in
  sorted shard-name order and quarantined everywhere else as `duplicate_key`, its `detail`
  naming the shard that kept it. (A key repeated inside one tar is the reader's business.)
- Applied to the round-0 embeddings, each shard's admission record: the losing shard's
  quarantine table gains the rows first, then its embeddings table is rewritten without them,
  each atomically; a rerun replaces (never repeats) the quarantine rows, so a crash between the
  writes is harmless. Stale later-round embeddings of a rewritten shard are deleted.
- Several sources (`input.sources`): keys are qualified by their source; a second pass keeps a
  pair found in several sources (same image bytes and caption) in the first source listed and
  quarantines it in the others as `duplicate_pair` (docs/cc3m.md).
- No key reaches the driver: map tasks hash-partition the keys, reduce tasks group them with
  Arrow, and one task per losing shard rewrites it.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import JobConfig
from pipeline.io.layout import RUN_STATE_FIELD, RunLayout
from pipeline.io.tables import (
    QUARANTINE_SCHEMA,
    file_exists,
    remove_path,
    write_json_atomic,
    write_table_atomic,
)
from pipeline.runtime.preflight import Request, more_cpus, resources_of

__all__ = ["KEYS_PER_PARTITION", "TASK_OPTIONS", "partitions_for", "ray_requests", "run_key_check"]

logger = logging.getLogger(__name__)

KEYS_PER_PARTITION = 1_000_000  # keys one reduce task groups (~100 MB of Arrow strings)
TASK_OPTIONS = {"num_cpus": 1, "max_retries": 3}  # map, reduce and apply tasks: idempotent


def ray_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What the key check asks of Ray: 1-CPU tasks."""
    return [Request("key-check task", "", resources_of(TASK_OPTIONS), fix=more_cpus(job))]


def partitions_for(total_keys: int, shards: int) -> int:
    """Hash partitions for `total_keys` keys over `shards` shards (at least 1)."""
    return max(1, min(-(-total_keys // KEYS_PER_PARTITION), 4096, max(shards, 1) * 4))


def _pair_ids(table: pa.Table) -> list[str]:
    """A pair's identity across sources: a hash of its image bytes' sha256 and its caption."""
    images = table.column("image_sha256").to_pylist()
    captions = table.column("caption").to_pylist()
    return [
        hashlib.blake2b(f"{image}\0{caption}".encode(), digest_size=16).hexdigest()
        if image is not None  # tables written before image hashes existed: no identity
        else f"key:{key}"
        for image, caption, key in zip(
            images, captions, table.column("key").to_pylist(), strict=True
        )
    ]


def _split_keys(embeddings_path: str, shard_index: int, parts: int, scope: int | None):
    """Map: the shard's rows split into `parts` tables by a hash of their identity.

    `scope` None: the key is the identity and the shard the scope (columns key, shard, scope);
    else the pair (`_pair_ids`, column id) and `scope` is the shard's source.
    """
    import pyarrow.parquet as pq

    columns = ["key"] if scope is None else ["key", "image_sha256", "caption"]
    table = pq.read_table(embeddings_path, columns=columns)
    keys = table.column("key").to_pylist()
    ids = keys if scope is None else _pair_ids(table)
    bucket = np.array([zlib.crc32(k.encode()) % parts for k in ids], dtype=np.int64)
    arrays = {"key": pa.array(keys, pa.string())}
    if scope is not None:
        arrays["id"] = pa.array(ids, pa.string())
    out = []
    for part in range(parts):
        rows = pa.array(np.flatnonzero(bucket == part))
        picked = {name: array.take(rows) for name, array in arrays.items()}
        picked["shard"] = pa.array(np.full(len(rows), shard_index, np.int32))
        picked["scope"] = pa.array(
            np.full(len(rows), shard_index if scope is None else scope, np.int32)
        )
        out.append(pa.table(picked))
    return out[0] if parts == 1 else tuple(out)


def _find_losers(by: str, *tables: pa.Table):
    """Reduce: the rows of identities (column `by`) seen in several scopes that are not in the
    first scope; the first shard holding the identity keeps it.

    Returns ({shard index: losers}, table of key, shard, keeper).
    """
    table = pa.concat_tables(tables)
    empty = pa.table(
        {"key": pa.array([], pa.string()), "shard": pa.array([], pa.int32()),
         "keeper": pa.array([], pa.int32())}
    )  # fmt: skip
    if table.num_rows == 0:
        return {}, empty
    grouped = table.group_by(by).aggregate(
        [("shard", "min"), ("scope", "min"), ("scope", "count_distinct")]
    )
    repeated = grouped.filter(pc.greater(grouped["scope_count_distinct"], 1))
    if repeated.num_rows == 0:
        return {}, empty
    keepers = repeated.select([by, "shard_min", "scope_min"])
    joined = table.join(keepers.rename_columns([by, "keeper", "keep_scope"]), by, join_type="inner")
    losers = joined.filter(pc.not_equal(joined["scope"], joined["keep_scope"]))
    losers = losers.select(["key", "shard", "keeper"])
    counts = Counter(losers.column("shard").to_pylist())
    return dict(counts), losers


def _quarantine_rows(reason: str, keys: list[str], shard: str, keepers: list[str]) -> pa.Table:
    if reason == "duplicate_pair":
        what, why = "the same image and caption are", "the first source listed"
    else:
        what, why = "key {key!r} is", "the first shard in sorted order"
    return pa.table(
        {
            "key": keys,
            "shard": [shard] * len(keys),
            "member": [None] * len(keys),
            "reason": [reason] * len(keys),
            "detail": [
                f"{what.format(key=key)} also in shard {keeper!r}, which keeps it ({why})"
                for key, keeper in zip(keys, keepers, strict=True)
            ],
        },
        schema=QUARANTINE_SCHEMA,
    )


def _drop_losers(
    output: str, reason: str, shard: str, shard_index: int, names: list[str], *losers: pa.Table
):
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
    rows = _quarantine_rows(reason, keys, shard, keepers)
    if file_exists(quarantine_path):  # small: a shard's quarantine rows
        replaced = set(keys)
        earlier = [
            row
            for row in pq.read_table(quarantine_path).to_pylist()
            if not (row["reason"] == reason and row["member"] is None and row["key"] in replaced)
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


def run_key_check(
    output: str,
    shards: list[str],
    run_state: dict | None = None,
    sources: Mapping[str, str | None] | None = None,
) -> dict:
    """Quarantine corpus-wide duplicate keys among `shards` (names with round-0 embeddings).

    Args:
        run_state: the run-state key of the check; with it, the summary is written last to
            `rounds/0/_keys.json` with the key (`pipeline.io.layout.RUN_STATE_FIELD`).
        sources: shard name -> its source (`input.sources`); with two sources or more, pairs
            repeated across sources are quarantined too (`duplicate_pair`).

    Returns {"duplicates": n, "by_shard": {shard: n}, "partitions": P}, and with several
    sources "duplicate_pairs": n, "pairs_by_shard": {shard: n}.
    """
    layout = RunLayout(output)
    if run_state is not None:
        remove_path(layout.keys_summary)  # an earlier check's; this one's is written last
    names = sorted(shards)
    summary = _key_check(layout, names, None)
    by_source = _by_source(names, sources or {})
    if by_source is not None:
        pairs = _key_check(layout, *by_source)
        summary.update(duplicate_pairs=pairs["duplicates"], pairs_by_shard=pairs["by_shard"])
    if run_state is not None:
        summary[RUN_STATE_FIELD] = run_state
        write_json_atomic(summary, layout.keys_summary)
    return summary


def _by_source(
    names: list[str], sources: Mapping[str, str | None]
) -> tuple[list[str], list[int]] | None:
    """The shards ordered source by source (in the order the sources are listed, then by name)
    and each one's source as a number; None under fewer than two sources.

    The pair pass keeps an identity in its first shard in this order, so in the first source.
    """
    rank = {source: i for i, source in enumerate(dict.fromkeys(sources.values()))}
    if len(rank) < 2:
        return None
    ordered = sorted(names, key=lambda name: (rank[sources[name]], name))
    return ordered, [rank[sources[name]] for name in ordered]


def _key_check(layout: RunLayout, names: list[str], scopes: list[int] | None) -> dict:
    """One map/reduce/apply pass: by key (`scopes` None) or by pair across sources (`scopes`:
    each shard's source, not decreasing along `names`). The first shard of `names` that holds
    an identity keeps it."""
    import ray

    from pipeline.io.admitted import read_embeddings_footer

    output = layout.output
    if not names:
        return {"duplicates": 0, "by_shard": {}, "partitions": 0}
    paths = [layout.embeddings(0, name) for name in names]
    footers = [read_embeddings_footer(p) for p in paths]
    total = sum(footer.rows for footer in footers if footer is not None)
    parts = partitions_for(total, len(names))
    split = ray.remote(**TASK_OPTIONS)(_split_keys)
    find = ray.remote(**TASK_OPTIONS)(_find_losers)
    drop = ray.remote(**TASK_OPTIONS)(_drop_losers)
    by, reason = ("key", "duplicate_key") if scopes is None else ("id", "duplicate_pair")

    mapped = [
        split.options(num_returns=parts).remote(p, i, parts, scopes[i] if scopes else None)
        for i, p in enumerate(paths)
    ]
    if parts == 1:
        mapped = [[ref] for ref in mapped]
    reduced = [
        find.options(num_returns=2).remote(by, *[m[part] for m in mapped]) for part in range(parts)
    ]
    counts = ray.get([counts_ref for counts_ref, _ in reduced])
    holders: dict[int, list] = {}
    for part, part_counts in enumerate(counts):
        for shard_index in part_counts:
            holders.setdefault(shard_index, []).append(reduced[part][1])
    applied = [
        drop.remote(output, reason, names[i], i, names, *refs)
        for i, refs in sorted(holders.items())
    ]
    dropped = ray.get(applied)
    by_shard = {names[i]: n for i, n in zip(sorted(holders), dropped, strict=True)}
    if by_shard:
        what = "keys" if scopes is None else "pairs (same image and caption)"
        logger.warning(
            f"duplicate {what}: "
            + ", ".join(f"{n} in {shard}" for shard, n in by_shard.items())
            + f" also appear in an earlier shard; quarantined as {reason} there"
        )
    return {"duplicates": sum(by_shard.values()), "by_shard": by_shard, "partitions": parts}
