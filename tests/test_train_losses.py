"""Training losses against naive references and their invariants (docs/methods.md §10.5, §11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.losses.per_sample import infonce_per_sample
from pipeline.core.losses.training import (
    SOFT_MARGINS,
    co_positive_mask,
    select_small_loss,
    soft_margin,
    soft_margin_triplet,
    sps_consistency_losses,
    symmetric_infonce,
    weighted_infonce,
)


def _unit(rows: int, dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=1).to(dtype)


def _naive_soft_triplet(u: torch.Tensor, v: torch.Tensor, margins) -> np.ndarray:
    """Loop form of docs/methods.md §10.5 with the margin of the query's own pair i."""
    s = (u.double() @ v.double().T).numpy()
    b = s.shape[0]
    out = np.zeros(b)
    for i in range(b):
        negatives = [j for j in range(b) if j != i]
        if not negatives:
            continue
        out[i] += max(max(0.0, margins[i] - s[i, i] + s[i, j]) for j in negatives)
        out[i] += max(max(0.0, margins[i] - s[i, i] + s[j, i]) for j in negatives)
    return out


# ------------------------------------------------------------------------------------------
# Warm-up selection
# ------------------------------------------------------------------------------------------


@given(b=st.integers(1, 200), seed=st.integers(0, 10_000), ratio=st.floats(0.01, 1.0))
@settings(max_examples=80, deadline=None)
def test_selection_keeps_exactly_floor_ratio_b_lowest(b, seed, ratio):
    rng = np.random.default_rng(seed)
    loss = torch.from_numpy(rng.integers(0, 5, size=b).astype(np.float32))  # many ties
    mask = select_small_loss(loss, ratio)
    k = max(1, math.floor(ratio * b + 1e-9))
    assert mask.dtype == torch.bool and mask.shape == (b,) and int(mask.sum()) == k
    want = sorted(range(b), key=lambda i: (float(loss[i]), i))[:k]  # ties by index
    assert torch.nonzero(mask).reshape(-1).tolist() == sorted(want)


def test_selection_default_ratio_and_edge_cases():
    loss = torch.tensor([5.0, 1.0, 3.0, 0.5, 4.0, 2.0, 9.0, 8.0, 7.0, 6.0])
    assert torch.nonzero(select_small_loss(loss)).reshape(-1).tolist() == [1, 3, 5]  # 0.3*10 = 3
    assert select_small_loss(torch.tensor([0.1, 0.2]), 0.3).tolist() == [True, False]  # >= 1
    assert select_small_loss(torch.zeros(0)).shape == (0,)
    assert int(select_small_loss(torch.ones(100), 0.29).sum()) == 29  # no float off-by-one
    nan_first = torch.tensor([float("nan"), 3.0, 2.0])
    assert select_small_loss(nan_first, 0.67).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="ratio"):
        select_small_loss(loss, 0.0)


# ------------------------------------------------------------------------------------------
# InfoNCE, plain and weighted
# ------------------------------------------------------------------------------------------


@given(b=st.integers(1, 16), seed=st.integers(0, 10_000), scale=st.floats(1.0, 100.0))
@settings(max_examples=40, deadline=None)
def test_weighted_infonce_with_unit_weights_is_symmetric_infonce(b, seed, scale):
    u, v = _unit(b, 8, seed), _unit(b, 8, seed + 1)
    plain = symmetric_infonce(u, v, scale)
    torch.testing.assert_close(weighted_infonce(u, v, scale, torch.ones(b)), plain)
    i2t, t2i = infonce_per_sample(u, v, scale)
    torch.testing.assert_close(plain, 0.5 * (i2t.mean() + t2i.mean()))
    w = torch.rand(b, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(weighted_infonce(u, v, scale, w), (w * 0.5 * (i2t + t2i)).sum() / b)


def test_symmetric_infonce_gradient_reaches_a_tensor_logit_scale():
    u = _unit(6, 8, 0).requires_grad_()
    v = _unit(6, 8, 1).requires_grad_()
    log_scale = torch.tensor(math.log(1 / 0.07), requires_grad=True)
    symmetric_infonce(u, v, log_scale.exp()).backward()
    assert log_scale.grad is not None and torch.isfinite(log_scale.grad)
    assert u.grad is not None and v.grad is not None


def test_zero_weight_removes_positive_term_but_keeps_the_pair_as_negative():
    b, k, scale = 5, 2, 10.0
    # With identity texts the logits are scale * image_emb, so image_emb.grad is the logits'
    # gradient (times scale): entry (i, j) is dL/dz_ij.
    logits_param = torch.randn(b, b, generator=torch.Generator().manual_seed(0))
    logits_param.requires_grad_()
    weights = torch.ones(b)
    weights[k] = 0.0
    weighted_infonce(logits_param, torch.eye(b), scale, weights).backward()
    grad = logits_param.grad
    # z_kk enters only pair k's own two terms: no gradient once its weight is 0.
    assert grad[k, k] == 0.0
    # Text k is a negative in every other image's row, image k in every other text's column.
    others = [i for i in range(b) if i != k]
    assert (grad[others, k].abs() > 0).all()
    assert (grad[k, others].abs() > 0).all()

    # Same with real embeddings: pair k's text still receives gradient via the others' rows.
    u = _unit(b, 8, 1).requires_grad_()
    v = _unit(b, 8, 2).requires_grad_()
    weighted_infonce(u, v, scale, weights).backward()
    assert v.grad[k].abs().sum() > 0 and u.grad[k].abs().sum() > 0

    # And the loss equals the others' terms only, with pair k left in their denominators.
    i2t, t2i = infonce_per_sample(u.detach(), v.detach(), scale)
    want = 0.5 * (i2t + t2i)[others].sum() / b
    torch.testing.assert_close(weighted_infonce(u.detach(), v.detach(), scale, weights), want)


def test_weights_are_constants_and_shape_checked():
    u, v = _unit(4, 8, 0).requires_grad_(), _unit(4, 8, 1)
    w = torch.full((4,), 0.5, requires_grad=True)
    weighted_infonce(u, v, 10.0, w).backward()
    assert w.grad is None and u.grad is not None  # labels are targets, not parameters
    with pytest.raises(ValueError, match="weights"):
        weighted_infonce(u, v, 10.0, torch.ones(3))


# ------------------------------------------------------------------------------------------
# Soft margin and the soft-margin triplet
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SOFT_MARGINS))
@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_soft_margin_endpoints_and_monotone(kind, alpha):
    y = torch.linspace(0, 1, 101)
    margin = soft_margin(y, alpha=alpha, kind=kind)
    assert margin[0].item() == pytest.approx(0.0, abs=1e-7)
    assert margin[-1].item() == pytest.approx(alpha, abs=1e-6)
    assert (margin.diff() >= -1e-7).all() and margin.dtype == torch.float32
    # Out-of-range labels are clamped, as in the references.
    torch.testing.assert_close(soft_margin(torch.tensor([-1.0, 2.0]), alpha, kind), margin[[0, -1]])


def test_soft_margin_exponential_is_bicro_formula():
    y = torch.tensor([0.0, 0.5, 0.9, 1.0])
    want = 0.2 * (10.0**y - 1) / 9
    torch.testing.assert_close(soft_margin(y), want)
    with pytest.raises(ValueError, match="unknown soft margin"):
        soft_margin(y, kind="cubic")
    with pytest.raises(ValueError, match="m="):
        soft_margin(y, m=1.0)


@given(b=st.integers(1, 12), seed=st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_soft_triplet_matches_naive_reference(b, seed):
    u, v = _unit(b, 6, seed), _unit(b, 6, seed + 5)
    margins = soft_margin(torch.rand(b, generator=torch.Generator().manual_seed(seed)))
    per_sample = soft_margin_triplet(u, v, margins, reduction="none")
    want = _naive_soft_triplet(u, v, margins.tolist())
    np.testing.assert_allclose(per_sample.numpy(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(soft_margin_triplet(u, v, margins), per_sample.sum())


@given(b=st.integers(2, 16), seed=st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_soft_triplet_is_permutation_equivariant(b, seed):
    u, v = _unit(b, 8, seed), _unit(b, 8, seed + 3)
    gen = torch.Generator().manual_seed(seed)
    margins = 0.5 * torch.rand(b, generator=gen)
    perm = torch.randperm(b, generator=gen)
    base = soft_margin_triplet(u, v, margins, reduction="none")
    permuted = soft_margin_triplet(u[perm], v[perm], margins[perm], reduction="none")
    torch.testing.assert_close(permuted, base[perm])


def test_soft_triplet_indexes_the_margin_by_the_query_not_the_negative():
    # Pair 0 is clean (margin 0.2), pair 1 a mismatch (margin 0). The buggy reference broadcasts
    # the (B,) margin over columns in both directions, so image 0's cost against text 1 uses
    # text 1's margin 0.
    u = torch.eye(2)
    v = torch.tensor([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)]])
    margins = torch.tensor([0.2, 0.0])
    got = soft_margin_triplet(u, v, margins, reduction="none")
    np.testing.assert_allclose(got.numpy(), _naive_soft_triplet(u, v, [0.2, 0.0]), atol=1e-6)

    scores = u @ v.T
    diagonal = torch.eye(2, dtype=torch.bool)
    buggy_i2t = (margins - scores.diagonal()[:, None] + scores).clamp(min=0)  # (B,) over columns
    buggy_i2t = buggy_i2t.masked_fill(diagonal, 0).amax(dim=1)
    fixed_i2t = (margins[:, None] - scores.diagonal()[:, None] + scores).clamp(min=0)
    fixed_i2t = fixed_i2t.masked_fill(diagonal, 0).amax(dim=1)
    assert buggy_i2t[0] == pytest.approx(0.0, abs=1e-6)  # 0 - 1 + 0.95 < 0: no violation seen
    assert fixed_i2t[0] == pytest.approx(0.15, abs=1e-6)  # 0.2 - 1 + 0.95 with its own margin
    assert got[0] >= 0.15 - 1e-6


def test_soft_triplet_zero_margin_and_single_pair():
    u, v = _unit(4, 8, 0), _unit(4, 8, 1)
    assert soft_margin_triplet(u[:1], v[:1], torch.tensor([0.2])).item() == 0.0
    same = _unit(4, 8, 2)  # perfectly aligned pairs, distinct rows: nothing violates margin 0
    assert soft_margin_triplet(same, same, torch.zeros(4)).item() == 0.0
    with pytest.raises(ValueError, match="margins"):
        soft_margin_triplet(u, v, torch.zeros(4, 1))
    with pytest.raises(ValueError, match="reduction"):
        soft_margin_triplet(u, v, torch.zeros(4), reduction="mean")


# ------------------------------------------------------------------------------------------
# SPS consistency losses
# ------------------------------------------------------------------------------------------


def test_sps_losses_match_definitions():
    u, v = _unit(6, 8, 0), _unit(6, 8, 1)
    l_cro, l_met = sps_consistency_losses(u, v)
    s = u.double() @ v.double().T
    want_cro = ((s - s.T) ** 2).mean()
    want_met = ((u.double() @ u.double().T - v.double() @ v.double().T) ** 2).mean()
    assert l_cro.item() == pytest.approx(want_cro.item(), rel=1e-5)
    assert l_met.item() == pytest.approx(want_met.item(), rel=1e-5)
    hinge_cro, _ = sps_consistency_losses(u, v, margin=0.1, squared=False)
    assert hinge_cro.item() == pytest.approx(((s - s.T).abs() - 0.1).clamp(min=0).mean().item())


def test_sps_losses_vanish_on_symmetric_similarity_and_equal_embeddings():
    u = _unit(7, 8, 3)
    # u = v: the cross matrix u uᵀ is symmetric and the two Gram matrices coincide.
    l_cro, l_met = sps_consistency_losses(u, u)
    assert l_cro.item() == pytest.approx(0.0, abs=1e-12) and l_met.item() == pytest.approx(0.0)
    # A symmetric cross matrix with u != v: v = u R with R symmetric -> u R uᵀ is symmetric.
    r = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    l_cro, l_met = sps_consistency_losses(u, u @ (r + r.T))
    assert l_cro.item() == pytest.approx(0.0, abs=1e-10) and l_met.item() > 0


# ------------------------------------------------------------------------------------------
# Low precision at CLIP's logit scale
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_losses_finite_at_logit_scale_100_in_half_precision(dtype):
    b = 32
    u = _unit(b, 16, 0, dtype).requires_grad_()
    for v in (_unit(b, 16, 1, dtype), u.detach().clone(), u.detach()[:1].expand(b, 16)):
        v = v.clone().requires_grad_()
        losses = [
            symmetric_infonce(u, v, 100.0),
            weighted_infonce(u, v, torch.tensor(100.0, dtype=dtype), torch.rand(b)),
            soft_margin_triplet(u, v, soft_margin(torch.rand(b))),
            *sps_consistency_losses(u, v),
        ]
        for loss in losses:
            assert loss.dtype == torch.float32 and torch.isfinite(loss)
        sum(losses).backward()
        assert torch.isfinite(u.grad.float()).all() and torch.isfinite(v.grad.float()).all()
        u.grad = None


def test_duplicate_proxy_captions_are_not_negatives_of_each_other():
    # Rows 1 and 2 are two noisy images trained with the same proxy caption (same text source);
    # row 3 is the proxy caption's own reliable pair. Masked, each duplicate's loss equals its
    # loss in the batch with the other copies removed.
    u = _unit(5, 8, seed=3)
    v = _unit(5, 8, seed=4)
    v[2] = v[1]
    v[3] = v[1]
    text_groups = torch.tensor([10, 11, 11, 11, 14])
    image_groups = torch.arange(5)
    mask = co_positive_mask(image_groups, text_groups)
    assert mask.sum() == 6 and not mask.diagonal().any()
    scale = 10.0
    for row, others in ((1, [0, 4]), (2, [0, 4]), (3, [0, 4])):
        keep = [row, *others]
        i2t, t2i = infonce_per_sample(u[keep], v[keep], scale)
        want = 0.5 * (i2t[0] + t2i[0])
        weights = torch.zeros(5)
        weights[row] = 5.0  # the loss divides by B = 5
        got = weighted_infonce(u, v, scale, weights, co_positive_mask(image_groups, text_groups))
        torch.testing.assert_close(got, want)
    # Unmasked, the copies cap each other: the loss of a duplicate is higher.
    weights = torch.zeros(5)
    weights[1] = 5.0
    assert weighted_infonce(u, v, scale, weights) > weighted_infonce(u, v, scale, weights, mask)
    # Distinct sources: the mask is all False and the loss is the plain one.
    distinct = co_positive_mask(torch.arange(5), torch.arange(5))
    assert not distinct.any()
    ones = torch.ones(5)
    torch.testing.assert_close(
        weighted_infonce(u, v, scale, ones, distinct), weighted_infonce(u, v, scale, ones)
    )
    assert co_positive_mask(None, None) is None


def test_soft_triplet_never_takes_a_co_positive_as_hardest_negative():
    u = _unit(4, 8, seed=5)
    v = _unit(4, 8, seed=6)
    v[1] = v[0]  # rows 0 and 1 carry the same proxy caption
    mask = co_positive_mask(None, torch.tensor([7, 7, 8, 9]))
    margins = torch.full((4,), 0.2)
    masked = soft_margin_triplet(u, v, margins, reduction="none", co_positives=mask)
    keep = [0, 2, 3]
    alone = soft_margin_triplet(u[keep], v[keep], margins[keep], reduction="none")
    torch.testing.assert_close(masked[0], alone[0])


def test_the_objective_names_sps_consistency_only_for_sps_targets():
    """L_cro / L_met only see SPS's reliable rows, so another method's objective does not
    claim them, whatever train.sps's weights say."""
    from pipeline.models import ModelSpec
    from pipeline.stages.train import TrainSpec, ViewSpec
    from pipeline.stages.train.loop import objective_name

    def spec(target: str) -> TrainSpec:
        view = ViewSpec(name="A", init=ModelSpec("ncl-tiny", None, "fp32"), seed=0, target=target)
        return TrainSpec("/out", 1, (view,), (), {}, round_kind="labels")

    assert objective_name(spec("sps"), False) == "weighted InfoNCE + SPS consistency"
    assert objective_name(spec("weights"), False) == "weighted InfoNCE"
    assert objective_name(spec("rematch"), False) == "weighted InfoNCE"
