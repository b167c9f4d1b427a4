"""SPS: reliable, quasi-clean and noisy pairs; proxy pairs for the noisy ones.

Pure module: numpy, plus a `NeighbourSearch` over the reliable set (docs/methods.md §7).

Contract:
- Partition (from the peer's mixture): reliable posterior > eps1, quasi-clean in (eps2, eps1],
  noisy <= eps2 (1 % rule at eps2, no guard).
- Labels: reliable 1; quasi-clean p + (1 - p) P^ with P^ the labelling model's match
  probability from its own InfoNCE losses; noisy 0 (the original caption is discarded). Each
  noisy pair gets proxy pairs instead: its image with the caption of the reliable pair nearest
  by image (label y_p = gamma P^ S, 0 below beta), and the symmetric text direction; they go
  to the proxies table, and the anchor-key columns name the two proxies. With `proxy:
  prototype` the proxy is the consensus member of the k nearest reliable pairs and y_p =
  gamma |t| S (`prototype_proxy`, IN2R-style).
- `reliable_fallback` > 0: an empty reliable set becomes the top fraction by posterior.
- With a trainee view (co-teaching), the partition and p come from the peer, while P^, the
  reliable-set index, the noisy queries and the logit scale are the trainee's own.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from pipeline.core.labels.arrays import check_rows as _check_rows
from pipeline.core.labels.arrays import rowdot as _rowdot
from pipeline.core.labels.base import INDEX_ROLES, IndexRole, ShardInputs, ShardLabels
from pipeline.core.losses.batching import fixed_size_loss_batches
from pipeline.core.partition.decisions import (
    CLEAN,
    NOISY,
    QUASI_CLEAN,
    PartitionDecisions,
    Select,
    decide_sps_split,
)
from pipeline.core.search.neighbours import NeighbourSearch, nearest, neighbour_rows, top1

__all__ = [
    "PROXY_COLUMNS",
    "decide",
    "index_role",
    "label_shard",
    "prototype_proxy",
    "proxy_match_probability",
    "sps_proxy_labels",
    "sps_quasi_clean_label",
]

# Columns of the proxies table after `key`, as `label_shard` returns them in `proxies`.
PROXY_COLUMNS = (
    "image_proxy_key",
    "image_proxy_caption",
    "y_p_img",
    "s_img",
    "text_proxy_key",
    "y_p_txt",
    "s_txt",
    "p_hat_img",
    "p_hat_txt",
)


def sps_quasi_clean_label(p: np.ndarray, loss_i2t: np.ndarray, loss_t2i: np.ndarray) -> np.ndarray:
    """SPS/CREAM quasi-clean label (docs/methods.md §7.2).

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
    label: np.ndarray = np.clip(p + (1.0 - p) * match, 0.0, 1.0).astype(np.float32)
    return label


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
    """In-batch match probabilities of proxy pairs, duplicate proxies masked (docs/methods.md §7.3).

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
    out: np.ndarray = (peak + np.log(np.exp(x - peak).sum(axis=axis, keepdims=True))).squeeze(axis)
    return out


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
    return {
        "label": _proxy_label(match, similarity, found, gamma=gamma, beta=beta),
        "similarity": similarity.astype(np.float32),
        "match": match.astype(np.float32),
    }


def _proxy_label(
    evidence: np.ndarray, similarity: np.ndarray, found: np.ndarray, *, gamma: float, beta: float
) -> np.ndarray:
    """y_p = gamma * evidence * S, zero below beta (the reference's cutoff), for S <= 0 and
    without a proxy (docs/methods.md §7.3); NaN where S is NaN; float32 in [0, 1]."""
    label = gamma * evidence * similarity
    label = np.where((label < beta) | (similarity <= 0.0) | ~found, 0.0, label)
    label = np.where(np.isnan(similarity), np.nan, label)
    return np.clip(label, 0.0, 1.0).astype(np.float32)


def prototype_proxy(
    query: np.ndarray,
    same: np.ndarray,
    other: np.ndarray,
    found: np.ndarray,
    *,
    logit_scale: float,
    gamma: float = 1.0,
    beta: float = 0.5,
) -> dict[str, np.ndarray]:
    """IN2R-style prototype proxies of one direction (docs/methods.md §7.3, `proxy: prototype`).

    Image direction shown (the text direction swaps the modalities): the k reliable pairs
    nearest to the noisy image weigh w_r = softmax_r(s u_n.u_r); their captions' weighted mean
    t = sum_r w_r v_r is the prototype (IN2R's target without its learned refiner). A caption
    cannot be averaged, so the candidate whose caption is nearest to t is the proxy (the first
    in search order on ties). Its label is y_p = gamma * |t| * S, with |t| in [0, 1] the
    neighbours' consensus (1 when their captions agree) and S = sum_r w_r u_n.u_r; then the
    cut of `_proxy_label`.

    Args:
        query: (Q, D) the noisy pairs' embeddings on the searched side (u_n).
        same: (Q, k, D) the candidates' embeddings on that side (u_r), search order.
        other: (Q, k, D) their embeddings on the other side (v_r: the captions).
        found: (Q, k) bool candidate exists (fewer reliable pairs than k: False).
        logit_scale: s, the labelling model's 1/tau.
        gamma, beta: the proxy-label scale and cutoff.

    Returns:
        dict of (Q,): "choice" int64 the proxy's position in 0..k-1 (-1: no candidate),
        "label", "similarity" (S), "consensus" (|t|) float32.
    """
    query = np.asarray(query, dtype=np.float64)
    same = np.asarray(same, dtype=np.float64)
    other = np.asarray(other, dtype=np.float64)
    found = np.asarray(found, dtype=bool)
    similarity = np.einsum("qd,qkd->qk", query, same)  # (Q, k)
    logits = np.where(found, logit_scale * similarity, -np.inf)
    # numpy's stub types any(axis=...) as bool | ndarray.
    any_found: np.ndarray = found.any(axis=1)  # type: ignore[assignment]
    peak = np.where(any_found, logits.max(axis=1), 0.0)[:, None]
    weights = np.where(found, np.exp(logits - peak), 0.0)
    weights /= np.maximum(weights.sum(axis=1, keepdims=True), 1e-300)
    prototype = np.einsum("qk,qkd->qd", weights, other)  # (Q, D)
    fit = np.where(found, np.einsum("qkd,qd->qk", other, prototype), -np.inf)
    choice = np.where(any_found, np.argmax(fit, axis=1), -1)
    mean_similarity = np.where(any_found, (weights * np.where(found, similarity, 0.0)).sum(1), 0)
    consensus = np.linalg.norm(prototype, axis=1)
    return {
        "choice": choice.astype(np.int64),
        "label": _proxy_label(consensus, mean_similarity, any_found, gamma=gamma, beta=beta),
        "similarity": mean_similarity.astype(np.float32),
        "consensus": consensus.astype(np.float32),
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
    """SPS proxy labels of noisy pairs, both directions (docs/methods.md §7.3).

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
    direction = partial(
        _proxy_direction,
        logit_scale=logit_scale,
        gamma=gamma,
        beta=beta,
        batch_size=batch_size,
        seed=seed,
    )
    image = direction(
        _rowdot(u_n, _check_rows("image_proxy_u", image_proxy_u, rows)),
        u_n,
        _check_rows("image_proxy_v", image_proxy_v, rows),
        image_proxy_ids,
        proxy_side="text",
    )
    text = direction(
        _rowdot(v_n, _check_rows("text_proxy_v", text_proxy_v, rows)),
        _check_rows("text_proxy_u", text_proxy_u, rows),
        v_n,
        text_proxy_ids,
        proxy_side="image",
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


def decide(
    count: dict[str, int], select: Select, threshold: float, params: Any
) -> tuple[PartitionDecisions, dict[str, Any]]:
    """The three-way split (params: eps1, eps2, reliable_fallback)."""
    eps2, reliable_cut, report = decide_sps_split(
        count,
        select,
        eps1=params.eps1,
        eps2=params.eps2,
        reliable_fallback=params.reliable_fallback,
    )
    decisions = PartitionDecisions(
        threshold=threshold,
        sps_eps1=params.eps1,
        sps_eps2=eps2,
        sps_reliable_cut=reliable_cut,
    )
    return decisions, {"sps_split": report}


def index_role(params: Any) -> IndexRole:
    """Proxies are searched among the reliable pairs (their captions are stored)."""
    return INDEX_ROLES["reliable"]


def _nearest_proxies(
    inputs: ShardInputs, neighbours: NeighbourSearch, params: Any, noisy: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The paper's proxies: the nearest reliable pair per direction, y_p = gamma P^ S.
    Returns the chosen rows by image and by text and `sps_proxy_labels`'s dict."""
    u, v, dim = inputs.u[noisy], inputs.v[noisy], inputs.u.shape[1]
    image_nn = top1(neighbours, "image", u, inputs.query_batch)
    text_nn = top1(neighbours, "text", v, inputs.query_batch)
    by_image = neighbour_rows(neighbours, image_nn, ("u", "v", "keys", "captions"), dim)
    by_text = neighbour_rows(neighbours, text_nn, ("u", "v", "keys"), dim)
    out = sps_proxy_labels(
        u,
        v,
        image_nn,
        by_image["u"],
        by_image["v"],
        text_nn,
        by_text["u"],
        by_text["v"],
        logit_scale=inputs.logit_scale,
        gamma=params.gamma,
        beta=params.beta,
        batch_size=params.batch_size,
        seed=inputs.seed,
    )
    return by_image, by_text, out


def _prototype_proxies(
    inputs: ShardInputs, neighbours: NeighbourSearch, params: Any, noisy: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`prototype_proxy` in both directions over the `proxy_k` nearest reliable pairs; the
    consensus |t| stands in the P^ columns. Returns what `_nearest_proxies` does."""
    queries, dim, k = len(noisy), inputs.u.shape[1], params.proxy_k
    chosen: dict[str, dict[str, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for side, query, same, other, fields in (
        ("img", inputs.u[noisy], "u", "v", ("u", "v", "keys", "captions")),
        ("txt", inputs.v[noisy], "v", "u", ("u", "v", "keys")),
    ):
        modality = "image" if side == "img" else "text"
        nn = nearest(neighbours, modality, query, k, inputs.query_batch)  # (Q, k)
        rows = neighbour_rows(neighbours, nn.reshape(-1), fields, dim)
        proxy = prototype_proxy(
            query,
            rows[same].reshape(queries, k, dim),
            rows[other].reshape(queries, k, dim),
            nn >= 0,
            logit_scale=inputs.logit_scale,
            gamma=params.gamma,
            beta=params.beta,
        )
        # No candidate (choice -1): position 0 is missing too, so its key is None.
        pick = np.arange(queries) * k + np.maximum(proxy["choice"], 0)
        chosen[side] = {name: rows[name][pick] for name in fields}
        out.update(
            {
                f"y_p_{side}": proxy["label"],
                f"s_{side}": proxy["similarity"],
                f"p_hat_{side}": proxy["consensus"],
            }
        )
    return chosen["img"], chosen["txt"], out


def label_shard(
    inputs: ShardInputs, neighbours: NeighbourSearch | None, params: Any
) -> ShardLabels:
    """SPS labels and proxy pairs of one shard (params: gamma, beta, batch_size, proxy,
    proxy_k)."""
    n = inputs.u.shape[0]
    masks = inputs.masks
    codes, prob = masks.sps, inputs.scalars.prob
    assert codes is not None and prob is not None  # decide sets eps2; shard_masks needs prob
    label = np.zeros(n, dtype=np.float32)
    label[codes == CLEAN] = 1.0
    quasi = codes == QUASI_CLEAN
    label[quasi] = sps_quasi_clean_label(
        prob[quasi], inputs.loss_i2t[quasi], inputs.loss_t2i[quasi]
    )
    noisy = np.flatnonzero(codes == NOISY)
    image_keys = np.full(n, None, dtype=object)
    text_keys = np.full(n, None, dtype=object)
    proxies = None
    if noisy.size:
        assert neighbours is not None  # index_role is never None
        find = _prototype_proxies if params.proxy == "prototype" else _nearest_proxies
        by_image, by_text, out = find(inputs, neighbours, params, noisy)
        image_keys[noisy] = by_image["keys"]
        text_keys[noisy] = by_text["keys"]
        proxies = {
            "rows": noisy,
            "image_proxy_key": by_image["keys"],
            "image_proxy_caption": by_image["captions"],
            "y_p_img": np.nan_to_num(out["y_p_img"], nan=0.0),
            "s_img": np.nan_to_num(out["s_img"], nan=0.0),
            "text_proxy_key": by_text["keys"],
            "y_p_txt": np.nan_to_num(out["y_p_txt"], nan=0.0),
            "s_txt": np.nan_to_num(out["s_txt"], nan=0.0),
            "p_hat_img": out["p_hat_img"],
            "p_hat_txt": out["p_hat_txt"],
        }
    return ShardLabels(
        soft_label=label,
        subset=codes,
        scores={"sps": label.copy()},
        image_anchor_key=image_keys,
        text_anchor_key=text_keys,
        proxies=proxies,
    )
