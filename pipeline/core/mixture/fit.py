"""Two-component loss mixtures (BMM, GMM) fitted on a histogram (docs/methods.md §2): pure numpy.

Contract:
- The fit never sees per-sample data: it runs on a `LossHistogram` (O(bins) per EM iteration
  whatever the corpus), built in two passes over the workers (`histogram_range` + `merge_ranges`,
  then `build_histogram` + `merge_histograms`, both exact; docs/methods.md §2.1), and fitted once
  by `fit_bmm` / `fit_gmm` (or `MIXTURES[kind]`). `clean_posterior(fit, losses)` then runs per
  sample on each worker. The histogram half lives in `pipeline.core.mixture.histogram`.
- Normalisation is global min-max with a floor on the range (§2.2); below it (all losses equal,
  one sample, fewer than two occupied bins) the fit is skipped, `no_spread=True`, and every
  finite loss is clean with probability 1.
- Non-finite losses never enter a histogram (`n_nonfinite`); `clean_posterior` returns NaN for
  them. For finite input the posterior is finite and in [0, 1].
- BMM follows the BetaMixture1D reference with the fixes of §2.3; GMM follows sklearn's EM for
  `GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4)` from a deterministic 2-means start.
  The clean component is always the one with the smaller mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import betaln, logsumexp

from pipeline.core.mixture.histogram import (
    DEFAULT_BINS,
    LossHistogram,
    as_float_array,
    build_histogram,
    denormalise,
    has_spread,
    histogram_range,
    merge_histograms,
    merge_ranges,
    normalise_losses,
)

__all__ = [
    "DEFAULT_BINS",
    "LossHistogram",
    "MixtureFit",
    "MIXTURES",
    "histogram_range",
    "merge_ranges",
    "build_histogram",
    "merge_histograms",
    "normalise_losses",
    "fit_bmm",
    "fit_gmm",
    "fit_mixture",
    "clean_posterior",
]

BMM_CLAMP = 1e-4  # the Beta EM breaks at exactly 0 or 1 (reference `fit` clamp)
RESP_FLOOR = 1e-12  # reference floor on pi_k * Beta(x) before normalising responsibilities
POSTERIOR_EPS = 1e-12  # reference eps in the BMM posterior's denominator
VAR_FLOOR = 1e-8  # keeps the method of moments finite when a component collapses
SHAPE_MIN, SHAPE_MAX = 1e-3, 1e5  # clamp on Beta a, b
COLLAPSE_MEAN_GAP = 1e-3  # components closer than this in mean have merged
COLLAPSE_MIN_WEIGHT = 1e-4  # a component lighter than this has vanished
MONOTONE_GRID = 16385  # points of the grid behind the monotone fix (spec asks >= 4096)


# --- Fit result -----------------------------------------------------------------------------


Pair = tuple[float, float]


@dataclass(frozen=True)
class MixtureFit:
    """A fitted two-component mixture over normalised losses, plus what happened during EM.

    Component parameters live in normalised loss units (x in [0, 1] over [lo, hi]); they are
    None when `no_spread` is set (no fit ran).
    """

    kind: str  # "bmm" or "gmm", the key in MIXTURES
    lo: float  # raw-loss range used for the normalisation; posteriors reuse it
    hi: float
    n: int  # finite losses the fit saw
    n_nonfinite: int  # losses excluded as NaN/inf
    bins: int  # histogram resolution
    weights: Pair | None  # mixing weights pi_k
    means: Pair | None  # component means in x units (a/(a+b) for Beta)
    variances: Pair | None  # component variances in x units (reg_covar included for GMM)
    alphas: Pair | None  # Beta a_k (BMM only)
    betas: Pair | None  # Beta b_k (BMM only)
    clean_component: int  # index of the smaller-mean component, never assumed to be 0
    iterations: int  # M-steps whose parameters were kept
    converged: bool  # GMM: stopped on tol; BMM: always False (fixed iteration count, no test)
    collapsed: bool  # BMM collapse guard fired and the previous parameters were kept
    no_spread: bool  # loss range below the floor: no fit, clean probability 1 for everyone
    monotone: bool  # clean_posterior enforces a clean posterior non-increasing in the loss
    log_likelihood: float  # mean per-sample log-likelihood (x units) of the final parameters
    log_likelihood_trace: tuple[float, ...] = field(default=())  # before each M-step + final

    def clean_share(self) -> float:
        """The clean component's mixing weight, 1 - the estimated noise rate (1: no fit ran)."""
        if self.no_spread or self.weights is None:
            return 1.0
        return float(self.weights[self.clean_component])

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (NaN becomes None) for metrics.json and Parquet metadata."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = [_json_float(v) for v in value]
            elif isinstance(value, float):
                value = _json_float(value)
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MixtureFit:
        """Inverse of `to_dict`; unknown keys are rejected so stale metadata fails loudly."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown MixtureFit keys {sorted(unknown)}")
        values = dict(data)
        for name in ("weights", "means", "variances", "alphas", "betas", "log_likelihood_trace"):
            if values.get(name) is not None:
                values[name] = tuple(_from_json_float(v) for v in values[name])
        for name in ("lo", "hi", "log_likelihood"):
            values[name] = _from_json_float(values[name])
        return cls(**values)

    @property
    def noisy_component(self) -> int:
        """Index of the larger-mean component."""
        return 1 - self.clean_component

    def loss_mean(self, component: int) -> float:
        """A component's mean in loss units (the fit's `means` are in normalised x units)."""
        if self.means is None:
            raise ValueError("a fit without spread has no components")
        return denormalise(self.means[component], self.lo, self.hi)

    def describe(self) -> str:
        """`clean mean 2.104 (weight 0.61), noisy mean 4.012 (weight 0.39)`: the components in
        loss units, the one text every console line and report cell shows for a fit."""
        if self.no_spread or self.means is None or self.weights is None:
            return f"no loss spread: every sample clean (n={self.n})"
        return ", ".join(
            f"{name} mean {self.loss_mean(k):.3f} (weight {self.weights[k]:.2f})"
            for name, k in (("clean", self.clean_component), ("noisy", self.noisy_component))
        )


def _json_float(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _from_json_float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _pair(values: np.ndarray) -> Pair:
    return float(values[0]), float(values[1])


def _no_spread_fit(hist: LossHistogram, kind: str, monotone: bool) -> MixtureFit:
    return MixtureFit(
        kind=kind,
        lo=hist.lo,
        hi=hist.hi,
        n=hist.n,
        n_nonfinite=hist.n_nonfinite,
        bins=hist.bins,
        weights=None,
        means=None,
        variances=None,
        alphas=None,
        betas=None,
        clean_component=0,
        iterations=0,
        converged=False,
        collapsed=False,
        no_spread=True,
        monotone=monotone,
        log_likelihood=math.nan,
    )


def _check_fittable(hist: LossHistogram) -> bool:
    """True when a fit can run; False for "no loss spread"; raises on an empty histogram."""
    if hist.n == 0:
        raise ValueError(
            f"no finite losses to fit the mixture on ({hist.n_nonfinite} NaN/inf excluded); "
            "check the loss pass of this dataset"
        )
    # A histogram built over a range wider than its data can still hold a single value; with
    # fewer than two occupied bins there is nothing to separate, which is also "no spread".
    return has_spread(hist.lo, hist.hi) and int(np.count_nonzero(hist.counts)) >= 2


# --- Beta mixture ---------------------------------------------------------------------------


def _beta_logpdf(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(K, M) log Beta(x | a_k, b_k) for x (M,) strictly inside (0, 1)."""
    a = a[:, None]
    b = b[:, None]
    logpdf: np.ndarray = (
        (a - 1.0) * np.log(x)[None, :] + (b - 1.0) * np.log1p(-x)[None, :] - betaln(a, b)
    )
    return logpdf


def _bmm_moments(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted method of moments for each row of w (K, M): returns a (K,), b (K,)."""
    total = w.sum(axis=1)
    mean = (w @ x) / total
    var = (w * (x[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
    var = np.maximum(var, VAR_FLOOR)
    a = mean * (mean * (1.0 - mean) / var - 1.0)
    b = a * (1.0 - mean) / mean
    return np.clip(a, SHAPE_MIN, SHAPE_MAX), np.clip(b, SHAPE_MIN, SHAPE_MAX)


def _bmm_em(
    x: np.ndarray,
    counts: np.ndarray,
    max_iter: int,
    init: tuple[Sequence[float], Sequence[float], Sequence[float]],
) -> dict[str, Any]:
    """BetaMixture1D EM on values x (M,) with multiplicities counts (M,)."""
    a = np.asarray(init[0], dtype=np.float64).copy()
    b = np.asarray(init[1], dtype=np.float64).copy()
    pi = np.asarray(init[2], dtype=np.float64).copy()
    n = counts.sum()
    trace = []
    iterations, collapsed = 0, False
    for _ in range(max_iter):
        log_joint = np.log(pi)[:, None] + _beta_logpdf(x, a, b)  # (2, M)
        trace.append(float(counts @ logsumexp(log_joint, axis=0)) / n)
        # The reference works in linear space and floors pi_k * Beta(x) at 1e-12; exp of the
        # log is the same number without the overflow of a huge Beta normaliser.
        resp = np.maximum(np.exp(log_joint), RESP_FLOOR)
        resp /= resp.sum(axis=0, keepdims=True)
        weighted = resp * counts[None, :]  # r_kh * c_h
        new_a, new_b = _bmm_moments(x, weighted)
        new_pi = weighted.sum(axis=1)
        new_pi /= new_pi.sum()
        new_mean = new_a / (new_a + new_b)
        if abs(new_mean[0] - new_mean[1]) < COLLAPSE_MEAN_GAP or new_pi.min() < COLLAPSE_MIN_WEIGHT:
            # Method-of-moments EM is not monotone and can merge both components when run on;
            # keep the last distinct parameters rather than a degenerate mixture.
            collapsed = True
            break
        a, b, pi = new_a, new_b, new_pi
        iterations += 1
    log_joint = np.log(pi)[:, None] + _beta_logpdf(x, a, b)
    final_ll = float(counts @ logsumexp(log_joint, axis=0)) / n
    trace.append(final_ll)
    return {
        "a": a,
        "b": b,
        "pi": pi,
        "iterations": iterations,
        "collapsed": collapsed,
        "log_likelihood": final_ll,
        "trace": tuple(trace),
    }


def fit_bmm(
    hist: LossHistogram,
    max_iter: int = 10,
    *,
    monotone: bool = True,
    init: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
) -> MixtureFit:
    """Binned two-component Beta mixture, BetaMixture1D with the fixes of docs/methods.md §2.3.

    Bin centres are clamped to [1e-4, 1 - 1e-4]; exactly `max_iter` EM iterations run (no
    convergence test, as the reference: more iterations can merge the components) unless the
    collapse guard stops earlier. Cost O(bins * max_iter).

    Args:
        hist: merged histogram of the whole corpus.
        max_iter: EM iterations (reference: 10).
        monotone: let `clean_posterior` enforce a clean posterior non-increasing in loss past
            its peak (default on, docs/methods.md §2.5).
        init: ((a0, a1), (b0, b1), (pi0, pi1)); default the reference's ((1, 2), (2, 1),
            (.5, .5)). For tests and warm starts.

    Returns:
        MixtureFit with kind "bmm".

    Raises:
        ValueError: if the histogram holds no finite loss.
    """
    if not _check_fittable(hist):
        return _no_spread_fit(hist, "bmm", monotone)
    x = np.clip(hist.centres, BMM_CLAMP, 1.0 - BMM_CLAMP)
    counts = hist.counts.astype(np.float64)
    keep = counts > 0  # empty bins add nothing to any sum; skipping them is exact and faster
    result = _bmm_em(x[keep], counts[keep], max_iter, init or ((1.0, 2.0), (2.0, 1.0), (0.5, 0.5)))
    a, b, pi = result["a"], result["b"], result["pi"]
    means = a / (a + b)
    variances = a * b / ((a + b) ** 2 * (a + b + 1.0))
    return MixtureFit(
        kind="bmm",
        lo=hist.lo,
        hi=hist.hi,
        n=hist.n,
        n_nonfinite=hist.n_nonfinite,
        bins=hist.bins,
        weights=_pair(pi),
        means=_pair(means),
        variances=_pair(variances),
        alphas=_pair(a),
        betas=_pair(b),
        clean_component=int(np.argmin(means)),
        iterations=result["iterations"],
        converged=False,
        collapsed=result["collapsed"],
        no_spread=False,
        monotone=monotone,
        log_likelihood=result["log_likelihood"],
        log_likelihood_trace=result["trace"],
    )


# --- Gaussian mixture -----------------------------------------------------------------------


def _gauss_logpdf(x: np.ndarray, mu: np.ndarray, var: np.ndarray) -> np.ndarray:
    """(K, M) log N(x | mu_k, var_k)."""
    diff = x[None, :] - mu[:, None]
    logpdf: np.ndarray = -0.5 * (np.log(2.0 * np.pi * var)[:, None] + diff * diff / var[:, None])
    return logpdf


def _gmm_mstep(
    x: np.ndarray, w: np.ndarray, reg_covar: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sklearn's M-step in 1-D from weights w (K, M) = resp * counts."""
    # + 10 eps as sklearn does, so a component that lost every sample stays finite.
    nk = w.sum(axis=1) + 10.0 * np.finfo(np.float64).eps
    mu = (w @ x) / nk
    var = (w * (x[None, :] - mu[:, None]) ** 2).sum(axis=1) / nk + reg_covar
    return mu, var, nk / nk.sum()


def _two_means_split(x: np.ndarray, counts: np.ndarray) -> int:
    """Optimal 1-D 2-means split of sorted values x (M,) with multiplicities counts (M,).

    Returns:
        s in [1, M-1] such that {x[:s]}, {x[s:]} minimise the within-cluster sum of squares
        (both sides non-empty); the first such s on ties. Deterministic, O(M).
    """
    cum_n = np.cumsum(counts)[:-1]
    cum_s = np.cumsum(counts * x)[:-1]
    total_n, total_s = counts.sum(), counts @ x
    right_n = total_n - cum_n
    valid = (cum_n > 0) & (right_n > 0)
    # SSE = sum c x^2 - S_L^2/n_L - S_R^2/n_R, so minimise SSE <=> maximise the last two terms.
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = cum_s**2 / cum_n + (total_s - cum_s) ** 2 / right_n
    gain = np.where(valid, gain, -np.inf)
    return int(np.argmax(gain)) + 1


def _gmm_em(
    x: np.ndarray,
    counts: np.ndarray,
    max_iter: int,
    tol: float,
    reg_covar: float,
    init: tuple[ArrayLike, ArrayLike, ArrayLike],
) -> dict[str, Any]:
    """sklearn's EM loop (1-D, 2 components) on values x (M,) with multiplicities counts (M,)."""
    mu, var, pi = (np.asarray(v, dtype=np.float64).copy() for v in init)
    n = counts.sum()
    trace = []
    lower_bound = -np.inf
    iterations, converged = 0, False
    for iteration in range(1, max_iter + 1):
        previous = lower_bound
        log_joint = np.log(pi)[:, None] + _gauss_logpdf(x, mu, var)
        log_norm = logsumexp(log_joint, axis=0)
        lower_bound = float(counts @ log_norm) / n  # sklearn's mean log-likelihood
        trace.append(lower_bound)
        resp = np.exp(log_joint - log_norm[None, :])
        mu, var, pi = _gmm_mstep(x, resp * counts[None, :], reg_covar)
        iterations = iteration
        # Same test as sklearn: the likelihood of the parameters that entered this iteration
        # against the previous one's.
        if abs(lower_bound - previous) < tol:
            converged = True
            break
    log_joint = np.log(pi)[:, None] + _gauss_logpdf(x, mu, var)
    final_ll = float(counts @ logsumexp(log_joint, axis=0)) / n
    trace.append(final_ll)
    return {
        "mu": mu,
        "var": var,
        "pi": pi,
        "iterations": iterations,
        "converged": converged,
        "log_likelihood": final_ll,
        "trace": tuple(trace),
    }


def fit_gmm(
    hist: LossHistogram,
    max_iter: int = 10,
    tol: float = 1e-2,
    reg_covar: float = 5e-4,
    *,
    monotone: bool = True,
    init: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
) -> MixtureFit:
    """Binned two-component 1-D Gaussian mixture, sklearn's EM made deterministic
    (docs/methods.md §2.4).

    Initialisation: hard assignment by the optimal 2-means split of the histogram (scanned over
    bin boundaries), then one M-step, as sklearn does after k-means. Every M-step adds
    `reg_covar` to each variance. Stops after `max_iter` iterations or when the mean
    log-likelihood changes by less than `tol`. Cost O(bins * max_iter).

    Args:
        hist: merged histogram of the whole corpus.
        max_iter, tol, reg_covar: as sklearn's GaussianMixture (NCR: 10, 1e-2, 5e-4).
        monotone: enforce a clean posterior non-increasing in the loss in `clean_posterior`.
            On by default, unlike the NCR/SPS/RCR references' raw GMM posterior: a narrow clean
            component otherwise calls the lowest losses noisy (docs/methods.md §2.5).
        init: ((mu0, mu1), (var0, var1), (pi0, pi1)) instead of the 2-means start. For tests
            and warm starts.

    Returns:
        MixtureFit with kind "gmm".

    Raises:
        ValueError: if the histogram holds no finite loss.
    """
    if not _check_fittable(hist):
        return _no_spread_fit(hist, "gmm", monotone)
    counts = hist.counts.astype(np.float64)
    keep = counts > 0
    x, counts = hist.centres[keep], counts[keep]
    start: tuple[ArrayLike, ArrayLike, ArrayLike]
    if init is None:
        split = _two_means_split(x, counts)
        hard = np.zeros((2, x.size))
        hard[0, :split] = 1.0
        hard[1, split:] = 1.0
        start = _gmm_mstep(x, hard * counts[None, :], reg_covar)
    else:
        start = init
    result = _gmm_em(x, counts, max_iter, tol, reg_covar, start)
    mu, var, pi = result["mu"], result["var"], result["pi"]
    return MixtureFit(
        kind="gmm",
        lo=hist.lo,
        hi=hist.hi,
        n=hist.n,
        n_nonfinite=hist.n_nonfinite,
        bins=hist.bins,
        weights=_pair(pi),
        means=_pair(mu),
        variances=_pair(var),
        alphas=None,
        betas=None,
        clean_component=int(np.argmin(mu)),
        iterations=result["iterations"],
        converged=result["converged"],
        collapsed=False,
        no_spread=False,
        monotone=monotone,
        log_likelihood=result["log_likelihood"],
        log_likelihood_trace=result["trace"],
    )


MIXTURES: dict[str, Callable[..., MixtureFit]] = {"bmm": fit_bmm, "gmm": fit_gmm}


def fit_mixture(
    losses: np.ndarray, kind: str, bins: int = DEFAULT_BINS, **kwargs: Any
) -> MixtureFit:
    """Range, histogram and fit in one call, for data that fits in memory (tests, tiny jobs).

    Args:
        losses: (N,) float raw losses; NaN/inf are excluded and counted.
        kind: a key of MIXTURES ("bmm" or "gmm").
        bins: histogram bins.
        **kwargs: passed to the fit function.

    Raises:
        ValueError: unknown kind, or no finite loss.
    """
    if kind not in MIXTURES:
        raise ValueError(f"unknown mixture kind {kind!r}; choose one of {sorted(MIXTURES)}")
    lo, hi = histogram_range(losses)
    if lo > hi:
        raise ValueError(
            f"no finite losses to fit the mixture on ({np.size(losses)} NaN/inf); check the "
            "loss pass of this dataset"
        )
    return MIXTURES[kind](build_histogram(losses, lo, hi, bins), **kwargs)


# --- Posterior ------------------------------------------------------------------------------

POSTERIOR_CHUNK = 1 << 20  # samples per block: bounds the float64 temporaries to a few MB


def _posterior_fn(fit: MixtureFit) -> Callable[[np.ndarray], np.ndarray]:
    """Exact clean posterior as a function of normalised x (already clamped for BMM).

    Written out for two components (logaddexp instead of a generic logsumexp over a (2, N)
    array): this runs per sample on every shard.
    """
    log_pi = np.log(np.asarray(fit.weights, dtype=np.float64))
    c, o = fit.clean_component, fit.noisy_component
    if fit.kind == "bmm":
        a = np.asarray(fit.alphas, dtype=np.float64)
        b = np.asarray(fit.betas, dtype=np.float64)
        const = log_pi - betaln(a, b)
        log_eps = math.log(POSTERIOR_EPS)

        def posterior(x: np.ndarray) -> np.ndarray:
            log_x, log_1mx = np.log(x), np.log1p(-x)
            clean = const[c] + (a[c] - 1.0) * log_x + (b[c] - 1.0) * log_1mx
            noisy = const[o] + (a[o] - 1.0) * log_x + (b[o] - 1.0) * log_1mx
            # pi_c f_c / (pi_c f_c + pi_n f_n + 1e-12), the reference's form, in log space.
            p: np.ndarray = np.exp(clean - np.logaddexp(np.logaddexp(clean, noisy), log_eps))
            return p

        return posterior
    if fit.kind == "gmm":
        mu = np.asarray(fit.means, dtype=np.float64)
        var = np.asarray(fit.variances, dtype=np.float64)
        const = log_pi - 0.5 * np.log(2.0 * np.pi * var)

        def posterior(x: np.ndarray) -> np.ndarray:
            clean = const[c] - 0.5 * (x - mu[c]) ** 2 / var[c]
            noisy = const[o] - 0.5 * (x - mu[o]) ** 2 / var[o]
            p: np.ndarray = np.exp(clean - np.logaddexp(clean, noisy))  # predict_proba: no eps
            return p

        return posterior
    raise ValueError(f"unknown mixture kind {fit.kind!r}; choose one of {sorted(MIXTURES)}")


def _monotone_envelope(
    posterior: Callable[[np.ndarray], np.ndarray],
    grid_lo: float,
    grid_hi: float,
    peak_limit: float,
) -> Callable[[np.ndarray], np.ndarray]:
    """Clean posterior made non-increasing in x over the whole range (docs/methods.md §2.5).

    The posterior is evaluated on a grid of MONOTONE_GRID points; its peak j* is searched at or
    below `peak_limit` (the noisy component's mean), so a Beta tail that lifts the clean
    posterior towards 1 at the highest losses (b_clean < 1) cannot pose as the peak.
    - Past j* the grid values get a running minimum, env. A sample in grid cell [g_j, g_j+1)
      with j >= j* gets its exact posterior clipped into [env_j+1, env_j]: exact wherever the
      posterior is already non-increasing, and non-increasing overall because a two-component
      posterior has at most one turning point (its log-ratio is u*log x + v*log(1-x) + w for
      Betas, a quadratic for Gaussians), so no cell holds a rise between two falls.
    - Below j* the posterior rises towards the peak when the clean component is narrower than
      the noisy one: a loss far below the clean mean is "unlikely clean" only because the clean
      Gaussian's tail falls faster than the noisy one's. Those samples (exact duplicates, text
      rendered in the image: the most certain pairs of a web corpus) get the peak value, so no
      lower loss is ever less clean than a higher one.
    """
    grid = np.linspace(grid_lo, grid_hi, MONOTONE_GRID)
    values = posterior(grid)
    searchable = grid <= peak_limit
    searchable[0] = True
    peak = int(np.argmax(np.where(searchable, values, -np.inf)))
    envelope = values.copy()
    envelope[peak:] = np.minimum.accumulate(values[peak:])
    step = (grid_hi - grid_lo) / (MONOTONE_GRID - 1)

    def monotone(x: np.ndarray) -> np.ndarray:
        cell = np.clip(np.floor((x - grid_lo) / step).astype(np.int64), 0, MONOTONE_GRID - 2)
        exact = posterior(x)
        clipped = np.clip(exact, envelope[cell + 1], envelope[cell])
        envelope_value: np.ndarray = np.where(
            cell >= peak, clipped, np.maximum(exact, values[peak])
        )
        return envelope_value

    return monotone


def clean_posterior(
    fit: MixtureFit, losses: np.ndarray, *, monotone: bool | None = None
) -> np.ndarray:
    """Per-sample probability of the clean (smaller-mean) component, exact and vectorised.

    Raw losses are normalised with the fit's (lo, hi); BMM clamps x to [1e-4, 1 - 1e-4] like
    its fit, so the minimum loss is no longer NaN (docs/methods.md §2.5); its posterior keeps the
    reference's 1e-12 in the denominator. GMM uses log-densities and logaddexp like sklearn's
    `predict_proba`. With the monotone fix on (the default of both fits), see
    `_monotone_envelope`; GMM then clamps x to [0, 1] so samples outside the fitted range get
    the value at its edge.

    Args:
        fit: result of `fit_bmm` / `fit_gmm`.
        losses: (N,) float raw losses of any shard.
        monotone: override `fit.monotone`.

    Returns:
        (N,) float32 in [0, 1]; 1 for every finite loss when `fit.no_spread`; NaN exactly where
        the loss is NaN/inf.
    """
    values = as_float_array(losses)
    out = np.full(values.shape, np.nan, dtype=np.float32)
    if fit.no_spread:
        out[np.isfinite(values)] = 1.0
        return out
    use_monotone = fit.monotone if monotone is None else monotone
    grid_lo, grid_hi = (BMM_CLAMP, 1.0 - BMM_CLAMP) if fit.kind == "bmm" else (0.0, 1.0)
    clamp = fit.kind == "bmm" or use_monotone
    posterior = _posterior_fn(fit)
    if use_monotone:
        assert fit.means is not None  # only a no-spread fit (returned above) has none
        noisy_mean = fit.means[fit.noisy_component]
        posterior = _monotone_envelope(posterior, grid_lo, grid_hi, noisy_mean)
    for start in range(0, values.size, POSTERIOR_CHUNK):
        block = values[start : start + POSTERIOR_CHUNK]
        finite = np.isfinite(block)
        x = normalise_losses(block[finite], fit.lo, fit.hi)
        if clamp:
            np.clip(x, grid_lo, grid_hi, out=x)
        p = np.clip(posterior(x), 0.0, 1.0)
        out[start : start + POSTERIOR_CHUNK][finite] = p
    return out
