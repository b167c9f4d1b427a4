"""Assign: an L2RM-style competitor-aware label from a local partial optimal transport.

Pure module: numpy, plus a `NeighbourSearch` over every pair (docs/methods.md §12).

Contract:
- Partition: the clean split of the configured mixture (reported in `subset`).
- Per query pair i: the k captions nearest to its image and the k images nearest to its
  caption (two searches of the `all` index). The candidate set P_i = {i} ∪ the pairs of both
  lists, de-duplicated, in global-id order. On P_i: the cost -s U_P V_Pᵀ (s: the labelling
  model's logit scale), uniform marginals 1/|P_i| and one dummy row and column carrying 1 - m
  (m: the transported mass, the mixture's clean weight π_c): the entropic partial OT of L2RM,
  solved by Sinkhorn in float64 with a fixed number of iterations.
- Score a_i = |P_i| π_ii in [0, 1]: the share of pair i's mass kept on its own partner. The
  label is min(p_i, a_i) ("min", default) or p_i + (1 - p_i) a_i ("fused"); p_i the posterior.
- Noisy rows: the OT re-solved with the pair's own entry forbidden (L2RM's restriction); the
  caption and the image receiving the most of its mass are its rematch proxies (the proxies
  table, `PROXY_COLUMNS` of SPS).
- Determinism: candidates in id order, exact similarities from stored embeddings, a fixed
  iteration count; labels do not depend on the number of index stores or on query blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.labels.base import IndexRole, ShardInputs, ShardLabels
from pipeline.core.labels.sps import PROXY_COLUMNS
from pipeline.core.partition.decisions import (
    CLEAN,
    NOISY,
    PartitionDecisions,
    Select,
    decide_clean_split,
)
from pipeline.core.search.neighbours import BatchLookup, NeighbourSearch, neighbour_rows

__all__ = [
    "INDEX_ROLE",
    "LABEL_FORMS",
    "SCORE_FORMS",
    "assign_block",
    "assign_label",
    "candidate_sets",
    "competitors",
    "decide",
    "index_role",
    "label_shard",
    "partial_sinkhorn",
    "rematch_block",
]

# The `all` role with the fields the proxies need (keys, captions) besides RCR's groups.
INDEX_ROLE = IndexRole("all", lambda masks: np.ones_like(masks.valid), ("keys", "captions"))
LABEL_FORMS = ("min", "fused")  # labels.assign.label
SCORE_FORMS = ("share", "relative")  # labels.assign.score
# Bound on the candidate embeddings gathered per query block: Q x M x D floats (about 64 MB).
_MAX_GATHERED = 1 << 23


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    """log sum exp along `axis`; -inf where every entry is -inf (no NaN)."""
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.exp(x - peak).sum(axis=axis, keepdims=True)) + peak
    squeezed: np.ndarray = np.squeeze(out, axis=axis)
    return squeezed


def partial_sinkhorn(
    logits: np.ndarray,
    valid: np.ndarray,
    mass: float,
    *,
    epsilon: float = 1.0,
    iterations: int = 50,
    forbid: np.ndarray | None = None,
) -> np.ndarray:
    """Entropic partial OT of a batch of square blocks (L2RM's dummy-point construction).

    Each block has n valid rows (images) and columns (captions), marginals 1/n each, plus one
    dummy row and one dummy column of mass 1 - `mass` at cost 0; the dummy-dummy entry is
    forbidden, so exactly `mass` of the real mass is transported between real rows and columns.
    Cost of a real entry: -logits. Sinkhorn in float64, `iterations` row-column updates (no
    tolerance test: the result is a fixed function of the inputs), as matrix scaling where the
    block's kernel fits float64 and in the log domain otherwise (`_SCALING_SPAN`).

    Args:
        logits: (Q, M, M) float s * u_r . v_c of each block (rows images, columns captions).
        valid: (Q, M) bool real candidates (padding False); the same set on rows and columns.
        mass: m in (0, 1], the transported share of the real mass.
        epsilon: entropic regularisation in logit units (1: the model's own temperature).
        iterations: Sinkhorn iterations.
        forbid: (Q, M, M) bool entries that may carry no mass (the masked diagonal), or None.

    Returns:
        (Q, M + 1, M + 1) float64 transport plans, the dummy row and column last; padded
        rows and columns carry 0.
    """
    logits = np.asarray(logits, dtype=np.float64)
    q, m_pad, _ = logits.shape
    valid = np.asarray(valid, dtype=bool)
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"transported mass must be in (0, 1], got {mass}")
    n = np.maximum(valid.sum(axis=1), 1).astype(np.float64)  # (Q,)
    # log K = -cost / epsilon on the extended (Q, M + 1, M + 1) block.
    kernel = np.zeros((q, m_pad + 1, m_pad + 1))
    kernel[:, :m_pad, :m_pad] = logits / epsilon
    kernel[:, m_pad, m_pad] = -np.inf  # dummy -> dummy: no mass
    if forbid is not None:
        kernel[:, :m_pad, :m_pad] = np.where(forbid, -np.inf, kernel[:, :m_pad, :m_pad])
    with np.errstate(divide="ignore"):
        log_real = np.where(valid, -np.log(n)[:, None], -np.inf)  # (Q, M)
        log_dummy = np.full((q, 1), np.log(1.0 - mass) if mass < 1.0 else -np.inf)
    log_marginal = np.concatenate([log_real, log_dummy], axis=1)  # (Q, M + 1), rows = columns
    plan = np.zeros((q, m_pad + 1, m_pad + 1))
    finite = np.isfinite(kernel)
    top = np.where(finite, kernel, -np.inf).max(axis=(1, 2))  # (Q,)
    low = np.where(finite, kernel, np.inf).min(axis=(1, 2))
    scaled = top - low <= _SCALING_SPAN
    if scaled.any():
        plan[scaled] = _scaling_sinkhorn(
            kernel[scaled], log_marginal[scaled], valid[scaled], iterations
        )
    redo = ~scaled | ~np.isfinite(plan).all(axis=(1, 2))
    if redo.any():
        plan[redo] = _log_sinkhorn(kernel[redo], log_marginal[redo], valid[redo], iterations)
    return plan


# Blocks whose log-kernel spans at most this many units run Sinkhorn's scaling form (matrix
# products, ~25x faster than the log domain's exp and log per entry and iteration): shifted to
# a maximum of 0, every kernel entry and scaling factor stays far inside float64's range
# (e^-250 ~ 1e-109). Wider blocks (sharp temperatures) and any block whose result is not finite
# take the log domain. Both are the same iteration; they agree to rounding (tests/test_assign.py).
_SCALING_SPAN = 250.0


def _scaling_sinkhorn(
    kernel: np.ndarray, log_marginal: np.ndarray, valid: np.ndarray, iterations: int
) -> np.ndarray:
    """Sinkhorn's matrix scaling on exp(kernel) (-inf entries: 0); (Q, M + 1, M + 1) plans."""
    finite = np.isfinite(kernel)
    shift = np.where(finite, kernel, -np.inf).max(axis=(1, 2), keepdims=True)
    with np.errstate(under="ignore"):
        k = np.where(finite, np.exp(np.where(finite, kernel - shift, 0.0)), 0.0)
    marginal = np.exp(log_marginal)  # (Q, M + 1); 0 for padding
    # Column factors start at 1, padding at (and stays) 0: exp of the log domain's start.
    col = np.concatenate([valid, np.ones((len(valid), 1), dtype=bool)], axis=1).astype(float)
    row = np.zeros_like(col)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(iterations):
            sums = np.einsum("qij,qj->qi", k, col)
            row = np.divide(marginal, sums, out=np.zeros_like(row), where=sums > 0)
            sums = np.einsum("qij,qi->qj", k, row)
            col = np.divide(marginal, sums, out=np.zeros_like(col), where=sums > 0)
        plan: np.ndarray = row[:, :, None] * k * col[:, None, :]
        return plan


def _log_sinkhorn(
    kernel: np.ndarray, log_marginal: np.ndarray, valid: np.ndarray, iterations: int
) -> np.ndarray:
    """The same iteration in the log domain (any span); (Q, M + 1, M + 1) plans."""
    q = kernel.shape[0]
    alpha = np.zeros((q, kernel.shape[1]))  # row potentials / epsilon
    # Column potentials / epsilon: padding starts (and stays) at -inf, so it never takes part.
    beta = np.concatenate([np.where(valid, 0.0, -np.inf), np.zeros((q, 1))], axis=1)
    for _ in range(iterations):
        alpha = log_marginal - _logsumexp(kernel + beta[:, None, :], axis=2)
        beta = log_marginal - _logsumexp(kernel + alpha[:, :, None], axis=1)
    with np.errstate(invalid="ignore"):
        log_plan = alpha[:, :, None] + beta[:, None, :] + kernel
    return np.where(np.isfinite(log_plan), np.exp(np.nan_to_num(log_plan, neginf=-np.inf)), 0.0)


def candidate_sets(
    self_ids: np.ndarray, text_ids: np.ndarray, image_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """P_i = {i} ∪ the competitor lists, de-duplicated, in increasing id order.

    Args:
        self_ids: (Q,) int64 global id of each query pair.
        text_ids: (Q, k) int64 captions competing for its image (-1: missing).
        image_ids: (Q, k') int64 images competing for its caption (-1: missing).

    Returns:
        ids (Q, M) int64 with M = 1 + k + k', each row sorted ascending with -1 padding at the
        end; and (Q,) int64 the position of the query's own id in its row.
    """
    self_ids = np.asarray(self_ids, dtype=np.int64)
    stacked = np.concatenate(
        [self_ids[:, None], np.asarray(text_ids, np.int64), np.asarray(image_ids, np.int64)], 1
    )
    big = np.iinfo(np.int64).max
    keyed = np.sort(np.where(stacked >= 0, stacked, big), axis=1)
    repeat = np.zeros_like(keyed, dtype=bool)
    repeat[:, 1:] = keyed[:, 1:] == keyed[:, :-1]
    ids = np.sort(np.where(repeat, big, keyed), axis=1)
    ids = np.where(ids == big, -1, ids)
    position = np.argmax(ids == self_ids[:, None], axis=1)
    return ids, position


def competitors(
    neighbours: NeighbourSearch, u: np.ndarray, v: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k captions nearest to each image and the k images nearest to each caption.

    Args:
        neighbours: search over the `all` index.
        u, v: (Q, D) float32 query images / captions.
        k: list length.

    Returns:
        text_ids, image_ids: (Q, k) int64 global ids, canonical order (score desc, id asc),
        -1 when the index holds fewer than k rows.
    """
    _, text_ids = neighbours.search("text", u, k)
    _, image_ids = neighbours.search("image", v, k)
    return text_ids, image_ids


def assign_block(
    u_p: np.ndarray,
    v_p: np.ndarray,
    valid: np.ndarray,
    position: np.ndarray,
    *,
    logit_scale: float,
    mass: float,
    epsilon: float = 1.0,
    iterations: int = 50,
    rematch: np.ndarray | None = None,
    score: str = "relative",
) -> dict[str, np.ndarray]:
    """Assignment scores of a block of queries from their candidates' embeddings.

    Args:
        u_p, v_p: (Q, M, D) float32 images / captions of the candidates (padding: any finite).
        valid: (Q, M) bool real candidates.
        position: (Q,) int64 the query's own position in its candidate list.
        logit_scale: s, the labelling model's 1/tau.
        mass, epsilon, iterations: as `partial_sinkhorn`.
        rematch: (Q,) bool queries to re-solve with their own entry forbidden, or None.
        score: "share": a = |P| pi_ii, the share of the pair's mass kept on its own partner;
            "relative": pi_ii over the largest real entry of the pair's row and column.

    Returns:
        dict of (Q,): "assign" float32 a in [0, 1]; "size" int64 |P|; with
        `rematch`, for those rows: "text_pos" / "image_pos" int64 candidate positions of the
        caption receiving the most of the image's mass and of the image sending the most to
        the caption (-1: none), "text_share" / "image_share" float32 that mass times |P|.
    """
    u64 = np.asarray(u_p, dtype=np.float64)
    v64 = np.asarray(v_p, dtype=np.float64)
    logits = logit_scale * np.matmul(u64, np.swapaxes(v64, 1, 2))  # (Q, M, M)
    q, m_pad = valid.shape
    rows = np.arange(q)
    size = valid.sum(axis=1)
    # (Q, M + 1, M + 1)
    plan = partial_sinkhorn(logits, valid, mass, epsilon=epsilon, iterations=iterations)
    own = plan[rows, position, position]
    if score == "share":
        value = size * own
    elif score == "relative":
        # Own entry over the largest real entry of its row or column: 1 when the pair's own
        # partner receives the most mass both ways (the OT form of the contextual margin).
        row_max = np.where(valid, plan[rows, position, :m_pad], 0.0).max(axis=1)  # (Q,)
        col_max = np.where(valid, plan[rows, :m_pad, position], 0.0).max(axis=1)
        best = np.maximum(row_max, col_max)
        value = np.divide(own, best, out=np.zeros(q), where=best > 0)
    else:
        raise ValueError(f"labels.assign.score must be one of {SCORE_FORMS}, got {score!r}")
    out: dict[str, np.ndarray] = {
        "assign": np.clip(value, 0.0, 1.0).astype(np.float32),
        "size": size.astype(np.int64),
    }
    if rematch is not None:
        out.update(
            rematch_block(
                logits, valid, position, rematch, mass=mass, epsilon=epsilon, iterations=iterations
            )
        )
    return out


def rematch_block(
    logits: np.ndarray,
    valid: np.ndarray,
    position: np.ndarray,
    rematch: np.ndarray,
    *,
    mass: float,
    epsilon: float = 1.0,
    iterations: int = 50,
) -> dict[str, np.ndarray]:
    """L2RM's rematch: the OT of the `rematch` queries re-solved with their own entry forbidden.

    Args:
        logits: (Q, M, M) float64 s * u_r . v_c of each block, as `assign_block` builds them.
        valid: (Q, M) bool real candidates.
        position: (Q,) int64 the query's own position in its candidate list.
        rematch: (Q,) bool queries to re-solve; the others keep -1 and 0.
        mass, epsilon, iterations: as `partial_sinkhorn`.

    Returns:
        dict of (Q,): "text_pos" / "image_pos" int64 candidate positions of the caption
        receiving the most of the image's mass and of the image sending the most to the
        caption (-1: none or not rematched), "text_share" / "image_share" float32 that mass
        times |P|.
    """
    q, m_pad = valid.shape
    size = valid.sum(axis=1)
    picked = np.flatnonzero(np.asarray(rematch, dtype=bool))
    text_pos = np.full(q, -1, dtype=np.int64)
    image_pos = np.full(q, -1, dtype=np.int64)
    text_share = np.zeros(q, dtype=np.float32)
    image_share = np.zeros(q, dtype=np.float32)
    out: dict[str, np.ndarray] = dict(
        text_pos=text_pos, image_pos=image_pos, text_share=text_share, image_share=image_share
    )
    if not picked.size:
        return out
    sub = np.arange(picked.size)
    pos = position[picked]
    forbid = np.zeros((picked.size, m_pad, m_pad), dtype=bool)
    forbid[sub, pos, pos] = True
    masked = partial_sinkhorn(
        logits[picked], valid[picked], mass, epsilon=epsilon, iterations=iterations, forbid=forbid
    )
    # Real, valid, not the pair itself; argmax takes the first maximum: the smallest id.
    allowed = valid[picked] & (np.arange(m_pad)[None, :] != pos[:, None])
    row = np.where(allowed, masked[sub, pos, :m_pad], -1.0)  # the image's mass by caption
    col = np.where(allowed, masked[sub, :m_pad, pos], -1.0)  # the caption's mass by image
    best_text, best_image = row.argmax(axis=1), col.argmax(axis=1)
    scale = size[picked]
    text_pos[picked] = np.where(row[sub, best_text] > 0, best_text, -1)
    image_pos[picked] = np.where(col[sub, best_image] > 0, best_image, -1)
    text_share[picked] = np.clip(scale * np.maximum(row[sub, best_text], 0), 0, 1)
    image_share[picked] = np.clip(scale * np.maximum(col[sub, best_image], 0), 0, 1)
    return out


def assign_label(p: np.ndarray, a: np.ndarray, form: str = "min") -> np.ndarray:
    """The soft label from the posterior p and the assignment score a, both (N,) in [0, 1].

    "min": min(p, a), which can demote a pair the loss calls clean (a page swap with a high
    cosine); "fused": p + (1 - p) a, which can only promote (CREAM/SPS's quasi-clean form).
    Returns (N,) float32 in [0, 1].
    """
    p = np.clip(np.nan_to_num(np.asarray(p, dtype=np.float64), nan=0.0), 0.0, 1.0)
    a = np.clip(np.nan_to_num(np.asarray(a, dtype=np.float64), nan=0.0), 0.0, 1.0)
    if form == "min":
        label: np.ndarray = np.minimum(p, a)
    elif form == "fused":
        label = p + (1.0 - p) * a
    else:
        raise ValueError(f"labels.assign.label must be one of {LABEL_FORMS}, got {form!r}")
    return label.astype(np.float32)


def decide(
    count: dict[str, int], select: Select, threshold: float, params: Any
) -> tuple[PartitionDecisions, dict[str, Any]]:
    """The clean split of the configured mixture (it fills `subset`)."""
    threshold, guard_cut, _, report = decide_clean_split(count, select, threshold=threshold)
    return PartitionDecisions(threshold=threshold, guard_cut=guard_cut), {"clean_split": report}


def index_role(params: Any) -> IndexRole:
    """Competitors are searched over every pair; keys and captions name the rematches."""
    return INDEX_ROLE


def _mass(inputs: ShardInputs, params: Any) -> float:
    """m: `params.mass` (the stage sets the mixture's clean weight pi_c), else the shard's share
    of valid rows in the clean split (in-memory passes without a fit)."""
    mass = getattr(params, "mass", None)
    if mass is None:
        valid = inputs.masks.valid
        mass = float(inputs.masks.clean[valid].mean()) if valid.any() else 1.0
    return float(min(max(mass, 1e-3), 1.0))


def label_shard(
    inputs: ShardInputs, neighbours: NeighbourSearch | None, params: Any
) -> ShardLabels:
    """Assignment labels and rematch proxies of one shard (params: k, epsilon, iterations,
    score, label, mass)."""
    assert neighbours is not None  # index_role is never None
    u, v, ids = inputs.u, inputs.v, inputs.scalars.ids
    n, dim = u.shape
    masks = inputs.masks
    subset = np.where(masks.clean, CLEAN, NOISY).astype(np.int8)
    score = np.zeros(n, dtype=np.float32)
    mass = _mass(inputs, params)
    width = 1 + 2 * params.k
    batch = max(1, min(inputs.query_batch, _MAX_GATHERED // (width * max(dim, 1))))
    # Per row: the rematched caption's / image's pair id and its mass share.
    rematch: dict[str, np.ndarray] = {
        "text": np.full(n, -1, dtype=np.int64),
        "image": np.full(n, -1, dtype=np.int64),
        "text_share": np.zeros(n, dtype=np.float32),
        "image_share": np.zeros(n, dtype=np.float32),
    }
    queries = np.flatnonzero(inputs.finite)  # non-finite rows are not indexed: score 0
    for start in range(0, queries.size, batch):
        rows = queries[start : start + batch]
        text_ids, image_ids = competitors(neighbours, u[rows], v[rows], params.k)
        cand, position = candidate_sets(ids[rows], text_ids, image_ids)
        valid = cand >= 0
        unique = np.unique(cand[valid])
        stored = neighbours.lookup(unique, ("u", "v"))
        safe = np.maximum(cand, 0)
        u_p = BatchLookup(unique, stored["u"])(safe.ravel()).reshape(*cand.shape, dim)
        v_p = BatchLookup(unique, stored["v"])(safe.ravel()).reshape(*cand.shape, dim)
        out = assign_block(
            u_p,
            v_p,
            valid,
            position,
            logit_scale=inputs.logit_scale,
            mass=mass,
            epsilon=params.epsilon,
            iterations=params.iterations,
            rematch=subset[rows] == NOISY,
            score=params.score,
        )
        score[rows] = out["assign"]
        block = np.arange(rows.size)
        for side in ("text", "image"):
            found = out[f"{side}_pos"]
            rematch[side][rows] = np.where(found >= 0, cand[block, np.maximum(found, 0)], -1)
            rematch[f"{side}_share"][rows] = out[f"{side}_share"]
    prob = inputs.scalars.prob
    assert prob is not None  # the partition (shard_masks) needs it
    soft = assign_label(prob, score, params.label)
    labels = ShardLabels(soft_label=soft, subset=subset, scores={"assign": score})
    noisy = np.flatnonzero(subset == NOISY)
    labels.proxies = _proxies(neighbours, noisy, u, v, dim, rematch)
    # The anchor-key columns name the two rematches, as they name SPS's proxies.
    labels.image_anchor_key = np.full(n, None, dtype=object)
    labels.text_anchor_key = np.full(n, None, dtype=object)
    labels.image_anchor_key[noisy] = labels.proxies["image_proxy_key"]
    labels.text_anchor_key[noisy] = labels.proxies["text_proxy_key"]
    return labels


def _proxies(
    neighbours: NeighbourSearch,
    noisy: np.ndarray,
    u: np.ndarray,
    v: np.ndarray,
    dim: int,
    rematch: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The rematch proxies of the noisy rows in the SPS proxies-table layout.

    Image direction: the noisy image with the caption of the pair its mass goes to most
    (`image_proxy_*`, y_p_img = that mass share); text direction: the image of the pair that
    sends the noisy caption the most mass (`text_proxy_key`, y_p_txt). s_*: the rematched
    pair's cosine; p_hat_*: the same mass share (no in-batch P^ here).
    """
    text_nn, image_nn = rematch["text"][noisy], rematch["image"][noisy]
    by_text = neighbour_rows(neighbours, text_nn, ("v", "keys", "captions"), dim)
    by_image = neighbour_rows(neighbours, image_nn, ("u", "keys"), dim)
    s_img = np.where(text_nn >= 0, (u[noisy] * by_text["v"]).sum(axis=1), 0.0)
    s_txt = np.where(image_nn >= 0, (by_image["u"] * v[noisy]).sum(axis=1), 0.0)
    y_img = np.where(text_nn >= 0, rematch["text_share"][noisy], 0.0).astype(np.float32)
    y_txt = np.where(image_nn >= 0, rematch["image_share"][noisy], 0.0).astype(np.float32)
    proxies = {
        "rows": noisy,
        "image_proxy_key": by_text["keys"],
        "image_proxy_caption": by_text["captions"],
        "y_p_img": y_img,
        "s_img": s_img.astype(np.float32),
        "text_proxy_key": by_image["keys"],
        "y_p_txt": y_txt,
        "s_txt": s_txt.astype(np.float32),
        "p_hat_img": y_img.copy(),
        "p_hat_txt": y_txt.copy(),
    }
    assert set(proxies) == {"rows", *PROXY_COLUMNS}
    return proxies
