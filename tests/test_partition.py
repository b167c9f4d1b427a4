"""Clean/noisy partitions (pipeline.core.partition): METHODS §1.6, §2.5, §4.3, §5.3."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.partition import (
    CLEAN,
    NOISY,
    QUASI_CLEAN,
    SUBSETS,
    rcr_candidates,
    select_anchors,
    split_clean,
    split_sps,
)


def test_split_clean_is_strict_threshold():
    prob = np.array([0.9, 0.5, 0.2, 0.51, np.nan])
    clean, flags = split_clean(prob)
    np.testing.assert_array_equal(clean, [True, False, False, True, False])
    assert not flags.one_percent_rule and not flags.symmetric_guard
    assert (flags.threshold, flags.n_selected, flags.n_invalid) == (0.5, 2, 1)


def test_one_percent_rule_when_everything_is_clean():
    prob = np.linspace(0.6, 1.0, 1_000)[::-1].copy()  # all > 0.5, distinct
    clean, flags = split_clean(prob)
    assert flags.one_percent_rule and not flags.symmetric_guard
    assert flags.threshold == np.sort(prob)[10]
    # Strict ">" at the value of sorted position floor(N/100): positions 0..10 turn noisy.
    assert (~clean).sum() == 11
    assert set(np.flatnonzero(~clean)) == set(np.argsort(prob)[:11])


def test_one_percent_rule_ignores_nan_samples():
    prob = np.r_[np.full(200, 0.9), np.linspace(0.95, 0.99, 100), np.nan]
    clean, flags = split_clean(prob)
    assert flags.one_percent_rule and flags.n_invalid == 1 and not clean[-1]


def test_symmetric_guard_takes_the_lowest_losses():
    prob = np.full(500, 0.1)
    losses = np.arange(500.0)[::-1].copy()
    clean, flags = split_clean(prob, losses=losses)
    assert flags.symmetric_guard and not flags.one_percent_rule
    np.testing.assert_array_equal(np.flatnonzero(clean), [495, 496, 497, 498, 499])
    # Without losses the highest probabilities are taken, ties by index.
    clean, flags = split_clean(np.r_[np.full(300, 0.2), 0.3], losses=None)
    assert flags.symmetric_guard  # floor(301 / 100) = 3 samples
    np.testing.assert_array_equal(np.flatnonzero(clean), [0, 1, 300])


def test_guard_after_one_percent_rule_with_ties():
    # All probabilities 1 (the "no loss spread" round): the 1 % rule's threshold equals the common
    # value, nothing stays clean, and the guard brings back the single lowest-loss sample.
    clean, flags = split_clean(np.ones(50), losses=np.r_[np.ones(20), 0.5, np.ones(29)])
    assert flags.one_percent_rule and flags.symmetric_guard
    np.testing.assert_array_equal(np.flatnonzero(clean), [20])
    one, flags = split_clean(np.array([1.0]), losses=np.array([3.0]))
    assert one.tolist() == [True] and flags.symmetric_guard


def test_all_nan_selects_nothing():
    clean, flags = split_clean(np.full(4, np.nan))
    assert not clean.any() and flags.n_invalid == 4 and not flags.symmetric_guard


@settings(max_examples=50, deadline=None)
@given(
    prob=st.lists(st.floats(0, 1), min_size=1, max_size=300),
    threshold=st.floats(0.05, 0.95),
)
def test_split_clean_always_leaves_both_sides_populated(prob, threshold):
    prob = np.array(prob)
    losses = -np.log(np.clip(prob, 1e-9, 1))
    clean, flags = split_clean(prob, threshold, losses=losses)
    assert clean.any()
    if prob.size >= 2 and np.unique(prob).size == prob.size:
        assert not clean.all()
    assert flags.n_selected == clean.sum()


def test_anchor_count_and_ties():
    clean = np.zeros(40, bool)
    clean[10:40] = True  # |C| = 30 -> ceil(0.1 * 30) = 3 exactly (not 4 by float rounding)
    losses = np.ones(40)
    losses[:10] = 0.0  # lower losses outside C never become anchors
    np.testing.assert_array_equal(select_anchors(clean, losses), [10, 11, 12])
    losses[[35, 20]] = 0.5
    np.testing.assert_array_equal(select_anchors(clean, losses), [10, 20, 35])
    assert select_anchors(clean, losses, 0.5).size == 15
    small = np.zeros(5, bool)
    small[3] = True
    np.testing.assert_array_equal(select_anchors(small, np.arange(5.0)), [3])  # at least 1
    assert select_anchors(np.ones(31, bool), np.zeros(31)).size == 4  # ceil(3.1)


def test_anchor_errors():
    with pytest.raises(ValueError, match="empty"):
        select_anchors(np.zeros(5, bool), np.zeros(5))
    with pytest.raises(ValueError, match="fraction"):
        select_anchors(np.ones(5, bool), np.zeros(5), 0.0)
    with pytest.raises(ValueError, match="must be equal"):
        select_anchors(np.ones(5, bool), np.zeros(4))


def test_split_sps_three_subsets():
    prob = np.array([0.995, 0.99, 0.7, 0.5, 0.1, np.nan])
    codes, flags = split_sps(prob)
    assert codes.dtype == np.int8
    np.testing.assert_array_equal(codes, [CLEAN, QUASI_CLEAN, QUASI_CLEAN, NOISY, NOISY, NOISY])
    assert [SUBSETS[c] for c in codes[:3]] == ["clean", "quasi_clean", "quasi_clean"]
    assert flags.n_selected == 3 and flags.n_invalid == 1 and not flags.one_percent_rule


def test_split_sps_one_percent_rule_at_eps2():
    prob = np.linspace(0.6, 0.999, 200)
    codes, flags = split_sps(prob)
    assert flags.one_percent_rule and (codes == NOISY).sum() == 3  # positions 0..2
    assert (codes == CLEAN).sum() == (prob > 0.99).sum()


@pytest.mark.parametrize("eps1, eps2", [(0.5, 0.5), (0.4, 0.6)])
def test_split_sps_validates_thresholds(eps1, eps2):
    with pytest.raises(ValueError, match=r"eps1 = .* \(reliable\).*raise eps1"):
        split_sps(np.array([0.5]), eps1, eps2)


def test_rcr_candidates_need_both_directions():
    a = np.array([0.9, 0.9, 0.2, 0.6, np.nan])
    b = np.array([0.8, 0.4, 0.9, 0.51, 0.9])
    in_c, flags = rcr_candidates(a, b)
    np.testing.assert_array_equal(in_c, [True, False, False, True, False])
    assert not flags.symmetric_guard and flags.n_invalid == 1


def test_rcr_candidates_fallback_when_empty():
    a = np.r_[np.full(250, 0.3), 0.45, 0.49]
    b = np.r_[np.full(250, 0.3), 0.48, 0.2]
    in_c, flags = rcr_candidates(a, b)
    assert flags.symmetric_guard and flags.n_selected == 2  # floor(252 / 100)
    np.testing.assert_array_equal(np.flatnonzero(in_c), [0, 250])  # min(a, b) largest, then index
    with pytest.raises(ValueError, match="equal shapes"):
        rcr_candidates(np.ones(3), np.ones(2))
