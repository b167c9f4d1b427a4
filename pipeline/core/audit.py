"""A person's audit of a run's labels: the stratified sample they judge and what their answers
estimate about the whole corpus. Pure numpy; no I/O.

Contract:
- `audit_strata(labels, strata)` puts every pair in one of `strata` equal-size strata by the
  rank of its label (ties broken by position, so strata stay equal however many labels tie);
  `stratified_sample(strata_of, per_stratum, seed)` draws `per_stratum` pairs of each, seeded.
- Answers are degrees: match 1, partial 0.5, mismatch 0 (`DEGREES`), as the synthetic corpora's
  ground truth grades pairs. An answered pair of stratum h stands for N_h / n_h pairs (N_h
  pairs in the stratum, n_h of them answered): the estimators below weigh it so.
- `audit_estimates` gives, for the kept set and the dropped set of a selection, the mean degree
  (the precision: the share of matching pairs, a partial match counting half) and, over the
  pairs judged match or mismatch, the AUROC of the labels and of the plain cosine; each with a
  stratified-bootstrap 95% interval (seeded). `favoured_threshold` is the label threshold
  whose estimated F1 of the matching pairs is highest.
- A figure that the answers cannot estimate (no answered pair kept, no mismatch answered...) is
  None, never a guess.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "ANSWERS",
    "DEGREES",
    "audit_estimates",
    "audit_strata",
    "favoured_threshold",
    "stratified_sample",
    "weighted_auroc",
]

ANSWERS = ("match", "partial", "mismatch")
DEGREES = {"match": 1.0, "partial": 0.5, "mismatch": 0.0}
BOOTSTRAP = 2000  # resamples for the intervals
LEVEL = 0.95


def audit_strata(labels: np.ndarray, strata: int) -> np.ndarray:
    """(N,) labels -> (N,) stratum of each pair in [0, strata): its label's rank decile (for
    strata=10), ties broken by position."""
    n = len(labels)
    order = np.argsort(np.asarray(labels, np.float64), kind="stable")
    ranks = np.empty(n, np.int64)
    ranks[order] = np.arange(n)
    return (ranks * strata) // max(n, 1)


def stratified_sample(strata_of: np.ndarray, per_stratum: int, seed: int) -> np.ndarray:
    """Indices of `per_stratum` pairs drawn without replacement from each stratum (all of a
    smaller one), in stratum order, seeded."""
    rng = np.random.default_rng(seed)
    chosen = []
    for stratum in np.unique(strata_of):
        members = np.flatnonzero(strata_of == stratum)
        take = min(per_stratum, len(members))
        chosen.append(np.sort(rng.choice(members, size=take, replace=False)))
    return np.concatenate(chosen) if chosen else np.empty(0, np.int64)


def weighted_auroc(scores: np.ndarray, positive: np.ndarray, weights: np.ndarray) -> float | None:
    """AUROC of `scores` separating `positive` from the rest, each pair weighing `weights`
    (ties count half); None without both classes."""
    scores = np.asarray(scores, np.float64)
    positive = np.asarray(positive, bool)
    weights = np.asarray(weights, np.float64)
    w_pos, w_neg = weights[positive].sum(), weights[~positive].sum()
    if w_pos <= 0 or w_neg <= 0:
        return None
    order = np.argsort(scores, kind="stable")
    s, p, w = scores[order], positive[order], weights[order]
    # Per distinct score: the negatives' weight below it, plus half of the negatives' at it.
    unique, start = np.unique(s, return_index=True)
    neg_at = np.add.reduceat(np.where(p, 0.0, w), start)
    pos_at = np.add.reduceat(np.where(p, w, 0.0), start)
    below = np.cumsum(neg_at) - neg_at
    return float((pos_at * (below + neg_at / 2)).sum() / (w_pos * w_neg))


def _estimates(
    degree: np.ndarray,
    kept: np.ndarray,
    labels: np.ndarray,
    cosine: np.ndarray,
    weight: np.ndarray,
) -> dict[str, float | None]:
    """The point estimates on one (re)sample of answered pairs."""

    def mean_degree(mask: np.ndarray) -> float | None:
        total = weight[mask].sum()
        return float((weight[mask] * degree[mask]).sum() / total) if total > 0 else None

    judged = degree != DEGREES["partial"]  # AUROC: matches vs mismatches, as with ground truth
    match = degree[judged] == DEGREES["match"]
    return {
        "kept_precision": mean_degree(kept),
        "dropped_precision": mean_degree(~kept),
        "label_auroc": weighted_auroc(labels[judged], match, weight[judged]),
        "cosine_auroc": weighted_auroc(cosine[judged], match, weight[judged]),
    }


def audit_estimates(
    degree: np.ndarray,
    kept: np.ndarray,
    labels: np.ndarray,
    cosine: np.ndarray,
    stratum: np.ndarray,
    stratum_size: dict[int, int],
    seed: int = 0,
) -> dict[str, Any]:
    """Estimates from the answered pairs (all arrays (n,), one entry per answered pair).

    Args:
        degree: each answer's degree (`DEGREES`).
        kept: whether the selection keeps the pair.
        labels, cosine: the pair's soft label and cosine.
        stratum: the pair's stratum; `stratum_size`: pairs per stratum in the whole corpus.
        seed: the bootstrap's seed.

    Returns:
        {name: {"estimate", "low", "high"}} for kept_precision, dropped_precision,
        label_auroc and cosine_auroc, plus "answered" and "kept_share" (the estimated share
        of the corpus kept).
    """
    stratum = np.asarray(stratum, np.int64)
    answered = {int(h): int((stratum == h).sum()) for h in np.unique(stratum)}
    weight = np.array([stratum_size[int(h)] / answered[int(h)] for h in stratum], np.float64)
    point = _estimates(degree, kept, labels, cosine, weight)
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(stratum == h) for h in answered]
    draws: dict[str, list[float]] = {name: [] for name in point}
    for _ in range(BOOTSTRAP):
        rows = np.concatenate([rng.choice(g, size=len(g), replace=True) for g in groups])
        again = _estimates(degree[rows], kept[rows], labels[rows], cosine[rows], weight[rows])
        for name, value in again.items():
            if value is not None:
                draws[name].append(value)
    tail = (1 - LEVEL) / 2
    out: dict[str, Any] = {"answered": int(len(degree))}
    for name, value in point.items():
        values = np.asarray(draws[name])
        enough = value is not None and len(values) >= BOOTSTRAP // 2
        out[name] = {
            "estimate": value,
            "low": float(np.quantile(values, tail)) if enough else None,
            "high": float(np.quantile(values, 1 - tail)) if enough else None,
        }
    total = weight.sum()
    out["kept_share"] = float(weight[kept].sum() / total) if total > 0 else None
    return out


def favoured_threshold(
    degree: np.ndarray, labels: np.ndarray, weight: np.ndarray, candidates: np.ndarray
) -> dict[str, float] | None:
    """The candidate label threshold t (keep label >= t) with the best estimated F1 of the
    matching pairs (precision: mean degree kept; recall: share of the degree mass kept), ties
    to the lower t; None when no answer is a match or partial."""
    mass = (weight * degree).sum()
    if mass <= 0:
        return None
    best: dict[str, float] | None = None
    for t in np.sort(np.asarray(candidates, np.float64)):
        kept = labels >= t
        if not kept.any():
            continue
        precision = (weight[kept] * degree[kept]).sum() / weight[kept].sum()
        recall = (weight[kept] * degree[kept]).sum() / mass
        f1 = 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)
        if best is None or f1 > best["f1"] + 1e-12:
            best = {"threshold": float(t), "f1": float(f1), "precision": float(precision),
                    "recall": float(recall)}  # fmt: skip
    return best
