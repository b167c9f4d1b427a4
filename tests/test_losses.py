"""Per-sample losses against naive references (docs/methods.md §1, §11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.losses.per_sample import (
    batched_losses,
    fixed_size_loss_batches,
    infonce_per_sample,
    triplet_per_sample,
)


def _unit(rows: int, dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=1)


def _naive_infonce(u, v, scale):
    b = u.shape[0]
    i2t, t2i = [], []
    for i in range(b):
        row = [math.exp(scale * float(u[i] @ v[j])) for j in range(b)]
        col = [math.exp(scale * float(u[j] @ v[i])) for j in range(b)]
        i2t.append(-math.log(row[i] / sum(row)))
        t2i.append(-math.log(col[i] / sum(col)))
    return np.array(i2t), np.array(t2i)


def _naive_triplet(u, v, margin):
    b = u.shape[0]
    s = (u @ v.T).numpy()
    out = np.zeros(b)
    for i in range(b):
        for j in range(b):
            if j != i:
                out[i] += max(0.0, margin - s[i, i] + s[i, j]) / b
                out[i] += max(0.0, margin - s[i, i] + s[j, i]) / b
    return out


@given(
    b=st.integers(2, 12),
    d=st.integers(2, 16),
    seed=st.integers(0, 10_000),
    scale=st.floats(1.0, 20.0),
)
@settings(max_examples=40, deadline=None)
def test_infonce_matches_naive_reference(b, d, seed, scale):
    u, v = _unit(b, d, seed), _unit(b, d, seed + 1)
    i2t, t2i = infonce_per_sample(u, v, scale)
    ref_i2t, ref_t2i = _naive_infonce(u, v, scale)
    assert i2t.dtype == torch.float32
    np.testing.assert_allclose(i2t.numpy(), ref_i2t, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(t2i.numpy(), ref_t2i, rtol=1e-4, atol=1e-4)


@given(b=st.integers(2, 64), d=st.integers(2, 32), seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_infonce_finite_at_clip_scale_even_for_identical_embeddings(b, d, seed):
    u = _unit(b, d, seed).float()
    for v in (u, u[:1].expand(b, d).contiguous()):  # identical pairs; all-identical texts
        i2t, t2i = infonce_per_sample(u.half(), v.half(), 100.0)
        assert torch.isfinite(i2t).all() and torch.isfinite(t2i).all()
        assert (i2t >= -1e-4).all() and (t2i >= -1e-4).all()
    # All-identical rows: every softmax is uniform, so each loss is exactly log b.
    same = u[:1].expand(b, d)
    i2t, _ = infonce_per_sample(same, same, 100.0)
    np.testing.assert_allclose(i2t.numpy(), math.log(b), rtol=1e-5)


@given(
    b=st.integers(2, 10),
    d=st.integers(2, 12),
    seed=st.integers(0, 10_000),
    margin=st.floats(0.0, 1.0),
)
@settings(max_examples=40, deadline=None)
def test_triplet_matches_naive_reference(b, d, seed, margin):
    u, v = _unit(b, d, seed), _unit(b, d, seed + 7)
    got = triplet_per_sample(u, v, margin)
    np.testing.assert_allclose(got.numpy(), _naive_triplet(u, v, margin), rtol=1e-5, atol=1e-6)


@given(b=st.integers(2, 16), seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_losses_are_permutation_equivariant(b, seed):
    u, v = _unit(b, 8, seed), _unit(b, 8, seed + 3)
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    i2t, t2i = infonce_per_sample(u, v, 10.0)
    p_i2t, p_t2i = infonce_per_sample(u[perm], v[perm], 10.0)
    torch.testing.assert_close(p_i2t, i2t[perm])
    torch.testing.assert_close(p_t2i, t2i[perm])
    torch.testing.assert_close(triplet_per_sample(u[perm], v[perm]), triplet_per_sample(u, v)[perm])


@given(n=st.integers(1, 700), b=st.integers(2, 64), seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_fixed_size_batches_score_every_sample_once(n, b, seed):
    batches = fixed_size_loss_batches(n, b, np.random.default_rng(seed))
    scored = np.concatenate([idx[:k] for idx, k in batches])
    assert sorted(scored.tolist()) == list(range(n))
    for indices, n_scored in batches:
        assert len(indices) == (b if n >= b else n)
        assert len(set(indices.tolist())) == len(indices)  # filler never repeats a member
        assert 0 < n_scored <= len(indices)


def test_fixed_size_batches_are_seeded():
    a = fixed_size_loss_batches(1000, 256, np.random.default_rng(5))
    b = fixed_size_loss_batches(1000, 256, np.random.default_rng(5))
    c = fixed_size_loss_batches(1000, 256, np.random.default_rng(6))
    assert all((x[0] == y[0]).all() for x, y in zip(a, b, strict=True))
    assert not all((x[0] == y[0]).all() for x, y in zip(a, c, strict=True))
    assert [k for _, k in a] == [256, 256, 256, 232]


@pytest.mark.parametrize("n", [0])
def test_fixed_size_batches_empty(n):
    assert fixed_size_loss_batches(n, 8, np.random.default_rng(0)) == []


def test_batched_losses_average_the_batchings():
    """One batching gives each row its batch's own losses; several give their mean, and the
    mean over many permutations varies less than one batching does (what it is for)."""
    n, b, scale = 70, 16, 20.0
    u, v = _unit(n, 8, 0).float(), _unit(n, 8, 1).float()
    rng = np.random.default_rng(0)
    batchings = [fixed_size_loss_batches(n, b, rng) for _ in range(3)]
    single = [batched_losses(u, v, scale, [batching]) for batching in batchings]
    for batching, out in zip(batchings, single, strict=True):
        for batch_index, (indices, n_scored) in enumerate(batching):
            i2t, t2i = infonce_per_sample(u[indices], v[indices], scale)
            rows = indices[:n_scored]
            np.testing.assert_array_equal(out["i2t"][rows], i2t[:n_scored].numpy())
            np.testing.assert_array_equal(out["t2i"][rows], t2i[:n_scored].numpy())
            assert np.all(out["batch"][rows] == batch_index)
    averaged = batched_losses(u, v, scale, batchings)
    for name in ("i2t", "t2i", "triplet"):
        expected = np.mean([out[name] for out in single], axis=0)
        np.testing.assert_allclose(averaged[name], expected, rtol=1e-6)
    np.testing.assert_array_equal(averaged["batch"], single[0]["batch"])

    def spread(permutations: int) -> float:  # between two independent draws of the loss
        draws = [
            batched_losses(
                u, v, scale, [fixed_size_loss_batches(n, b, rng) for _ in range(permutations)]
            )["i2t"]
            for _ in range(2)
        ]
        return float(np.std(draws[0] - draws[1]))

    assert spread(16) < 0.5 * spread(1)


# ---------------------------------------------------------------------------------------------
# Competitor InfoNCE (labels.loss_negatives: competitors)
# ---------------------------------------------------------------------------------------------


def _brute_competitor_infonce(u, v, k, scale):
    """Every pair against the k most similar other captions / images of the whole corpus, by
    exact float64 cosines, ties by id (loops, no search)."""
    u64, v64 = u.astype(np.float64), v.astype(np.float64)
    sim = u64 @ v64.T  # (N, N): image r, caption c
    out = []
    for i in range(len(u)):
        others = np.array([j for j in range(len(u)) if j != i])
        texts = sorted(others, key=lambda j: (-sim[i, j], j))[:k]
        images = sorted(others, key=lambda j: (-sim[j, i], j))[:k]
        own = scale * sim[i, i]
        i2t = np.log(np.exp(scale * np.r_[sim[i, i], sim[i, texts]]).sum()) - own
        t2i = np.log(np.exp(scale * np.r_[sim[i, i], sim[images, i]]).sum()) - own
        out.append((i2t, t2i))
    return np.array(out).T


@pytest.mark.parametrize("stores", [1, 3])
def test_competitor_losses_match_a_brute_force_reference(stores):
    from pipeline.core.losses.competitors import competitor_losses
    from pipeline.core.search.neighbours import build_local_neighbours

    rng = np.random.default_rng(8)
    n, dim, k, scale = 70, 8, 5, 20.0
    u = rng.standard_normal((n, dim)).astype(np.float32)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    v = u + 0.8 * rng.standard_normal((n, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    v[12], u[13] = v[40], u[41]  # exact duplicates of other pairs: ties broken by id
    ids = np.arange(n, dtype=np.int64)
    neighbours = build_local_neighbours([{"ids": ids, "u": u, "v": v}], stores=stores)
    i2t, t2i = competitor_losses(neighbours, u, v, ids, k, scale, query_batch=16)
    expected_i2t, expected_t2i = _brute_competitor_infonce(u, v, k, scale)
    np.testing.assert_allclose(i2t, expected_i2t, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(t2i, expected_t2i, rtol=1e-5, atol=1e-5)
    assert i2t.dtype == np.float32 and np.all(i2t > 0) and np.all(t2i > 0)


def test_competitor_losses_edge_cases():
    """Fewer indexed rows than k: the missing terms are left out; non-finite rows get NaN; a
    swapped caption costs more against competitors than a correct pair."""
    from pipeline.core.losses.competitors import competitor_infonce, competitor_losses
    from pipeline.core.search.neighbours import build_local_neighbours

    u = np.eye(3, 4, dtype=np.float32)
    v = np.eye(3, 4, dtype=np.float32)
    v[2] = u[0]  # pair 2's caption describes pair 0's image
    u_q = np.vstack([u, np.full((1, 4), np.nan, np.float32)])
    v_q = np.vstack([v, np.zeros((1, 4), np.float32)])
    ids = np.arange(4, dtype=np.int64)
    neighbours = build_local_neighbours([{"ids": ids[:3], "u": u, "v": v}])
    i2t, t2i = competitor_losses(neighbours, u_q, v_q, ids, k=10, logit_scale=10.0)
    assert np.isnan(i2t[3]) and np.isnan(t2i[3])
    # Pair 1 against the two other captions: cosines 0 (caption 0) and 0 (caption 2).
    assert i2t[1] == pytest.approx(np.log(np.exp(10.0) + 2) - 10.0, rel=1e-5)
    assert t2i[2] > t2i[1] and i2t[0] > i2t[1]  # caption 2 competes for image 0
    none = np.full((1, 2), -np.inf)
    alone = competitor_infonce(np.array([0.3]), none, none, 10.0)
    assert alone[0][0] == 0.0 and alone[1][0] == 0.0
