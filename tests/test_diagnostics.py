"""The label-free diagnostics' counts against brute-force references (scipy on the binned
labels, plain numpy on the subsets)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from pipeline.core.diagnostics import (
    BINS,
    binned_spearman,
    joint_counts,
    label_parts,
    merge_parts,
    summarize_parts,
)


def _binned(x: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(x * BINS), 0, BINS - 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binned_spearman_is_scipy_s_on_the_binned_labels(seed):
    rng = np.random.default_rng(seed)
    x = rng.beta(2, 5, 3000)
    y = np.clip(x + rng.normal(0, 0.2, 3000), 0, 1)
    got = binned_spearman(joint_counts(x, y))
    assert got == pytest.approx(spearmanr(_binned(x), _binned(y)).statistic, abs=1e-12)
    assert got == pytest.approx(spearmanr(x, y).statistic, abs=0.01)  # binning costs little


def test_binned_spearman_of_constant_or_empty_labels_is_none():
    assert binned_spearman(joint_counts(np.full(10, 0.5), np.linspace(0, 1, 10))) is None
    assert binned_spearman(np.zeros((BINS, BINS))) is None
    assert binned_spearman(joint_counts(np.r_[0.0, 1.0], np.r_[1.0, 0.0])) == pytest.approx(-1)


def test_parts_of_shards_merge_to_the_whole_corpus_s_summary():
    rng = np.random.default_rng(3)
    n = 1200
    a, b = rng.random(n), rng.random(n)
    sa, sb = rng.integers(0, 3, n), rng.integers(0, 3, n)
    prev_soft, prev_subset = rng.random(n), rng.integers(0, 3, n)
    soft, subset = (a + b) / 2, np.maximum(sa, sb)
    kept = (soft >= 0.2) & (subset < 2)

    def part(rows, with_previous=True):
        previous = (prev_soft[rows], prev_subset[rows]) if with_previous else None
        return label_parts(a[rows], b[rows], sa[rows], sb[rows], int(kept[rows].sum()), previous)

    halves = np.array_split(np.arange(n), 3)
    whole = summarize_parts(part(np.arange(n)))
    merged = summarize_parts(merge_parts([part(rows) for rows in halves]))
    assert merged == whole
    assert whole["pairs"] == n and whole["kept_fraction"] == pytest.approx(kept.mean())
    assert whole["views_subset_agreement"] == pytest.approx(np.mean(sa == sb))
    assert whole["changed_subset_share"] == pytest.approx(np.mean(prev_subset != subset))
    assert whole["subset_shares"]["noisy"] == pytest.approx(np.mean(subset == 2))
    assert whole["views_spearman"] == pytest.approx(spearmanr(a, b).statistic, abs=0.01)
    assert whole["change_spearman"] == pytest.approx(spearmanr(prev_soft, soft).statistic, abs=0.01)
    assert sum(whole["label_distribution"]) == pytest.approx(1)
    tenths = np.histogram(soft, bins=10, range=(0, 1))[0] / n
    np.testing.assert_allclose(whole["label_distribution"], tenths)
    assert whole["label_quantiles"]["p50"] == pytest.approx(np.median(soft), abs=1 / BINS)
    # a shard without the previous round counts for everything but the change
    partial = summarize_parts(merge_parts([part(halves[0], False), *map(part, halves[1:])]))
    assert partial["change_pairs"] == n - len(halves[0]) and partial["pairs"] == n
