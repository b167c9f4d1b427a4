"""A whole label pass over in-memory arrays, with the label stage's own functions.

Pure module. `label_in_memory` runs the same steps as the Ray label pass (partition counts, the
method's decisions through radix selects, the index over the role's rows, per-shard labels)
in this process, with `build_local_neighbours` as the neighbour-search back-end. Unit tests,
notebooks and benchmarks use it; for the same posteriors and embeddings it gives the Ray pass's
labels bit for bit, whatever the number of shards or index stores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar, cast

import numpy as np

from pipeline.core.labels import (
    IndexRole,
    LabelMethod,
    ShardInputs,
    ShardLabels,
    get_method,
    label_shard,
)
from pipeline.core.labels.centring import centre, corpus_means, embedding_sums
from pipeline.core.partition.decisions import (
    PartitionDecisions,
    ShardMasks,
    ShardScalars,
    partition_counts,
    selection_rows,
    shard_masks,
)
from pipeline.core.partition.select import radix_select, select_round
from pipeline.core.search.neighbours import ShardedNeighbours, build_local_neighbours, image_groups

__all__ = ["InMemoryResult", "label_in_memory"]


@dataclass
class InMemoryResult:
    labels: ShardLabels  # every row, concatenated in row order
    masks: ShardMasks  # the corpus's partition (with in-batch anchors when used)
    decisions: PartitionDecisions
    partition: dict[str, Any]  # the decision report (as in the pass summary)


_Rows = TypeVar("_Rows", ShardScalars, ShardMasks)


def _rows(obj: _Rows, rows: slice) -> _Rows:
    """A dataclass of per-row arrays restricted to `rows` (None fields stay None)."""
    values = {
        f.name: (v[rows] if isinstance(v, np.ndarray) else v)
        for f in fields(obj)
        for v in [getattr(obj, f.name)]
    }
    return type(obj)(**values)


def _concat(parts: list[ShardLabels]) -> ShardLabels:
    def cat(values: list[np.ndarray | None]) -> np.ndarray | None:
        # A method fills an optional column in every shard or in none.
        return None if values[0] is None else np.concatenate(cast(list[np.ndarray], values))

    proxies: dict[str, np.ndarray] | None = None
    found = [(i, p.proxies) for i, p in enumerate(parts) if p.proxies is not None]
    if found:
        offsets = np.cumsum([0] + [p.soft_label.size for p in parts])
        proxies = {
            name: np.concatenate(
                [(prox[name] + offsets[i]) if name == "rows" else prox[name] for i, prox in found]
            )
            for name in found[0][1]
        }
    return ShardLabels(
        soft_label=np.concatenate([p.soft_label for p in parts]),
        subset=np.concatenate([p.subset for p in parts]),
        scores={name: np.concatenate([p.scores[name] for p in parts]) for name in parts[0].scores},
        image_anchor_key=cat([p.image_anchor_key for p in parts]),
        text_anchor_key=cat([p.text_anchor_key for p in parts]),
        proxies=proxies,
    )


def _decide(
    entry: LabelMethod, params: Any, scalars: ShardScalars, threshold: float, fetch_limit: int
) -> tuple[PartitionDecisions, dict[str, Any]]:
    """The method's decisions with the radix select over the one in-memory shard."""
    count = partition_counts(
        scalars,
        threshold=threshold,
        sps_eps1=getattr(params, "eps1", None),
        sps_eps2=getattr(params, "eps2", None),
        rcr_delta=getattr(params, "delta", None),
    )

    def select(
        what: str,
        k: int,
        in_play: int,
        decisions: PartitionDecisions | None = None,
        with_id: bool = True,
    ) -> tuple[int, int | None, int]:
        keys, ids = selection_rows(scalars, what, decisions)
        return radix_select(
            lambda prefix, fetch: [select_round(keys, ids, prefix, fetch)],
            k,
            in_play,
            with_id=with_id,
            fetch_limit=fetch_limit,
        )

    return entry.decide(count, select, threshold, params)


def _neighbours(
    role: IndexRole | None,
    masks: ShardMasks,
    u: np.ndarray,
    v: np.ndarray,
    ids: np.ndarray,
    keys: np.ndarray | None,
    captions: np.ndarray | None,
    image_hashes: list[str | None] | None,
    layout: dict[str, Any],
) -> ShardedNeighbours | None:
    """In-process stores over the role's rows (None when the method searches nothing)."""
    if role is None:
        return None
    n = ids.size
    stored = {
        "keys": np.asarray([str(i) for i in ids] if keys is None else keys, dtype=object),
        "captions": np.asarray([None] * n if captions is None else captions, dtype=object),
        "groups": image_groups(image_hashes, ids),
    }
    finite = np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)
    rows = np.flatnonzero(role.rows(masks) & finite)
    part = {"ids": ids[rows], "u": u[rows], "v": v[rows]}
    part.update({name: stored[name][rows] for name in role.fields})
    return build_local_neighbours([part], dim=u.shape[1], **layout)


def _labelling_embeddings(
    entry: LabelMethod, params: Any, u: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """float32 (u, v), centred on the corpus means when the method centres: exact sums, so the
    same means as the Ray pass's per-shard sums whatever the sharding."""
    u = np.ascontiguousarray(u, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not entry.centred(params):
        return u, v
    mean_u, mean_v = corpus_means(embedding_sums(u, v))
    return centre(u, mean_u), centre(v, mean_v)


def _scalars(
    ids: np.ndarray,
    loss: np.ndarray,
    prob: np.ndarray,
    loss_i2t: np.ndarray | None,
    loss_t2i: np.ndarray | None,
    alpha_i2t: np.ndarray | None,
    alpha_t2i: np.ndarray | None,
) -> ShardScalars:
    """The corpus as one shard's scalars (float32; missing InfoNCE terms are zeros)."""

    def floats(values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float32)

    zeros = np.zeros(ids.size, dtype=np.float32)
    return ShardScalars(
        ids=ids,
        loss=floats(loss),
        loss_i2t=zeros if loss_i2t is None else floats(loss_i2t),
        loss_t2i=zeros if loss_t2i is None else floats(loss_t2i),
        prob=floats(prob),
        alpha_i2t=None if alpha_i2t is None else floats(alpha_i2t),
        alpha_t2i=None if alpha_t2i is None else floats(alpha_t2i),
    )


def label_in_memory(
    method: str,
    params: Any,
    *,
    u: np.ndarray,
    v: np.ndarray,
    loss: np.ndarray,
    prob: np.ndarray,
    loss_i2t: np.ndarray | None = None,
    loss_t2i: np.ndarray | None = None,
    alpha_i2t: np.ndarray | None = None,
    alpha_t2i: np.ndarray | None = None,
    threshold: float = 0.5,
    keys: np.ndarray | None = None,
    captions: np.ndarray | None = None,
    image_hashes: list[str | None] | None = None,
    shard_sizes: list[int] | None = None,
    shard_seeds: list[int] | None = None,
    index_stores: int = 1,
    factory: str = "Flat",
    nprobe: int | None = None,
    seed: int = 0,
    logit_scale: float = 1 / 0.07,
    query_batch: int = 1024,
    fetch_limit: int = 65536,
) -> InMemoryResult:
    """Label N pairs with `method` (a `LABEL_METHODS` name) and its `params` section.

    Args:
        u, v: (N, D) float32 L2-normalised embeddings of the labelling model.
        loss: (N,) float32 the mixture's loss; prob: (N,) its clean posterior.
        loss_i2t, loss_t2i: (N,) the labelling model's InfoNCE (SPS's P^; default zeros);
            alpha_i2t, alpha_t2i: (N,) per-direction posteriors (RCR); threshold: delta.
        keys, captions: (N,) stored with index rows (default: row numbers / None);
            image_hashes: (N,) hex SHA-256 per image (RCR de-duplication) or None.
        shard_sizes, shard_seeds: rows and seeds per shard (default one shard, `seed` + shard).
        index_stores, factory, nprobe, seed, logit_scale, query_batch, fetch_limit: as the
            label stage's (`index.*` of a job, and the stage's tuning).
    """
    entry = get_method(method)
    u, v = _labelling_embeddings(entry, params, u, v)
    n = u.shape[0]
    ids = np.arange(n, dtype=np.int64)
    scalars = _scalars(ids, loss, prob, loss_i2t, loss_t2i, alpha_i2t, alpha_t2i)
    decisions, partition = _decide(entry, params, scalars, threshold, fetch_limit)
    masks = shard_masks(scalars, decisions)
    neighbours = _neighbours(
        entry.index_role(params),
        masks,
        u,
        v,
        ids,
        keys,
        captions,
        image_hashes,
        dict(stores=index_stores, factory=factory, nprobe=nprobe, seed=seed),
    )
    bounds = np.cumsum([0] + list(shard_sizes or [n]))
    shards = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    seeds = shard_seeds or [seed + index for index in range(len(shards))]
    parts: list[ShardLabels] = []
    for rows, shard_seed in zip(shards, seeds, strict=True):
        inputs = ShardInputs(
            scalars=_rows(scalars, rows),
            masks=_rows(masks, rows),
            u=u[rows],
            v=v[rows],
            loss_i2t=scalars.loss_i2t[rows],
            loss_t2i=scalars.loss_t2i[rows],
            seed=shard_seed,
            logit_scale=logit_scale,
            image_dedup=image_hashes is not None,
            query_batch=query_batch,
        )
        parts.append(label_shard(entry, inputs, neighbours, params))
        masks.anchor[rows] = inputs.masks.anchor  # in-batch anchors are chosen per shard
    return InMemoryResult(
        labels=_concat(parts), masks=masks, decisions=decisions, partition=partition
    )
