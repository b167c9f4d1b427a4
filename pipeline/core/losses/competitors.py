"""Per-sample InfoNCE against each pair's nearest cross-modal competitors (issue 33 item 2).

Pure module: numpy, plus a `NeighbourSearch` over every pair (docs/methods.md §1.7).

Contract:
- The in-batch loss (`per_sample.infonce_per_sample`) contrasts a pair with random batch
  mates; here the negatives of pair i are the k captions nearest to its image (i2t) and the k
  images nearest to its caption (t2i) in the whole corpus, its own caption / image left out:
      l_i2t = logsumexp(s·[c_ii, c_i,t1 .. c_i,tk]) - s·c_ii
      l_t2i = logsumexp(s·[c_ii, c_d1,i .. c_dk,i]) - s·c_ii
  with c the cosine and s the logit scale. A pair whose caption fits another image better (a
  swapped gallery caption) gets a large loss however easy its random batch mates are.
- Competitors are in the canonical order of the search (score desc, id asc), so the losses do
  not depend on index shards or query blocks; fewer than k indexed rows leave the missing
  terms out (-inf). Rows whose embeddings are not finite get NaN (the mixture ignores them).
"""

from __future__ import annotations

import numpy as np

from pipeline.core.search.neighbours import NeighbourSearch

__all__ = ["competitor_infonce", "competitor_losses", "drop_self"]


def competitor_infonce(
    own: np.ndarray, text_scores: np.ndarray, image_scores: np.ndarray, logit_scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """InfoNCE of each pair against given competitor cosines.

    Args:
        own: (Q,) float cosine of each pair's image and caption.
        text_scores: (Q, k) float cosines of the image with its competing captions (-inf: none).
        image_scores: (Q, k') float cosines of the caption with its competing images (-inf: none).
        logit_scale: s, the model's 1/tau.

    Returns:
        loss_i2t, loss_t2i: (Q,) float32, >= 0.
    """
    own = np.asarray(own, dtype=np.float64)[:, None]  # (Q, 1)

    def one_way(scores: np.ndarray) -> np.ndarray:
        logits = logit_scale * np.concatenate([own, np.asarray(scores, np.float64)], axis=1)
        peak = logits.max(axis=1, keepdims=True)  # finite: the own term always is
        total = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
        losses: np.ndarray = (total - logits[:, 0]).astype(np.float32)
        return losses

    return one_way(text_scores), one_way(image_scores)


def drop_self(
    scores: np.ndarray, ids: np.ndarray, self_ids: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first k entries of each (Q, k + 1) search row that are not the query's own pair.

    Returns:
        scores (Q, k) float64 (-inf: missing) and ids (Q, k) int64 (-1: missing), order kept.
    """
    keep = (ids >= 0) & (ids != np.asarray(self_ids)[:, None])
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # kept entries first, in order
    kept = np.take_along_axis(keep, order, axis=1)
    out_scores = np.where(kept, np.take_along_axis(scores, order, axis=1), -np.inf)
    out_ids = np.where(kept, np.take_along_axis(ids, order, axis=1), -1)
    return out_scores.astype(np.float64), out_ids.astype(np.int64)


def competitor_losses(
    neighbours: NeighbourSearch,
    u: np.ndarray,
    v: np.ndarray,
    ids: np.ndarray,
    k: int,
    logit_scale: float,
    query_batch: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """Competitor InfoNCE of a shard's pairs over an index of every pair.

    Args:
        neighbours: search over every pair's image and caption (the same view as u, v).
        u, v: (N, D) float32 L2-normalised image / text embeddings of the shard.
        ids: (N,) int64 global ids (a pair's own id is left out of its competitors).
        k: competitors per direction.
        logit_scale: s.
        query_batch: queries per search.

    Returns:
        loss_i2t, loss_t2i: (N,) float32; NaN where the embeddings are not finite.
    """
    n = u.shape[0]
    i2t = np.full(n, np.nan, dtype=np.float32)
    t2i = np.full(n, np.nan, dtype=np.float32)
    rows = np.flatnonzero(np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1))
    for start in range(0, rows.size, query_batch):
        block = rows[start : start + query_batch]
        own = (u[block].astype(np.float64) * v[block].astype(np.float64)).sum(axis=1)
        text_scores, text_ids = neighbours.search("text", u[block], k + 1)
        image_scores, image_ids = neighbours.search("image", v[block], k + 1)
        text_scores, _ = drop_self(text_scores, text_ids, ids[block], k)
        image_scores, _ = drop_self(image_scores, image_ids, ids[block], k)
        i2t[block], t2i[block] = competitor_infonce(own, text_scores, image_scores, logit_scale)
    return i2t, t2i
