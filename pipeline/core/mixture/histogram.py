"""Loss histograms: the only form in which per-sample losses reach a mixture fit (pure numpy).

Contract (docs/methods.md §2.1): every worker calls `histogram_range` on its losses and the
driver folds the pairs with `merge_ranges`; every worker then calls `build_histogram(losses, lo,
hi)` with that global range, and the driver folds the results with `merge_histograms` (integer
counts add exactly). Non-finite losses never enter a histogram; they are counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEFAULT_BINS",
    "HISTOGRAM_CHUNK",
    "RANGE_FLOOR",
    "LossHistogram",
    "as_float_array",
    "build_histogram",
    "denormalise",
    "has_spread",
    "histogram_range",
    "merge_histograms",
    "merge_ranges",
    "normalise_losses",
]

DEFAULT_BINS = 4096  # 1000 bins already match the exact fit to 3 decimals (docs/methods.md §2.1)
RANGE_FLOOR = 1e-12  # relative floor on max - min before the fit counts as "no loss spread"
HISTOGRAM_CHUNK = 1 << 18  # losses binned per block (2 MB float64 buffers, cache-friendly)

# --------------------------------------------------------------------------------------------
# Histograms
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LossHistogram:
    """Counts of finite raw losses in `bins` equal bins over the global range [lo, hi].

    Bin h covers normalised x in [h/H, (h+1)/H) (the last bin also holds x = 1); its centre is
    (h + 0.5)/H. Two histograms with the same (lo, hi, bins) merge by adding fields.
    """

    counts: np.ndarray  # (H,) int64; counts are integers so merges are exact and order-free
    lo: float  # global minimum of the finite raw losses (not of this shard)
    hi: float  # global maximum of the finite raw losses
    n: int  # finite losses counted, == counts.sum()
    n_nonfinite: int  # NaN/inf losses seen and left out (docs/methods.md §1.5)
    loss_sum: float  # sum of the finite raw losses, for the mean loss in diagnostics

    def __post_init__(self) -> None:
        counts = np.array(self.counts, dtype=np.int64)  # private copy, then frozen
        counts.setflags(write=False)
        object.__setattr__(self, "counts", counts)

    @property
    def bins(self) -> int:
        """Number of bins H."""
        return int(self.counts.shape[0])

    @property
    def centres(self) -> np.ndarray:
        """(H,) float64 bin centres in normalised loss units, (h + 0.5)/H."""
        return (np.arange(self.bins, dtype=np.float64) + 0.5) / self.bins


def _scale(lo: float, hi: float) -> float:
    """Denominator of the min-max normalisation, floored (docs/methods.md §2.2)."""
    return max(hi - lo, RANGE_FLOOR * max(1.0, abs(hi)))


def denormalise(x: float, lo: float, hi: float) -> float:
    """The loss at normalised position `x` of [lo, hi]: the inverse of `normalise_losses`."""
    return lo + x * _scale(lo, hi)


def has_spread(lo: float, hi: float) -> bool:
    return hi - lo >= RANGE_FLOOR * max(1.0, abs(hi))


def as_float_array(losses: np.ndarray) -> np.ndarray:
    """1-D float32/float64 view of the losses (no copy when already floating)."""
    values = np.asarray(losses)
    if values.dtype not in (np.float32, np.float64):
        values = values.astype(np.float64)
    return values.ravel()


def _finite_part(values: np.ndarray) -> np.ndarray:
    """The finite entries; the common all-finite case costs one min and one max, no copy."""
    if values.size and np.isfinite(values.min()) and np.isfinite(values.max()):
        return values  # min/max propagate NaN and show +-inf, so nothing else is non-finite
    finite: np.ndarray = values[np.isfinite(values)]
    return finite


def histogram_range(losses: np.ndarray) -> tuple[float, float]:
    """Min and max of the finite losses of one shard (pass 1 of the two-pass fit).

    Args:
        losses: (N,) float raw per-sample losses; NaN/inf are ignored.

    Returns:
        (min, max) as Python floats; (inf, -inf) when no loss is finite, the identity of
        `merge_ranges`, so empty shards merge harmlessly.
    """
    finite = _finite_part(as_float_array(losses))
    if finite.size == 0:
        return math.inf, -math.inf
    return float(finite.min()), float(finite.max())


def merge_ranges(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Combine two `histogram_range` results (exact: min of mins, max of maxes)."""
    return min(a[0], b[0]), max(a[1], b[1])


def build_histogram(
    losses: np.ndarray, lo: float, hi: float, bins: int = DEFAULT_BINS
) -> LossHistogram:
    """Histogram of one shard's finite losses over the global range (pass 2).

    Args:
        losses: (N,) float raw per-sample losses. NaN/inf are counted in `n_nonfinite` and left
            out (docs/methods.md §1.5).
        lo: global minimum of the finite losses over every shard (`merge_ranges`).
        hi: global maximum, `hi >= lo`.
        bins: number of bins H (>= 2).

    Returns:
        The shard's `LossHistogram`.

    Raises:
        ValueError: on a bad range or bin count, or a finite loss outside [lo, hi] (the range
            was not computed over this data).
    """
    if not isinstance(bins, (int, np.integer)) or bins < 2:
        raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        raise ValueError(
            f"histogram range must be finite with lo <= hi, got ({lo}, {hi}); compute it with "
            "histogram_range over every shard and merge_ranges (an (inf, -inf) range means no "
            "finite loss anywhere)"
        )
    values = as_float_array(losses)
    finite = _finite_part(values)
    n_nonfinite = int(values.size - finite.size)
    if finite.size and (finite.min() < lo or finite.max() > hi):
        raise ValueError(
            f"losses span [{finite.min()}, {finite.max()}], outside the histogram range "
            f"[{lo}, {hi}]; the range must be the global min/max over every shard"
        )
    # bin = floor(x * H) with x = (loss - lo) / scale, in float64, in place, block by block: at
    # 1e7 losses this pass, not the O(bins) fit, is the cost of the mixture step, and small
    # reused buffers avoid the page faults of fresh 80 MB temporaries.
    factor = bins / _scale(lo, hi)
    counts = np.zeros(bins, dtype=np.int64)
    scaled = np.empty(min(finite.size, HISTOGRAM_CHUNK), dtype=np.float64)
    index = np.empty(scaled.size, dtype=np.int64)
    for start in range(0, finite.size, HISTOGRAM_CHUNK):
        block = finite[start : start + HISTOGRAM_CHUNK]
        buf, idx = scaled[: block.size], index[: block.size]
        np.subtract(block, lo, out=buf, dtype=np.float64)
        buf *= factor
        idx[:] = buf  # non-negative, so truncation to int is floor
        np.minimum(idx, bins - 1, out=idx)  # x = 1 goes to the last bin
        counts += np.bincount(idx, minlength=bins)
    return LossHistogram(
        counts=counts,
        lo=lo,
        hi=hi,
        n=int(finite.size),
        n_nonfinite=n_nonfinite,
        loss_sum=float(finite.sum(dtype=np.float64)),
    )


def merge_histograms(a: LossHistogram, b: LossHistogram) -> LossHistogram:
    """Exact sum of two histograms built over the same range and bins.

    Raises:
        ValueError: if (lo, hi, bins) differ; the shards did not share one global range.
    """
    if a.lo != b.lo or a.hi != b.hi or a.bins != b.bins:
        raise ValueError(
            f"cannot merge histograms over different grids: (lo, hi, bins) = "
            f"({a.lo}, {a.hi}, {a.bins}) vs ({b.lo}, {b.hi}, {b.bins}); build every shard's "
            "histogram with the same merged global range and bin count"
        )
    return LossHistogram(
        counts=a.counts + b.counts,
        lo=a.lo,
        hi=a.hi,
        n=a.n + b.n,
        n_nonfinite=a.n_nonfinite + b.n_nonfinite,
        loss_sum=a.loss_sum + b.loss_sum,
    )


def normalise_losses(losses: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Global min-max normalisation with the range floor of docs/methods.md §2.2.

    Args:
        losses: (N,) float raw losses.
        lo, hi: the fit's range.

    Returns:
        (N,) float64 x = (loss - lo) / max(hi - lo, 1e-12 * max(1, |hi|)); NaN/inf propagate.
    """
    return (np.asarray(losses, dtype=np.float64) - lo) / _scale(lo, hi)
