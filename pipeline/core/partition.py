"""Partitions of a corpus from clean probabilities (METHODS §1.6, §2.5, §4.3, §5.3): pure numpy.

Contract:
- Inputs are per-sample arrays of one batch or of the whole corpus, aligned by position; the
  position is the sample index used to break ties, so results are deterministic.
- A NaN probability (its loss was NaN/inf and was recorded upstream) is never clean, never an
  anchor and never a candidate; it counts in `n_invalid`. The fallback rules below look at the
  finite probabilities only, so one bad sample cannot switch them off.
- Every fallback that fires is reported in the returned `PartitionFlags`, never silently:
  * 1 % rule [C]: if every probability exceeds the threshold, the threshold becomes the value at
    sorted position floor(N/100), so about 1 % of the samples turn noisy (more on ties: with all
    probabilities equal, all of them);
  * symmetric guard [I]: if then no sample is clean, the lowest-loss max(1, floor(N/100))
    samples are made clean (highest probability instead when no losses are given).
- `split_clean` (BiCro clean set), `select_anchors` (BiCro anchors), `split_sps` (SPS reliable /
  quasi-clean / noisy) and `rcr_candidates` (RCR's set C) are the whole public surface.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "SUBSETS",
    "CLEAN",
    "QUASI_CLEAN",
    "NOISY",
    "PartitionFlags",
    "split_clean",
    "select_anchors",
    "split_sps",
    "rcr_candidates",
]

SUBSETS = ("clean", "quasi_clean", "noisy")  # names of split_sps codes; SPS "reliable" is clean
CLEAN, QUASI_CLEAN, NOISY = 0, 1, 2  # int8 codes, indices into SUBSETS


@dataclass(frozen=True)
class PartitionFlags:
    """What a partition did, for metrics.json."""

    threshold: float  # the threshold finally applied (changed by the 1 % rule)
    one_percent_rule: bool  # every finite probability exceeded the threshold
    symmetric_guard: bool  # nothing was clean/selected, so the lowest-loss 1 % were taken
    n_selected: int  # samples in the clean set (split_clean) / C (rcr) / not noisy (sps)
    n_invalid: int  # NaN/inf probabilities, never selected

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


def _as_prob(prob: np.ndarray, name: str = "prob") -> np.ndarray:
    values = np.asarray(prob, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of per-sample values, got {values.shape}")
    return values


def _one_percent_threshold(prob: np.ndarray, valid: np.ndarray) -> float:
    """The 1 % rule of split_prob: the value at sorted position floor(N/100) of the finite probs."""
    finite = np.sort(prob[valid])
    return float(finite[finite.size // 100])


def _lowest_k(score: np.ndarray, valid: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k valid samples with the smallest score; ties by index (stable)."""
    candidates = np.flatnonzero(valid)
    order = np.argsort(score[candidates], kind="stable")
    return candidates[order[:k]]


def split_clean(
    prob: np.ndarray, threshold: float = 0.5, losses: np.ndarray | None = None
) -> tuple[np.ndarray, PartitionFlags]:
    """BiCro/NCR clean set: prob > threshold (strict), with the 1 % rule and symmetric guard.

    Args:
        prob: (N,) float clean probabilities (NaN for excluded samples).
        threshold: delta (BiCro/NCR: 0.5).
        losses: (N,) float raw losses, used only by the symmetric guard to pick the lowest-loss
            samples. Without them the guard picks the highest probabilities (ties by index).

    Returns:
        clean_mask: (N,) bool.
        flags: which rules fired, the threshold applied and the counts.
    """
    prob = _as_prob(prob)
    valid = np.isfinite(prob)
    applied = float(threshold)
    one_percent = bool(valid.any()) and bool(np.all(prob[valid] > applied))
    if one_percent:
        applied = _one_percent_threshold(prob, valid)
    with np.errstate(invalid="ignore"):
        clean = valid & (prob > applied)
    guard = bool(valid.any()) and not clean.any()
    if guard:
        k = max(1, int(valid.sum()) // 100)
        if losses is not None:
            score = np.asarray(losses, dtype=np.float64)
            if score.shape != prob.shape:
                raise ValueError(f"losses {score.shape} must match prob {prob.shape}")
            # A NaN loss sorts last under argsort, so finite losses are always preferred.
            chosen = _lowest_k(score, valid, k)
        else:
            chosen = _lowest_k(-prob, valid, k)
        clean[chosen] = True
    flags = PartitionFlags(
        threshold=applied,
        one_percent_rule=one_percent,
        symmetric_guard=guard,
        n_selected=int(clean.sum()),
        n_invalid=int((~valid).sum()),
    )
    return clean, flags


def select_anchors(
    clean_mask: np.ndarray, losses: np.ndarray, fraction: float = 0.10
) -> np.ndarray:
    """BiCro anchors (§2.5 step 4): the ceil(fraction * |C|) lowest-loss members of the clean set.

    Args:
        clean_mask: (N,) bool clean set C (from `split_clean`, non-empty).
        losses: (N,) float per-sample losses; members with a NaN/inf loss are skipped.
        fraction: rho in (0, 1] (BiCro: 0.10).

    Returns:
        (A,) int64 sample indices in increasing order, 1 <= A <= |C|; among equal losses the
        smaller index wins.

    Raises:
        ValueError: bad fraction, mismatched shapes, or an empty clean set.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"anchor fraction must be in (0, 1], got {fraction}")
    mask = np.asarray(clean_mask, dtype=bool)
    values = np.asarray(losses, dtype=np.float64)
    if mask.shape != values.shape or mask.ndim != 1:
        raise ValueError(f"clean_mask {mask.shape} and losses {values.shape} must be equal 1-D")
    members = mask & np.isfinite(values)
    size = int(members.sum())
    if size == 0:
        raise ValueError(
            "the clean set is empty (or all its losses are NaN/inf); build it with split_clean, "
            "whose symmetric guard keeps at least one sample clean"
        )
    # Exact decimal arithmetic: 0.1 * 30 is 3.0000000000000004 in floats and would ceil to 4.
    k = max(1, math.ceil(Fraction(repr(float(fraction))) * size))
    return np.sort(_lowest_k(values, members, k)).astype(np.int64)


def split_sps(
    prob: np.ndarray, eps1: float = 0.99, eps2: float = 0.5
) -> tuple[np.ndarray, PartitionFlags]:
    """SPS partition (§4.3): reliable prob > eps1, quasi-clean eps2 < prob <= eps1, noisy else.

    The 1 % rule of `split_clean` is applied at eps2 (as the released code does); no symmetric
    guard (an empty reliable set only means no proxies, which the label stage flags).

    Args:
        prob: (N,) float clean probabilities from the peer's GMM (NaN -> noisy).
        eps1: reliable threshold (paper: 0.99; released code: 0.6).
        eps2: noisy threshold (0.5).

    Returns:
        codes: (N,) int8 indices into SUBSETS (CLEAN = reliable, QUASI_CLEAN, NOISY).
        flags: `n_selected` counts reliable + quasi-clean; `threshold` is the eps2 applied.

    Raises:
        ValueError: if eps1 <= eps2, naming the value to change.
    """
    if not eps1 > eps2:
        raise ValueError(
            f"SPS thresholds need eps1 > eps2, got eps1 = {eps1} (reliable) and eps2 = {eps2} "
            f"(noisy): raise eps1 above {eps2} or lower eps2 below {eps1}"
        )
    prob = _as_prob(prob)
    valid = np.isfinite(prob)
    applied = float(eps2)
    one_percent = bool(valid.any()) and bool(np.all(prob[valid] > applied))
    if one_percent:
        applied = _one_percent_threshold(prob, valid)
    codes = np.full(prob.shape, NOISY, dtype=np.int8)
    with np.errstate(invalid="ignore"):
        kept = valid & (prob > applied)
        codes[kept] = QUASI_CLEAN
        codes[kept & (prob > eps1)] = CLEAN
    flags = PartitionFlags(
        threshold=applied,
        one_percent_rule=one_percent,
        symmetric_guard=False,
        n_selected=int(kept.sum()),
        n_invalid=int((~valid).sum()),
    )
    return codes, flags


def rcr_candidates(
    alpha_i2t: np.ndarray, alpha_t2i: np.ndarray, delta: float = 0.5
) -> tuple[np.ndarray, PartitionFlags]:
    """RCR's training set C (§5.3, Eq. 8): both directions' clean posteriors > delta.

    Fallback [I], in the spirit of §1.6: if C is empty, the max(1, floor(N/100)) pairs with the
    largest min(alpha_i2t, alpha_t2i) (ties by index) form C, so training never sees an empty
    set, and `symmetric_guard` is set. The upper 1 % rule is not applied: RCR re-weights C and
    has no noisy branch that needs populating.

    Args:
        alpha_i2t: (N,) float clean posterior of the image->text GMM.
        alpha_t2i: (N,) float clean posterior of the text->image GMM.
        delta: threshold (RCR grid {0.5, 0.9}).

    Returns:
        in_c: (N,) bool membership of C.
        flags: the fallback and the counts (`n_invalid`: a NaN in either direction).
    """
    a = _as_prob(alpha_i2t, "alpha_i2t")
    b = _as_prob(alpha_t2i, "alpha_t2i")
    if a.shape != b.shape:
        raise ValueError(f"alpha_i2t {a.shape} and alpha_t2i {b.shape} must have equal shapes")
    valid = np.isfinite(a) & np.isfinite(b)
    with np.errstate(invalid="ignore"):
        in_c = valid & (a > delta) & (b > delta)
    guard = bool(valid.any()) and not in_c.any()
    if guard:
        k = max(1, int(valid.sum()) // 100)
        in_c[_lowest_k(-np.minimum(a, b), valid, k)] = True
    flags = PartitionFlags(
        threshold=float(delta),
        one_percent_rule=False,
        symmetric_guard=guard,
        n_selected=int(in_c.sum()),
        n_invalid=int((~valid).sum()),
    )
    return in_c, flags
