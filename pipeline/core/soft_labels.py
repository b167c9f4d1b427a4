"""Soft correspondence labels: BiCro, RCR, SPS and the cosine baseline (METHODS §2, §4, §5).

Pure module: numpy (+ `pipeline.core.knn` for the in-memory conveniences); no Ray, no I/O, no
config objects.

Contract:
- Every function is vectorised over a block of query pairs and takes plain arrays. The
  "global" neighbours (nearest anchor, nearest reliable pair, top-(K+1) lists) are inputs:
  the Ray label pass searches FAISS shards (`pipeline.core.knn`) and passes the results in.
  Similarities entering a label are always recomputed here from the embeddings, never taken
  from an (approximate) index.
- Outputs are float32 in [0, 1] (NaN where an input embedding is NaN), one value per row,
  aligned with the input rows: permuting the inputs permutes the outputs (METHODS §7; the
  BiCro reference's scatter misalignment, §2.4, is not reproduced).
- `bicro_global_anchors`, `bicro_in_batch_anchors`, `rcr_global` and `sps_proxy_global` run a
  whole in-memory corpus (tests, the demo, the global-vs-in-batch ablation).
- `SOFT_LABEL_METHODS` maps method names to their label functions; signatures differ per
  method because each method needs different neighbours.
"""

from __future__ import annotations

import numpy as np

from pipeline.core.knn import EmbeddingLookup, ShardedIndex, exact_scores
from pipeline.core.losses import fixed_size_loss_batches
from pipeline.core.partition import select_anchors

__all__ = [
    "SOFT_LABEL_METHODS",
    "bicro_global_anchors",
    "bicro_in_batch_anchors",
    "bicro_labels",
    "cosine_labels",
    "fold",
    "ndcg_at_k",
    "proxy_match_probability",
    "rcr_global",
    "rcr_ndcg",
    "rcr_weights",
    "select_bicro_anchors",
    "sps_proxy_global",
    "sps_proxy_labels",
    "sps_quasi_clean_label",
]

# Distances below this are floored (BiCro's Euclidean path clamps d^2 at 1e-4).
_MIN_DISTANCE = 1e-2
# IDCG at or below this means "no relevant neighbour at all": NDCG is set to 0 and flagged.
_IDCG_EPS = 1e-12


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(Q,) float64 row-wise inner products of two (Q, D) arrays (exact f32 products)."""
    return (np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)).sum(axis=-1)


def _check_rows(name: str, array: np.ndarray, rows: int) -> np.ndarray:
    array = np.asarray(array)
    if array.shape[0] != rows:
        raise ValueError(f"{name} has {array.shape[0]} rows, expected {rows}")
    return array


# ----------------------------------------------------------------------------------------------
# BiCro (METHODS §2)
# ----------------------------------------------------------------------------------------------


def fold(a, b, eps: float = 1e-6) -> np.ndarray:
    """BiCro's consistency fold (METHODS §2.5 step 6), elementwise.

    fold(A, B) = 0 if min(A, B) <= eps, else min(A, B) / max(A, B). Unlike the reference
    (`SIM_SELE`), two negative inputs give 0, not a positive ratio, and 0/0 cannot occur.

    Args:
        a, b: broadcastable float arrays (similarities or distances).
        eps: the floor below which a side counts as "no evidence".

    Returns:
        float64 array in [0, 1] (NaN where an input is NaN), symmetric in (a, b).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    low, high = np.minimum(a, b), np.maximum(a, b)  # NaN propagates through both
    positive = low > eps
    ratio = np.divide(low, high, out=np.zeros(np.broadcast(low, high).shape), where=positive)
    return np.where(np.isnan(low), np.nan, ratio)


def _ratio(first: np.ndarray, second: np.ndarray, mode: str, eps: float) -> np.ndarray:
    """fold of two similarities (mode "similarity") or of their chord distances ("distance")."""
    if mode == "similarity":
        return fold(first, second, eps)
    if mode == "distance":
        # ||x - y|| for unit vectors, floored as the reference's Euclidean path (d >= 0.01).
        d_first = np.maximum(np.sqrt(np.maximum(2.0 - 2.0 * first, 0.0)), _MIN_DISTANCE)
        d_second = np.maximum(np.sqrt(np.maximum(2.0 - 2.0 * second, 0.0)), _MIN_DISTANCE)
        d_first = np.where(np.isnan(first), np.nan, d_first)
        d_second = np.where(np.isnan(second), np.nan, d_second)
        return fold(d_first, d_second, eps)
    raise ValueError(f"ratio must be 'similarity' or 'distance', got {mode!r}")


def bicro_labels(
    u: np.ndarray,
    v: np.ndarray,
    anchor_u_nn: np.ndarray,
    anchor_v_of_u_nn: np.ndarray,
    anchor_v_nn: np.ndarray,
    anchor_u_of_v_nn: np.ndarray,
    is_anchor: np.ndarray,
    is_clean: np.ndarray,
    *,
    clean_floor: float = 0.5,
    theta: float = 0.5,
    ratio: str = "similarity",
    eps: float = 1e-6,
) -> dict[str, np.ndarray]:
    """BiCro soft labels of a block of pairs given their nearest anchors (METHODS §2.5 6-8).

    Image side: a* is the anchor whose image is nearest to u_i; A = u_i.u_a*, B = v_i.v_a*.
    Text side: b* is the anchor whose text is nearest to v_i; A' = v_i.v_b*, B' = u_i.u_b*.
    r_i2t = fold(A, B), r_t2i = fold(A', B'), c = (r_i2t + r_t2i) / 2. Labels: anchors 1;
    clean non-anchors clean_floor + (1 - clean_floor) c; noisy c. BiCro*: labels <= theta -> 0.
    In "distance" mode the fold is applied to D = sqrt(max(2 - 2S, 0)) floored at 1e-2
    (the literal Eq. 9-11); the nearest anchor is the same (largest S = smallest D).

    Args:
        u, v: (Q, D) float32 L2-normalised image / text embeddings of the pairs.
        anchor_u_nn: (Q, D) image embedding of each pair's nearest image-anchor (u_a*).
        anchor_v_of_u_nn: (Q, D) that anchor's text embedding (v_a*).
        anchor_v_nn: (Q, D) text embedding of each pair's nearest text-anchor (v_b*).
        anchor_u_of_v_nn: (Q, D) that anchor's image embedding (u_b*).
            Rows of anchors are ignored (anchors are not queried; pass anything, e.g. zeros).
        is_anchor: (Q,) bool, the pair is an anchor.
        is_clean: (Q,) bool, the pair is in the clean set (anchors are clean).
        clean_floor: lower end of clean non-anchor labels (0.5 as the code, 1 as the paper).
        theta: BiCro* threshold.
        ratio: "similarity" (default, the code) or "distance" (the paper's Eq. 9-11).
        eps: fold floor.

    Returns:
        dict of (Q,) float32: "bicro" (raw label), "bicro_star" (in {0} or (theta, 1]),
        "r_i2t", "r_t2i" (NaN for anchors, which are not queried).
    """
    u = np.asarray(u)
    rows = u.shape[0]
    v = _check_rows("v", v, rows)
    is_anchor = _check_rows("is_anchor", np.asarray(is_anchor, dtype=bool), rows)
    is_clean = _check_rows("is_clean", np.asarray(is_clean, dtype=bool), rows)
    image_a = _rowdot(u, _check_rows("anchor_u_nn", anchor_u_nn, rows))
    image_b = _rowdot(v, _check_rows("anchor_v_of_u_nn", anchor_v_of_u_nn, rows))
    text_a = _rowdot(v, _check_rows("anchor_v_nn", anchor_v_nn, rows))
    text_b = _rowdot(u, _check_rows("anchor_u_of_v_nn", anchor_u_of_v_nn, rows))
    r_i2t = _ratio(image_a, image_b, ratio, eps)
    r_t2i = _ratio(text_a, text_b, ratio, eps)
    consistency = 0.5 * (r_i2t + r_t2i)
    label = np.where(is_clean, clean_floor + (1.0 - clean_floor) * consistency, consistency)
    label = np.where(is_anchor, 1.0, label)
    # Threshold after the float32 cast, so the published BiCro* is exactly in {0} or (theta, 1].
    label32 = np.clip(label, 0.0, 1.0).astype(np.float32)
    star = np.where(label32 <= theta, np.float32(0.0), label32)
    return {
        "bicro": label32,
        "bicro_star": star.astype(np.float32),
        "r_i2t": np.where(is_anchor, np.nan, r_i2t).astype(np.float32),
        "r_t2i": np.where(is_anchor, np.nan, r_t2i).astype(np.float32),
    }


def select_bicro_anchors(
    losses: np.ndarray,
    is_clean: np.ndarray,
    *,
    fraction: float = 0.1,
    ids: np.ndarray | None = None,
) -> np.ndarray:
    """BiCro's global anchors (METHODS §2.5 step 4) as a mask, loss ties broken by sample id.

    Delegates to `pipeline.core.partition.select_anchors` (ceil(rho |C|) lowest finite losses,
    ties by position) on the rows sorted by id, so the choice does not depend on row order.

    Args:
        losses: (N,) float per-sample losses (non-finite losses are never anchors).
        is_clean: (N,) bool clean set C.
        fraction: rho in (0, 1].
        ids: (N,) int64 sample ids breaking loss ties (default: row index).

    Returns:
        (N,) bool anchor mask.

    Raises:
        ValueError: the clean set has no finite loss (apply the §1.6 fallback first).
    """
    losses = np.asarray(losses, dtype=np.float64)
    is_clean = np.asarray(is_clean, dtype=bool)
    by_id = (
        np.arange(losses.shape[0])
        if ids is None
        else np.argsort(np.asarray(ids, dtype=np.int64), kind="stable")
    )
    chosen = select_anchors(is_clean[by_id], losses[by_id], fraction)
    mask = np.zeros(losses.shape[0], dtype=bool)
    mask[by_id[chosen]] = True
    return mask


def _finite_rows(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)


def bicro_global_anchors(
    u: np.ndarray,
    v: np.ndarray,
    losses: np.ndarray,
    is_clean: np.ndarray,
    *,
    ids: np.ndarray | None = None,
    fraction: float = 0.1,
    clean_floor: float = 0.5,
    theta: float = 0.5,
    ratio: str = "similarity",
    eps: float = 1e-6,
    factory: str = "Flat",
    shards: int = 1,
    nprobe: int | None = None,
) -> dict[str, np.ndarray]:
    """BiCro with global anchors over a whole in-memory corpus (METHODS §2.5 steps 4-8).

    Builds one image and one text inner-product index on the anchors, queries every finite
    non-anchor pair for its top-1 anchor (canonical tie-breaking by sample id), and labels with
    `bicro_labels`. Rows with a non-finite embedding get NaN labels and are never anchors.

    Args:
        u, v: (N, D) float32 L2-normalised image / text embeddings.
        losses: (N,) per-sample loss (anchors are the lowest-loss clean pairs).
        is_clean: (N,) bool clean set C from the mixture.
        ids: (N,) int64 sample ids (tie-breaking; default row index).
        factory, shards, nprobe: anchor index layout (see `pipeline.core.knn.ShardedIndex`).
        Other arguments: see `bicro_labels` and `select_bicro_anchors`.

    Returns:
        `bicro_labels`'s dict plus "is_anchor" (N,) bool and "image_anchor", "text_anchor"
        (N,) int64 row indices of a* and b* (-1 for anchors and non-finite rows).
    """
    u = np.asarray(u, dtype=np.float32)
    v = _check_rows("v", np.asarray(v, dtype=np.float32), u.shape[0])
    n = u.shape[0]
    ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    finite = _finite_rows(u, v)
    is_clean = np.asarray(is_clean, dtype=bool)
    is_anchor = select_bicro_anchors(
        np.where(finite, losses, np.nan), is_clean & finite, fraction=fraction, ids=ids
    )
    anchor_rows = np.flatnonzero(is_anchor)
    queries = np.flatnonzero(~is_anchor & finite)
    image_nn = np.full(n, -1, dtype=np.int64)
    text_nn = np.full(n, -1, dtype=np.int64)
    if queries.size:
        # Index ids are positions into `anchor_rows` ordered by sample id, so FAISS's canonical
        # (score desc, id asc) tie-break is a tie-break by sample id, whatever the row order.
        by_id = anchor_rows[np.argsort(ids[anchor_rows], kind="stable")]
        for embeddings, out in ((u, image_nn), (v, text_nn)):
            index = ShardedIndex.build(
                embeddings[by_id], shards=min(shards, by_id.size), factory=factory, nprobe=nprobe
            )
            _, position = index.search(embeddings[queries], 1)
            out[queries] = by_id[position[:, 0]]
    safe_image = np.maximum(image_nn, 0)
    safe_text = np.maximum(text_nn, 0)
    labels = bicro_labels(
        u,
        v,
        u[safe_image],
        v[safe_image],
        v[safe_text],
        u[safe_text],
        is_anchor,
        is_clean,
        clean_floor=clean_floor,
        theta=theta,
        ratio=ratio,
        eps=eps,
    )
    for key in labels:
        labels[key] = np.where(finite, labels[key], np.nan).astype(np.float32)
    labels.update(is_anchor=is_anchor, image_anchor=image_nn, text_anchor=text_nn)
    return labels


def bicro_in_batch_anchors(
    u: np.ndarray,
    v: np.ndarray,
    losses: np.ndarray,
    is_clean: np.ndarray,
    *,
    ids: np.ndarray | None = None,
    batch_size: int = 128,
    seed: int = 0,
    clean_floor: float = 0.5,
    theta: float = 0.5,
    ratio: str = "similarity",
    eps: float = 1e-6,
) -> dict[str, np.ndarray]:
    """BiCro's released per-batch anchors (METHODS §2.2 step 4), labels aligned to samples.

    The clean set is shuffled (seeded) into batches of `batch_size` (the last may be short);
    in each, the floor(b/10) + 1 lowest-loss pairs (ties by id) are the anchors, and every pair
    of the batch takes its nearest anchor within the batch. Noisy pairs are shuffled into
    batches too; noisy batch j uses the anchors of clean batch j mod (number of clean batches),
    as the reference cycles its noisy loader alongside the clean one, except that here every
    noisy pair is labelled. Labels follow `bicro_labels` with is_clean from the split. Batches
    are drawn from the samples sorted by id, so permuting the rows permutes the labels.
    `losses` stand in for the reference's per-batch peer loss.

    Args:
        u, v: (N, D) float32 L2-normalised image / text embeddings.
        losses: (N,) float per-sample loss.
        is_clean: (N,) bool clean set.
        ids: (N,) int64 sample ids (default row index).
        batch_size: b (128 in the reference).
        seed: batch shuffle seed.
        Other arguments: see `bicro_labels`.

    Returns:
        `bicro_labels`'s dict plus "is_anchor" (N,) bool (anchor of its own batch).

    Raises:
        ValueError: no clean pair (nothing to anchor on).
    """
    u = np.asarray(u, dtype=np.float32)
    n = u.shape[0]
    v = _check_rows("v", np.asarray(v, dtype=np.float32), n)
    losses = _check_rows("losses", np.asarray(losses, dtype=np.float64), n)
    is_clean = _check_rows("is_clean", np.asarray(is_clean, dtype=bool), n)
    ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if not is_clean.any():
        raise ValueError(
            "in-batch BiCro needs clean pairs to anchor on; apply the partition's fallback "
            "(METHODS §1.6) first."
        )
    rng = np.random.default_rng(seed)

    def batches(mask: np.ndarray) -> list[np.ndarray]:
        rows = np.flatnonzero(mask)
        rows = rows[np.argsort(ids[rows], kind="stable")]
        rows = rows[rng.permutation(rows.size)]
        return [rows[start : start + batch_size] for start in range(0, rows.size, batch_size)]

    clean_batches = batches(is_clean)
    noisy_batches = batches(~is_clean)
    anchors_of = []
    is_anchor = np.zeros(n, dtype=bool)
    for batch in clean_batches:
        count = min(batch.size, batch.size // 10 + 1)
        anchors = batch[np.lexsort((ids[batch], losses[batch]))[:count]]
        is_anchor[anchors] = True
        anchors_of.append(anchors)

    image_nn = np.zeros(n, dtype=np.int64)
    text_nn = np.zeros(n, dtype=np.int64)
    jobs = [(batch, anchors_of[j]) for j, batch in enumerate(clean_batches)]
    jobs += [(batch, anchors_of[j % len(clean_batches)]) for j, batch in enumerate(noisy_batches)]
    for batch, anchors in jobs:
        # argmax keeps the first maximum: anchors are ordered by (loss, id), so ties resolve
        # deterministically and independently of the row order.
        image_nn[batch] = anchors[np.argmax(u[batch] @ u[anchors].T, axis=1)]  # (b,)
        text_nn[batch] = anchors[np.argmax(v[batch] @ v[anchors].T, axis=1)]
    labels = bicro_labels(
        u,
        v,
        u[image_nn],
        v[image_nn],
        v[text_nn],
        u[text_nn],
        is_anchor,
        is_clean,
        clean_floor=clean_floor,
        theta=theta,
        ratio=ratio,
        eps=eps,
    )
    labels["is_anchor"] = is_anchor
    return labels


# ----------------------------------------------------------------------------------------------
# RCR (METHODS §5)
# ----------------------------------------------------------------------------------------------


def _lookup_groups(group_ids, ids: np.ndarray) -> np.ndarray:
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
    return first & valid


def _ranked_gains(
    order_queries: np.ndarray,
    gain_queries: np.ndarray,
    candidate_ids: np.ndarray,
    database: np.ndarray | EmbeddingLookup,
    k: int,
    exclude: np.ndarray | None,
    group_ids,
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
    """One direction of RCR's NDCG@K (METHODS §5.1 Eq. 9-10, §5.2 guards, §5.3 step 4).

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
            a group counts (image de-duplication, §5.3 step 4); None ranks rows.

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
    """RCR rank-consistency weights of a block of pairs (METHODS §5.1 Eq. 9-11, §5.3).

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
    """RCR training weight w~ = w * 1[i in C] (METHODS §5.1 Eq. 12), (N,) float32."""
    return np.where(np.asarray(in_c, dtype=bool), np.asarray(w, dtype=np.float32), 0.0).astype(
        np.float32
    )


def rcr_global(
    u: np.ndarray,
    v: np.ndarray,
    *,
    k: int = 10,
    include_self: bool = True,
    image_group_ids: np.ndarray | None = None,
    factory: str = "Flat",
    shards: int = 1,
    nprobe: int | None = None,
) -> dict[str, np.ndarray]:
    """`rcr_ndcg` for every pair of an in-memory corpus, with its own four searches (§5.3 3).

    Args:
        u, v: (N, D) float32 L2-normalised embeddings; the database is the corpus itself.
        image_group_ids: (N,) int64 image id per row for de-duplication (None: rows distinct).
        Other arguments: see `rcr_ndcg` and `pipeline.core.knn.ShardedIndex`.

    Returns:
        `rcr_ndcg`'s dict for all N pairs.
    """
    u = np.asarray(u, dtype=np.float32)
    v = _check_rows("v", np.asarray(v, dtype=np.float32), u.shape[0])
    n = u.shape[0]
    depth = k + 1
    image_depth = depth
    if image_group_ids is not None:
        # Enough rows to hold k + 1 distinct images when every image repeats `copies` times.
        copies = int(np.bincount(np.unique(image_group_ids, return_inverse=True)[1]).max())
        image_depth = depth * copies
    text_index = ShardedIndex.build(v, shards=shards, factory=factory, nprobe=nprobe)
    image_index = ShardedIndex.build(u, shards=shards, factory=factory, nprobe=nprobe)
    _, i2t = text_index.search(u, depth)
    _, t2t = text_index.search(v, depth)
    _, t2i = image_index.search(v, image_depth)
    _, i2i = image_index.search(u, image_depth)
    return rcr_ndcg(
        u,
        v,
        i2t,
        t2t,
        t2i,
        i2i,
        v,
        u,
        k=k,
        self_ids=np.arange(n, dtype=np.int64),
        include_self=include_self,
        image_group_ids=image_group_ids,
    )


# ----------------------------------------------------------------------------------------------
# SPS (METHODS §4)
# ----------------------------------------------------------------------------------------------


def sps_quasi_clean_label(p: np.ndarray, loss_i2t: np.ndarray, loss_t2i: np.ndarray) -> np.ndarray:
    """SPS/CREAM quasi-clean label (METHODS §4.5, §4.9 step 2).

    P^ = (exp(-l_i2t) + exp(-l_t2i)) / 2 (the model's in-batch match probability, recovered
    from the eval-pass InfoNCE losses), clamped to [0, 1]; y = p + (1 - p) P^, clamped to [0, 1].

    Args:
        p: (N,) float clean posterior of the peer's mixture, in [0, 1].
        loss_i2t, loss_t2i: (N,) float per-direction InfoNCE losses of the labelling model.

    Returns:
        (N,) float32 in [p, 1].
    """
    p = np.asarray(p, dtype=np.float64)
    match = 0.5 * (np.exp(-np.asarray(loss_i2t, np.float64)) + np.exp(-np.asarray(loss_t2i)))
    match = np.clip(match, 0.0, 1.0)
    return np.clip(p + (1.0 - p) * match, 0.0, 1.0).astype(np.float32)


def proxy_match_probability(
    image_emb: np.ndarray,
    text_emb: np.ndarray,
    proxy_ids: np.ndarray,
    *,
    proxy_side: str = "text",
    logit_scale: float,
    batch_size: int = 128,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """In-batch match probabilities of proxy pairs, duplicate proxies masked (METHODS §4.8 fix).

    Pairs are cut into fixed-size batches (`fixed_size_loss_batches`: seeded, the short tail
    filled with other pairs whose outputs are dropped). Pairs carrying the same proxy id share
    one proxy (the same caption, or the same image). In each softmax:
    - co-positives (other pairs with the pair's own proxy id) are removed from the negatives;
    - when the candidates are the proxy side, every other distinct proxy counts once (its m
      identical copies get weight 1/m each), so the result equals a softmax over the batch's
      distinct proxies. Without this, k copies of a proxy cap each pair's P^ near 1/k.

    Args:
        image_emb: (Q, D) image side of each proxy pair (noisy image, or proxy image).
        text_emb: (Q, D) text side (proxy caption, or noisy caption).
        proxy_ids: (Q,) int64 id of the proxy in each pair.
        proxy_side: "text" (image direction: the texts are proxy captions) or "image" (text
            direction: the images are proxy images).
        logit_scale: 1/tau (CLIP's logit_scale.exp(), or 1/0.07).
        batch_size: b.
        seed: batch shuffle seed.

    Returns:
        p_i2t, p_t2i: (Q,) float32 in [0, 1].
    """
    if proxy_side not in ("text", "image"):
        raise ValueError(f"proxy_side must be 'text' or 'image', got {proxy_side!r}")
    image_emb = np.asarray(image_emb, dtype=np.float64)
    rows = image_emb.shape[0]
    text_emb = _check_rows("text_emb", np.asarray(text_emb, dtype=np.float64), rows)
    proxy_ids = _check_rows("proxy_ids", np.asarray(proxy_ids, dtype=np.int64), rows)
    p_i2t = np.zeros(rows)
    p_t2i = np.zeros(rows)
    for batch, scored in fixed_size_loss_batches(rows, batch_size, np.random.default_rng(seed)):
        logits = logit_scale * image_emb[batch] @ text_emb[batch].T  # (b, b): z_ij = S(I_i, T_j)
        own = np.eye(batch.size, dtype=bool)
        same = proxy_ids[batch][:, None] == proxy_ids[batch][None, :]  # (b, b) co-positives
        # log(1/m_j) on candidate j, a copy of a proxy present m_j times (0 on the own entry).
        copies = -np.log(same.sum(axis=1))  # (b,)
        text_weight = np.where(own, 0.0, copies[None, :]) if proxy_side == "text" else 0.0
        image_weight = np.where(own, 0.0, copies[:, None]) if proxy_side == "image" else 0.0
        allowed = ~same | own
        row_terms = np.where(allowed, logits + text_weight, -np.inf)  # candidates: texts j
        col_terms = np.where(allowed, logits + image_weight, -np.inf)  # candidates: images i
        diagonal = np.diagonal(logits)
        p_i2t[batch[:scored]] = np.exp(diagonal - _logsumexp(row_terms, axis=1))[:scored]
        p_t2i[batch[:scored]] = np.exp(diagonal - _logsumexp(col_terms, axis=0))[:scored]
    return (
        np.clip(p_i2t, 0.0, 1.0).astype(np.float32),
        np.clip(p_t2i, 0.0, 1.0).astype(np.float32),
    )


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    peak = x.max(axis=axis, keepdims=True)
    return (peak + np.log(np.exp(x - peak).sum(axis=axis, keepdims=True))).squeeze(axis)


def _proxy_direction(
    similarity: np.ndarray,
    image_side: np.ndarray,
    text_side: np.ndarray,
    proxy_ids: np.ndarray,
    *,
    proxy_side: str,
    logit_scale: float,
    gamma: float,
    beta: float,
    batch_size: int,
    seed: int,
) -> dict[str, np.ndarray]:
    proxy_ids = np.asarray(proxy_ids, dtype=np.int64)
    found = proxy_ids >= 0
    match = np.zeros(proxy_ids.shape[0], dtype=np.float64)
    if found.any():
        p_i2t, p_t2i = proxy_match_probability(
            image_side[found],
            text_side[found],
            proxy_ids[found],
            proxy_side=proxy_side,
            logit_scale=logit_scale,
            batch_size=batch_size,
            seed=seed,
        )
        match[found] = 0.5 * (p_i2t.astype(np.float64) + p_t2i)
    similarity = np.where(found, similarity, 0.0)
    label = gamma * match * similarity
    # Zero below beta (the reference's cutoff), and for S <= 0 explicitly (§4.9 step 5).
    label = np.where((label < beta) | (similarity <= 0.0) | ~found, 0.0, label)
    label = np.where(np.isnan(similarity), np.nan, label)
    return {
        "label": np.clip(label, 0.0, 1.0).astype(np.float32),
        "similarity": similarity.astype(np.float32),
        "match": match.astype(np.float32),
    }


def sps_proxy_labels(
    u_n: np.ndarray,
    v_n: np.ndarray,
    image_proxy_ids: np.ndarray,
    image_proxy_u: np.ndarray,
    image_proxy_v: np.ndarray,
    text_proxy_ids: np.ndarray,
    text_proxy_u: np.ndarray,
    text_proxy_v: np.ndarray,
    *,
    logit_scale: float,
    gamma: float = 1.0,
    beta: float = 0.5,
    batch_size: int = 128,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """SPS proxy labels of noisy pairs, both directions (METHODS §4.6, §4.9 steps 3 and 5).

    Image direction: İ is the reliable pair whose image is nearest to the noisy image I_n, Ṫ its
    caption; y_p = gamma * P^(I_n, Ṫ) * S(I_n, İ), with P^ the bidirectional in-batch match
    probability over batches of proxy pairs (I_n, Ṫ) with duplicate proxies masked. Text
    direction: T̈ is the reliable text nearest to T_n, Ï its image; y_p^t = gamma * P^(Ï, T_n)
    * S(T_n, T̈). Both: 0 below beta, 0 when S <= 0, clamp to [0, 1]. gamma = 1, beta = 0.5
    reproduce the released code's image direction.

    Args:
        u_n, v_n: (Q, D) float32 L2-normalised noisy image / text embeddings.
        image_proxy_ids: (Q,) int64 id of the reliable pair nearest by image (-1: none, e.g.
            an empty reliable set -> label 0, flagged in "no_proxy").
        image_proxy_u: (Q, D) that pair's image embedding (u of İ).
        image_proxy_v: (Q, D) that pair's text embedding (v of Ṫ, the proxy caption).
        text_proxy_ids: (Q,) int64 id of the reliable pair nearest by text (-1: none).
        text_proxy_u: (Q, D) that pair's image embedding (u of Ï, the proxy image).
        text_proxy_v: (Q, D) that pair's text embedding (v of T̈).
        logit_scale: 1/tau for P^.
        gamma, beta: the proxy-label scale and cutoff.
        batch_size, seed: P^ batching.

    Returns:
        dict of (Q,) arrays: "y_p_img", "y_p_txt" float32 labels; "s_img", "s_txt" float32
        similarities S(I_n, İ), S(T_n, T̈); "p_hat_img", "p_hat_txt" float32 match
        probabilities; "no_proxy" bool (no proxy in either direction).
    """
    u_n = np.asarray(u_n)
    rows = u_n.shape[0]
    v_n = _check_rows("v_n", v_n, rows)
    image_proxy_ids = _check_rows("image_proxy_ids", np.asarray(image_proxy_ids), rows)
    text_proxy_ids = _check_rows("text_proxy_ids", np.asarray(text_proxy_ids), rows)
    options = dict(
        logit_scale=logit_scale, gamma=gamma, beta=beta, batch_size=batch_size, seed=seed
    )
    image = _proxy_direction(
        _rowdot(u_n, _check_rows("image_proxy_u", image_proxy_u, rows)),
        u_n,
        _check_rows("image_proxy_v", image_proxy_v, rows),
        image_proxy_ids,
        proxy_side="text",
        **options,
    )
    text = _proxy_direction(
        _rowdot(v_n, _check_rows("text_proxy_v", text_proxy_v, rows)),
        _check_rows("text_proxy_u", text_proxy_u, rows),
        v_n,
        text_proxy_ids,
        proxy_side="image",
        **options,
    )
    return {
        "y_p_img": image["label"],
        "y_p_txt": text["label"],
        "s_img": image["similarity"],
        "s_txt": text["similarity"],
        "p_hat_img": image["match"],
        "p_hat_txt": text["match"],
        "no_proxy": (np.asarray(image_proxy_ids) < 0) & (np.asarray(text_proxy_ids) < 0),
    }


def sps_proxy_global(
    u: np.ndarray,
    v: np.ndarray,
    is_reliable: np.ndarray,
    query_rows: np.ndarray,
    *,
    ids: np.ndarray | None = None,
    logit_scale: float,
    gamma: float = 1.0,
    beta: float = 0.5,
    batch_size: int = 128,
    seed: int = 0,
    factory: str = "Flat",
    shards: int = 1,
    nprobe: int | None = None,
) -> dict[str, np.ndarray]:
    """`sps_proxy_labels` for `query_rows` of an in-memory corpus, proxies from global search.

    One index over the reliable images and one over the reliable texts (§4.9 step 3); top-1,
    exact scores, ties by sample id.

    Args:
        u, v: (N, D) float32 L2-normalised embeddings.
        is_reliable: (N,) bool reliable set D_re.
        query_rows: (Q,) int64 rows to label (the noisy set).
        ids: (N,) int64 sample ids (proxy ids and tie-breaking; default row index).
        Other arguments: see `sps_proxy_labels` and `pipeline.core.knn.ShardedIndex`.

    Returns:
        `sps_proxy_labels`'s dict plus "image_proxy", "text_proxy" (Q,) int64 proxy rows (-1
        when the reliable set is empty).
    """
    u = np.asarray(u, dtype=np.float32)
    v = _check_rows("v", np.asarray(v, dtype=np.float32), u.shape[0])
    ids = np.arange(u.shape[0], dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
    query_rows = np.asarray(query_rows, dtype=np.int64)
    reliable = np.flatnonzero(np.asarray(is_reliable, dtype=bool) & _finite_rows(u, v))
    reliable = reliable[np.argsort(ids[reliable], kind="stable")]
    proxies = []
    for embeddings in (u, v):
        if reliable.size == 0 or query_rows.size == 0:
            proxies.append(np.full(query_rows.size, -1, dtype=np.int64))
            continue
        index = ShardedIndex.build(
            embeddings[reliable], shards=min(shards, reliable.size), factory=factory, nprobe=nprobe
        )
        _, position = index.search(embeddings[query_rows], 1)
        proxies.append(np.where(position[:, 0] >= 0, reliable[position[:, 0]], -1))
    image_proxy, text_proxy = proxies
    safe_image, safe_text = np.maximum(image_proxy, 0), np.maximum(text_proxy, 0)
    out = sps_proxy_labels(
        u[query_rows],
        v[query_rows],
        np.where(image_proxy >= 0, ids[safe_image], -1),
        u[safe_image],
        v[safe_image],
        np.where(text_proxy >= 0, ids[safe_text], -1),
        u[safe_text],
        v[safe_text],
        logit_scale=logit_scale,
        gamma=gamma,
        beta=beta,
        batch_size=batch_size,
        seed=seed,
    )
    out.update(image_proxy=image_proxy, text_proxy=text_proxy)
    return out


# ----------------------------------------------------------------------------------------------
# Baseline
# ----------------------------------------------------------------------------------------------


def cosine_labels(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """CLIP-score baseline: (1 + cos(u_i, v_i)) / 2, a strictly monotone map onto [0, 1].

    Affine, so AUROC and Spearman equal those of the raw cosine (up to float32 ties); clipping
    at 0 instead would tie every negative cosine and change the AUROC. Not calibrated: CLIP
    cosines of 0.2-0.4 map to 0.6-0.7.

    Args:
        u, v: (N, D) float32 L2-normalised embeddings.

    Returns:
        (N,) float32 in [0, 1].
    """
    return np.clip(0.5 * (1.0 + _rowdot(u, v)), 0.0, 1.0).astype(np.float32)


# Name -> label function. Signatures differ (each method needs different neighbours); the label
# stage dispatches on the name and supplies what the method asks for.
SOFT_LABEL_METHODS = {
    "cosine": cosine_labels,
    "bicro": bicro_labels,
    "bicro_in_batch": bicro_in_batch_anchors,
    "rcr": rcr_ndcg,
    "sps_quasi_clean": sps_quasi_clean_label,
    "sps_proxy": sps_proxy_labels,
}
