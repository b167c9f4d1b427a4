"""Partitions of the corpus from clean posteriors, decided globally and applied per shard.

Pure module: numpy only (docs/methods.md §3).

Contract:
- A label pass sees the corpus one shard at a time. Each shard reduces its rows to counts
  (`partition_counts`); a method's `decide` function turns the summed counts, plus a few order
  statistics found with `pipeline.core.partition.select.radix_select`, into one
  `PartitionDecisions`; every shard then applies it to its own rows (`shard_masks`). The decisions
  are a handful of numbers, so the partition of a shard depends on the corpus, never on how it was
  sharded.
- Fallbacks (docs/methods.md §3.2), reported in the partition summary, never silent:
  * 1 % rule: when every finite posterior exceeds the threshold, the threshold becomes the value
    at sorted position floor(N/100), so about 1 % of the pairs turn noisy;
  * symmetric guard: when nothing is then selected, the max(1, floor(N/100)) lowest-loss valid
    pairs (RCR: largest min(alpha_i2t, alpha_t2i)) are, ties by sample id; SPS's optional
    reliable fallback is the same rule over the highest posteriors.
- A NaN/inf posterior (its loss was not finite) is never clean, never an anchor, never in C.
- `Select` is how decisions ask for order statistics: `select(what, k, in_play, decisions,
  with_id)` ranks the rows named by `what` (see `selection_rows`) over every shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from pipeline.core.partition.select import Cut, at_or_below, key_value, order_keys

__all__ = [
    "CLEAN",
    "NOISY",
    "QUASI_CLEAN",
    "SUBSETS",
    "PartitionDecisions",
    "Select",
    "ShardMasks",
    "ShardScalars",
    "combined_subsets",
    "decide_anchors",
    "decide_clean_split",
    "decide_rcr_candidates",
    "decide_sps_split",
    "partition_counts",
    "selection_rows",
    "shard_masks",
]

SUBSETS = ("clean", "quasi_clean", "noisy")  # subset names by int8 code; SPS "reliable" = clean
CLEAN, QUASI_CLEAN, NOISY = 0, 1, 2


def combined_subsets(codes_a: np.ndarray, codes_b: np.ndarray) -> np.ndarray:
    """(N,) subset codes of two views -> the published subset: the more cautious of the two."""
    return np.asarray(np.maximum(codes_a, codes_b))


@dataclass
class ShardScalars:
    """Per-pair scalars of one shard that every partition step needs (no embeddings)."""

    ids: np.ndarray  # (N,) int64 global sample ids (tie-breaks everywhere)
    loss: np.ndarray  # (N,) float32 the loss the mixture was fitted on
    loss_i2t: np.ndarray  # (N,) float32 per-direction InfoNCE of the partitioning model
    loss_t2i: np.ndarray  # (N,) float32
    prob: np.ndarray | None = None  # (N,) float32 clean posterior of the configured mixture
    alpha_i2t: np.ndarray | None = None  # (N,) float32 RCR: per-direction GMM posteriors
    alpha_t2i: np.ndarray | None = None


@dataclass(frozen=True)
class PartitionDecisions:
    """The corpus-wide decisions every shard applies (plain data: a few numbers)."""

    threshold: float  # clean iff posterior > threshold (after the 1 % rule)
    guard_cut: Cut | None = None  # symmetric guard: clean iff valid (loss key, id) <= cut
    anchor_cut: Cut | None = None  # BiCro anchors: clean (loss key, id) <= cut
    sps_eps1: float | None = None  # SPS: reliable iff posterior > eps1
    sps_eps2: float | None = None  # SPS: noisy iff posterior <= eps2 (after the 1 % rule)
    sps_reliable_cut: Cut | None = None  # SPS fallback: reliable iff valid (-p, id) <= cut
    rcr_delta: float | None = None  # RCR: C iff both direction posteriors > delta
    rcr_guard_cut: Cut | None = None  # RCR guard: valid (-min alpha, id) <= cut


@dataclass
class ShardMasks:
    """One shard's partition under the decisions."""

    valid: np.ndarray  # (N,) bool finite posterior
    clean: np.ndarray  # (N,) bool clean split
    anchor: np.ndarray  # (N,) bool BiCro anchors (in-batch anchors are set by the method)
    sps: np.ndarray | None = None  # (N,) int8 CLEAN (reliable) / QUASI_CLEAN / NOISY
    in_c: np.ndarray | None = None  # (N,) bool RCR's set C


# select(what, k, in_play, decisions, with_id) -> (value key, id or None, rows <= result)
Select = Callable[..., tuple[int, int | None, int]]


def _prob(scalars: ShardScalars) -> np.ndarray:
    assert scalars.prob is not None, "a partition needs the clean posteriors (add_posteriors)"
    return scalars.prob


def _alphas(scalars: ShardScalars) -> tuple[np.ndarray, np.ndarray]:
    a, b = scalars.alpha_i2t, scalars.alpha_t2i
    assert a is not None and b is not None, "RCR needs both per-direction posteriors"
    return a, b


def _rcr_valid(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    valid: np.ndarray = np.isfinite(a) & np.isfinite(b)
    return valid


def partition_counts(
    scalars: ShardScalars,
    *,
    threshold: float,
    sps_eps1: float | None = None,
    sps_eps2: float | None = None,
    rcr_delta: float | None = None,
) -> dict[str, int]:
    """Counts of one shard behind the decisions; they add across shards.

    Returns:
        rows, valid, above_delta (posterior > threshold); with SPS thresholds above_eps1 and
        above_eps2; with RCR posteriors and delta rcr_valid and in_c.
    """
    prob = _prob(scalars)
    valid = np.isfinite(prob)
    with np.errstate(invalid="ignore"):
        counts = {
            "rows": int(prob.size),
            "valid": int(valid.sum()),
            "above_delta": int((prob > threshold).sum()),
        }
        if sps_eps1 is not None and sps_eps2 is not None:
            counts["above_eps2"] = int((prob > sps_eps2).sum())
            counts["above_eps1"] = int((prob > sps_eps1).sum())
        if scalars.alpha_i2t is not None and rcr_delta is not None:
            a, b = _alphas(scalars)
            rcr_valid = _rcr_valid(a, b)
            counts["rcr_valid"] = int(rcr_valid.sum())
            counts["in_c"] = int((rcr_valid & (a > rcr_delta) & (b > rcr_delta)).sum())
    return counts


def shard_masks(scalars: ShardScalars, decisions: PartitionDecisions) -> ShardMasks:
    """The partition of one shard from the global decisions."""
    prob = _prob(scalars)
    valid = np.isfinite(prob)
    loss_keys = order_keys(np.where(valid, scalars.loss, 0.0))
    with np.errstate(invalid="ignore"):
        if decisions.guard_cut is None:
            clean = valid & (prob > decisions.threshold)
        else:
            clean = valid & at_or_below(loss_keys, scalars.ids, decisions.guard_cut)
        anchor = np.zeros_like(clean)
        if decisions.anchor_cut is not None:
            anchor = clean & at_or_below(loss_keys, scalars.ids, decisions.anchor_cut)
        masks = ShardMasks(valid=valid, clean=clean, anchor=anchor)
        if decisions.sps_eps2 is not None:
            codes = np.full(prob.shape, NOISY, dtype=np.int8)
            kept = valid & (prob > decisions.sps_eps2)
            codes[kept] = QUASI_CLEAN
            if decisions.sps_reliable_cut is None:
                codes[kept & (prob > decisions.sps_eps1)] = CLEAN
            else:
                top = order_keys(np.where(valid, -prob, 0.0))
                codes[valid & at_or_below(top, scalars.ids, decisions.sps_reliable_cut)] = CLEAN
            masks.sps = codes
    if decisions.rcr_delta is not None and scalars.alpha_i2t is not None:
        a, b = _alphas(scalars)
        rcr_valid = _rcr_valid(a, b)
        if decisions.rcr_guard_cut is None:
            with np.errstate(invalid="ignore"):
                delta = decisions.rcr_delta
                masks.in_c = rcr_valid & (a > delta) & (b > delta)
        else:
            keys = order_keys(np.where(rcr_valid, -np.minimum(a, b), 0.0))
            masks.in_c = rcr_valid & at_or_below(keys, scalars.ids, decisions.rcr_guard_cut)
    return masks


def selection_rows(
    scalars: ShardScalars, what: str, decisions: PartitionDecisions | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(keys uint64, ids int64) of the rows a selection ranks.

    `what`: "prob" (valid posteriors), "prob_desc" (their negatives: highest first),
    "loss_valid" (losses of valid rows), "loss_clean"
    (losses of the clean split under `decisions`), "rcr_guard" (-min(alpha_i2t, alpha_t2i)).
    """
    prob = _prob(scalars)
    valid = np.isfinite(prob)
    if what == "prob":
        return order_keys(prob[valid]), scalars.ids[valid]
    if what == "prob_desc":
        return order_keys(-prob[valid]), scalars.ids[valid]
    if what == "loss_valid":
        return order_keys(scalars.loss[valid]), scalars.ids[valid]
    if what == "loss_clean":
        assert decisions is not None, "loss_clean ranks the clean split under `decisions`"
        clean = shard_masks(scalars, decisions).clean
        return order_keys(scalars.loss[clean]), scalars.ids[clean]
    if what == "rcr_guard":
        a, b = _alphas(scalars)
        rcr_valid = _rcr_valid(a, b)
        return order_keys(-np.minimum(a, b)[rcr_valid]), scalars.ids[rcr_valid]
    raise ValueError(f"unknown selection {what!r}")


def _one_percent_threshold(select: Select, valid: int) -> tuple[float, int]:
    """The value at sorted position floor(N/100) of the valid posteriors, and how many rows
    are at or below it (they turn noisy)."""
    key, _, n_le = select("prob", valid // 100 + 1, valid, None, False)
    return key_value(key), n_le


def _guard_cut(select: Select, what: str, valid: int, fraction: Fraction) -> tuple[Cut, int]:
    """The symmetric guard's cut: the max(1, floor(fraction x valid)) first rows of the
    selection `what` (ties by id), and how many that is."""
    k = max(1, math.floor(fraction * valid))
    key, sample, _ = select(what, k, valid, None, True)
    assert sample is not None  # ranked with ids: the cut's id
    return (key, sample), k


GUARD_FRACTION = Fraction(1, 100)  # the symmetric guard's share of the valid pairs


def decide_clean_split(
    count: dict[str, int], select: Select, *, threshold: float
) -> tuple[float, Cut | None, int, dict[str, Any]]:
    """The clean split (posterior > threshold) with the 1 % rule and the symmetric guard.

    Returns:
        (threshold applied, guard cut or None, clean pairs, report for the summary).
    """
    valid = count["valid"]
    n_clean = count["above_delta"]
    guard_cut = None
    one_percent = valid > 0 and n_clean == valid
    if one_percent:
        threshold, n_le = _one_percent_threshold(select, valid)
        n_clean = valid - n_le
    guard = valid > 0 and n_clean == 0
    if guard:
        guard_cut, n_clean = _guard_cut(select, "loss_valid", valid, GUARD_FRACTION)
    report = {
        "threshold": threshold,
        "one_percent_rule": bool(one_percent),
        "symmetric_guard": bool(guard),
        "n_selected": int(n_clean),
        "n_invalid": int(count["rows"] - valid),
    }
    return threshold, guard_cut, n_clean, report


def decide_anchors(
    select: Select, n_clean: int, interim: PartitionDecisions, *, fraction: float
) -> tuple[Cut, dict[str, Any]]:
    """BiCro's anchors: the ceil(fraction x |clean|) lowest-loss clean pairs, ties by id.

    Exact decimal arithmetic: 0.1 x 30 is 3.0000000000000004 in floats and would ceil to 4.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"anchor fraction must be in (0, 1], got {fraction}")
    k = max(1, math.ceil(Fraction(repr(float(fraction))) * n_clean))
    key, sample, _ = select("loss_clean", k, n_clean, interim, True)
    assert sample is not None  # ranked with ids: the cut's id
    return (key, sample), {"n_anchors": k, "fraction": fraction}


def decide_sps_split(
    count: dict[str, int],
    select: Select,
    *,
    eps1: float,
    eps2: float,
    reliable_fallback: float = 0.0,
) -> tuple[float, Cut | None, dict[str, Any]]:
    """SPS: reliable > eps1 >= quasi-clean > eps2 >= noisy; the 1 % rule applies at eps2 (as the
    released code). When no posterior exceeds eps1 and `reliable_fallback` > 0, the
    max(1, floor(reliable_fallback x N)) valid pairs of highest posterior (ties by id) are
    reliable instead: the symmetric guard's rule over the posterior. At 0 the set stays empty
    (no proxies), as in the paper.

    Returns:
        (eps2 applied, reliable cut or None, report).
    """
    if not eps1 > eps2:
        raise ValueError(f"SPS needs eps1 > eps2, got eps1={eps1} and eps2={eps2}")
    valid = count["valid"]
    kept = count["above_eps2"]
    one_percent = valid > 0 and kept == valid
    if one_percent:
        eps2, n_le = _one_percent_threshold(select, valid)
        kept = valid - n_le
    n_reliable, reliable_cut = int(count["above_eps1"]), None
    fallback = n_reliable == 0 and valid > 0 and reliable_fallback > 0
    if fallback:
        share = Fraction(repr(float(reliable_fallback)))
        reliable_cut, n_reliable = _guard_cut(select, "prob_desc", valid, share)
    report = {
        "threshold": eps2,
        "eps1": eps1,
        "one_percent_rule": bool(one_percent),
        "symmetric_guard": False,
        "reliable_fallback": bool(fallback),
        "n_selected": int(kept),
        "n_invalid": int(count["rows"] - valid),
        "n_reliable": n_reliable,
        "no_reliable_set": n_reliable == 0,  # no proxies: every noisy label is 0
    }
    return eps2, reliable_cut, report


def decide_rcr_candidates(
    count: dict[str, int], select: Select, *, delta: float
) -> tuple[Cut | None, dict[str, Any]]:
    """RCR's set C: both directions' posteriors > delta; if empty, the max(1, floor(N/100))
    pairs with the largest min posterior (no 1 % rule: RCR has no noisy branch to populate).

    Returns:
        (guard cut or None, report).
    """
    rcr_valid, in_c = count["rcr_valid"], count["in_c"]
    cut = None
    guard = rcr_valid > 0 and in_c == 0
    if guard:
        cut, in_c = _guard_cut(select, "rcr_guard", rcr_valid, GUARD_FRACTION)
    report = {
        "threshold": delta,
        "one_percent_rule": False,
        "symmetric_guard": bool(guard),
        "n_selected": int(in_c),
        "n_invalid": int(count["rows"] - rcr_valid),
    }
    return cut, report
