"""RCR: rank consistency between cross-modal and intra-modal retrieval (NDCG@K).

Pure module: numpy, plus a `NeighbourSearch` over every pair (docs/methods.md §6).

Contract:
- Partition: the set C of pairs whose two per-direction GMM posteriors exceed delta (guard:
  the 1 % with the largest min posterior when C is empty). `clean_prob` stays the configured
  mixture on the configured loss.
- w = (NDCG_txt + NDCG_img) / 2 for every pair: the texts its image retrieves, scored by their
  similarity to its own text, against its text's own top-K texts; and the same for images,
  which are ranked as unique images (rows sharing a content hash are one image).
  `soft_label` is w~ = w x 1[C], the `rcr` column w.
- Similarities entering a label are recomputed exactly from stored embeddings, never taken
  from an approximate index; every tie is broken by global id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.labels.arrays import check_rows as _check_rows
from pipeline.core.labels.base import INDEX_ROLES, IndexRole, ShardInputs, ShardLabels
from pipeline.core.partition.decisions import (
    CLEAN,
    NOISY,
    PartitionDecisions,
    Select,
    decide_rcr_candidates,
)
from pipeline.core.search.knn import EmbeddingLookup, exact_scores
from pipeline.core.search.neighbours import BatchLookup, NeighbourSearch, image_search_distinct

__all__ = [
    "decide",
    "index_role",
    "label_shard",
    "max_search_depth",
    "ndcg_at_k",
    "quality_scores",
    "rcr_ndcg",
    "rcr_weights",
]

# IDCG at or below this means "no relevant neighbour at all": NDCG is set to 0 and flagged.
_IDCG_EPS = 1e-12
# Bound on the neighbour rows prefetched per query block: 4 lists of (K + 1) ids per query.
_MAX_KEYS_PER_QUERY_BATCH = 1 << 16
# Image de-duplication: image lists grow to at most (K + 1) x this rows.
_MAX_IMAGE_DEPTH_FACTOR = 32


def max_search_depth(k: int) -> int:
    """The most neighbours one RCR search may ask an index for at K = `k` (the image search
    widens up to this depth while duplicates fill the top rows)."""
    return (k + 1) * _MAX_IMAGE_DEPTH_FACTOR


def _lookup_groups(group_ids: np.ndarray | EmbeddingLookup, ids: np.ndarray) -> np.ndarray:
    """Group id of every id in `ids` (any shape); -1 ids map to -1."""
    safe = np.maximum(ids, 0)
    groups = group_ids(safe.ravel()).reshape(ids.shape) if callable(group_ids) else group_ids[safe]
    return np.where(ids >= 0, np.asarray(groups, dtype=np.int64), -1)


def _first_of_group(groups: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """(Q, M) bool: True where an entry is the first (highest-ranked) of its group in its row."""
    # Invalid entries get unique negative keys so they never collide with a real group.
    keys = np.where(valid, groups, -2 - np.arange(groups.shape[1])[None, :])
    order = np.argsort(keys, axis=1, kind="stable")  # stable: rank order within a group
    sorted_keys = np.take_along_axis(keys, order, axis=1)
    repeat = np.zeros_like(sorted_keys, dtype=bool)
    repeat[:, 1:] = sorted_keys[:, 1:] == sorted_keys[:, :-1]
    first = np.empty_like(repeat)
    np.put_along_axis(first, order, ~repeat, axis=1)
    kept: np.ndarray = first & valid
    return kept


def _ranked_gains(
    order_queries: np.ndarray,
    gain_queries: np.ndarray,
    candidate_ids: np.ndarray,
    database: np.ndarray | EmbeddingLookup,
    k: int,
    exclude: np.ndarray | None,
    group_ids: np.ndarray | EmbeddingLookup | None,
) -> np.ndarray:
    """(Q, k) float64 gains max(S, 0) of a candidate list ranked by the order scores; -inf pad."""
    candidate_ids = np.asarray(candidate_ids, dtype=np.int64)
    order_scores = exact_scores(order_queries, database, candidate_ids, dtype=np.float64)
    if order_queries is gain_queries:
        gains = order_scores.copy()
    else:
        gains = exact_scores(gain_queries, database, candidate_ids, dtype=np.float64)
    valid = candidate_ids >= 0
    # Canonical order in float64: score desc, then id asc, missing last.
    order = np.lexsort((candidate_ids, -np.where(valid, order_scores, -np.inf), ~valid), axis=1)
    ranked_ids = np.take_along_axis(candidate_ids, order, axis=1)
    ranked_gains = np.take_along_axis(gains, order, axis=1)
    keep = ranked_ids >= 0
    if group_ids is not None:
        groups = _lookup_groups(group_ids, ranked_ids)
        keep &= _first_of_group(groups, keep)
        if exclude is not None:
            keep &= groups != exclude[:, None]
    elif exclude is not None:
        keep &= ranked_ids != exclude[:, None]
    # Compact kept entries to the front, preserving rank order.
    compact = np.argsort(~keep, axis=1, kind="stable")[:, :k]
    out = np.take_along_axis(np.where(keep, np.maximum(ranked_gains, 0.0), -np.inf), compact, 1)
    if out.shape[1] < k:
        out = np.pad(out, ((0, 0), (0, k - out.shape[1])), constant_values=-np.inf)
    # NaN queries give NaN gains; keep them NaN (not -inf) so the NDCG reports NaN.
    nan_rows = np.isnan(gains).any(axis=1)
    out[nan_rows] = np.nan
    return out


def ndcg_at_k(
    order_queries: np.ndarray,
    gain_queries: np.ndarray,
    actual_ids: np.ndarray,
    ideal_ids: np.ndarray,
    database: np.ndarray | EmbeddingLookup,
    *,
    k: int = 10,
    self_ids: np.ndarray | None = None,
    include_self: bool = True,
    group_ids: np.ndarray | EmbeddingLookup | None = None,
) -> dict[str, np.ndarray]:
    """One direction of RCR's NDCG@K (docs/methods.md §6.2-§6.4).

    Text direction: order_queries = u (image queries texts), gain_queries = v, database = texts.
    The actual list ranks `actual_ids` by S(order_query, .); the ideal list ranks `ideal_ids` by
    the gain S(gain_query, .). Both are re-scored exactly here; gains are clamped at 0; the
    discount is 1/log2(j + 1), j from 1; K_eff = min(k, candidates in the ideal list).

    Args:
        order_queries: (Q, D) embeddings that produced the actual list (u_i for texts).
        gain_queries: (Q, D) embeddings defining relevance (v_i for texts).
        actual_ids: (Q, M) ids from the cross-modal search (M >= k + 1 so `include_self=False`
            still leaves k; more when de-duplicating groups). -1 allowed.
        ideal_ids: (Q, M') ids from the intra-modal search with gain_queries. -1 allowed.
        database: (N, D) database embeddings indexed by id, or a lookup.
        k: K.
        self_ids: (Q,) int64 id of each query's own row in the database; required when
            `include_self` is False.
        include_self: keep the query's own item (its row, or its group) in both lists.
        group_ids: (N,) int64 group of every database id (or a lookup): only the first item of
            a group counts (image de-duplication, docs/methods.md §6.3); None ranks rows.

    Returns:
        dict: "ndcg" (Q,) float32 in [0, 1] (NaN for NaN queries), "k_eff" (Q,) int64,
        "degenerate" (Q,) bool (IDCG <= 1e-12: NDCG set to 0).
    """
    order_queries = np.asarray(order_queries)
    rows = order_queries.shape[0]
    gain_queries = _check_rows("gain_queries", gain_queries, rows)
    if not include_self and self_ids is None:
        raise ValueError("include_self=False needs self_ids (each query's own database id)")
    exclude = None
    if not include_self:
        exclude = _check_rows("self_ids", np.asarray(self_ids, dtype=np.int64), rows)
        if group_ids is not None:
            exclude = _lookup_groups(group_ids, exclude)
    actual = _ranked_gains(order_queries, gain_queries, actual_ids, database, k, exclude, group_ids)
    ideal = _ranked_gains(gain_queries, gain_queries, ideal_ids, database, k, exclude, group_ids)
    k_eff = np.minimum(k, (ideal > -np.inf).sum(axis=1) + np.isnan(ideal).sum(axis=1))
    position = np.arange(k)[None, :]
    discount = 1.0 / np.log2(np.arange(2, k + 2, dtype=np.float64))  # j = 1..k -> log2(j + 1)
    in_list = position < k_eff[:, None]
    # A missing actual entry within K_eff (approximate search came back short) has gain 0.
    dcg = (np.where(in_list & (actual > -np.inf), actual, 0.0) * discount).sum(axis=1)
    dcg = np.where(np.isnan(actual).any(axis=1), np.nan, dcg)
    idcg = (np.where(in_list, ideal, 0.0) * discount).sum(axis=1)
    degenerate = ~(idcg > _IDCG_EPS) & ~np.isnan(idcg)
    ndcg = np.divide(dcg, idcg, out=np.zeros(rows), where=~degenerate)
    ndcg = np.where(np.isnan(dcg) | np.isnan(idcg), np.nan, ndcg)
    return {
        "ndcg": np.clip(ndcg, 0.0, 1.0).astype(np.float32),
        "k_eff": k_eff.astype(np.int64),
        "degenerate": degenerate,
    }


def rcr_ndcg(
    u: np.ndarray,
    v: np.ndarray,
    i2t_ids: np.ndarray,
    t2t_ids: np.ndarray,
    t2i_ids: np.ndarray,
    i2i_ids: np.ndarray,
    text_db: np.ndarray | EmbeddingLookup,
    image_db: np.ndarray | EmbeddingLookup,
    *,
    k: int = 10,
    self_ids: np.ndarray | None = None,
    include_self: bool = True,
    image_group_ids: np.ndarray | EmbeddingLookup | None = None,
) -> dict[str, np.ndarray]:
    """RCR rank-consistency weights of a block of pairs (docs/methods.md §6.2).

    NDCG_txt: texts retrieved by the image (i2t) scored by their similarity to the pair's own
    text, against the text's own top-K texts (t2t). NDCG_img: images retrieved by the text (t2i)
    scored by similarity to the pair's image, against the image's top-K images (i2i), with
    images de-duplicated by `image_group_ids`. w = (NDCG_txt + NDCG_img) / 2.

    Args:
        u, v: (Q, D) image / text embeddings of the query pairs.
        i2t_ids: (Q, M) text ids from searching the text index with u.
        t2t_ids: (Q, M) text ids from searching the text index with v.
        t2i_ids: (Q, M) image ids from searching the image index with v.
        i2i_ids: (Q, M) image ids from searching the image index with u.
            M >= k + 1; for de-duplicated images, enough to hold k + 1 distinct groups.
        text_db, image_db: (N, D) embeddings indexed by id, or lookups.
        k: K (10).
        self_ids: (Q,) int64 database id of each pair (needed for include_self=False).
        include_self: literal reading (True): both lists may contain the pair's own item.
        image_group_ids: (N,) int64 image id per database row, or a lookup; None: no de-dup.

    Returns:
        dict of (Q,): "ndcg_txt", "ndcg_img", "w" float32 in [0, 1]; "k_eff" int64 (the
        smaller of the two directions); "degenerate" bool (either direction had IDCG ~ 0).
    """
    text = ndcg_at_k(
        u, v, i2t_ids, t2t_ids, text_db, k=k, self_ids=self_ids, include_self=include_self
    )
    image = ndcg_at_k(
        v,
        u,
        t2i_ids,
        i2i_ids,
        image_db,
        k=k,
        self_ids=self_ids,
        include_self=include_self,
        group_ids=image_group_ids,
    )
    weight = 0.5 * (text["ndcg"].astype(np.float64) + image["ndcg"].astype(np.float64))
    return {
        "ndcg_txt": text["ndcg"],
        "ndcg_img": image["ndcg"],
        "w": weight.astype(np.float32),
        "k_eff": np.minimum(text["k_eff"], image["k_eff"]),
        "degenerate": text["degenerate"] | image["degenerate"],
    }


def rcr_weights(w: np.ndarray, in_c: np.ndarray) -> np.ndarray:
    """RCR training weight w~ = w * 1[i in C] (docs/methods.md §6.2), (N,) float32."""
    return np.where(np.asarray(in_c, dtype=bool), np.asarray(w, dtype=np.float32), 0.0).astype(
        np.float32
    )


def decide(
    count: dict[str, int], select: Select, threshold: float, params: Any
) -> tuple[PartitionDecisions, dict[str, Any]]:
    """The set C (params: delta). The clean split at `threshold` stays for clean_prob only."""
    cut, report = decide_rcr_candidates(count, select, delta=params.delta)
    decisions = PartitionDecisions(threshold=threshold, rcr_delta=params.delta, rcr_guard_cut=cut)
    return decisions, {"rcr_candidates": report}


def index_role(params: Any) -> IndexRole:
    """Both rankings run over the whole corpus."""
    return INDEX_ROLES["all"]


def label_shard(
    inputs: ShardInputs, neighbours: NeighbourSearch | None, params: Any
) -> ShardLabels:
    """RCR weights of one shard (params: k, include_self).

    With `inputs.image_dedup` the index stores an image group per row and images are ranked as
    unique images; otherwise every row is its own image (tables without image hashes).
    """
    assert neighbours is not None  # index_role: every pair is indexed
    u, v, ids = inputs.u, inputs.v, inputs.scalars.ids
    n = u.shape[0]
    depth = params.k + 1
    dedup = inputs.image_dedup
    weight = np.zeros(n, dtype=np.float32)
    finite = inputs.finite
    batch = max(1, min(inputs.query_batch, _MAX_KEYS_PER_QUERY_BATCH // (2 * depth)))
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        ub, vb = u[start:stop], v[start:stop]
        _, i2t = neighbours.search("text", ub, depth)
        _, t2t = neighbours.search("text", vb, depth)
        if dedup:
            max_depth = depth * _MAX_IMAGE_DEPTH_FACTOR
            t2i = image_search_distinct(neighbours, vb, depth, max_depth)
            i2i = image_search_distinct(neighbours, ub, depth, max_depth)
        else:
            _, t2i = neighbours.search("image", vb, depth)
            _, i2i = neighbours.search("image", ub, depth)
        text_ids = np.unique(np.concatenate([i2t.ravel(), t2t.ravel()]))
        image_ids = np.unique(np.concatenate([t2i.ravel(), i2i.ravel()]))
        if dedup and not params.include_self:
            # The query's own group is excluded by its id: fetch it too (rows with non-finite
            # vectors are not indexed; their NDCG is NaN anyway).
            image_ids = np.union1d(image_ids, ids[start:stop][finite[start:stop]])
        text_ids, image_ids = text_ids[text_ids >= 0], image_ids[image_ids >= 0]
        text_db = BatchLookup(text_ids, neighbours.lookup(text_ids, ("v",))["v"])
        image_rows = neighbours.lookup(image_ids, ("u", "groups") if dedup else ("u",))
        image_db = BatchLookup(image_ids, image_rows["u"])
        groups = BatchLookup(image_ids, image_rows["groups"]) if dedup else None
        out = rcr_ndcg(
            ub,
            vb,
            i2t,
            t2t,
            t2i,
            i2i,
            text_db,
            image_db,
            k=params.k,
            self_ids=ids[start:stop],
            include_self=params.include_self,
            image_group_ids=groups,
        )
        weight[start:stop] = np.nan_to_num(out["w"], nan=0.0)
    in_c = inputs.masks.in_c
    assert in_c is not None  # RCR's decisions always set C
    return ShardLabels(
        soft_label=rcr_weights(weight, in_c),
        subset=np.where(in_c, CLEAN, NOISY).astype(np.int8),
        scores={"rcr": weight},
    )


def quality_scores(
    inputs: ShardInputs, labels: ShardLabels, cosine: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The paper's ablation weights: w unmasked, the mean per-direction posterior, and the
    cosine restricted to C."""
    scalars, in_c = inputs.scalars, inputs.masks.in_c
    a, b = scalars.alpha_i2t, scalars.alpha_t2i
    assert in_c is not None and a is not None and b is not None  # RCR partitions on them
    scores = {
        "rcr_unmasked": labels.scores["rcr"],
        "rcr_alpha_mean": 0.5 * (a + b),
        "rcr_cosine_on_c": np.where(in_c, cosine, -1.0),
    }
    return scores, {"rcr_alpha_mean": in_c}
