"""Centring each modality on its corpus mean (docs/methods.md §5.5, `labels.bicro.centre`).

Pure module: numpy only.

Contract:
- `embedding_sums(u, v)` reduces one shard to the per-modality sums of its finite rows (both
  embeddings finite) in fixed point, int64 units of 2^-32, and their count; `merge_sums` adds
  shards. Integer addition is exact, so the corpus mean does not depend on the sharding or the
  order the driver folds the shards in: the Ray pass and `label_in_memory` centre identically.
- `corpus_means(sums)` is the (D,) float64 mean of each modality; `centre(x, mean)` subtracts
  it and re-normalises each row to unit length (float32). A row equal to the mean becomes 0
  (no direction: no evidence); a non-finite row stays non-finite.
- Inputs are L2-normalised embeddings, so |x| <= 1 and a shard of up to 2^31 rows cannot
  overflow the int64 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EmbeddingSums", "centre", "corpus_means", "embedding_sums", "merge_sums"]

_SCALE = 2.0**32  # fixed-point unit of the sums: far below float32's resolution near 1


@dataclass(frozen=True)
class EmbeddingSums:
    """Fixed-point sums of one modality pair over some rows (they add across shards)."""

    rows: int
    u: np.ndarray  # (D,) int64 sum of round(u * 2^32) over the rows
    v: np.ndarray  # (D,) int64


def embedding_sums(u: np.ndarray, v: np.ndarray) -> EmbeddingSums:
    """The sums of the finite rows of (N, D) unit-norm image and text embeddings."""
    u = np.asarray(u, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    finite = np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)

    def fixed(x: np.ndarray) -> np.ndarray:
        return np.asarray(np.rint(x[finite] * _SCALE).astype(np.int64).sum(axis=0, dtype=np.int64))

    return EmbeddingSums(rows=int(finite.sum()), u=fixed(u), v=fixed(v))


def merge_sums(parts: list[EmbeddingSums]) -> EmbeddingSums:
    """The sums of several shards (exact, order-independent)."""
    if not parts:
        raise ValueError("no embedding sums to merge: the pass has no shard")
    return EmbeddingSums(
        rows=sum(p.rows for p in parts),
        u=np.asarray(np.sum([p.u for p in parts], axis=0, dtype=np.int64)),
        v=np.asarray(np.sum([p.v for p in parts], axis=0, dtype=np.int64)),
    )


def corpus_means(sums: EmbeddingSums) -> tuple[np.ndarray, np.ndarray]:
    """(D,) float64 mean image and text embeddings.

    Raises:
        ValueError: no finite row to average.
    """
    if sums.rows == 0:
        raise ValueError("no finite embedding in the pass: the corpus mean is undefined")
    return sums.u / _SCALE / sums.rows, sums.v / _SCALE / sums.rows


def centre(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """(N, D) float32 rows of `x` minus `mean`, re-normalised (zero rows stay 0)."""
    shifted = np.asarray(x, dtype=np.float64) - np.asarray(mean, dtype=np.float64)
    norms = np.linalg.norm(shifted, axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        out = np.divide(shifted, norms, out=np.zeros_like(shifted), where=norms > 1e-12)
    out[~np.isfinite(shifted).all(axis=1)] = np.nan
    return np.asarray(out, dtype=np.float32)
