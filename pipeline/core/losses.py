"""Per-sample contrastive losses (docs/methods.md §1): pure torch, no Ray, no I/O.

Contract:
- `infonce_per_sample` returns the image->text and text->image InfoNCE loss of every pair of a
  batch, computed with log-softmax in float32 whatever the input dtype, so CLIP's logit scale of
  100 never overflows (the references' exp-then-divide form does).
- `triplet_per_sample` is BiCro/NCR's mean-hinge triplet loss (margin 0.2, the mean divides by
  b because the zeroed diagonal is included).
- `fixed_size_loss_batches` is the batching rule of docs/methods.md §1.1: a seeded permutation cut
  into batches of exactly b, the remainder batch filled with other samples whose losses are
  discarded, so every loss sees the same number of negatives.
"""

from __future__ import annotations

import torch

from pipeline.core.batching import fixed_size_loss_batches

__all__ = [
    "infonce_per_sample",
    "triplet_per_sample",
    "fixed_size_loss_batches",
]


def infonce_per_sample(
    image_emb: torch.Tensor, text_emb: torch.Tensor, logit_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-batch InfoNCE loss of each pair, in both directions.

    Args:
        image_emb: (B, D) L2-normalised image embeddings.
        text_emb: (B, D) L2-normalised text embeddings; row i is paired with image i.
        logit_scale: 1/tau, e.g. CLIP's `logit_scale.exp()` (<= 100).

    Returns:
        loss_i2t: (B,) float32, -log softmax_j(z_ij)[i] (image i queries the batch's texts).
        loss_t2i: (B,) float32, -log softmax_j(z_ji)[i] (text i queries the batch's images).
    """
    logits = logit_scale * image_emb.float() @ text_emb.float().T  # (B, B): z_ij = s(I_i, T_j)
    diagonal = torch.arange(logits.shape[0], device=logits.device)
    loss_i2t = -torch.log_softmax(logits, dim=1)[diagonal, diagonal]
    loss_t2i = -torch.log_softmax(logits, dim=0)[diagonal, diagonal]
    return loss_i2t, loss_t2i


def triplet_per_sample(
    image_emb: torch.Tensor, text_emb: torch.Tensor, margin: float = 0.2
) -> torch.Tensor:
    """Mean-hinge triplet loss of each pair (BiCro/NCR `eval_loss`), float32.

    Args:
        image_emb: (B, D) L2-normalised image embeddings.
        text_emb: (B, D) L2-normalised text embeddings.
        margin: alpha of the hinge.

    Returns:
        (B,) float32: (1/B) sum_{j!=i} [a - s_ii + s_ij]_+ + (1/B) sum_{j!=i} [a - s_ii + s_ji]_+.
    """
    scores = image_emb.float() @ text_emb.float().T  # (B, B)
    positive = scores.diagonal()
    off_diagonal = ~torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    cost_i2t = (margin - positive[:, None] + scores).clamp(min=0) * off_diagonal
    cost_t2i = (margin - positive[None, :] + scores).clamp(min=0) * off_diagonal
    batch = scores.shape[0]
    return cost_i2t.sum(dim=1) / batch + cost_t2i.sum(dim=0) / batch
