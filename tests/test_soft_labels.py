"""Label methods (pipeline.core.labels): invariants, hand-checked values, and separation on
synthetic blobs; whole-corpus runs go through `label_in_memory`, the label stage's own steps
with the in-process neighbour back-end."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

from pipeline.config import BicroLabelsConfig, LabelsConfig, RcrLabelsConfig, SpsLabelsConfig
from pipeline.core.coteach import TRAINING_TARGETS
from pipeline.core.labels import LABEL_METHODS, SCORE_COLUMNS
from pipeline.core.labels.bicro import bicro_in_batch_anchors, bicro_labels, fold
from pipeline.core.labels.cosine import cosine_labels
from pipeline.core.labels.in_memory import label_in_memory
from pipeline.core.labels.rcr import ndcg_at_k, rcr_ndcg, rcr_weights
from pipeline.core.labels.sps import (
    proxy_match_probability,
    sps_proxy_labels,
    sps_quasi_clean_label,
)
from pipeline.core.losses.per_sample import infonce_per_sample
from pipeline.core.partition.decisions import CLEAN
from pipeline.core.search.exact import exact_topk_torch


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _random_unit(rows: int, dim: int, seed: int, dtype=np.float32) -> np.ndarray:
    return _unit(np.random.default_rng(seed).standard_normal((rows, dim))).astype(dtype)


def _blobs(n=2000, dim=32, clusters=40, noise=0.3, spread=0.6, seed=0):
    """Clustered image/text embeddings; a `noise` fraction of captions rotated among themselves.

    Returns u, v (n, dim) float32 and is_noisy (n,) bool.
    """
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((clusters, dim)))
    cluster = rng.integers(0, clusters, n)
    u = _unit(centers[cluster] + spread * rng.standard_normal((n, dim)) / math.sqrt(dim))
    v = _unit(centers[cluster] + spread * rng.standard_normal((n, dim)) / math.sqrt(dim))
    noisy_rows = rng.choice(n, int(noise * n), replace=False)
    v[noisy_rows] = v[np.roll(noisy_rows, 1)]  # each noisy pair takes another sample's caption
    is_noisy = np.zeros(n, dtype=bool)
    is_noisy[noisy_rows] = True
    return u.astype(np.float32), v.astype(np.float32), is_noisy


@pytest.fixture(scope="module")
def blobs():
    u, v, is_noisy = _blobs()
    loss = 1.0 - (u * v).sum(axis=1)
    # A stand-in for the mixture's split: the 60 % lowest losses are "clean".
    is_clean = loss <= np.quantile(loss, 0.6)
    return u, v, is_noisy, loss, is_clean


# ---------------------------------------------------------------------------------------------
# fold and BiCro
# ---------------------------------------------------------------------------------------------

unit_floats = st.floats(-1.0, 1.0, allow_nan=False)


@given(a=unit_floats, b=unit_floats)
@settings(max_examples=300, deadline=None)
def test_fold_properties(a, b):
    value = float(fold(a, b))
    assert 0.0 <= value <= 1.0
    assert value == float(fold(b, a))
    if a > 1e-6:
        assert float(fold(a, a)) == 1.0
    if min(a, b) <= 1e-6:
        assert value == 0.0


def test_fold_fixes_reference_sign_bugs():
    # The reference returns +0.2 for (-0.1, -0.5) and inf/NaN for a zero denominator.
    np.testing.assert_array_equal(fold([-0.1, 0.0, 0.3], [-0.5, 0.0, 0.0]), [0.0, 0.0, 0.0])
    assert float(fold(0.2, 0.8)) == pytest.approx(0.25)
    assert np.isnan(fold(np.nan, 0.5))


def _bicro_inputs(rows: int, dim: int, seed: int):
    rng = np.random.default_rng(seed)
    arrays = [_random_unit(rows, dim, seed + i) for i in range(6)]
    is_anchor = rng.random(rows) < 0.2
    is_clean = is_anchor | (rng.random(rows) < 0.5)
    return arrays, is_anchor, is_clean


@given(
    rows=st.integers(1, 40),
    dim=st.integers(2, 12),
    seed=st.integers(0, 10_000),
    clean_floor=st.floats(0.0, 1.0),
    theta=st.floats(0.0, 0.99),
    ratio=st.sampled_from(["similarity", "distance"]),
)
@settings(max_examples=60, deadline=None)
def test_bicro_labels_properties(rows, dim, seed, clean_floor, theta, ratio):
    arrays, is_anchor, is_clean = _bicro_inputs(rows, dim, seed)
    options = dict(clean_floor=clean_floor, theta=theta, ratio=ratio)
    out = bicro_labels(*arrays, is_anchor, is_clean, **options)
    for key in ("bicro", "bicro_star"):
        assert out[key].dtype == np.float32
        assert np.all((out[key] >= 0) & (out[key] <= 1))
    assert np.all(out["bicro"][is_anchor] == 1.0) and np.all(out["bicro_star"][is_anchor] == 1.0)
    star = out["bicro_star"]
    assert np.all((star == 0) | ((star > theta) & (star <= 1)))
    clean_rest = is_clean & ~is_anchor
    assert np.all(out["bicro"][clean_rest] >= np.float32(clean_floor) - 1e-6)
    # Row equivariance: permuting every input row permutes every output row.
    perm = np.random.default_rng(seed).permutation(rows)
    permuted = bicro_labels(*[a[perm] for a in arrays], is_anchor[perm], is_clean[perm], **options)
    for key, value in out.items():
        np.testing.assert_array_equal(permuted[key], value[perm])


def test_bicro_labels_hand_values():
    e = np.eye(4, dtype=np.float32)
    u = np.array([e[0]])
    v = np.array([e[1]])
    # Image side: A = u.u_a = 0.8, B = v.v_a = 0.4 -> 0.5. Text side: A' = 0.6, B' = 0.3 -> 0.5.
    u_a = np.array([0.8 * e[0] + 0.6 * e[2]])
    v_a = np.array([0.4 * e[1] + math.sqrt(1 - 0.16) * e[3]])
    v_b = np.array([0.6 * e[1] + 0.8 * e[2]])
    u_b = np.array([0.3 * e[0] + math.sqrt(1 - 0.09) * e[3]])
    for is_clean, expected in ((False, 0.5), (True, 0.75)):
        out = bicro_labels(u, v, u_a, v_a, v_b, u_b, [False], [is_clean])
        assert out["r_i2t"][0] == pytest.approx(0.5, abs=1e-6)
        assert out["r_t2i"][0] == pytest.approx(0.5, abs=1e-6)
        assert out["bicro"][0] == pytest.approx(expected, abs=1e-6)
        assert out["bicro_star"][0] == (0.0 if expected <= 0.5 else pytest.approx(expected))
    # Distance mode: D = sqrt(2 - 2S): image sqrt(0.4)/sqrt(1.2), text sqrt(0.8)/sqrt(1.4).
    out = bicro_labels(u, v, u_a, v_a, v_b, u_b, [False], [False], ratio="distance")
    expected = 0.5 * (math.sqrt(0.4 / 1.2) + math.sqrt(0.8 / 1.4))
    assert out["bicro"][0] == pytest.approx(expected, abs=1e-6)


def _bicro(u, v, loss, is_clean, **options):
    """BiCro over a corpus whose clean split is `is_clean` (posterior 1 / 0)."""
    return label_in_memory(
        "bicro",
        options.pop("params", BicroLabelsConfig()),
        u=u,
        v=v,
        loss=loss,
        prob=is_clean.astype(np.float32),
        **options,
    )


def test_bicro_global_separates_clean_from_noisy(blobs):
    u, v, is_noisy, loss, is_clean = blobs
    out = _bicro(u, v, loss, is_clean)
    anchor, raw = out.masks.anchor, out.labels.scores["bicro"]
    assert anchor.sum() == -(-int(is_clean.sum()) // 10)  # ceil(0.1 |C|)
    assert np.all(out.labels.image_anchor_key[anchor] == None)  # noqa: E711 - not queried
    named = out.labels.image_anchor_key[~anchor].astype(int)
    assert np.all(anchor[named])  # every pair names an anchor
    assert np.all(raw[anchor] == 1.0)
    assert roc_auc_score(~is_noisy, raw) >= 0.95
    assert roc_auc_score(~is_noisy[~anchor], raw[~anchor]) >= 0.95
    np.testing.assert_array_equal(out.labels.subset == CLEAN, is_clean)
    star = out.labels.soft_label
    assert np.all((star == 0) | (star > 0.5)) and np.all(star[star > 0] == raw[star > 0])
    # The global-vs-in-batch ablation (README, measured figures): global anchors are at least
    # as good.
    in_batch = bicro_in_batch_anchors(u, v, loss, is_clean)
    assert roc_auc_score(~is_noisy, raw) >= roc_auc_score(~is_noisy, in_batch["bicro"])


def test_bicro_global_is_permutation_equivariant_and_shard_free(blobs):
    """Permuting rows permutes the labels when no tie needs the id; shards and index stores
    change nothing."""
    u, v, _, loss, is_clean = blobs
    n = u.shape[0]
    out = _bicro(u, v, loss, is_clean)
    sharded = _bicro(u, v, loss, is_clean, shard_sizes=[700, 0, n - 700], index_stores=3)
    np.testing.assert_array_equal(sharded.labels.soft_label, out.labels.soft_label)
    np.testing.assert_array_equal(sharded.labels.image_anchor_key, out.labels.image_anchor_key)
    perm = np.random.default_rng(1).permutation(n)
    permuted = _bicro(u[perm], v[perm], loss[perm], is_clean[perm], index_stores=2)
    np.testing.assert_array_equal(permuted.labels.soft_label, out.labels.soft_label[perm])
    np.testing.assert_array_equal(permuted.masks.anchor, out.masks.anchor[perm])
    # Anchor keys are row numbers: map the permuted ones back to original rows.
    queried = ~permuted.masks.anchor
    np.testing.assert_array_equal(
        perm[permuted.labels.text_anchor_key[queried].astype(int)],
        out.labels.text_anchor_key[perm][queried].astype(int),
    )


def test_bicro_k_anchors_average_the_folds_of_the_k_nearest(blobs):
    """anchor_k = 3: each side's fold is the mean over its 3 nearest anchors (brute force
    here), whatever the shards and index stores; the anchor keys still name the nearest."""
    u, v, _, loss, is_clean = blobs
    params = BicroLabelsConfig(anchor_k=3)
    out = _bicro(u, v, loss, is_clean, params=params, shard_sizes=[900, 1100], index_stores=3)
    anchor = out.masks.anchor
    rows = np.flatnonzero(anchor)
    queried = ~anchor
    image_nn = rows[np.argsort(-(u[queried] @ u[rows].T), axis=1, kind="stable")[:, :3]]
    text_nn = rows[np.argsort(-(v[queried] @ v[rows].T), axis=1, kind="stable")[:, :3]]
    uq, vq = u[queried][:, None, :], v[queried][:, None, :]
    r_i2t = fold((uq * u[image_nn]).sum(-1), (vq * v[image_nn]).sum(-1)).mean(axis=1)
    r_t2i = fold((vq * v[text_nn]).sum(-1), (uq * u[text_nn]).sum(-1)).mean(axis=1)
    c = 0.5 * (r_i2t + r_t2i)
    expected = np.where(is_clean[queried], 0.5 + 0.5 * c, c)
    np.testing.assert_allclose(out.labels.scores["bicro"][queried], expected, atol=1e-5)
    np.testing.assert_array_equal(out.labels.image_anchor_key[queried].astype(int), image_nn[:, 0])
    nearest_only = _bicro(u, v, loss, is_clean)
    assert not np.allclose(
        out.labels.scores["bicro"][queried], nearest_only.labels.scores["bicro"][queried]
    )


def test_bicro_rows_without_a_finite_loss():
    u, v, _ = _blobs(n=300, seed=3)
    u[5] = np.nan
    loss = (1.0 - (u * v).sum(axis=1)).astype(np.float32)  # NaN for row 5
    prob = np.where(np.isfinite(loss), 1.0, np.nan).astype(np.float32)
    out = label_in_memory("bicro", BicroLabelsConfig(), u=u, v=v, loss=loss, prob=prob)
    assert out.labels.soft_label[5] == 0.0 and not out.masks.anchor[5]
    assert out.labels.subset[5] != CLEAN
    assert np.isfinite(out.labels.scores["bicro"]).all()


def test_bicro_in_batch_labels_are_aligned_and_equivariant():
    u, v, _ = _blobs(n=700, seed=2)
    loss = 1.0 - (u * v).sum(axis=1)
    is_clean = loss <= np.quantile(loss, 0.5)
    ids = np.arange(700, dtype=np.int64) + 1000
    out = bicro_in_batch_anchors(u, v, loss, is_clean, ids=ids, batch_size=64)
    perm = np.random.default_rng(0).permutation(700)
    permuted = bicro_in_batch_anchors(
        u[perm], v[perm], loss[perm], is_clean[perm], ids=ids[perm], batch_size=64
    )
    for key in ("bicro", "bicro_star", "r_i2t", "r_t2i", "is_anchor"):
        np.testing.assert_array_equal(permuted[key], out[key][perm])
    # floor(b/10) + 1 anchors per clean batch (the last batch may be short).
    sizes = [64] * (is_clean.sum() // 64) + ([is_clean.sum() % 64] if is_clean.sum() % 64 else [])
    assert out["is_anchor"].sum() == sum(min(s, s // 10 + 1) for s in sizes)


def test_bicro_in_batch_single_batch_matches_naive_loop():
    u, v, _ = _blobs(n=90, seed=4)
    loss = 1.0 - (u * v).sum(axis=1)
    is_clean = np.ones(90, dtype=bool)
    out = bicro_in_batch_anchors(u, v, loss, is_clean, batch_size=128)
    anchors = np.argsort(loss, kind="stable")[: 90 // 10 + 1]
    for i in range(90):
        if i in anchors:
            assert out["bicro"][i] == 1.0
            continue
        a = anchors[np.argmax([u[i] @ u[j] for j in anchors])]
        b = anchors[np.argmax([v[i] @ v[j] for j in anchors])]
        r1 = float(fold(u[i] @ u[a], v[i] @ v[a]))
        r2 = float(fold(v[i] @ v[b], u[i] @ u[b]))
        assert out["bicro"][i] == pytest.approx(0.5 + 0.25 * (r1 + r2), abs=1e-5)


# ---------------------------------------------------------------------------------------------
# RCR
# ---------------------------------------------------------------------------------------------


def _lists(queries, database, depth):
    return exact_topk_torch(queries, database, depth, device="cpu")[1]


def _rcr_brute(u, v, k, include_self=True, groups=None, depth=None):
    depth = depth or k + 1
    return rcr_ndcg(
        u,
        v,
        _lists(u, v, depth),
        _lists(v, v, depth),
        _lists(v, u, depth),
        _lists(u, u, depth),
        v,
        u,
        k=k,
        self_ids=np.arange(u.shape[0]),
        include_self=include_self,
        image_group_ids=groups,
    )


def test_ndcg_hand_value():
    # Texts t0..t2 on a circle; the query image retrieves t2, t1, t0 but its text is t0.
    angles = np.array([0.0, 0.5, 1.0])
    texts = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    image = np.array([[math.cos(1.2), math.sin(1.2)]])
    text = texts[:1]
    out = ndcg_at_k(image, text, np.array([[0, 1, 2]]), np.array([[0, 1, 2]]), texts, k=3)
    gains = np.cos(angles)  # S(t0, t_j)
    dcg = gains[2] / 1 + gains[1] / math.log2(3) + gains[0] / 2
    idcg = gains[0] / 1 + gains[1] / math.log2(3) + gains[2] / 2
    assert out["ndcg"][0] == pytest.approx(dcg / idcg, abs=1e-6)
    assert out["k_eff"][0] == 3
    # Excluding self drops t0 from both lists: K_eff shrinks to the 2 candidates left.
    out = ndcg_at_k(
        image, text, np.array([[0, 1, 2]]), np.array([[0, 1, 2]]), texts, k=3,
        self_ids=np.array([0]), include_self=False,
    )  # fmt: skip
    assert out["k_eff"][0] == 2
    assert out["ndcg"][0] == pytest.approx(
        (gains[2] + gains[1] / math.log2(3)) / (gains[1] + gains[2] / math.log2(3)), abs=1e-6
    )


@given(
    rows=st.integers(3, 40),
    dim=st.integers(2, 10),
    k=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    include_self=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_ndcg_properties(rows, dim, k, seed, include_self):
    # float64 embeddings: the rotation changes scores by ~1e-16, never enough to reorder.
    u = _random_unit(rows, dim, seed, np.float64)
    v = _random_unit(rows, dim, seed + 1, np.float64)
    out = _rcr_brute(u, v, k, include_self)
    for key in ("ndcg_txt", "ndcg_img", "w"):
        assert np.all((out[key] >= 0) & (out[key] <= 1))
    same = _rcr_brute(u, u.copy(), k, include_self)
    # Identical rankings give exactly 1, unless every gain is <= 0 (IDCG = 0: set 0, flagged).
    np.testing.assert_array_equal(same["ndcg_txt"][~same["degenerate"]], 1.0)
    np.testing.assert_array_equal(same["ndcg_img"][~same["degenerate"]], 1.0)
    if include_self:
        assert not same["degenerate"].any()
    rotation, _ = np.linalg.qr(np.random.default_rng(seed + 2).standard_normal((dim, dim)))
    rotated = _rcr_brute(u @ rotation, v @ rotation, k, include_self)
    for key in ("ndcg_txt", "ndcg_img", "w"):
        np.testing.assert_allclose(rotated[key], out[key], atol=1e-6)


def test_ndcg_image_dedup_and_degenerate():
    rng = np.random.default_rng(5)
    images = _random_unit(30, 8, 6)
    u = np.repeat(images, 3, axis=0)  # every image has 3 captions (F30K/COCO style)
    v = _unit(u + 0.3 * rng.standard_normal(u.shape)).astype(np.float32)
    groups = np.repeat(np.arange(30), 3)
    deduped = _rcr_brute(u, v, 5, groups=groups, depth=6 * 3)
    plain = _rcr_brute(u, v, 5, depth=6 * 3)
    # Without de-dup the image's own copies fill the ideal list and the scores change.
    assert not np.allclose(deduped["ndcg_img"], plain["ndcg_img"])
    assert np.all((deduped["ndcg_img"] >= 0) & (deduped["ndcg_img"] <= 1))
    # All-negative gains: IDCG = 0 -> NDCG 0, flagged.
    e = np.eye(2)
    out = ndcg_at_k(e[:1], -e[:1], np.array([[0]]), np.array([[0]]), e[:1], k=1)
    assert out["ndcg"][0] == 0.0 and out["degenerate"][0]


def test_rcr_in_memory_separates_clean_from_noisy(blobs):
    u, v, is_noisy, loss, _ = blobs
    clean = (~is_noisy).astype(np.float32)
    options = dict(u=u, v=v, loss=loss, prob=clean, alpha_i2t=clean, alpha_t2i=clean)
    out = label_in_memory("rcr", RcrLabelsConfig(k=10), index_stores=2, **options)
    w = out.labels.scores["rcr"]
    assert roc_auc_score(~is_noisy, w) >= 0.95
    assert w[~is_noisy].mean() > 0.7 and w[is_noisy].mean() < 0.3
    np.testing.assert_array_equal(out.masks.in_c, ~is_noisy)
    np.testing.assert_array_equal(out.labels.soft_label, rcr_weights(w, ~is_noisy))
    excluded = label_in_memory("rcr", RcrLabelsConfig(k=10, include_self=False), **options)
    assert roc_auc_score(~is_noisy, excluded.labels.scores["rcr"]) >= 0.95


# ---------------------------------------------------------------------------------------------
# SPS
# ---------------------------------------------------------------------------------------------


@given(
    p=st.floats(0.0, 1.0),
    loss_i2t=st.floats(0.0, 50.0),
    loss_t2i=st.floats(0.0, 50.0),
)
@settings(max_examples=200, deadline=None)
def test_sps_quasi_clean_in_p_to_one(p, loss_i2t, loss_t2i):
    y = float(sps_quasi_clean_label(np.array([p]), np.array([loss_i2t]), np.array([loss_t2i]))[0])
    assert np.float32(p) <= y <= 1.0
    match = 0.5 * (math.exp(-loss_i2t) + math.exp(-loss_t2i))
    assert y == pytest.approx(p + (1 - p) * match, abs=1e-6)


def test_proxy_match_probability_matches_infonce_without_duplicates():
    import torch

    u, v = _random_unit(64, 16, 7), _random_unit(64, 16, 8)
    p_i2t, p_t2i = proxy_match_probability(
        u, v, np.arange(64), logit_scale=10.0, batch_size=64, seed=0
    )
    l_i2t, l_t2i = infonce_per_sample(torch.from_numpy(u), torch.from_numpy(v), 10.0)
    np.testing.assert_allclose(p_i2t, np.exp(-l_i2t.numpy()), rtol=1e-4)
    np.testing.assert_allclose(p_t2i, np.exp(-l_t2i.numpy()), rtol=1e-4)


def test_proxy_duplicates_are_masked():
    u = _random_unit(6, 8, 9)
    distinct_texts = _random_unit(3, 8, 10)
    proxy = np.array([0, 0, 0, 1, 2, 2])
    v = distinct_texts[proxy]
    p_i2t, p_t2i = proxy_match_probability(u, v, proxy, logit_scale=5.0, batch_size=6)
    # image -> text with duplicate captions == softmax over the distinct captions.
    logits = 5.0 * u.astype(np.float64) @ distinct_texts.T.astype(np.float64)
    expected = np.exp(logits[np.arange(6), proxy]) / np.exp(logits).sum(axis=1)
    np.testing.assert_allclose(p_i2t, expected, rtol=1e-5)
    # text -> image: the other images sharing the proxy are not negatives.
    scores = 5.0 * u.astype(np.float64) @ v.T.astype(np.float64)
    for i in range(6):
        keep = (proxy != proxy[i]) | (np.arange(6) == i)
        assert p_t2i[i] == pytest.approx(
            np.exp(scores[i, i]) / np.exp(scores[keep, i]).sum(), rel=1e-5
        )
    # Text direction (the images are the proxies): the same, with the roles swapped.
    images = distinct_texts[proxy]
    texts = _random_unit(6, 8, 11)
    q_i2t, q_t2i = proxy_match_probability(
        images, texts, proxy, proxy_side="image", logit_scale=5.0, batch_size=6
    )
    logits = 5.0 * texts.astype(np.float64) @ distinct_texts.T.astype(np.float64)
    expected = np.exp(logits[np.arange(6), proxy]) / np.exp(logits).sum(axis=1)
    np.testing.assert_allclose(q_t2i, expected, rtol=1e-5)
    scores = 5.0 * images.astype(np.float64) @ texts.T.astype(np.float64)
    for i in range(6):
        keep = (proxy != proxy[i]) | (np.arange(6) == i)
        assert q_i2t[i] == pytest.approx(
            np.exp(scores[i, i]) / np.exp(scores[i, keep]).sum(), rel=1e-5
        )


@given(
    rows=st.integers(1, 30),
    dim=st.integers(2, 8),
    seed=st.integers(0, 10_000),
    gamma=st.floats(0.5, 3.0),
    beta=st.floats(0.05, 0.9),
)
@settings(max_examples=60, deadline=None)
def test_sps_proxy_zero_below_beta_over_gamma(rows, dim, seed, gamma, beta):
    arrays = [_random_unit(rows, dim, seed + i) for i in range(6)]
    rng = np.random.default_rng(seed)
    ids_img, ids_txt = rng.integers(0, 5, rows), rng.integers(0, 5, rows)
    out = sps_proxy_labels(
        arrays[0], arrays[1], ids_img, arrays[2], arrays[3], ids_txt, arrays[4], arrays[5],
        logit_scale=20.0, gamma=gamma, beta=beta, batch_size=8,
    )  # fmt: skip
    for direction in ("img", "txt"):
        label, similarity = out[f"y_p_{direction}"], out[f"s_{direction}"]
        assert np.all((label >= 0) & (label <= 1))
        assert np.all((label == 0) | (label >= np.float32(beta) - 1e-6))
        below = similarity < beta / gamma * (1 - 1e-6)
        assert np.all(label[below] == 0)
        assert np.all(label[similarity <= 0] == 0)


def test_sps_in_memory_proxies_and_empty_reliable_set(blobs):
    u, v, is_noisy, loss, _ = blobs
    is_reliable = ~is_noisy & (loss <= np.quantile(loss, 0.5))
    prob = np.select([is_reliable, is_noisy], [1.0, 0.0], 0.7).astype(np.float32)
    captions = np.array([f"caption {i}" for i in range(len(u))], dtype=object)
    params = SpsLabelsConfig()
    out = label_in_memory("sps", params, u=u, v=v, loss=loss, prob=prob, captions=captions)
    proxies = out.labels.proxies
    noisy_rows = np.flatnonzero(is_noisy)
    np.testing.assert_array_equal(proxies["rows"], noisy_rows)
    image_proxy = proxies["image_proxy_key"].astype(int)
    assert np.all(is_reliable[image_proxy])
    assert np.all(is_reliable[proxies["text_proxy_key"].astype(int)])
    # The proxy caption of a noisy image is the caption of its nearest reliable image.
    nearest = np.flatnonzero(is_reliable)[np.argmax(u[noisy_rows] @ u[is_reliable].T, axis=1)]
    assert np.mean(image_proxy == nearest) > 0.99
    assert proxies["image_proxy_caption"].tolist() == captions[image_proxy].tolist()
    for direction in ("img", "txt"):
        label, similarity = proxies[f"y_p_{direction}"], proxies[f"s_{direction}"]
        assert (label > 0).any() and np.all((label == 0) | (label >= 0.5))
        assert np.all(label <= similarity + 1e-6)  # y_p = P^ x S with P^ <= 1
    soft = out.labels.soft_label
    assert np.all(soft[is_reliable] == 1) and np.all(soft[is_noisy] == 0)
    quasi = ~is_reliable & ~is_noisy
    assert np.all(soft[quasi] >= 0.7 - 1e-6)
    empty = label_in_memory("sps", params, u=u, v=v, loss=loss, prob=np.minimum(prob, 0.9))
    assert np.all(empty.labels.proxies["image_proxy_key"] == None)  # noqa: E711
    np.testing.assert_array_equal(empty.labels.proxies["y_p_img"], 0.0)
    np.testing.assert_array_equal(empty.labels.proxies["y_p_txt"], 0.0)


# ---------------------------------------------------------------------------------------------
# Cosine baseline and registry
# ---------------------------------------------------------------------------------------------


def test_cosine_labels_are_the_clipped_cosine(blobs):
    """The CLIP-score weight: the cosine itself where positive, 0 below (not (1 + cos) / 2,
    which weighs every pair 0.5-0.75)."""
    u, v, is_noisy, _, _ = blobs
    labels = cosine_labels(u, v)
    raw = (u.astype(np.float64) * v).sum(axis=1)
    assert labels.dtype == np.float32
    np.testing.assert_allclose(labels, np.maximum(raw, 0.0), atol=1e-6)
    assert (raw < 0).any() and np.all(labels[raw < 0] == 0)
    positive = raw > 0  # the ranking of positive cosines is kept
    assert roc_auc_score(~is_noisy[positive], labels[positive]) == pytest.approx(
        roc_auc_score(~is_noisy[positive], raw[positive]), abs=1e-6
    )


@pytest.mark.parametrize("name", sorted(LABEL_METHODS))
def test_every_registered_method_labels_a_corpus(name, blobs):
    """Each entry runs end to end in memory and fills exactly the columns it declares; the
    config accepts its name and its training target exists."""
    u, v, is_noisy, loss, _ = blobs
    entry = LABEL_METHODS[name]
    params = getattr(LabelsConfig(method=name), name, None)
    clean = (~is_noisy).astype(np.float32)
    out = label_in_memory(
        name, params, u=u, v=v, loss=loss, prob=clean, alpha_i2t=clean, alpha_t2i=clean
    )
    soft = out.labels.soft_label
    assert soft.dtype == np.float32 and soft.shape == (len(u),)
    assert np.all((soft >= 0) & (soft <= 1))
    assert roc_auc_score(~is_noisy, soft) >= 0.9
    assert set(out.labels.scores) == set(entry.score_columns)
    assert (out.labels.proxies is not None) == entry.proxy_table
    assert entry.training_target in TRAINING_TARGETS
    assert set(entry.score_columns) <= set(SCORE_COLUMNS)
    from pipeline.io.labels import LABELS_SCHEMA

    assert set(SCORE_COLUMNS) <= set(LABELS_SCHEMA.names)


def test_a_new_method_is_one_module_and_one_entry(monkeypatch, blobs):
    """The worked example of docs/methods.md §4.4: the mixture posterior as the label."""
    from pipeline.core.labels import LabelMethod
    from pipeline.core.labels.base import ShardLabels
    from pipeline.core.partition.decisions import NOISY, PartitionDecisions, decide_clean_split

    def decide(count, select, threshold, params):
        threshold, guard_cut, _, report = decide_clean_split(count, select, threshold=threshold)
        return PartitionDecisions(threshold=threshold, guard_cut=guard_cut), {"clean_split": report}

    def label_shard(inputs, neighbours, params):
        return ShardLabels(
            soft_label=inputs.scalars.prob.astype(np.float32),
            subset=np.where(inputs.masks.clean, CLEAN, NOISY).astype(np.int8),
        )

    entry = LabelMethod(
        name="posterior",
        decide=decide,
        index_role=lambda params: None,
        label_shard=label_shard,
        score_columns=(),
        training_target="weights",
    )
    monkeypatch.setitem(LABEL_METHODS, "posterior", entry)
    u, v, is_noisy, loss, _ = blobs
    prob = np.clip(1.0 - loss, 0, 1).astype(np.float32)
    prob[3] = np.nan  # a row without a finite loss: the shared rule makes it noisy, label 0
    out = label_in_memory(
        "posterior", None, u=u, v=v, loss=loss, prob=prob, shard_sizes=[999, 1001]
    )
    expected = np.where(np.isfinite(prob), prob, 0.0)
    np.testing.assert_array_equal(out.labels.soft_label, expected)
    assert out.labels.subset[3] == NOISY and out.partition["clean_split"]["n_invalid"] == 1


@settings(max_examples=50, deadline=None)
@given(
    p=st.lists(st.floats(0, 1), min_size=2, max_size=50),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_label_grows_with_posterior_and_consistency(p, seed):
    from pipeline.core.labels.bicro import fused_labels

    rng = np.random.default_rng(seed)
    p = np.array(p)
    r1, r2 = rng.uniform(0, 1, p.size), rng.uniform(0, 1, p.size)
    anchor = rng.random(p.size) < 0.2
    y = fused_labels(p, r1, r2, anchor)
    assert y.dtype == np.float32 and np.all((y >= 0) & (y <= 1))
    assert np.all(y[anchor] == 1)
    assert np.all(y >= np.float32(p) - 1e-6)  # never below the posterior
    assert np.all(fused_labels(np.minimum(p + 0.1, 1), r1, r2, anchor) >= y - 1e-6)
    assert np.all(fused_labels(p, np.minimum(r1 + 0.1, 1), r2, anchor) >= y - 1e-6)


def test_fused_bicro_keeps_the_ranking_uncut(blobs):
    u, v, is_noisy, loss, _ = blobs
    prob = np.clip(1.5 - loss, 0, 1).astype(np.float32)  # a graded posterior
    step = label_in_memory("bicro", BicroLabelsConfig(), u=u, v=v, loss=loss, prob=prob)
    fused = label_in_memory(
        "bicro", BicroLabelsConfig(label="fused"), u=u, v=v, loss=loss, prob=prob
    )
    y = fused.labels.soft_label
    assert np.any((y > 0) & (y <= 0.5))  # no theta cut on the published label
    assert np.all(y >= prob - 1e-6)  # never below the posterior
    assert roc_auc_score(~is_noisy, y) >= roc_auc_score(~is_noisy, step.labels.soft_label) - 0.01
    np.testing.assert_array_equal(fused.labels.scores["bicro"], y)
