"""BiCro: bidirectional cross-modal similarity consistency against clean anchors.

Pure module: numpy, plus a `NeighbourSearch` for the global anchors (docs/methods.md §5).

Contract:
- Partition: the clean split of the configured mixture (1 % rule, symmetric guard); with
  global anchors, the ceil(rho x |clean|) lowest-loss clean pairs are the anchors (ties by id).
- Labels: anchors 1; every other pair compares its similarity to its nearest anchor (by image,
  then by text) across modalities: c = (fold(A, B) + fold(A', B')) / 2, each fold averaged
  over the `anchor_k` nearest anchors of its side (1: the paper's); clean non-anchors get
  clean_floor + (1 - clean_floor) c, noisy pairs c; BiCro* sets labels <= theta to 0.
  `soft_label` is BiCro*, the `bicro` column the raw label, the anchor-key columns name the
  anchors a* (by image) and b* (by text).
- With `centre`, the label pass hands in embeddings centred on the corpus mean of each
  modality (queries and anchors alike; `pipeline.core.labels.centring`).
- `anchors: in_batch` reproduces the released per-batch anchors within each shard (no index).
- Outputs are aligned with the input rows: permuting the rows permutes the labels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from pipeline.core.labels.arrays import check_rows as _check_rows
from pipeline.core.labels.arrays import rowdot as _rowdot
from pipeline.core.labels.base import INDEX_ROLES, IndexRole, ShardInputs, ShardLabels
from pipeline.core.partition.decisions import (
    CLEAN,
    NOISY,
    PartitionDecisions,
    Select,
    decide_anchors,
    decide_clean_split,
)
from pipeline.core.search.neighbours import NeighbourSearch, nearest, neighbour_rows

__all__ = [
    "bicro_in_batch_anchors",
    "bicro_labels",
    "centred",
    "consistency_ratios",
    "decide",
    "fold",
    "fused_labels",
    "index_role",
    "label_shard",
    "quality_scores",
    "step_labels",
]

# Distances below this are floored (BiCro's Euclidean path clamps d^2 at 1e-4).
_MIN_DISTANCE = 1e-2


def fold(a: ArrayLike, b: ArrayLike, eps: float = 1e-6) -> np.ndarray:
    """BiCro's consistency fold (docs/methods.md §5.3), elementwise.

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
    """BiCro labels of pairs given their nearest anchors (docs/methods.md §5.3-§5.4).

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
    r_i2t, r_t2i = consistency_ratios(
        u,
        v,
        (anchor_u_nn, anchor_v_of_u_nn),
        (anchor_u_of_v_nn, anchor_v_nn),
        ratio=ratio,
        eps=eps,
    )
    return step_labels(r_i2t, r_t2i, is_anchor, is_clean, clean_floor=clean_floor, theta=theta)


def consistency_ratios(
    u: np.ndarray,
    v: np.ndarray,
    by_image: tuple[np.ndarray, np.ndarray],
    by_text: tuple[np.ndarray, np.ndarray],
    *,
    ratio: str = "similarity",
    eps: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray]:
    """BiCro's two consistency ratios of pairs against one anchor per side, (Q,) float64:
    r_i2t = fold(u.u_a*, v.v_a*) with by_image = (u_a*, v_a*) of the nearest anchor by image,
    r_t2i = fold(v.v_b*, u.u_b*) with by_text = (u_b*, v_b*) of the nearest anchor by text."""
    u = np.asarray(u)
    rows = u.shape[0]
    v = _check_rows("v", v, rows)
    (image_u, image_v), (text_u, text_v) = by_image, by_text
    image_a = _rowdot(u, _check_rows("anchor_u_nn", image_u, rows))
    image_b = _rowdot(v, _check_rows("anchor_v_of_u_nn", image_v, rows))
    text_a = _rowdot(v, _check_rows("anchor_v_nn", text_v, rows))
    text_b = _rowdot(u, _check_rows("anchor_u_of_v_nn", text_u, rows))
    return _ratio(image_a, image_b, ratio, eps), _ratio(text_a, text_b, ratio, eps)


def step_labels(
    r_i2t: ArrayLike,
    r_t2i: ArrayLike,
    is_anchor: ArrayLike,
    is_clean: ArrayLike,
    *,
    clean_floor: float = 0.5,
    theta: float = 0.5,
) -> dict[str, np.ndarray]:
    """BiCro's step label from the two (Q,) ratios: c = (r_i2t + r_t2i) / 2; anchors 1, clean
    non-anchors clean_floor + (1 - clean_floor) c, noisy pairs c; BiCro* cuts <= theta to 0.
    Returns `bicro_labels`'s dict."""
    rows = np.shape(r_i2t)[0]
    is_anchor = _check_rows("is_anchor", np.asarray(is_anchor, dtype=bool), rows)
    is_clean = _check_rows("is_clean", np.asarray(is_clean, dtype=bool), rows)
    r_i2t = np.asarray(r_i2t, dtype=np.float64)
    r_t2i = _check_rows("r_t2i", np.asarray(r_t2i, dtype=np.float64), rows)
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
    """BiCro's released per-batch anchors (docs/methods.md §5.6), labels aligned to samples.

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
            "(docs/methods.md §3.2) first."
        )
    image_nn, text_nn, is_anchor = _in_batch_nearest_anchors(
        u, v, losses, is_clean, ids, batch_size, np.random.default_rng(seed)
    )
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


def _in_batch_nearest_anchors(
    u: np.ndarray,
    v: np.ndarray,
    losses: np.ndarray,
    is_clean: np.ndarray,
    ids: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pair's nearest anchor by image and by text within its batch, and the anchors.

    Returns:
        image_nn, text_nn (N,) int64 rows; is_anchor (N,) bool.
    """
    n = u.shape[0]

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
    return image_nn, text_nn, is_anchor


def decide(
    count: dict[str, int], select: Select, threshold: float, params: Any
) -> tuple[PartitionDecisions, dict[str, Any]]:
    """The clean split and, with global anchors, the anchor cut (params: anchors,
    anchor_fraction)."""
    threshold, guard_cut, n_clean, report = decide_clean_split(count, select, threshold=threshold)
    partition: dict[str, Any] = {"clean_split": report}
    anchor_cut = None
    if params.anchors == "global" and n_clean > 0:
        interim = PartitionDecisions(threshold=threshold, guard_cut=guard_cut)
        anchor_cut, partition["anchors"] = decide_anchors(
            select, n_clean, interim, fraction=params.anchor_fraction
        )
    decisions = PartitionDecisions(threshold=threshold, guard_cut=guard_cut, anchor_cut=anchor_cut)
    return decisions, partition


def index_role(params: Any) -> IndexRole | None:
    """Global anchors are searched in an index over the anchors; in-batch anchors need none."""
    return INDEX_ROLES["anchors"] if params.anchors == "global" else None


def _global_anchor_labels(
    inputs: ShardInputs, neighbours: NeighbourSearch, params: Any
) -> ShardLabels:
    u, v, masks = inputs.u, inputs.v, inputs.masks
    n, k = u.shape[0], params.anchor_k
    queries = np.flatnonzero(~masks.anchor & inputs.finite)
    image_nn = np.full((n, k), -1, dtype=np.int64)
    text_nn = np.full((n, k), -1, dtype=np.int64)
    image_nn[queries] = nearest(neighbours, "image", u[queries], k, inputs.query_batch)
    text_nn[queries] = nearest(neighbours, "text", v[queries], k, inputs.query_batch)
    r_i2t, r_t2i, keys = _mean_anchor_ratios(u, v, neighbours, image_nn, text_nn, params.ratio)
    labels = step_labels(
        r_i2t,
        r_t2i,
        masks.anchor,
        masks.clean,
        clean_floor=params.clean_floor,
        theta=params.theta,
    )
    no_anchor = (image_nn[:, 0] < 0) & ~masks.anchor  # empty anchor set: nothing to compare with
    out = _shard_labels(inputs, labels, no_anchor, params)
    out.image_anchor_key, out.text_anchor_key = keys
    return out


def _mean_anchor_ratios(
    u: np.ndarray,
    v: np.ndarray,
    neighbours: NeighbourSearch,
    image_nn: np.ndarray,
    text_nn: np.ndarray,
    ratio: str,
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """r_i2t and r_t2i averaged over each pair's k nearest anchors by image and by text
    (`labels.bicro.anchor_k`; k = 1 is BiCro's single nearest anchor), NaN where a side has
    none; and the keys of the nearest anchor of each side (the anchor-key columns). One lookup
    per side fetches all k anchors' rows."""
    n, dim = u.shape
    k = image_nn.shape[1]
    fields = ("u", "v", "keys")
    by_image = neighbour_rows(neighbours, image_nn.reshape(-1), fields, dim)
    by_text = neighbour_rows(neighbours, text_nn.reshape(-1), fields, dim)
    r_i2t, r_t2i = consistency_ratios(
        np.repeat(u, k, axis=0),
        np.repeat(v, k, axis=0),
        (by_image["u"], by_image["v"]),
        (by_text["u"], by_text["v"]),
        ratio=ratio,
    )
    mean = []
    for values, nn in ((r_i2t, image_nn), (r_t2i, text_nn)):
        found = nn >= 0
        total = np.where(found, values.reshape(n, k), 0.0).sum(axis=1)
        count = found.sum(axis=1)
        mean.append(np.divide(total, count, out=np.full(n, np.nan), where=count > 0))
    keys = (by_image["keys"].reshape(n, k)[:, 0], by_text["keys"].reshape(n, k)[:, 0])
    return mean[0], mean[1], keys


def fused_labels(
    prob: np.ndarray, r_i2t: np.ndarray, r_t2i: np.ndarray, is_anchor: np.ndarray
) -> np.ndarray:
    """The fused label y = p + (1 - p) c (the NCR/CREAM form; docs/methods.md §5.4): the clean
    posterior p raised by the consistency c = (r_i2t + r_t2i) / 2; anchors 1.

    Unlike the step label (clean_floor + ..., or c for noisy pairs) it keeps the ranking of both
    evidences: a pair's label grows with its posterior and with its consistency.

    Returns:
        (N,) float32 in [0, 1] (NaN consistency, i.e. no anchor to compare with, counts as 0).
    """
    p = np.clip(np.nan_to_num(np.asarray(prob, np.float64), nan=0.0), 0.0, 1.0)
    c = np.nan_to_num(0.5 * (np.asarray(r_i2t, np.float64) + r_t2i), nan=0.0)
    fused = np.where(np.asarray(is_anchor, bool), 1.0, p + (1.0 - p) * np.clip(c, 0.0, 1.0))
    return np.clip(fused, 0.0, 1.0).astype(np.float32)


def _shard_labels(
    inputs: ShardInputs, labels: dict[str, np.ndarray], no_anchor: np.ndarray, params: Any
) -> ShardLabels:
    """The shard's labels in the configured form (`params.label`): the step label and its
    BiCro* cut, or the fused label, published uncut (the cut applies to training weights)."""
    masks = inputs.masks
    if params.label == "fused":
        r_i2t = np.where(no_anchor, np.nan, labels["r_i2t"])
        prob = inputs.scalars.prob
        assert prob is not None  # the partition (shard_masks) needs it
        soft = fused_labels(prob, r_i2t, labels["r_t2i"], masks.anchor)
        raw = soft
    else:
        raw = np.where(no_anchor, 0.0, np.nan_to_num(labels["bicro"], nan=0.0))
        soft = np.where(no_anchor, 0.0, np.nan_to_num(labels["bicro_star"], nan=0.0))
    return ShardLabels(
        soft_label=np.asarray(soft, np.float32),
        subset=np.where(masks.clean, CLEAN, NOISY).astype(np.int8),
        scores={"bicro": np.asarray(raw, np.float32)},
    )


def _in_batch_labels(inputs: ShardInputs, params: Any) -> ShardLabels:
    u, v, masks, scalars = inputs.u, inputs.v, inputs.masks, inputs.scalars
    n = u.shape[0]
    nothing = np.full(n, np.nan, dtype=np.float32)
    labels = {"bicro": nothing, "bicro_star": nothing, "r_i2t": nothing, "r_t2i": nothing}
    anchor = np.zeros(n, dtype=bool)
    if masks.clean.any():
        labels = bicro_in_batch_anchors(
            u,
            v,
            np.where(masks.valid, scalars.loss, np.inf),
            masks.clean,
            ids=scalars.ids,
            batch_size=params.batch_size,
            seed=inputs.seed,
            clean_floor=params.clean_floor,
            theta=params.theta,
            ratio=params.ratio,
        )
        anchor = labels["is_anchor"]
    masks.anchor = anchor  # the shard's own anchors, counted in the pass summary
    return _shard_labels(inputs, labels, np.zeros(n, dtype=bool), params)


def label_shard(
    inputs: ShardInputs, neighbours: NeighbourSearch | None, params: Any
) -> ShardLabels:
    """BiCro labels of one shard (params: the `labels.bicro` settings)."""
    if params.anchors == "global":
        assert neighbours is not None  # index_role asks for the anchors' index
        return _global_anchor_labels(inputs, neighbours, params)
    return _in_batch_labels(inputs, params)


def centred(params: Any) -> bool:
    """`labels.bicro.centre`: fold similarities of embeddings centred on each modality's corpus
    mean, so a near-collapsed space (every cosine high) does not make every pair consistent."""
    return bool(params.centre)


def weight_cut(params: Any) -> float:
    """The fused label is published uncut; theta then cuts the training weights (BiCro*)."""
    return params.theta if params.label == "fused" else 0.0


def quality_scores(
    inputs: ShardInputs, labels: ShardLabels, cosine: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The raw label (before the theta cut) as an ablation score."""
    return {"bicro_raw": labels.scores["bicro"]}, {"bicro_raw": labels.subset == CLEAN}
