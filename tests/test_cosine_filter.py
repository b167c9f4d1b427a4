"""train.mode cosine_filter: the CLIP-score filter over shards, against sorting the corpus."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.stages.baselines.cosine_filter import (
    FILTER_SCHEMA,
    write_cosine_filter,
    write_score_filter,
)


def _embeddings(root, sizes, seed=0):
    """Tables with only what the filter reads: key, cosine_a, cosine_b (rounded: many ties)."""
    rng = np.random.default_rng(seed)
    paths, rows = {}, []
    for index, size in enumerate(sizes):
        a = np.round(rng.uniform(-0.2, 0.6, size), 2).astype(np.float32)
        b = np.round(rng.uniform(-0.2, 0.6, size), 2).astype(np.float32)
        keys = [f"{index:02d}{i:05d}" for i in range(size)]
        path = root / f"{index:05d}.parquet"
        pq.write_table(pa.table({"key": keys, "cosine_a": a, "cosine_b": b}), path)
        paths[f"{index:05d}"] = str(path)
        rows += list(zip(keys, 0.5 * (a + b), strict=True))
    return paths, rows


@pytest.mark.ray
@pytest.mark.parametrize("fraction", [0.3, 0.61, 1.0])
@pytest.mark.parametrize("fetch_limit", [1, 65536])
def test_keeps_the_highest_mean_cosines_ties_by_id(local_ray, tmp_path, fraction, fetch_limit):
    paths, rows = _embeddings(tmp_path, [120, 0, 75, 200])
    kept = write_cosine_filter(paths, str(tmp_path / "out"), fraction, fetch_limit=fetch_limit)
    k = round(fraction * len(rows))
    # Brute force: highest mean cosine first, then the lowest global id (= row order here).
    order = sorted(range(len(rows)), key=lambda i: (-np.float32(rows[i][1]), i))
    expected = sorted(rows[i][0] for i in order[:k])
    tables = [pq.read_table(tmp_path / "out" / f"{s}.parquet") for s in paths]
    assert all(t.schema.equals(FILTER_SCHEMA, check_metadata=True) for t in tables)
    got = sorted(key for t in tables for key in t.column("key").to_pylist())
    assert got == expected and sum(kept.values()) == k
    assert kept == {s: t.num_rows for s, t in zip(paths, tables, strict=True)}


def test_fraction_is_validated():
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
        write_cosine_filter({}, "unused", 0.0)


@pytest.mark.ray
def test_scores_from_two_label_tables_average_per_pair(local_ray, tmp_path):
    """train.filter_scorer labels: the mean of the two views' soft labels, each view's tables
    apart (same keys, same order), against sorting the corpus; a table listing its shard's
    pairs in another order is refused."""
    rng = np.random.default_rng(3)
    sources, rows = {}, []
    for index, size in enumerate([90, 40]):
        keys = [f"{index}{i:04d}" for i in range(size)]
        labels = [np.round(rng.uniform(0, 1, size), 1).astype(np.float32) for _ in "ab"]
        parts = []
        for view, values in zip("ab", labels, strict=True):
            path = tmp_path / f"labels_{view}_{index}.parquet"
            pq.write_table(pa.table({"key": keys, "soft_label": values}), path)
            parts.append((str(path), "soft_label"))
        sources[f"{index:05d}"] = tuple(parts)
        rows += list(zip(keys, (labels[0] + labels[1]) / np.float32(2), strict=True))
    kept = write_score_filter(sources, str(tmp_path / "out"), 0.4)
    order = sorted(range(len(rows)), key=lambda i: (-rows[i][1], i))
    expected = sorted(rows[i][0] for i in order[: round(0.4 * len(rows))])
    got = sorted(
        key
        for shard in sources
        for key in pq.read_table(tmp_path / "out" / f"{shard}.parquet").column("key").to_pylist()
    )
    assert got == expected and sum(kept.values()) == len(expected)
    path, _ = sources["00001"][1]
    shuffled = pq.read_table(path).take(list(range(39, -1, -1)))
    pq.write_table(shuffled, path)
    with pytest.raises(Exception, match="same order"):
        write_score_filter(sources, str(tmp_path / "again"), 0.4)
