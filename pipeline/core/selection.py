"""Subset selection by score, DataComp-style (docs/methods.md §14): pure numpy.

Contract:
- `kept_count(fraction, n)` is the one rule for "keep the top fraction f of n pairs":
  floor(f·n + 0.5) pairs (`ncl-pipeline export --keep-fraction` and the selection benchmark).
- `top_fraction(scores, keys, fraction)` marks those pairs: larger score first, ties to the
  smaller key; a NaN score is never kept (so fewer are kept when too few are finite).
- `neg_clip_loss(image, text, logit_scale)` is negCLIPLoss (Wang et al., NeurIPS 2024): the
  pair's CLIP score minus tau times the mean, over `repeats` random partitions of the pool into
  batches, of its two log-sum-exps over the batch (the CLIP loss's normaliser, "how much every
  other caption and image also look like a match").
- `rank_fusion(*scores)` averages the scores' percentile ranks (ties share their mean rank).
- `rank_grid(values)` + `fused_rank(pairs)` are the same fusion for an export over many
  tables: each score's rank is counted against a sorted grid of at most `FUSION_GRID` of its
  values (all of them below that: then the order is `rank_fusion`'s, ties included), and the
  fused score is an integer, so a driver and its tasks compute it bit for bit alike.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import logsumexp
from scipy.stats import rankdata

__all__ = [
    "FUSION_GRID",
    "fused_rank",
    "kept_count",
    "neg_clip_loss",
    "rank_fusion",
    "rank_grid",
    "top_fraction",
]

# Grid points per score: percentile ranks to 1/65,536, 256 KiB a score shipped to each task.
FUSION_GRID = 65_537


def kept_count(fraction: float, n: int) -> int:
    """Pairs the top `fraction` of `n` keeps: the nearest integer to f·n, halves up."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction} must be in (0, 1]")
    return min(n, math.floor(fraction * n + 0.5))


def top_fraction(scores: np.ndarray, keys: np.ndarray, fraction: float) -> np.ndarray:
    """(N,) bool: the `kept_count(fraction, N)` pairs of largest score (ties: smaller key)."""
    scores = np.asarray(scores, np.float64)
    keys = np.asarray(keys).astype(str)
    finite = ~np.isnan(scores)
    keep = min(kept_count(fraction, len(scores)), int(finite.sum()))
    # lexsort sorts by its last key first: score descending, then key ascending; NaN last.
    order = np.lexsort((keys, np.where(finite, -scores, np.inf)))
    mask = np.zeros(len(scores), bool)
    mask[order[:keep]] = True
    return mask


def neg_clip_loss(
    image_emb: np.ndarray,
    text_emb: np.ndarray,
    logit_scale: float,
    batch_size: int = 512,
    repeats: int = 10,
    seed: int = 0,
) -> np.ndarray:
    """(N,) negCLIPLoss of N pairs from L2-normalised (N, D) embeddings and the scorer's
    1/tau; larger is better. A last partial batch joins the one before it."""
    image = np.asarray(image_emb, np.float64)
    text = np.asarray(text_emb, np.float64)
    n = len(image)
    cosine: np.ndarray = np.einsum("nd,nd->n", image, text)
    if n < 2:
        return cosine
    batch_size = min(batch_size, n)
    normaliser = np.zeros(n)
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        order = rng.permutation(n)
        starts = list(range(0, n - batch_size + 1, batch_size))
        for i, start in enumerate(starts):
            end = n if i == len(starts) - 1 else start + batch_size
            rows = order[start:end]
            logits = logit_scale * image[rows] @ text[rows].T  # (b, b)
            normaliser[rows] += 0.5 * (logsumexp(logits, axis=1) + logsumexp(logits, axis=0))
    result: np.ndarray = cosine - normaliser / (repeats * logit_scale)
    return result


def rank_fusion(*scores: np.ndarray) -> np.ndarray:
    """(N,) mean of each score's percentile rank in (0, 1]: large when every score is large."""
    ranks = [rankdata(np.asarray(s, np.float64)) / len(s) for s in scores]
    fused: np.ndarray = np.mean(ranks, axis=0)
    return fused


def rank_grid(values: np.ndarray, size: int = FUSION_GRID) -> np.ndarray:
    """(G,) float32, sorted: the finite `values`, or `size` evenly spaced order statistics of
    them (the smallest and the largest included) when there are more."""
    finite: np.ndarray = np.sort(np.asarray(values, np.float32)[~np.isnan(values)])
    if len(finite) <= size:
        return finite
    picked: np.ndarray = finite[np.linspace(0, len(finite) - 1, size).round().astype(np.int64)]
    return picked


def fused_rank(pairs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """(N,) int64 from [(values (N,), grid (G,)), ...]: the sum over scores of the grid points
    below the value plus those at or below it (twice the mean rank, ties sharing it, minus 1:
    `rank_fusion`'s order); -1 where any value is NaN (never kept)."""
    total = np.zeros(len(pairs[0][0]), np.int64)
    missing = np.zeros(len(total), bool)
    for values, grid in pairs:
        values = np.asarray(values, np.float32)
        missing |= np.isnan(values)
        total += np.searchsorted(grid, values, "left") + np.searchsorted(grid, values, "right")
    total[missing] = -1
    return total
