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
- `batched_losses` scores a shard's pairs on such batches, averaged over several batchings
  (`embed.loss_permutations`): each pair's in-batch loss then depends less on which b - 1
  negatives it happened to meet.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.core.losses.batching import fixed_size_loss_batches

__all__ = [
    "batched_losses",
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


def batched_losses(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: float,
    batchings: list[list[tuple[np.ndarray, int]]],
) -> dict[str, np.ndarray]:
    """Per-sample InfoNCE (both directions) and triplet losses on fixed-size batches, each
    the mean over `batchings` (docs/methods.md §1.1; filler rows are scored but discarded).

    Args:
        image_emb, text_emb: (N, D) L2-normalised float32 embeddings; row i is pair i.
        logit_scale: the model's 1/tau.
        batchings: one or more `fixed_size_loss_batches` results over the N rows (one per
            seeded permutation); one batching gives exactly its batch's losses.

    Returns:
        "i2t", "t2i", "triplet": (N,) float32 (NaN for a row no batch scored); "batch": (N,)
        int32, each row's batch in the first batching (-1: none).
    """
    n = image_emb.shape[0]
    sums = {name: np.zeros(n) for name in ("i2t", "t2i", "triplet")}
    counts = np.zeros(n)
    batch_ids = np.full(n, -1, dtype=np.int32)
    for number, batches in enumerate(batchings):
        for batch_index, (indices, n_scored) in enumerate(batches):
            idx = torch.as_tensor(indices)
            scored = indices[:n_scored]
            loss_i2t, loss_t2i = infonce_per_sample(image_emb[idx], text_emb[idx], logit_scale)
            triplet = triplet_per_sample(image_emb[idx], text_emb[idx])
            for name, values in (("i2t", loss_i2t), ("t2i", loss_t2i), ("triplet", triplet)):
                sums[name][scored] += values[:n_scored].numpy()
            counts[scored] += 1
            if number == 0:
                batch_ids[scored] = batch_index
    out = {
        name: np.divide(total, counts, out=np.full(n, np.nan), where=counts > 0).astype(np.float32)
        for name, total in sums.items()
    }
    out["batch"] = batch_ids
    return out
