"""Corpus-wide partition decisions (pipeline.core.partition.decisions,
pipeline.core.partition.select).

The decisions are computed as the label stage computes them: per-shard counts, order statistics
by the distributed radix select over several in-memory shards, and each method's `decide`.
They are checked against brute-force sorting of the whole corpus.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import BicroLabelsConfig, RcrLabelsConfig, SpsLabelsConfig
from pipeline.core.labels import get_method
from pipeline.core.partition.decisions import (
    CLEAN,
    NOISY,
    QUASI_CLEAN,
    SUBSETS,
    ShardScalars,
    partition_counts,
    selection_rows,
    shard_masks,
)
from pipeline.core.partition.select import key_value, order_keys, radix_select, select_round

# ---------------------------------------------------------------------------------------------
# Order keys and the radix select
# ---------------------------------------------------------------------------------------------


def test_order_keys_sort_like_floats():
    values = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 0.5, 2.0, np.inf], np.float32)
    keys = order_keys(values)
    assert np.all(np.diff(keys.astype(np.int64)) >= 0)
    assert keys[3] == keys[4]  # -0.0 and 0.0 are the same value
    assert [key_value(int(k)) for k in keys] == [float(v) for v in values + np.float32(0)]


def _local_rounds(parts):
    """run_round over in-memory shards: [(keys, ids), ...]."""

    def run_round(prefix, fetch):
        return [select_round(keys, ids, prefix, fetch) for keys, ids in parts]

    return run_round


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fetch_limit", [1, 7, 10**6])
def test_radix_select_matches_sorting(seed, fetch_limit):
    rng = np.random.default_rng(seed)
    n = 300
    values = np.round(rng.normal(size=n), 1).astype(np.float32)  # many ties
    values[rng.choice(n, 5, replace=False)] = -0.0
    ids = rng.permutation(n).astype(np.int64) * 7919 + 2**40  # wide ids: all 6 digits used
    keys = order_keys(values)
    bounds = [0, 50, 50, 220, n]  # one empty shard
    parts = [(keys[a:b], ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    order = np.lexsort((ids, keys))
    for k in (1, 2, 17, n // 2, n):
        key, sample, n_le = radix_select(
            _local_rounds(parts), k, n, with_id=True, fetch_limit=fetch_limit
        )
        assert (key, sample, n_le) == (int(keys[order[k - 1]]), int(ids[order[k - 1]]), k)
        key, sample, n_le = radix_select(
            _local_rounds(parts), k, n, with_id=False, fetch_limit=fetch_limit
        )
        assert sample is None and key == int(keys[order[k - 1]])
        assert n_le == int((keys <= keys[order[k - 1]]).sum())


# ---------------------------------------------------------------------------------------------
# Decisions over shards, as the label stage takes them
# ---------------------------------------------------------------------------------------------


def _decide(method, params, prob, loss=None, alpha=(None, None), bounds=None, fetch_limit=1):
    """The method's decisions and the corpus's masks, from shards cut at `bounds`."""
    n = prob.size
    loss = (-np.log(np.clip(prob, 1e-9, 1)) if loss is None else loss).astype(np.float32)
    bounds = bounds or [0, n // 3, n // 3, n]
    shards = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        shards.append(
            ShardScalars(
                ids=np.arange(a, b, dtype=np.int64),
                loss=loss[a:b],
                loss_i2t=loss[a:b],
                loss_t2i=loss[a:b],
                prob=prob[a:b].astype(np.float32),
                alpha_i2t=None if alpha[0] is None else alpha[0][a:b].astype(np.float32),
                alpha_t2i=None if alpha[1] is None else alpha[1][a:b].astype(np.float32),
            )
        )
    counts = [
        partition_counts(
            s,
            threshold=0.5,
            sps_eps1=getattr(params, "eps1", None),
            sps_eps2=getattr(params, "eps2", None),
            rcr_delta=getattr(params, "delta", None),
        )
        for s in shards
    ]
    count = {key: sum(c[key] for c in counts) for key in counts[0]}

    def select(what, k, in_play, decisions=None, with_id=True):
        parts = [selection_rows(s, what, decisions) for s in shards]
        return radix_select(
            _local_rounds(parts), k, in_play, with_id=with_id, fetch_limit=fetch_limit
        )

    decisions, partition = get_method(method).decide(count, select, 0.5, params)
    masks = [shard_masks(s, decisions) for s in shards]

    def cat(name):
        parts = [getattr(m, name) for m in masks]
        return None if parts[0] is None else np.concatenate(parts)

    return partition, {name: cat(name) for name in ("valid", "clean", "anchor", "sps", "in_c")}


def _sorted_position(values: np.ndarray, position: int) -> float:
    return float(np.sort(values[np.isfinite(values)])[position])


def _lowest(score: np.ndarray, valid: np.ndarray, k: int) -> np.ndarray:
    """The k valid rows of smallest score, ties by row (the brute-force reference)."""
    rows = np.flatnonzero(valid)
    return np.sort(rows[np.lexsort((rows, score[rows]))[:k]])


BICRO = BicroLabelsConfig()


def test_clean_split_is_a_strict_threshold():
    prob = np.array([0.9, 0.5, 0.2, 0.51, np.nan], np.float32)
    loss = np.array([1, 2, 3, 1.5, np.nan], np.float32)
    partition, masks = _decide("cosine", None, prob, loss)
    np.testing.assert_array_equal(masks["clean"], [True, False, False, True, False])
    flags = partition["clean_split"]
    assert not flags["one_percent_rule"] and not flags["symmetric_guard"]
    assert (flags["threshold"], flags["n_selected"], flags["n_invalid"]) == (0.5, 2, 1)


def test_one_percent_rule_when_everything_is_clean():
    prob = np.linspace(0.6, 1.0, 1_000)[::-1].astype(np.float32)  # all > 0.5, distinct
    partition, masks = _decide("bicro", BICRO, prob)
    flags = partition["clean_split"]
    assert flags["one_percent_rule"] and not flags["symmetric_guard"]
    assert flags["threshold"] == _sorted_position(prob, 10)
    # Strict ">" at the value of sorted position floor(N/100): positions 0..10 turn noisy.
    assert set(np.flatnonzero(~masks["clean"])) == set(np.argsort(prob)[:11])


def test_one_percent_rule_ignores_nan_samples():
    prob = np.r_[np.full(200, 0.9), np.linspace(0.95, 0.99, 100), np.nan].astype(np.float32)
    partition, masks = _decide("bicro", BICRO, prob)
    flags = partition["clean_split"]
    assert flags["one_percent_rule"] and flags["n_invalid"] == 1 and not masks["clean"][-1]


def test_symmetric_guard_takes_the_lowest_losses():
    prob = np.full(500, 0.1, np.float32)
    loss = np.arange(500.0, dtype=np.float32)[::-1].copy()
    partition, masks = _decide("bicro", BICRO, prob, loss)
    assert partition["clean_split"]["symmetric_guard"]
    np.testing.assert_array_equal(np.flatnonzero(masks["clean"]), [495, 496, 497, 498, 499])


def test_guard_after_one_percent_rule_with_ties():
    # All probabilities 1 (the "no loss spread" round): the 1 % rule's threshold equals the
    # common value, nothing stays clean, and the guard brings back the lowest-loss sample.
    loss = np.r_[np.ones(20), 0.5, np.ones(29)].astype(np.float32)
    partition, masks = _decide("bicro", BICRO, np.ones(50, np.float32), loss)
    flags = partition["clean_split"]
    assert flags["one_percent_rule"] and flags["symmetric_guard"]
    np.testing.assert_array_equal(np.flatnonzero(masks["clean"]), [20])
    assert masks["anchor"].tolist() == masks["clean"].tolist()  # ceil(0.1 x 1) = 1 anchor


def test_all_nan_selects_nothing():
    partition, masks = _decide("bicro", BICRO, np.full(4, np.nan, np.float32))
    assert not masks["clean"].any() and not masks["anchor"].any()
    assert partition["clean_split"]["n_invalid"] == 4 and "anchors" not in partition


@settings(max_examples=40, deadline=None)
@given(
    prob=st.lists(st.floats(0, 1, width=32), min_size=1, max_size=300),
    cut=st.integers(0, 300),
)
def test_clean_split_always_leaves_both_sides_populated(prob, cut):
    prob = np.array(prob, np.float32)
    partition, masks = _decide("bicro", BICRO, prob, bounds=[0, min(cut, prob.size), prob.size])
    clean = masks["clean"]
    assert clean.any()
    if prob.size >= 2 and np.unique(prob).size == prob.size:
        assert not clean.all()
    assert partition["clean_split"]["n_selected"] == clean.sum()


def test_anchor_count_and_ties():
    # |C| = 30 -> ceil(0.1 x 30) = 3 exactly (not 4 by float rounding); ties by sample id.
    prob = np.r_[np.full(10, 0.1), np.full(30, 0.9)].astype(np.float32)
    loss = np.ones(40, np.float32)
    loss[:10] = 0.0  # lower losses outside C never become anchors
    _, masks = _decide("bicro", BICRO, prob, loss)
    np.testing.assert_array_equal(np.flatnonzero(masks["anchor"]), [10, 11, 12])
    loss[[35, 20]] = 0.5
    _, masks = _decide("bicro", BICRO, prob, loss)
    np.testing.assert_array_equal(np.flatnonzero(masks["anchor"]), [10, 20, 35])
    partition, masks = _decide("bicro", BicroLabelsConfig(anchor_fraction=0.5), prob, loss)
    assert masks["anchor"].sum() == 15 == partition["anchors"]["n_anchors"]
    prob31 = np.r_[np.full(31, 0.9), 0.1].astype(np.float32)
    _, masks = _decide("bicro", BICRO, prob31, np.zeros(32, np.float32))
    assert masks["anchor"].sum() == 4  # ceil(3.1)
    # In-batch anchors are chosen by the method per shard: the decisions name none.
    partition, masks = _decide("bicro", BicroLabelsConfig(anchors="in_batch"), prob, loss)
    assert not masks["anchor"].any() and "anchors" not in partition


def test_sps_three_subsets():
    prob = np.array([0.995, 0.99, 0.7, 0.5, 0.1, np.nan], np.float32)
    partition, masks = _decide("sps", SpsLabelsConfig(), prob)
    codes = masks["sps"]
    assert codes.dtype == np.int8
    np.testing.assert_array_equal(codes, [CLEAN, QUASI_CLEAN, QUASI_CLEAN, NOISY, NOISY, NOISY])
    assert [SUBSETS[c] for c in codes[:3]] == ["clean", "quasi_clean", "quasi_clean"]
    flags = partition["sps_split"]
    assert flags["n_selected"] == 3 and flags["n_invalid"] == 1 and flags["n_reliable"] == 1
    assert not flags["one_percent_rule"] and not flags["no_reliable_set"]


def test_sps_one_percent_rule_at_eps2():
    prob = np.linspace(0.6, 0.999, 200).astype(np.float32)
    partition, masks = _decide("sps", SpsLabelsConfig(), prob)
    assert partition["sps_split"]["one_percent_rule"] and (masks["sps"] == NOISY).sum() == 3
    assert (masks["sps"] == CLEAN).sum() == (prob > np.float32(0.99)).sum()


@pytest.mark.parametrize("fetch_limit", [1, 10**6])
def test_sps_reliable_fallback_is_the_guard_over_posteriors(fetch_limit):
    """No posterior above eps1: the floor(rho N) highest posteriors (ties by id) are reliable,
    across shards, found by the same radix select as the symmetric guard."""
    rng = np.random.default_rng(5)
    prob = np.round(rng.uniform(0.3, 0.9, 301), 1).astype(np.float32)  # many ties
    prob[[3, 150]] = np.nan
    params = SpsLabelsConfig(reliable_fallback=0.05)
    partition, masks = _decide("sps", params, prob, fetch_limit=fetch_limit)
    valid = np.flatnonzero(np.isfinite(prob))
    top = valid[np.lexsort((valid, -prob[valid]))][: int(0.05 * valid.size)]
    np.testing.assert_array_equal(np.flatnonzero(masks["sps"] == CLEAN), np.sort(top))
    flags = partition["sps_split"]
    assert flags["reliable_fallback"] and flags["n_reliable"] == top.size == 14
    assert not flags["no_reliable_set"]
    assert not _decide("sps", SpsLabelsConfig(), prob)[0]["sps_split"]["reliable_fallback"]


def test_sps_thresholds_are_validated_at_config_load():
    with pytest.raises(ValueError, match="eps1 > eps2"):
        SpsLabelsConfig(eps1=0.4, eps2=0.6)


def test_rcr_candidates_need_both_directions():
    a = np.array([0.9, 0.9, 0.2, 0.6, np.nan], np.float32)
    b = np.array([0.8, 0.4, 0.9, 0.51, 0.9], np.float32)
    partition, masks = _decide("rcr", RcrLabelsConfig(), np.full(5, 0.5, np.float32), alpha=(a, b))
    np.testing.assert_array_equal(masks["in_c"], [True, False, False, True, False])
    flags = partition["rcr_candidates"]
    assert not flags["symmetric_guard"] and flags["n_invalid"] == 1


def test_rcr_candidates_fallback_when_empty():
    a = np.r_[np.full(250, 0.3), 0.45, 0.49].astype(np.float32)
    b = np.r_[np.full(250, 0.3), 0.48, 0.2].astype(np.float32)
    prob = np.full(252, 0.5, np.float32)
    partition, masks = _decide("rcr", RcrLabelsConfig(), prob, alpha=(a, b))
    flags = partition["rcr_candidates"]
    assert flags["symmetric_guard"] and flags["n_selected"] == 2  # floor(252 / 100)
    # The largest min(a, b), then the smallest id.
    np.testing.assert_array_equal(np.flatnonzero(masks["in_c"]), [0, 250])


@pytest.mark.parametrize("case", ["mixed", "all_clean", "none_clean"])
@pytest.mark.parametrize("fetch_limit", [1, 10**6])
def test_decisions_over_shards_equal_brute_force(case, fetch_limit):
    """Ties in losses and posteriors, NaN rows and an empty shard: the sharded decisions equal
    sorting the whole corpus."""
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    n = 700
    loss = np.round(rng.gamma(2.0, 1.0, n), 1).astype(np.float32)  # tied losses
    low, high = {"mixed": (0.0, 1.0), "all_clean": (0.995, 1.0), "none_clean": (0.0, 0.3)}[case]
    prob = rng.uniform(low, high, n).astype(np.float32)
    prob[rng.choice(n, 20, replace=False)] = np.float32(high)  # tied probabilities
    prob[rng.choice(n, 9, replace=False)] = np.nan  # NaN losses upstream
    loss[np.isnan(prob)] = np.nan
    bounds = [0, 100, 100, 450, n]
    valid = np.isfinite(prob)

    partition, masks = _decide(
        "bicro",
        BicroLabelsConfig(anchor_fraction=0.13),
        prob,
        loss,
        (None, None),
        bounds,
        fetch_limit,
    )
    threshold = np.float32(0.5)
    if np.all(prob[valid] > threshold):  # the 1 % rule
        threshold = np.float32(_sorted_position(prob, valid.sum() // 100))
    clean = valid & (prob > threshold)
    if not clean.any():  # the guard
        clean[_lowest(loss, valid, max(1, valid.sum() // 100))] = True
    np.testing.assert_array_equal(masks["clean"], clean)
    anchors = _lowest(loss, clean, int(np.ceil(0.13 * clean.sum() - 1e-9)))
    np.testing.assert_array_equal(np.flatnonzero(masks["anchor"]), anchors)
    assert partition["anchors"]["n_anchors"] == anchors.size

    params = SpsLabelsConfig(eps1=0.998, eps2=0.5)
    partition, masks = _decide("sps", params, prob, loss, (None, None), bounds, fetch_limit)
    eps2 = np.float32(0.5)
    if np.all(prob[valid] > eps2):
        eps2 = np.float32(_sorted_position(prob, valid.sum() // 100))
    codes = np.where(valid & (prob > eps2), QUASI_CLEAN, NOISY)
    codes[valid & (prob > eps2) & (prob > np.float32(0.998))] = CLEAN
    np.testing.assert_array_equal(masks["sps"], codes)
    assert partition["sps_split"]["n_reliable"] == int((codes == CLEAN).sum())

    alpha_i2t = rng.uniform(low, high, n).astype(np.float32)
    alpha_t2i = rng.uniform(low, high, n).astype(np.float32)
    alpha_i2t[np.isnan(prob)] = np.nan
    alpha = (alpha_i2t, alpha_t2i)
    partition, masks = _decide("rcr", RcrLabelsConfig(), prob, loss, alpha, bounds, fetch_limit)
    both = np.isfinite(alpha_i2t) & np.isfinite(alpha_t2i)
    in_c = both & (alpha_i2t > 0.5) & (alpha_t2i > 0.5)
    if not in_c.any():
        in_c[_lowest(-np.minimum(alpha_i2t, alpha_t2i), both, max(1, both.sum() // 100))] = True
    np.testing.assert_array_equal(masks["in_c"], in_c)


def _fits(losses: dict[str, np.ndarray]) -> dict:
    """The label pass's fits (pipeline.stages.labels.driver._fit_mixtures) on in-memory losses."""
    from pipeline.core.mixture.fit import fit_mixture

    return {
        "bmm": fit_mixture(losses["loss"], "bmm"),
        "gmm": fit_mixture(losses["loss"], "gmm"),
        "gmm_i2t": fit_mixture(losses["i2t"], "gmm"),
        "gmm_t2i": fit_mixture(losses["t2i"], "gmm"),
    }


@pytest.mark.parametrize("method", ["bicro", "sps", "cosine"])
def test_both_directions_posterior_drops_pairs_clean_one_way_only(method):
    """`labels.posterior: both_directions`: a pair whose summed loss looks clean but whose
    text->image loss is noisy (the caption matches many images) is not clean; pairs clean
    both ways stay clean."""
    from pipeline.config import LabelsConfig
    from pipeline.core.partition.decisions import ShardScalars
    from pipeline.stages.labels import LabelSpec
    from pipeline.stages.labels.shard_tasks import add_posteriors

    rng = np.random.default_rng(0)
    n_clean, n_noisy, n_one_way = 300, 200, 60
    i2t = np.concatenate(
        [rng.normal(1.0, 0.15, n_clean), rng.normal(4.0, 0.15, n_noisy), np.full(n_one_way, 0.2)]
    ).astype(np.float32)
    t2i = np.concatenate(
        [rng.normal(1.0, 0.15, n_clean), rng.normal(4.0, 0.15, n_noisy), np.full(n_one_way, 3.4)]
    ).astype(np.float32)
    one_way = np.arange(n_clean + n_noisy, i2t.size)
    fits = _fits({"loss": i2t + t2i, "i2t": i2t, "t2i": t2i})

    def posterior(choice: str) -> ShardScalars:
        spec = LabelSpec(
            output="unused",
            round_index=0,
            view="a",
            shards=("00000",),
            out_dir="unused",
            labels=LabelsConfig(method=method, posterior=choice),
        )
        scalars = ShardScalars(ids=np.arange(i2t.size), loss=i2t + t2i, loss_i2t=i2t, loss_t2i=t2i)
        add_posteriors(spec, scalars, fits)
        return scalars

    summed, both = posterior("summed_loss"), posterior("both_directions")
    assert (summed.prob[one_way] > 0.5).all()  # the summed loss calls them clean
    np.testing.assert_array_equal(both.prob, np.minimum(both.alpha_i2t, both.alpha_t2i))
    assert (both.prob[one_way] < 0.5).all()
    assert (both.prob[:n_clean] > 0.5).all()
    assert (both.prob[n_clean : n_clean + n_noisy] < 0.5).all()
