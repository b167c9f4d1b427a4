"""Mixture-fit speed and agreement, measured side by side in one run (BENCHMARKS.md "mixture fit").

On N synthetic per-sample losses (docs/methods.md §2.2: clean Gamma(1.5, 0.4), noisy N(5, 0.6)):
  ours      histogram_range + build_histogram + fit_bmm / fit_gmm (and the fit alone on the
            prebuilt histogram, which is what the driver pays once the workers have binned);
  sklearn   GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4) (NCR's setting, fixed
            random_state) on the same min-max-normalised losses, as an (N, 1) float64 array.
Speed figures are ratios sklearn_time / our_time, medians of --reps repetitions. Agreement is
our GMM clean posterior against sklearn's `predict_proba` column of its smaller mean, on a
--agree-n subsample. Prints one JSON line per figure.

    python benchmarks/mixture.py --n 10000000 --noise 0.4 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import numpy as np

from pipeline.core.mixture.fit import (
    MIXTURES,
    build_histogram,
    clean_posterior,
    histogram_range,
    normalise_losses,
)


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def synthetic_losses(n: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) float32 losses as the loss pass stores them, and (n,) bool truth (True = clean)."""
    rng = np.random.default_rng(seed)
    n_noisy = int(round(n * noise))
    losses = np.concatenate([rng.gamma(1.5, 0.4, n - n_noisy), rng.normal(5.0, 0.6, n_noisy)])
    return losses.astype(np.float32), np.arange(n) < n - n_noisy


def timed(fn, reps: int) -> tuple[float, object]:
    """Median wall time of `reps` calls, and the last result."""
    times, result = [], None
    for _ in range(reps):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000, help="losses to fit")
    parser.add_argument("--noise", type=float, default=0.4, help="fraction of noisy pairs")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per timing (median)")
    parser.add_argument("--bins", type=int, default=4096, help="histogram bins")
    parser.add_argument(
        "--sklearn-n", type=int, default=0, help="subsample for sklearn (0: all N losses)"
    )
    parser.add_argument("--agree-n", type=int, default=100_000, help="posterior-agreement sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.mixture import GaussianMixture

    losses, is_clean = synthetic_losses(args.n, args.noise, args.seed)
    common = {"n": args.n, "noise": args.noise, "bins": args.bins, "reps": args.reps}

    def binned_input():
        return build_histogram(losses, *histogram_range(losses), bins=args.bins)

    hist = binned_input()  # also warms the pages of `losses` before any timing
    hist_s, _ = timed(binned_input, args.reps)

    # sklearn on the same normalised losses; the normalisation itself is not timed on either side.
    x = normalise_losses(losses, hist.lo, hist.hi).reshape(-1, 1)  # (N, 1) float64
    sk_n = args.sklearn_n or args.n
    x_sk = (
        x[np.random.default_rng(args.seed).choice(args.n, sk_n, replace=False)]
        if sk_n < args.n
        else x
    )

    def sklearn_fit():
        with warnings.catch_warnings():  # max_iter=10 often ends on the cap, by design
            warnings.simplefilter("ignore", ConvergenceWarning)
            return GaussianMixture(
                2, max_iter=10, tol=1e-2, reg_covar=5e-4, random_state=args.seed
            ).fit(x_sk)

    sk_s, sk_model = timed(sklearn_fit, args.reps)
    sk_note = "all N losses" if sk_n == args.n else f"subsample of {sk_n}; ratio not rescaled"

    fits = {}
    for kind, fit_fn in MIXTURES.items():
        fit_s, fit = timed(lambda fit_fn=fit_fn: fit_fn(hist), max(args.reps, 5))
        total_s, _ = timed(lambda fit_fn=fit_fn: fit_fn(binned_input()), args.reps)
        fits[kind] = fit
        emit(
            "mixture_fit_speed",
            kind=kind,
            **common,
            ratio_total=sk_s / total_s,
            ratio_fit_only=sk_s / fit_s,
            bar=">= 100x",
            ours_total_s=total_s,
            ours_histogram_s=hist_s,
            ours_fit_s=fit_s,
            ours_iterations=fit.iterations,
            sklearn_s=sk_s,
            sklearn_n=sk_n,
            sklearn_n_iter=int(sk_model.n_iter_),
            sklearn_note=sk_note,
        )

    # Per-sample posterior over all N: ours (exact, chunked) vs sklearn's predict_proba.
    post_s, _ = timed(lambda: clean_posterior(fits["gmm"], losses), args.reps)
    sk_post_s, _ = timed(lambda: sk_model.predict_proba(x), args.reps)
    emit(
        "mixture_posterior_speed",
        kind="gmm",
        **common,
        ratio=sk_post_s / post_s,
        ours_s=post_s,
        sklearn_s=sk_post_s,
    )

    sample = np.random.default_rng(args.seed + 1).choice(args.n, args.agree_n, replace=False)
    ours = clean_posterior(fits["gmm"], losses[sample]).astype(np.float64)
    theirs = sk_model.predict_proba(x[sample])[:, int(np.argmin(sk_model.means_.ravel()))]
    diff = np.abs(ours - theirs)
    emit(
        "mixture_posterior_agreement",
        kind="gmm",
        **common,
        agree_n=args.agree_n,
        max_abs_diff=float(diff.max()),
        mean_abs_diff=float(diff.mean()),
        bar="<= 1e-3",
        ours_means=list(fits["gmm"].means),
        sklearn_means=[float(m) for m in sk_model.means_.ravel()],
    )

    for kind, fit in fits.items():
        p = clean_posterior(fit, losses)
        emit(
            "mixture_accuracy",
            kind=kind,
            **common,
            accuracy=float(np.mean((p > 0.5) == is_clean)),
            means=list(fit.means),
            weights=list(fit.weights),
        )


if __name__ == "__main__":
    main()
