"""Synthetic embeddings tables for label-pass tests: clustered blobs with shuffled captions.

`write_blob_run` writes `<out>/rounds/0/embeddings/<shard>.parquet` in the embed pass's schema
(view "a"; without `image_sha256`, like tables written before that column existed) with losses
computed by `pipeline.core.losses.per_sample` on seeded fixed-size batches, as the embed pass does,
plus a `ground_truth.parquet` (key, kind, degree) beside the run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.core.losses.per_sample import (
    fixed_size_loss_batches,
    infonce_per_sample,
    triplet_per_sample,
)
from pipeline.io.layout import RunLayout
from pipeline.io.tables import embedding_schema, write_table_atomic

LOGIT_SCALE = 1 / 0.07


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def blob_pairs(n: int, dim: int, noise: float, partial: float, seed: int, clusters: int = 40):
    """u, v (n, dim) float32, kind (n,) str, degree (n,) float32.

    Mismatched pairs take the caption of another mismatched sample (rotation); partial pairs
    take the caption of another sample of their own cluster (close, not exact).
    """
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((clusters, dim)))
    cluster = rng.integers(0, clusters, n)
    spread = 0.6 / math.sqrt(dim)
    u = _unit(centers[cluster] + spread * rng.standard_normal((n, dim)))
    v = _unit(centers[cluster] + spread * rng.standard_normal((n, dim)))
    order = rng.permutation(n)
    n_noisy, n_partial = int(noise * n), int(partial * n)
    noisy = order[:n_noisy]
    v_new = v.copy()
    v_new[noisy] = v[np.roll(noisy, 1)]
    kind = np.full(n, "clean", dtype=object)
    kind[noisy] = "mismatched"
    for row in order[n_noisy : n_noisy + n_partial]:
        mates = np.flatnonzero((cluster == cluster[row]) & (np.arange(n) != row))
        if mates.size:
            v_new[row] = _unit((0.5 * v[row] + 0.5 * v[rng.choice(mates)])[None])[0]
            kind[row] = "partial"
    degree = np.select([kind == "clean", kind == "partial"], [1.0, 0.5], 0.0).astype(np.float32)
    return u.astype(np.float32), v_new.astype(np.float32), kind.astype(str), degree


def write_blob_run(
    out: Path,
    *,
    n: int = 800,
    shards: int = 4,
    dim: int = 32,
    noise: float = 0.3,
    partial: float = 0.1,
    seed: int = 0,
    batch_size: int = 64,
) -> dict:
    """Write a run directory holding only round-0 embeddings; returns names and truth."""
    u, v, kind, degree = blob_pairs(n, dim, noise, partial, seed)
    layout = RunLayout(str(out))
    names = [f"{s:05d}" for s in range(shards)]
    bounds = np.linspace(0, n, shards + 1).astype(int)
    all_keys = []
    for s, name in enumerate(names):
        rows = np.arange(bounds[s], bounds[s + 1])
        shard_keys = [f"{s:05d}{i:04d}" for i in range(rows.size)]
        all_keys += shard_keys
        image = torch.from_numpy(u[rows])
        text = torch.from_numpy(v[rows])
        # Losses from the fp16 embeddings the table stores, as the label pass will read them.
        image16 = torch.nn.functional.normalize(image.half().float(), dim=1)
        text16 = torch.nn.functional.normalize(text.half().float(), dim=1)
        rng = np.random.default_rng([seed, s])
        losses = {name: np.full(rows.size, np.nan, np.float32) for name in ("i2t", "t2i", "trip")}
        batch_ids = np.zeros(rows.size, np.int32)
        for b, (idx, scored) in enumerate(fixed_size_loss_batches(rows.size, batch_size, rng)):
            t_idx = torch.as_tensor(idx)
            i2t, t2i = infonce_per_sample(image16[t_idx], text16[t_idx], LOGIT_SCALE)
            trip = triplet_per_sample(image16[t_idx], text16[t_idx])
            losses["i2t"][idx[:scored]] = i2t[:scored].numpy()
            losses["t2i"][idx[:scored]] = t2i[:scored].numpy()
            losses["trip"][idx[:scored]] = trip[:scored].numpy()
            batch_ids[idx[:scored]] = b
        metadata = {
            "ncl.schema": "embeddings.v1",
            "ncl.model_id.a": "blobs",
            "ncl.logit_scale.a": repr(LOGIT_SCALE),
        }
        schema = embedding_schema(["a"], dim, metadata, image_sha256=False)

        def fixed(matrix: np.ndarray) -> pa.Array:
            flat = pa.array(matrix.astype(np.float16).reshape(-1), type=pa.float16())
            return pa.FixedSizeListArray.from_arrays(flat, dim)

        columns = {
            "key": shard_keys,
            "shard": [name] * rows.size,
            "url": [f"http://example.com/{k}.jpg" for k in shard_keys],
            "caption": [f"caption of {k}" for k in shard_keys],
            "loss_batch": batch_ids,
            "image_embedding_a": fixed(u[rows]),
            "text_embedding_a": fixed(v[rows]),
            "cosine_a": (image * text).sum(dim=1).numpy().astype(np.float32),
            "loss_i2t_a": losses["i2t"],
            "loss_t2i_a": losses["t2i"],
            "loss_triplet_a": losses["trip"],
        }
        table = pa.table([columns[c] for c in schema.names], schema=schema)
        write_table_atomic(table, layout.embeddings(0, name), schema)
    truth = pa.table(
        {
            "key": pa.array(all_keys, pa.string()),
            "kind": pa.array(list(kind), pa.string()),
            "degree": pa.array(degree, pa.float32()),
        }
    )
    ground_truth = out.parent / f"{out.name}_ground_truth.parquet"
    pq.write_table(truth, ground_truth)
    return {
        "shards": names,
        "ground_truth": str(ground_truth),
        "keys": np.array(all_keys),
        "kind": kind,
        "degree": degree,
        "u": u,
        "v": v,
    }


def truth_quality(keys, scores, ground_truth: str, clean_subset=None) -> dict:
    """`label_quality` of per-pair `scores` (aligned with `keys`) against a corpus's
    `ground_truth.parquet` (key, kind, degree), pairs without a truth row left out: the
    quality a label pass with `eval.ground_truth` reports for that score.

    Args:
        keys: (N,) sample keys; scores: (N,) float; clean_subset: (N,) bool or None.
    """
    from pipeline.core.metrics import label_quality

    truth = {
        row["key"]: row
        for row in pq.read_table(ground_truth, columns=["key", "kind", "degree"]).to_pylist()
    }
    rows = [i for i, key in enumerate(keys) if key in truth]
    kind = np.array([truth[keys[i]]["kind"] for i in rows])
    degree = np.array([truth[keys[i]]["degree"] for i in rows], np.float32)
    subset = None if clean_subset is None else np.asarray(clean_subset)[rows]
    return label_quality(np.asarray(scores, np.float32)[rows], kind, degree, subset)


def table_quality(table, ground_truth: str, column: str, with_subset: bool = False) -> dict:
    """`truth_quality` of one column of a label table (its `subset == "clean"` as the clean
    subset when `with_subset`)."""
    keys = table.column("key").to_pylist()
    scores = table.column(column).to_numpy(zero_copy_only=False)
    subset = np.array(table.column("subset").to_pylist()) == "clean" if with_subset else None
    return truth_quality(keys, scores, ground_truth, subset)
