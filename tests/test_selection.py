"""`pipeline.core.selection` against brute-force references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.core.selection import (
    fused_rank,
    kept_count,
    neg_clip_loss,
    rank_fusion,
    rank_grid,
    top_fraction,
)


@pytest.mark.parametrize(("fraction", "n", "kept"), [(0.3, 10, 3), (0.25, 10, 3), (0.5, 7, 4),
                                                     (1.0, 5, 5), (0.01, 10, 0)])  # fmt: skip
def test_kept_count_rounds_half_up(fraction, n, kept):
    assert kept_count(fraction, n) == kept


def test_kept_count_refuses_a_fraction_outside_0_1():
    for fraction in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="must be in"):
            kept_count(fraction, 10)


def test_top_fraction_breaks_ties_by_key_and_never_keeps_nan():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, 50).astype(float)  # many ties
    scores[[3, 17]] = np.nan
    keys = np.array([f"{i:04d}" for i in rng.permutation(50)])
    for fraction in (0.1, 0.3, 0.5, 0.97, 1.0):
        mask = top_fraction(scores, keys, fraction)
        ranked = sorted(
            (i for i in range(50) if not math.isnan(scores[i])), key=lambda i: (-scores[i], keys[i])
        )
        expected = set(ranked[: min(kept_count(fraction, 50), 48)])
        assert set(np.flatnonzero(mask)) == expected


def _neg_clip_reference(image, text, scale, batch, repeats, seed):
    """One pair at a time: its score minus tau * mean over the partitions of its batch's two
    log-sum-exps."""
    n = len(image)
    rng = np.random.default_rng(seed)
    total = np.zeros(n)
    for _ in range(repeats):
        order = rng.permutation(n)
        batches = [list(order[s : s + batch]) for s in range(0, n - batch + 1, batch)]
        batches[-1] += list(order[len(batches) * batch :])
        for rows in batches:
            for i in rows:
                row = math.log(sum(math.exp(scale * image[i] @ text[j]) for j in rows))
                col = math.log(sum(math.exp(scale * image[j] @ text[i]) for j in rows))
                total[i] += 0.5 * (row + col)
    return np.einsum("nd,nd->n", image, text) - total / (repeats * scale)


def test_neg_clip_loss_matches_the_reference():
    rng = np.random.default_rng(1)
    image = rng.normal(size=(23, 8))
    text = image + 0.5 * rng.normal(size=(23, 8))
    image /= np.linalg.norm(image, axis=1, keepdims=True)
    text /= np.linalg.norm(text, axis=1, keepdims=True)
    got = neg_clip_loss(image, text, 10.0, batch_size=6, repeats=3, seed=2)
    np.testing.assert_allclose(got, _neg_clip_reference(image, text, 10.0, 6, 3, 2), rtol=1e-9)


def test_neg_clip_loss_demotes_a_caption_that_matches_many_images():
    q, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(32, 32)))
    image, text = q[:23], q[:23].copy()  # orthonormal images, each caption its own image
    text[5] = 0.5 * image[:12].sum(axis=0) + 0.5 * image[5]  # image 5, and 11 others half
    text[7] = image[7] + 1.8 * q[30]  # names image 7 vaguely, and nothing else
    text /= np.linalg.norm(text, axis=1, keepdims=True)
    cosine = np.einsum("nd,nd->n", image, text)
    got = neg_clip_loss(image, text, 10.0, batch_size=23, repeats=1)
    assert cosine[5] > cosine[7] and got[5] < got[7]


def test_rank_fusion_is_the_mean_percentile_rank():
    a = np.array([0.1, 0.9, 0.5, 0.5])
    b = np.array([4.0, 1.0, 3.0, 2.0])
    np.testing.assert_allclose(
        rank_fusion(a, b), [(0.25 + 1.0) / 2, (1.0 + 0.25) / 2, (0.625 + 0.75) / 2, 0.5625]
    )


def test_fused_rank_orders_as_rank_fusion_ties_included():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 20, 300).astype(np.float32)  # many ties
    b = rng.normal(size=300).astype(np.float32)
    fused = fused_rank([(a, rank_grid(a)), (b, rank_grid(b))])
    reference = rank_fusion(a, b)
    # rank_fusion = sum of (left + right + 1) / 2 over 2 scores, / (2 N): fused = 4 N r - 2
    np.testing.assert_array_equal(fused, np.round(reference * 4 * 300).astype(np.int64) - 2)


def test_fused_rank_on_a_coarse_grid_stays_within_its_resolution_and_never_keeps_nan():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(2, 5000)).astype(np.float32)
    a[7] = np.nan
    grids = [(a, rank_grid(a, size=101)), (b, rank_grid(b, size=101))]
    assert len(grids[0][1]) == 101 and grids[0][1][0] == np.nanmin(a)
    fused = fused_rank(grids)
    assert fused[7] == -1
    finite = ~np.isnan(a)
    exact = rank_fusion(a[finite], b[finite])
    approx = fused[finite] / (2 * 2 * 101)  # mean of the two percentile ranks on the grid
    assert np.abs(approx - exact).max() < 2 / 101
