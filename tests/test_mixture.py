"""Binned BMM/GMM (pipeline.core.mixture.fit) against per-sample references, sklearn and the
invariants of docs/methods.md §11."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from pipeline.core.mixture.fit import (
    MIXTURES,
    MixtureFit,
    build_histogram,
    clean_posterior,
    fit_bmm,
    fit_gmm,
    fit_mixture,
    histogram_range,
    merge_histograms,
    merge_ranges,
)

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def synthetic_losses(n: int, noise: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic corpus of docs/methods.md §2.2: clean Gamma(1.5, 0.4), noisy N(5, 0.6),
    shuffled.

    Returns:
        losses: (n,) float64; is_clean: (n,) bool.
    """
    rng = np.random.default_rng(seed)
    n_noisy = int(round(n * noise))
    losses = np.concatenate([rng.gamma(1.5, 0.4, n - n_noisy), rng.normal(5.0, 0.6, n_noisy)])
    is_clean = np.arange(n) < n - n_noisy
    order = rng.permutation(n)
    return losses[order], is_clean[order]


def minmax(losses: np.ndarray) -> np.ndarray:
    return (losses - losses.min()) / (losses.max() - losses.min())


# ---------------------------------------------------------------------------------------------
# Per-sample references, written independently of the module (scipy.stats densities, plain loops)
# ---------------------------------------------------------------------------------------------


def exact_bmm(x: np.ndarray, max_iter: int = 10) -> dict:
    """BetaMixture1D on every sample, with the docs/methods.md §2.3 floors, clamps and guard."""
    x = np.clip(x, 1e-4, 1 - 1e-4)
    a, b, pi = np.array([1.0, 2.0]), np.array([2.0, 1.0]), np.array([0.5, 0.5])
    for _ in range(max_iter):
        r = np.stack([pi[k] * stats.beta.pdf(x, a[k], b[k]) for k in range(2)])
        r[r <= 1e-12] = 1e-12
        r /= r.sum(axis=0)
        new_a, new_b = np.empty(2), np.empty(2)
        for k in range(2):
            m = np.sum(r[k] * x) / np.sum(r[k])
            v = max(np.sum(r[k] * (x - m) ** 2) / np.sum(r[k]), 1e-8)
            ak = m * (m * (1 - m) / v - 1)
            new_a[k], new_b[k] = ak, ak * (1 - m) / m
        new_a, new_b = np.clip(new_a, 1e-3, 1e5), np.clip(new_b, 1e-3, 1e5)
        new_pi = r.sum(axis=1) / r.sum()
        means = new_a / (new_a + new_b)
        if abs(means[0] - means[1]) < 1e-3 or new_pi.min() < 1e-4:
            break
        a, b, pi = new_a, new_b, new_pi
    return {"a": a, "b": b, "pi": pi}


def exact_gmm(x: np.ndarray, max_iter: int = 10, tol: float = 1e-2, reg: float = 5e-4) -> dict:
    """sklearn-style EM on every sample, started from the exact optimal 2-means split."""
    xs = np.sort(x)
    best, split = np.inf, 1
    for s in range(1, xs.size):  # brute force over every split of the sorted values
        left, right = xs[:s], xs[s:]
        sse = ((left - left.mean()) ** 2).sum() + ((right - right.mean()) ** 2).sum()
        if sse < best - 1e-12:
            best, split = sse, s
    resp = np.stack([x < xs[split], x >= xs[split]]).astype(float)

    def m_step(resp):
        nk = resp.sum(axis=1)
        mu = resp @ x / nk
        var = np.array([resp[k] @ (x - mu[k]) ** 2 / nk[k] for k in range(2)]) + reg
        return mu, var, nk / nk.sum()

    mu, var, pi = m_step(resp)
    bound = -np.inf
    for _ in range(max_iter):
        previous = bound
        dens = np.stack([pi[k] * stats.norm.pdf(x, mu[k], np.sqrt(var[k])) for k in range(2)])
        bound = np.mean(np.log(dens.sum(axis=0)))
        mu, var, pi = m_step(dens / dens.sum(axis=0))
        if abs(bound - previous) < tol:
            break
    return {"mu": mu, "var": var, "pi": pi}


# ---------------------------------------------------------------------------------------------
# Binned == exact, and agreement with sklearn
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise", [0.2, 0.6])
def test_binned_bmm_matches_exact_per_sample_em(noise):
    losses, _ = synthetic_losses(20_000, noise, seed=1)
    fit = fit_mixture(losses, "bmm", bins=4096)
    ref = exact_bmm(minmax(losses))
    assert fit.iterations == 10 and not fit.collapsed
    np.testing.assert_allclose(fit.weights, ref["pi"], atol=1e-3)
    np.testing.assert_allclose(fit.means, ref["a"] / (ref["a"] + ref["b"]), atol=1e-3)
    np.testing.assert_allclose(fit.alphas, ref["a"], rtol=1e-3)
    np.testing.assert_allclose(fit.betas, ref["b"], rtol=1e-3)


@pytest.mark.parametrize("noise", [0.2, 0.6])
def test_binned_gmm_matches_exact_per_sample_em(noise):
    losses, _ = synthetic_losses(5_000, noise, seed=2)
    fit = fit_mixture(losses, "gmm", bins=4096)
    ref = exact_gmm(minmax(losses))
    np.testing.assert_allclose(fit.weights, ref["pi"], atol=1e-3)
    np.testing.assert_allclose(fit.means, ref["mu"], atol=1e-3)
    np.testing.assert_allclose(fit.variances, ref["var"], atol=1e-3)


def test_gmm_posterior_agrees_with_sklearn():
    from sklearn.mixture import GaussianMixture

    losses, _ = synthetic_losses(20_000, 0.4, seed=3)
    x = minmax(losses).reshape(-1, 1)
    ours = clean_posterior(fit_mixture(losses, "gmm"), losses)
    gmm = GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4, random_state=0).fit(x)
    theirs = gmm.predict_proba(x)[:, gmm.means_.argmin()]
    assert np.max(np.abs(ours - theirs)) < 1e-2


@pytest.mark.parametrize("kind", ["bmm", "gmm"])
@pytest.mark.parametrize("noise", [0.2, 0.4, 0.6])
def test_classification_accuracy(kind, noise):
    losses, is_clean = synthetic_losses(20_000, noise, seed=4)
    p = clean_posterior(fit_mixture(losses, kind), losses)
    assert p.dtype == np.float32
    assert np.mean((p > 0.5) == is_clean) >= 0.97


def test_clean_component_chosen_by_mean_when_initialised_swapped():
    losses, is_clean = synthetic_losses(10_000, 0.4, seed=5)
    lo, hi = histogram_range(losses)
    hist = build_histogram(losses, lo, hi)
    normal = fit_bmm(hist)
    swapped = fit_bmm(hist, init=((2.0, 1.0), (1.0, 2.0), (0.5, 0.5)))
    assert normal.clean_component == 0 and swapped.clean_component == 1
    assert swapped.means[1] < swapped.means[0]
    np.testing.assert_allclose(
        clean_posterior(swapped, losses), clean_posterior(normal, losses), atol=1e-6
    )
    g = fit_gmm(hist)
    g_swapped = fit_gmm(hist, init=(g.means[::-1], g.variances[::-1], g.weights[::-1]))
    assert g_swapped.clean_component == 1
    assert np.mean((clean_posterior(g_swapped, losses) > 0.5) == is_clean) >= 0.97


def test_fit_records_diagnostics_and_round_trips():
    losses, _ = synthetic_losses(5_000, 0.4, seed=6)
    for kind in MIXTURES:
        fit = fit_mixture(losses, kind)
        assert fit.kind == kind and np.isfinite(fit.log_likelihood)
        assert len(fit.log_likelihood_trace) == fit.iterations + 1
        text = json.dumps(fit.to_dict(), allow_nan=False)
        assert MixtureFit.from_dict(json.loads(text)) == fit
    gmm = fit_mixture(losses, "gmm")
    assert gmm.converged and gmm.iterations < 10  # well-separated data meets tol=1e-2 early
    with pytest.raises(ValueError, match="unknown"):
        MixtureFit.from_dict({**gmm.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="choose one of"):
        fit_mixture(losses, "kmeans")


def test_bmm_collapse_guard_keeps_previous_parameters():
    # One tight lump and a single far outlier: the moment M-step drives the outlier component's
    # weight towards 1/N, below the 1e-4 guard, so the previous parameters are kept.
    losses = np.concatenate([np.random.default_rng(7).normal(1.0, 0.01, 20_000), [50.0]])
    fit = fit_mixture(losses, "bmm")
    assert fit.collapsed and fit.iterations < 10
    assert min(fit.weights) >= 1e-4
    p = clean_posterior(fit, losses)
    assert np.all(np.isfinite(p)) and np.all((p >= 0) & (p <= 1))


# ---------------------------------------------------------------------------------------------
# Monotone clean posterior
# ---------------------------------------------------------------------------------------------


def _non_increasing_after_peak(p_sorted: np.ndarray) -> bool:
    peak = int(np.argmax(p_sorted))
    return bool(np.all(np.diff(p_sorted[peak:]) <= 0))


def _handmade_bmm(alphas, betas, weights=(0.5, 0.5)) -> MixtureFit:
    a, b = np.array(alphas), np.array(betas)
    return MixtureFit(
        kind="bmm", lo=0.0, hi=1.0, n=100, n_nonfinite=0, bins=4096, weights=weights,
        means=tuple(a / (a + b)), variances=(0.01, 0.01), alphas=alphas, betas=betas,
        clean_component=0, iterations=10, converged=False, collapsed=False, no_spread=False,
        monotone=True, log_likelihood=0.0,
    )  # fmt: skip


def test_monotone_fix_removes_the_high_loss_tail_of_the_clean_component():
    # Clean Beta(0.8, 0.9): b < 1 puts density at x -> 1 where the noisy Beta(6, 4) fades, so
    # the raw clean posterior climbs back towards 1 at the highest losses (docs/methods.md §2.5).
    fit = _handmade_bmm((0.8, 6.0), (0.9, 4.0))
    x = np.linspace(0.0, 1.0, 20_001)
    raw = clean_posterior(fit, x, monotone=False)
    fixed = clean_posterior(fit, x)
    assert raw[-1] > 0.9 and not _non_increasing_after_peak(raw)
    assert _non_increasing_after_peak(fixed) and fixed[-1] < 0.5
    # Where the raw posterior already falls (up to its trough) the fix changes nothing.
    trough = int(np.argmin(raw))
    np.testing.assert_array_equal(fixed[: trough + 1], raw[: trough + 1])


@PROPERTY
@given(
    seed=st.integers(0, 10_000),
    noise=st.floats(0.05, 0.9),
    n=st.integers(30, 3_000),
    clean_shape=st.floats(0.3, 5.0),
)
def test_clean_posterior_is_non_increasing_in_the_loss(seed, noise, n, clean_shape):
    rng = np.random.default_rng(seed)
    n_noisy = int(n * noise)
    losses = np.concatenate(
        [rng.gamma(clean_shape, 0.4, n - n_noisy), rng.normal(5.0, 0.6, n_noisy)]
    )
    for kind in ("bmm", "gmm"):
        p = clean_posterior(fit_mixture(losses, kind), np.sort(losses))
        assert np.all(np.diff(p) <= 0), kind


@pytest.mark.parametrize("kind", ["gmm", "bmm"])
def test_near_zero_losses_are_the_cleanest(kind):
    """Exact duplicates (and text rendered in the image) give losses far below the clean mean.
    A narrow clean component makes their raw GMM posterior ~0; they must come out clean, with
    the highest clean probability of the corpus."""
    rng = np.random.default_rng(0)
    clean = rng.normal(2.0, 0.1, 3000)
    noisy = rng.normal(5.0, 0.8, 2000)
    duplicates = np.full(50, 0.01)
    losses = np.concatenate([clean, noisy, duplicates])
    fit = fit_mixture(losses, kind)
    p = clean_posterior(fit, losses)
    assert np.all(p[-50:] > 0.5)
    assert p[-50:].min() >= p[:-50].max() - 1e-6
    if kind == "gmm":  # the failure the fix removes: the raw posterior calls them noisy
        assert clean_posterior(fit, duplicates, monotone=False).max() < 0.5


# ---------------------------------------------------------------------------------------------
# Properties (docs/methods.md §11)
# ---------------------------------------------------------------------------------------------


@PROPERTY
@given(
    seed=st.integers(0, 10_000),
    noise=st.floats(0.1, 0.8),
    scale=st.floats(1e-2, 1e2),
    shift=st.floats(-100.0, 100.0),
    kind=st.sampled_from(sorted(MIXTURES)),
)
def test_invariant_to_positive_affine_transform(seed, noise, scale, shift, kind):
    losses, _ = synthetic_losses(2_000, noise, seed)
    p = clean_posterior(fit_mixture(losses, kind), losses)
    moved = scale * losses + shift
    q = clean_posterior(fit_mixture(moved, kind), moved)
    # Rounding can move a loss lying on a bin edge into the next bin; nothing more.
    np.testing.assert_allclose(p, q, atol=1e-4)


finite_losses = st.lists(
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=200
)


@PROPERTY
@given(values=finite_losses, kind=st.sampled_from(sorted(MIXTURES)))
def test_posterior_in_unit_interval_and_never_nan(values, kind):
    losses = np.array(values)
    p = clean_posterior(fit_mixture(losses, kind), losses)
    assert p.shape == losses.shape and not np.any(np.isnan(p))
    assert np.all((p >= 0) & (p <= 1))


@PROPERTY
@given(values=finite_losses, kind=st.sampled_from(sorted(MIXTURES)))
def test_fit_is_deterministic(values, kind):
    losses = np.array(values)
    first, second = fit_mixture(losses, kind), fit_mixture(losses, kind)
    assert first.to_dict() == second.to_dict()
    np.testing.assert_array_equal(clean_posterior(first, losses), clean_posterior(second, losses))


@PROPERTY
@given(
    values=st.lists(
        st.one_of(st.floats(-50, 50), st.sampled_from([np.nan, np.inf, -np.inf])),
        min_size=1,
        max_size=300,
    ),
    cuts=st.lists(st.integers(0, 300), max_size=4),
    bins=st.integers(2, 64),
)
def test_histograms_merge_exactly(values, cuts, bins):
    losses = np.array(values)
    parts = np.split(losses, sorted(c for c in cuts if c <= losses.size))
    lo, hi = (np.inf, -np.inf)
    for part in parts:
        lo, hi = merge_ranges((lo, hi), histogram_range(part))
    if lo > hi:  # nothing finite anywhere: there is no range to build on
        assert not np.isfinite(losses).any()
        return
    merged = build_histogram(parts[0], lo, hi, bins)
    for part in parts[1:]:
        merged = merge_histograms(merged, build_histogram(part, lo, hi, bins))
    whole = build_histogram(losses, lo, hi, bins)
    np.testing.assert_array_equal(merged.counts, whole.counts)
    assert (merged.n, merged.n_nonfinite) == (whole.n, whole.n_nonfinite)
    assert merged.n == np.isfinite(losses).sum() == merged.counts.sum()


# ---------------------------------------------------------------------------------------------
# Degenerate inputs and errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MIXTURES))
@pytest.mark.parametrize("losses", [np.full(500, 3.25), np.array([7.0]), np.full(2, -1.0)])
def test_no_loss_spread_gives_probability_one(kind, losses):
    fit = fit_mixture(losses, kind)
    assert fit.no_spread and fit.weights is None
    np.testing.assert_array_equal(clean_posterior(fit, losses), np.ones(losses.size, np.float32))
    json.dumps(fit.to_dict(), allow_nan=False)  # NaN log-likelihood is exported as null


@pytest.mark.parametrize("kind", sorted(MIXTURES))
def test_two_distinct_losses(kind):
    losses = np.array([0.3, 4.0])
    fit = fit_mixture(losses, kind)
    assert not fit.no_spread
    p = clean_posterior(fit, losses)
    assert np.all(np.isfinite(p)) and p[0] >= p[1]


@pytest.mark.parametrize("kind", sorted(MIXTURES))
def test_nonfinite_losses_are_excluded_and_counted(kind):
    losses, _ = synthetic_losses(3_000, 0.4, seed=8)
    dirty = losses.copy()
    dirty[[5, 17, 99]] = [np.nan, np.inf, -np.inf]
    fit = fit_mixture(dirty, kind)
    assert (fit.n, fit.n_nonfinite) == (2_997, 3)
    clean_fit = fit_mixture(np.delete(losses, [5, 17, 99]), kind)
    assert fit.to_dict() | {"n_nonfinite": 0} == clean_fit.to_dict()
    p = clean_posterior(fit, dirty)
    assert np.isnan(p[[5, 17, 99]]).all() and np.isfinite(np.delete(p, [5, 17, 99])).all()


def test_minimum_loss_is_not_nan_for_bmm():
    # The reference evaluates Beta(0 | a < 1) = inf at the minimum loss and gets inf/inf = NaN.
    losses, _ = synthetic_losses(5_000, 0.4, seed=9)
    fit = fit_mixture(losses, "bmm")
    p = clean_posterior(fit, np.array([losses.min(), losses.min() - 1.0]))
    assert np.all(p > 0.9)


def test_histogram_errors():
    hist = build_histogram(np.arange(10.0), 0.0, 9.0, bins=8)
    with pytest.raises(ValueError, match="different grids"):
        merge_histograms(hist, build_histogram(np.arange(10.0), 0.0, 10.0, bins=8))
    with pytest.raises(ValueError, match="outside the histogram range"):
        build_histogram(np.array([11.0]), 0.0, 9.0)
    with pytest.raises(ValueError, match="merge_ranges"):
        build_histogram(np.array([np.nan]), *histogram_range(np.array([np.nan])))
    assert histogram_range(np.array([np.nan, np.inf])) == (np.inf, -np.inf)
    empty = build_histogram(np.array([np.nan]), 0.0, 1.0)
    with pytest.raises(ValueError, match="no finite losses"):
        fit_bmm(empty)
    with pytest.raises(ValueError, match="no finite losses"):
        fit_mixture(np.array([np.nan, np.inf]), "gmm")
    assert not hist.counts.flags.writeable


def test_inspect_and_the_report_show_one_fit_with_the_same_numbers():
    """`ncl-pipeline inspect` (a label table's metadata) and the report (metrics.json's label
    pass summary, the fit without its trace) render a fit with one text, in loss units."""
    from pipeline.reporting.inspect import _fit_line
    from pipeline.reporting.story import _fit_text

    losses, is_clean = synthetic_losses(6000, 0.4, seed=3)
    lo, hi = histogram_range(losses)
    fit = fit_gmm(build_histogram(losses, lo, hi))
    text = fit.describe()
    clean = float(text.split("clean mean ")[1].split()[0])
    noisy = float(text.split("noisy mean ")[1].split()[0])
    assert abs(clean - losses[is_clean].mean()) < 0.1  # loss units, not [0, 1]
    assert abs(noisy - losses[~is_clean].mean()) < 0.1
    summary = {k: v for k, v in fit.to_dict().items() if k != "log_likelihood_trace"}
    assert _fit_text(json.loads(json.dumps(summary))) == text
    assert _fit_line("gmm", json.loads(json.dumps(fit.to_dict()))).startswith(
        f"  gmm      {text} |"
    )
    flat = fit_gmm(build_histogram(np.full(10, 2.0), 2.0, 2.0))
    assert flat.no_spread and _fit_text(flat.to_dict()) == flat.describe()
    assert _fit_line("gmm", flat.to_dict()) == f"  gmm      {flat.describe()}"
