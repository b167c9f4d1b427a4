"""BiCro on centred embeddings (`labels.bicro.centre`, pipeline.core.labels.centring): exact
corpus means whatever the sharding, labels equal to a brute-force numpy reference, and the
reason for the option, a near-collapsed space where raw cosines fold to ~1 for every pair."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.config import BicroLabelsConfig
from pipeline.core.labels.bicro import fold
from pipeline.core.labels.centring import centre, corpus_means, embedding_sums, merge_sums
from pipeline.core.labels.in_memory import label_in_memory


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _collapsed_blobs(n=1200, dim=24, clusters=30, noise=0.3, offset=4.0, seed=0):
    """Clustered pairs, a `noise` share of captions rotated among themselves, then every
    embedding pushed towards one shared direction per modality (a near-collapsed space)."""
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((clusters, dim)))
    cluster = rng.integers(0, clusters, n)
    u = centers[cluster] + 0.6 * rng.standard_normal((n, dim)) / math.sqrt(dim)
    v = centers[cluster] + 0.6 * rng.standard_normal((n, dim)) / math.sqrt(dim)
    noisy = rng.choice(n, int(noise * n), replace=False)
    v[noisy] = v[np.roll(noisy, 1)]
    is_noisy = np.zeros(n, dtype=bool)
    is_noisy[noisy] = True
    u = _unit(_unit(u) + offset * _unit(rng.standard_normal((1, dim))))
    v = _unit(_unit(v) + offset * _unit(rng.standard_normal((1, dim))))
    loss = (1.0 - (u * v).sum(axis=1)).astype(np.float32)
    is_clean = ~is_noisy & (rng.random(n) < 0.8)  # an imperfect split, as a mixture gives
    return u, v, is_noisy, loss, is_clean


@pytest.fixture(scope="module")
def collapsed():
    return _collapsed_blobs()


def _bicro(u, v, loss, is_clean, params, **options):
    return label_in_memory(
        "bicro", params, u=u, v=v, loss=loss, prob=is_clean.astype(np.float32), **options
    )


def test_sums_are_exact_whatever_the_sharding():
    rng = np.random.default_rng(3)
    u = _unit(rng.standard_normal((500, 16)))
    v = _unit(rng.standard_normal((500, 16)))
    u[7] = np.nan  # a row with a non-finite embedding counts on neither side
    whole = embedding_sums(u, v)
    cuts = np.sort(rng.choice(np.arange(1, 500), 6, replace=False))
    parts = [
        embedding_sums(a, b) for a, b in zip(np.split(u, cuts), np.split(v, cuts), strict=True)
    ]
    merged = merge_sums(parts[::-1])
    assert merged.rows == whole.rows == 499
    np.testing.assert_array_equal(merged.u, whole.u)
    np.testing.assert_array_equal(merged.v, whole.v)
    mean_u, mean_v = corpus_means(merged)
    keep = np.isfinite(u).all(axis=1)
    np.testing.assert_allclose(mean_u, u[keep].astype(np.float64).mean(axis=0), atol=1e-9)
    np.testing.assert_allclose(mean_v, v[keep].astype(np.float64).mean(axis=0), atol=1e-9)


def test_centre_renormalises_and_keeps_degenerate_rows_visible():
    x = np.array([[1.0, 0.0], [0.6, 0.8], [np.nan, 0.0]], np.float32)
    out = centre(x, x[1].astype(np.float64))
    np.testing.assert_allclose(out[0], np.array([0.4, -0.8]) / math.hypot(0.4, 0.8), rtol=1e-5)
    np.testing.assert_array_equal(out[1], [0.0, 0.0])  # the mean itself: no direction
    assert np.isnan(out[2]).all()
    with pytest.raises(ValueError, match="no finite embedding"):
        corpus_means(embedding_sums(x[2:], x[2:]))


def test_centred_labels_match_a_brute_force_reference(collapsed):
    u, v, _, loss, is_clean = collapsed
    out = _bicro(u, v, loss, is_clean, BicroLabelsConfig(centre=True, theta=0.0))
    cu = _unit(u - u.astype(np.float64).mean(axis=0))
    cv = _unit(v - v.astype(np.float64).mean(axis=0))
    clean_rows = np.flatnonzero(is_clean)
    order = np.lexsort((clean_rows, loss[clean_rows]))
    anchors = clean_rows[order[: math.ceil(0.1 * clean_rows.size)]]
    np.testing.assert_array_equal(np.flatnonzero(out.masks.anchor), np.sort(anchors))
    queried = ~out.masks.anchor
    a_img = anchors[np.argmax(cu[queried] @ cu[anchors].T, axis=1)]
    a_txt = anchors[np.argmax(cv[queried] @ cv[anchors].T, axis=1)]
    r_i2t = fold((cu[queried] * cu[a_img]).sum(1), (cv[queried] * cv[a_img]).sum(1))
    r_t2i = fold((cv[queried] * cv[a_txt]).sum(1), (cu[queried] * cu[a_txt]).sum(1))
    c = 0.5 * (r_i2t + r_t2i)
    expected = np.where(is_clean[queried], 0.5 + 0.5 * c, c)
    np.testing.assert_allclose(out.labels.scores["bicro"][queried], expected, atol=1e-5)
    assert np.mean(out.labels.image_anchor_key[queried].astype(int) == a_img) > 0.99


def test_centred_labels_do_not_depend_on_shards_or_index_stores(collapsed):
    u, v, _, loss, is_clean = collapsed
    params = BicroLabelsConfig(centre=True, label="fused")
    one = _bicro(u, v, loss, is_clean, params)
    split = _bicro(u, v, loss, is_clean, params, shard_sizes=[500, 0, 700], index_stores=3)
    np.testing.assert_array_equal(split.labels.soft_label, one.labels.soft_label)
    np.testing.assert_array_equal(split.labels.text_anchor_key, one.labels.text_anchor_key)


def test_centring_restores_the_cut_a_collapsed_space_defeats(collapsed):
    """Raw cosines all sit near 1 in the collapsed space, so the fold calls every mismatched
    pair consistent and BiCro* (theta 0.5) keeps them all; the ranking (AUROC) hides this.
    Centred, the cut drops them again, as it does in the same space before the collapse."""
    u, v, is_noisy, _, is_clean = collapsed
    assert (u @ u[:50].T).min() > 0.8  # the collapse the option is for
    before = _collapsed_blobs(offset=0.0)  # the same pairs and split, not collapsed
    np.testing.assert_array_equal(before[2], is_noisy)

    def kept(params, corpus):
        u, v, _, loss, _ = corpus
        star = _bicro(u, v, loss, is_clean, params).labels.soft_label
        return (star[is_noisy] > 0).mean()

    assert kept(BicroLabelsConfig(), collapsed) > 0.9
    assert kept(BicroLabelsConfig(centre=True), collapsed) < 0.1
    assert kept(BicroLabelsConfig(), before) < 0.1
