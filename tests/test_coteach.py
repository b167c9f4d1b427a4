"""Co-teaching schedule and per-method training targets (pipeline.core.coteach)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.coteach import (
    TRAINING_TARGETS,
    Phase,
    coteach_phase,
    proxy_image_weights,
    training_targets,
)
from pipeline.core.partition.decisions import CLEAN, NOISY, QUASI_CLEAN

SUBSET = np.array([CLEAN, CLEAN, QUASI_CLEAN, NOISY, NOISY])
LABEL = np.array([1.0, 0.7, 0.6, 0.3, 0.0], dtype=np.float32)


def test_bicro_noisy_subset_joins_after_half_the_epochs_whatever_the_round_split():
    # 2 rounds x 2 epochs or 1 round x 4 epochs: the same global switch at epoch 2.
    phases = [coteach_phase(e, 4, target="bicro").noisy for e in range(4)]
    assert phases == [False, False, True, True]
    assert coteach_phase(0, 1, target="bicro").noisy is True  # as the reference's E // 2 = 0
    assert coteach_phase(0, 2, bicro_noisy_start=0.0, target="bicro").noisy is True


def test_sps_schedule_matches_the_reference_epochs():
    # SPS code: 40 epochs, quasi-clean from epoch 10, noisy from epoch 15.
    quasi = [coteach_phase(e, 40, target="sps").quasi_clean for e in range(40)]
    noisy = [coteach_phase(e, 40, target="sps").noisy for e in range(40)]
    assert quasi.index(True) == 10 and all(quasi[10:])
    assert noisy.index(True) == 15 and all(noisy[15:])
    assert coteach_phase(3, 8, target="sps").noisy is True  # 0.375 * 8 = 3 despite float error


def test_phase_rejects_bad_epochs_and_targets():
    with pytest.raises(ValueError, match="outside"):
        coteach_phase(4, 4)
    with pytest.raises(ValueError, match="target"):
        coteach_phase(0, 4, target="ncr")


def test_bicro_clean_phase_zeroes_noisy_rows_only():
    early = training_targets("bicro", Phase(noisy=False, quasi_clean=True), SUBSET, LABEL)
    np.testing.assert_allclose(early.weight, [1.0, 0.7, 0.6, 0.0, 0.0])
    late = training_targets("bicro", Phase(noisy=True, quasi_clean=True), SUBSET, LABEL)
    np.testing.assert_array_equal(late.weight, LABEL)
    assert not early.reliable.any() and not early.use_proxy.any()


def test_weights_target_uses_the_label_as_is():
    out = training_targets("weights", Phase(noisy=False, quasi_clean=False), SUBSET, LABEL)
    np.testing.assert_array_equal(out.weight, LABEL)


def test_every_label_method_names_a_training_target():
    from pipeline.core.labels import LABEL_METHODS

    assert {m.training_target for m in LABEL_METHODS.values()} <= set(TRAINING_TARGETS)
    # RCR and the cosine baseline train on their label as the weight; BiCro and SPS schedule.
    assert LABEL_METHODS["rcr"].training_target == "weights"
    assert LABEL_METHODS["cosine"].training_target == "weights"
    assert LABEL_METHODS["bicro"].training_target == "bicro"
    assert LABEL_METHODS["sps"].training_target == "sps"
    assert LABEL_METHODS["assign"].training_target == "rematch"


def test_sps_targets_follow_the_schedule():
    proxy = np.array([np.nan, np.nan, np.nan, 0.8, 0.0], dtype=np.float32)
    reliable_only = training_targets("sps", Phase(False, False), SUBSET, LABEL, proxy)
    np.testing.assert_array_equal(reliable_only.weight, [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(reliable_only.reliable, [True, True, False, False, False])
    assert not reliable_only.use_proxy.any()
    quasi = training_targets("sps", Phase(False, True), SUBSET, LABEL, proxy)
    np.testing.assert_allclose(quasi.weight, [1, 1, 0.6, 0, 0])
    everything = training_targets("sps", Phase(True, True), SUBSET, LABEL, proxy)
    np.testing.assert_allclose(everything.weight, [1, 1, 0.6, 0.8, 0])
    # Only a noisy row with a positive proxy label swaps its caption for the proxy caption.
    np.testing.assert_array_equal(everything.use_proxy, [False, False, False, True, False])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40),
    seed=st.integers(0, 2**31 - 1),
    method=st.sampled_from(TRAINING_TARGETS),
    noisy=st.booleans(),
    quasi=st.booleans(),
)
def test_targets_are_bounded_and_permutation_equivariant(n, seed, method, noisy, quasi):
    rng = np.random.default_rng(seed)
    subset = rng.integers(0, 3, n)
    label = rng.uniform(-0.5, 1.5, n).astype(np.float32)
    label[rng.random(n) < 0.1] = np.nan
    proxy = rng.uniform(0, 1, n).astype(np.float32)
    phase = Phase(noisy=noisy, quasi_clean=quasi)
    out = training_targets(method, phase, subset, label, proxy)
    assert out.weight.dtype == np.float32 and out.weight.shape == (n,)
    assert np.all((out.weight >= 0) & (out.weight <= 1))
    perm = rng.permutation(n)
    permuted = training_targets(method, phase, subset[perm], label[perm], proxy[perm])
    np.testing.assert_array_equal(permuted.weight, out.weight[perm])
    np.testing.assert_array_equal(permuted.use_proxy, out.use_proxy[perm])
    assert out.proxy_row.dtype == np.float32 and out.proxy_row.shape == (n,)
    assert np.all((out.proxy_row >= 0) & (out.proxy_row <= 1))
    np.testing.assert_array_equal(permuted.proxy_row, out.proxy_row[perm])
    if method != "rematch":
        assert not out.proxy_row.any()


def test_rematch_targets_weigh_pairs_by_label_and_add_the_rematches():
    """assign's target: w = label for every pair, as `weights`; a noisy row with y_p > 0 adds
    a row (its image, the rematched caption) weighing y_p, from the first co-teaching epoch."""
    proxy = np.array([np.nan, 0.9, np.nan, 0.8, 0.0], dtype=np.float32)
    assert coteach_phase(0, 4, target="rematch") == Phase(noisy=True, quasi_clean=True)
    out = training_targets("rematch", Phase(True, True), SUBSET, LABEL, proxy)
    np.testing.assert_allclose(out.weight, LABEL)
    # Only the noisy row with a positive proxy label adds one (row 1 is clean: no rematch).
    np.testing.assert_allclose(out.proxy_row, [0, 0, 0, 0.8, 0])
    assert not out.use_proxy.any() and not out.reliable.any()
    plain = training_targets("weights", Phase(True, True), SUBSET, LABEL, proxy)
    np.testing.assert_array_equal(plain.weight, out.weight)
    assert not plain.proxy_row.any()
    assert not training_targets("rematch", Phase(False, True), SUBSET, LABEL, proxy).proxy_row.any()
    text = np.array([0.7, 0.0, np.nan], dtype=np.float32)
    np.testing.assert_allclose(proxy_image_weights("rematch", Phase(True, True), text), [0.7, 0, 0])
    assert not proxy_image_weights("weights", Phase(True, True), text).any()


def test_weight_cut_zeroes_labels_at_or_below_it():
    """BiCro's fused label is published uncut; theta cuts the training weights instead."""
    label = np.array([0.9, 0.5, 0.3, 0.51, 0.0], dtype=np.float32)
    subset = np.zeros(5, dtype=np.int8)
    out = training_targets("bicro", Phase(True, True), subset, label, weight_cut=0.5)
    np.testing.assert_array_equal(out.weight, np.array([0.9, 0, 0, 0.51, 0], np.float32))
    uncut = training_targets("bicro", Phase(True, True), subset, label)
    np.testing.assert_array_equal(uncut.weight, label)
    from pipeline.config import BicroLabelsConfig
    from pipeline.core.labels import LABEL_METHODS

    cut = LABEL_METHODS["bicro"].weight_cut
    assert cut(BicroLabelsConfig(label="fused", theta=0.4)) == 0.4
    assert cut(BicroLabelsConfig(label="step")) == 0.0  # the step label is already cut
