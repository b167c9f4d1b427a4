"""Label-free diagnostics of a round's labels: what a run without ground truth can say about
them. Pure numpy; no Ray, no I/O.

Contract:
- Everything is computed from mergeable counts, so each shard contributes a small part
  (`label_parts`) and the driver only adds parts (`merge_parts`) and reads them
  (`summarize_parts`): nothing per pair reaches the driver.
- Labels are binned on [0, 1] in `BINS` equal bins. Spearman correlations are those of the
  binned values (`binned_spearman`: pairs in one bin share its mid-rank), within ~1/BINS of
  the exact coefficient; label quantiles are read off the same histogram.
- Subsets are codes 0 clean, 1 quasi_clean, 2 noisy (`pipeline.core.partition.SUBSETS`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.metrics import histogram_quantiles
from pipeline.core.partition.decisions import SUBSETS as SUBSET_NAMES
from pipeline.core.partition.decisions import combined_subsets

__all__ = [
    "BINS",
    "binned_spearman",
    "joint_counts",
    "label_parts",
    "merge_parts",
    "summarize_parts",
]

BINS = 100  # label bins: a (BINS, BINS) joint per shard and round stays ~80 KB
SUBSETS = len(SUBSET_NAMES)
DISTRIBUTION_BINS = 10  # the label distribution as reported: shares per tenth of [0, 1]
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def _bins(values: np.ndarray) -> np.ndarray:
    """(N,) labels -> (N,) bin indices in [0, BINS) (NaN counts as 0: an unusable label)."""
    x = np.nan_to_num(np.asarray(values, np.float64), nan=0.0)
    return np.clip((x * BINS).astype(np.int64), 0, BINS - 1)


def joint_counts(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(N,) and (N,) labels in [0, 1] -> (BINS, BINS) int64 counts of their bin pairs."""
    flat = _bins(x) * BINS + _bins(y)
    return np.bincount(flat, minlength=BINS * BINS).reshape(BINS, BINS)


def _subset_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N,) and (N,) subset codes -> (3, 3) counts (rows: a, columns: b)."""
    flat = np.asarray(a, np.int64) * SUBSETS + np.asarray(b, np.int64)
    return np.bincount(flat, minlength=SUBSETS * SUBSETS).reshape(SUBSETS, SUBSETS)


def binned_spearman(joint: np.ndarray) -> float | None:
    """Spearman's rho of two variables known by their (B, B) joint bin counts, ties within a
    bin broken by mid-ranks (what scipy's spearmanr gives on the binned values); None when
    either side is constant or there is no pair."""
    joint = np.asarray(joint, np.float64)
    n = joint.sum()
    if n == 0:
        return None
    rows, cols = joint.sum(1), joint.sum(0)

    def midranks(counts: np.ndarray) -> np.ndarray:
        return np.asarray(np.cumsum(counts) - counts + (counts + 1) / 2)

    centre = (n + 1) / 2
    rx, ry = midranks(rows) - centre, midranks(cols) - centre
    var_x, var_y = float(rows @ rx**2), float(cols @ ry**2)
    if var_x <= 0 or var_y <= 0:
        return None
    return float(rx @ joint @ ry / np.sqrt(var_x * var_y))


def label_parts(
    soft_a: np.ndarray,
    soft_b: np.ndarray,
    subset_a: np.ndarray,
    subset_b: np.ndarray,
    kept: int,
    previous: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """One shard's counts for one round.

    Args:
        soft_a, soft_b: (N,) the two views' soft labels, key-aligned.
        subset_a, subset_b: (N,) the views' subset codes.
        kept: how many of the N pairs the export keeps at its defaults (published labels).
        previous: the previous round's published (soft label, subset code) of the same N
            pairs, key-aligned, or None (first labels round, or the shard was not labelled).

    Returns:
        Counts: "pairs", "views" (joint of a vs b), "subsets" (3x3 a vs b), "published"
        (histogram of the mean label), "published_subsets" (3,), "kept", and with `previous`:
        "change" (joint of the previous vs this round's mean label), "change_subsets" (3x3).
    """
    soft = (np.asarray(soft_a, np.float64) + np.asarray(soft_b, np.float64)) / 2
    published_subset = combined_subsets(subset_a, subset_b)
    parts: dict[str, Any] = {
        "pairs": int(len(soft)),
        "views": joint_counts(soft_a, soft_b),
        "subsets": _subset_counts(subset_a, subset_b),
        "published": np.bincount(_bins(soft), minlength=BINS),
        "published_subsets": np.bincount(np.asarray(published_subset, np.int64), minlength=SUBSETS),
        "kept": int(kept),
    }
    if previous is not None:
        parts["change"] = joint_counts(previous[0], soft)
        parts["change_subsets"] = _subset_counts(previous[1], published_subset)
    return parts


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of shards' parts (a key missing from some parts sums over those that have it)."""
    merged: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            merged[name] = value if name not in merged else merged[name] + value
    return merged


def _share(count: float, total: float) -> float | None:
    return float(count) / total if total else None


def summarize_parts(merged: dict[str, Any]) -> dict[str, Any]:
    """The round's diagnostics (JSON-ready) from its merged parts.

    Returns:
        pairs; kept_fraction (export defaults); subset_shares; views_spearman and
        views_subset_agreement (share of pairs both views put in the same subset); with a
        previous round: change_spearman and changed_subset_share; label_distribution (shares
        per tenth of [0, 1]) and label_quantiles (p10 ... p90) of the published labels.
    """
    pairs = merged.get("pairs", 0)
    if not pairs:
        return {"pairs": 0}
    published = np.asarray(merged["published"], np.float64)
    values = histogram_quantiles(published, QUANTILES)
    tenths = published.reshape(DISTRIBUTION_BINS, -1).sum(1)
    subsets = np.asarray(merged["published_subsets"])
    out: dict[str, Any] = {
        "pairs": int(pairs),
        "kept_fraction": _share(merged["kept"], pairs),
        "subset_shares": {
            name: _share(n, pairs) for name, n in zip(SUBSET_NAMES, subsets, strict=True)
        },
        "views_spearman": binned_spearman(merged["views"]),
        "views_subset_agreement": _share(np.trace(merged["subsets"]), pairs),
        "change_spearman": None,
        "changed_subset_share": None,
        "label_distribution": [float(v) for v in tenths / pairs],
        "label_quantiles": {
            f"p{round(100 * q)}": v for q, v in zip(QUANTILES, values, strict=True)
        },
    }
    if "change" in merged:
        compared = merged["change_subsets"].sum()
        out["change_spearman"] = binned_spearman(merged["change"])
        out["changed_subset_share"] = _share(
            compared - np.trace(merged["change_subsets"]), compared
        )
        out["change_pairs"] = int(compared)
    return out
