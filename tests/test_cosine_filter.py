"""train.mode cosine_filter: the CLIP-score filter over shards, against sorting the corpus."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.stages.baselines.cosine_filter import FILTER_SCHEMA, write_cosine_filter


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
