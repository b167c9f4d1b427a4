"""Training losses for fine-tuning on estimated correspondence labels: pure torch, no Ray, no I/O
(docs/methods.md §10.5).

Contract:
- Every loss takes (B, D) L2-normalised image and text embeddings whose row i is pair i, in any
  float dtype, and computes in float32 with log-softmax, so CLIP's logit scale of 100 never
  overflows. The result is a float32 scalar with autograd intact (embeddings and a tensor
  `logit_scale` both receive gradients); per-sample labels, margins and weights are constants.
- The per-sample InfoNCE terms come from `pipeline.core.losses.per_sample`; this module only
  reduces them. A weight scales only the pair's own positive term; the pair stays a negative in
  every other row and column.
- Co-positives (`co_positive_mask`): rows that share an image or a text source are removed from
  each other's negatives when the caller passes per-row source ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pipeline.core.losses.per_sample import infonce_per_sample

__all__ = [
    "SOFT_MARGINS",
    "select_small_loss",
    "symmetric_infonce",
    "weighted_infonce",
    "soft_margin",
    "soft_margin_triplet",
    "sps_consistency_losses",
    "co_positive_mask",
]


def select_small_loss(per_sample_loss: torch.Tensor, ratio: float = 0.3) -> torch.Tensor:
    """BiCro warm-up selection: keep the ⌊ratio·B⌋ (at least 1) lowest-loss pairs of a batch.

    Args:
        per_sample_loss: (B,) float, e.g. `triplet_per_sample` of the batch.
        ratio: fraction kept, in (0, 1]; BiCro's scripts use 0.3 (docs/methods.md §10.2).

    Returns:
        (B,) bool mask on the loss's device, exactly k = max(1, ⌊ratio·B⌋) True (0 when B = 0).
        Equal losses are taken in index order; NaN losses are ranked last (never kept before a
        finite one).

    Raises:
        ValueError: when ratio is outside (0, 1].
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1]; got {ratio}")
    loss = per_sample_loss.detach().reshape(-1)  # (B,)
    batch = loss.shape[0]
    mask = torch.zeros(batch, dtype=torch.bool, device=loss.device)
    if batch == 0:
        return mask
    # The epsilon keeps float error from losing one: 0.29 * 100 = 28.999999999999996.
    keep = max(1, math.floor(ratio * batch + 1e-9))
    order = torch.sort(loss.float().nan_to_num(nan=float("inf")), stable=True).indices  # (B,)
    mask[order[:keep]] = True
    return mask


def symmetric_infonce(
    image_emb: torch.Tensor, text_emb: torch.Tensor, logit_scale: float | torch.Tensor
) -> torch.Tensor:
    """CLIP's symmetric in-batch InfoNCE, (1/B) Σ_i ½(ℓ^{i2t}_i + ℓ^{t2i}_i).

    Args:
        image_emb: (B, D) L2-normalised image embeddings.
        text_emb: (B, D) L2-normalised text embeddings; row i is paired with image i.
        logit_scale: 1/τ, a float or a 0-d tensor (e.g. `model.logit_scale.exp()`, which then
            receives a gradient).

    Returns:
        () float32 scalar.
    """
    loss_i2t, loss_t2i = infonce_per_sample(image_emb, text_emb, logit_scale)  # (B,), (B,)
    return 0.5 * (loss_i2t + loss_t2i).mean()


def co_positive_mask(
    image_groups: torch.Tensor | None, text_groups: torch.Tensor | None
) -> torch.Tensor | None:
    """(B, B) bool: True where rows i != j share an image source or a text source.

    Such a j is a second positive of i, not a negative (SPS proxy pairs, docs/methods.md §10.5):
    k noisy images carrying one proxy caption would otherwise cap each other's match
    probability near 1/k and push a correct caption away from its image.

    Args:
        image_groups: (B,) int64 id of each row's image source (e.g. a hash of the key of the
            pair the image comes from), or None.
        text_groups: (B,) int64 id of each row's text source, or None.

    Returns:
        The mask (diagonal False), or None when both ids are None.
    """
    same = None
    for groups in (image_groups, text_groups):
        if groups is None:
            continue
        groups = groups.reshape(-1)
        equal = groups[:, None] == groups[None, :]  # (B, B)
        same = equal if same is None else same | equal
    if same is None:
        return None
    return same & ~torch.eye(same.shape[0], dtype=torch.bool, device=same.device)


def weighted_infonce(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: float | torch.Tensor,
    weights: torch.Tensor,
    co_positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair weighted InfoNCE, (1/B) Σ_i w_i·½(ℓ^{i2t}_i + ℓ^{t2i}_i) (docs/methods.md §10.5).

    A weight touches only the pair's own terms ℓ^{i2t}_i and ℓ^{t2i}_i. Weight 0 removes the
    pair's positive term, but its text and image stay in the denominators of every other row
    and column as negatives. The mean divides by B, not Σw (docs/methods.md §10.5: as NPC does; a
    down-weighted batch takes a smaller step). All weights 1 give `symmetric_infonce`.

    Args:
        image_emb: (B, D) L2-normalised image embeddings.
        text_emb: (B, D) L2-normalised text embeddings.
        logit_scale: 1/τ, a float or a 0-d tensor.
        weights: (B,) non-negative weights (e.g. RCR's w̃ or SPS's labels); detached.
        co_positives: (B, B) bool from `co_positive_mask`, or None: a True (i, j) leaves j out
            of i's softmaxes in both directions (neither a negative nor a positive of i).

    Returns:
        () float32 scalar.

    Raises:
        ValueError: when weights is not (B,) or co_positives not (B, B).
    """
    batch = image_emb.shape[0]
    if weights.shape != (batch,):
        raise ValueError(f"weights must have shape ({batch},); got {tuple(weights.shape)}")
    if co_positives is None:
        loss_i2t, loss_t2i = infonce_per_sample(image_emb, text_emb, logit_scale)  # (B,), (B,)
    else:
        if co_positives.shape != (batch, batch):
            raise ValueError(
                f"co_positives must have shape ({batch}, {batch}); got {tuple(co_positives.shape)}"
            )
        logits = logit_scale * image_emb.float() @ text_emb.float().T  # (B, B): z_ij
        logits = logits.masked_fill(co_positives.to(logits.device), float("-inf"))
        diagonal = torch.arange(batch, device=logits.device)
        loss_i2t = -torch.log_softmax(logits, dim=1)[diagonal, diagonal]  # (B,)
        loss_t2i = -torch.log_softmax(logits, dim=0)[diagonal, diagonal]  # (B,)
    weights = weights.detach().to(device=loss_i2t.device, dtype=torch.float32)  # (B,)
    return (weights * 0.5 * (loss_i2t + loss_t2i)).sum() / batch


def _exponential_margin(labels: torch.Tensor, alpha: float, m: float) -> torch.Tensor:
    if m <= 0 or m == 1:
        raise ValueError(f"the exponential soft margin needs m > 0 and m != 1; got m={m}")
    return alpha * (torch.pow(m, labels) - 1.0) / (m - 1.0)


def _linear_margin(labels: torch.Tensor, alpha: float, m: float) -> torch.Tensor:
    return alpha * labels


def _sin_margin(labels: torch.Tensor, alpha: float, m: float) -> torch.Tensor:
    return alpha * (torch.sin(math.pi * labels - math.pi / 2) / 2 + 0.5)


# name -> α̂(y; α, m); all map y = 0 to 0 and y = 1 to α
# (docs/methods.md §10.5, BiCro `--soft_margin`).
SOFT_MARGINS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "exponential": _exponential_margin,
    "linear": _linear_margin,
    "sin": _sin_margin,
}


def soft_margin(
    labels: torch.Tensor, alpha: float = 0.2, kind: str = "exponential", m: float = 10.0
) -> torch.Tensor:
    """Soft triplet margin α̂ of each pair from its correspondence label (docs/methods.md §10.5).

    exponential: α(m^y − 1)/(m − 1) (BiCro Eq. 2, the default, m = 10); linear: α·y;
    sin: α(sin(πy − π/2)/2 + 1/2). Each gives α̂(0) = 0 and α̂(1) = α.

    Args:
        labels: (B,) soft labels y; clamped to [0, 1] first, as the references do.
        alpha: the full margin α, reached at y = 1.
        kind: a key of `SOFT_MARGINS`.
        m: base of the exponential form (ignored by the others).

    Returns:
        (B,) float32 margins in [0, α], detached.

    Raises:
        ValueError: for an unknown kind or an exponential base m <= 0 or m == 1.
    """
    if kind not in SOFT_MARGINS:
        raise ValueError(f"unknown soft margin {kind!r}; use one of {sorted(SOFT_MARGINS)}")
    y = labels.detach().float().clamp(0.0, 1.0)  # (B,)
    return SOFT_MARGINS[kind](y, alpha, m)


def soft_margin_triplet(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    margins: torch.Tensor,
    reduction: str = "sum",
    co_positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """VSE++ hardest-negative triplet loss with a per-pair margin (NCR/BiCro training loss).

    ℓ_i = [α̂_i − s_ii + max_{j≠i} s_ij]_+ + [α̂_i − s_ii + max_{j≠i} s_ji]_+, where the margin
    α̂_i belongs to the QUERY's own pair in both directions: a (B, 1) margin over the
    image->text cost matrix (rows are the query images) and a (1, B) margin over the
    text->image one (columns are the query texts). The references broadcast a (B,) margin over
    both, which indexes the image->text costs by the negative caption instead
    (docs/methods.md §10.5).

    Args:
        image_emb: (B, D) L2-normalised image embeddings.
        text_emb: (B, D) L2-normalised text embeddings.
        margins: (B,) per-pair margins, e.g. `soft_margin(labels)`; detached.
        reduction: "sum" (the references: summed over the batch, not averaged) or "none".
        co_positives: (B, B) bool from `co_positive_mask`, or None: a True (i, j) is never
            i's hardest negative.

    Returns:
        () float32 sum, or (B,) float32 per-sample losses with reduction="none". A batch of one
        has no negative, so its loss is 0.

    Raises:
        ValueError: for a margins shape other than (B,) or an unknown reduction.
    """
    batch = image_emb.shape[0]
    if margins.shape != (batch,):
        raise ValueError(f"margins must have shape ({batch},); got {tuple(margins.shape)}")
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none'; got {reduction!r}")
    scores = image_emb.float() @ text_emb.float().T  # (B, B): s_ij = S(I_i, T_j)
    positive = scores.diagonal()  # (B,)
    margin = margins.detach().to(device=scores.device, dtype=torch.float32)  # (B,)
    diagonal = torch.eye(batch, dtype=torch.bool, device=scores.device)  # (B, B)
    # Image i queries the texts: row i, margin of pair i -> (B, 1).
    cost_i2t = (margin[:, None] - positive[:, None] + scores).clamp(min=0)  # (B, B)
    # Text j queries the images: column j, margin of pair j -> (1, B).
    cost_t2i = (margin[None, :] - positive[None, :] + scores).clamp(min=0)  # (B, B)
    # Zero the positives before the max: costs are >= 0, so an all-zero row means no violation.
    if co_positives is not None:
        diagonal = diagonal | co_positives.to(scores.device)
    cost_i2t = cost_i2t.masked_fill(diagonal, 0.0)
    cost_t2i = cost_t2i.masked_fill(diagonal, 0.0)
    per_sample = cost_i2t.amax(dim=1) + cost_t2i.amax(dim=0)  # (B,)
    return per_sample.sum() if reduction == "sum" else per_sample


def sps_consistency_losses(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    margin: float = 0.0,
    squared: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPS's stable-space constraints on a reliable batch (docs/methods.md §10.5).

    L_cro = mean_{i,j} h(S(I_i,T_j) − S(I_j,T_i)): asymmetry of the cross-modal similarity
    matrix. L_met = mean_{i,j} h(S(I_i,I_j) − S(T_i,T_j)): disagreement of the image-image and
    text-text similarity matrices. h(d) = [|d| − margin]_+, squared when `squared`. The released
    code is margin 0, squared (the defaults), i.e. mean squared differences over all B² entries
    (diagonals included: they contribute 0 for L_cro and for L_met with unit-norm rows).

    Args:
        image_emb: (B, D) L2-normalised image embeddings.
        text_emb: (B, D) L2-normalised text embeddings.
        margin: α of the hinge (the paper's reading; 0 in the code).
        squared: square the hinge (true in the code).

    Returns:
        (l_cro, l_met), two () float32 scalars.
    """
    u = image_emb.float()  # (B, D)
    v = text_emb.float()  # (B, D)
    cross = u @ v.T  # (B, B): S(I_i, T_j)
    image_image = u @ u.T  # (B, B)
    text_text = v @ v.T  # (B, B)

    def hinge(diff: torch.Tensor) -> torch.Tensor:
        # abs() has no gradient at 0, which is where the constraint is met anyway.
        out = (diff.abs() - margin).clamp(min=0) if margin > 0 else diff.abs()
        return out.square() if squared else out

    l_cro = hinge(cross - cross.T).mean()
    l_met = hinge(image_image - text_text).mean()
    return l_cro, l_met
