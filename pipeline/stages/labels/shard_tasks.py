"""The per-shard steps of the label pass: each runs as one Ray task on one embeddings table.

Every function here reads one `rounds/<r>/embeddings/<shard>.parquet`, calls the pure core
(`pipeline.core.partition.decisions`, `pipeline.core.labels`) and returns a small summary, or (the
label step) writes the shard's tables. None of them talks to Ray: the driver schedules them.

Sample ids: shard i's row j has global id offset_i + j (shards in the spec's order); every tie
in the core is broken by it, so labels do not depend on sharding or scheduling.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.labels import ShardInputs
from pipeline.core.labels.centring import EmbeddingSums, centre, embedding_sums
from pipeline.core.mixture.fit import MixtureFit, build_histogram, clean_posterior, histogram_range
from pipeline.core.partition.decisions import (
    PartitionDecisions,
    ShardScalars,
    partition_counts,
    selection_rows,
    shard_masks,
)
from pipeline.core.partition.select import select_round
from pipeline.core.search.neighbours import image_groups
from pipeline.io.admitted import read_embeddings_footer
from pipeline.io.tables import embedding_matrix, read_schema, read_table
from pipeline.stages.labels.spec import LabelSpec

__all__ = [
    "FIT_LOSSES",
    "add_posteriors",
    "competitor_loss_task",
    "competitor_rows_task",
    "count_task",
    "embedding_sums_task",
    "histogram_task",
    "index_rows_task",
    "load_shard",
    "range_task",
    "select_task",
    "shard_seed",
]

FIT_LOSSES = ("loss", "i2t", "t2i")  # the losses whose histograms are fitted


def _embedding_columns(view: str) -> list[str]:
    return [f"image_embedding_{view}", f"text_embedding_{view}"]


def _scalar_columns(spec: LabelSpec) -> list[str]:
    view = spec.view
    columns = [f"loss_i2t_{view}", f"loss_t2i_{view}"]
    if spec.labels.loss == "triplet":
        columns.append(f"loss_triplet_{view}")
    return columns


def _stored_embeddings(spec: LabelSpec, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    view = spec.labelling_view
    u = embedding_matrix(table.column(f"image_embedding_{view}"))
    v = embedding_matrix(table.column(f"text_embedding_{view}"))
    return u, v


def _labelling_embeddings(spec: LabelSpec, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(u, v) of the labelling view as the method sees them: centred on the corpus means when
    the driver set them (`LabelSpec.embedding_means`)."""
    u, v = _stored_embeddings(spec, table)
    if spec.embedding_means is None:
        return u, v
    mean_u, mean_v = spec.embedding_means
    return centre(u, mean_u), centre(v, mean_v)


def _float_column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy().astype(np.float32)


def _scalars(spec: LabelSpec, table: pa.Table, offset: int, shard: str | None) -> ShardScalars:
    """The shard's losses as the mixture sees them: the embed pass's in-batch InfoNCE, or with
    `labels.loss_negatives: competitors` (and a `shard`) the pass's competitor losses."""
    view = spec.view
    if spec.competitors and shard is not None:
        losses = read_table(spec.competitor_loss_path(shard), ["loss_i2t", "loss_t2i"])
        i2t, t2i = (_float_column(losses, name) for name in ("loss_i2t", "loss_t2i"))
    else:
        i2t = _float_column(table, f"loss_i2t_{view}")
        t2i = _float_column(table, f"loss_t2i_{view}")
    # The InfoNCE sum in float32: the `loss` column holds exactly the value the mixture saw.
    if spec.labels.loss == "triplet":
        loss = _float_column(table, f"loss_triplet_{view}")
    else:
        loss = i2t + t2i
    ids = offset + np.arange(table.num_rows, dtype=np.int64)
    return ShardScalars(ids=ids, loss=loss, loss_i2t=i2t, loss_t2i=t2i)


def add_posteriors(spec: LabelSpec, scalars: ShardScalars, fits: dict[str, MixtureFit]) -> None:
    """The clean posterior that partitions, and the per-direction ones where they are used
    (RCR's set C; `labels.posterior: both_directions`)."""
    both = spec.labels.posterior == "both_directions"
    if spec.method.direction_posteriors or both:
        scalars.alpha_i2t = clean_posterior(fits["gmm_i2t"], scalars.loss_i2t)
        scalars.alpha_t2i = clean_posterior(fits["gmm_t2i"], scalars.loss_t2i)
        if both:
            # A NaN in either direction stays NaN: such a pair is never clean.
            scalars.prob = np.minimum(scalars.alpha_i2t, scalars.alpha_t2i)
            return
    scalars.prob = clean_posterior(fits[spec.mixture_kind], scalars.loss)


def _load_scalars(
    spec: LabelSpec, shard: str, offset: int, fits: dict[str, MixtureFit] | None = None
) -> ShardScalars:
    table = read_table(spec.embeddings_path(shard), _scalar_columns(spec))
    scalars = _scalars(spec, table, offset, shard)
    if fits is not None:
        add_posteriors(spec, scalars, fits)
    return scalars


def shard_seed(spec: LabelSpec, shard: str) -> int:
    return (spec.seed * 1_000_003 + spec.round_index * 7919 + zlib.crc32(shard.encode())) % 2**32


def range_task(spec: LabelSpec, shard: str) -> dict[str, Any]:
    """Rows, loss ranges and embedding metadata of one shard.

    Raises:
        ValueError: the table lacks a column of the view (or of the labelling view).
    """
    path = spec.embeddings_path(shard)
    schema = read_schema(path)
    labelling = spec.labelling_view
    needed = _scalar_columns(spec) + _embedding_columns(spec.view) + [f"cosine_{spec.view}"]
    if labelling != spec.view:
        needed += _embedding_columns(labelling) + [
            f"loss_i2t_{labelling}",
            f"loss_t2i_{labelling}",
        ]
    missing = [name for name in needed if name not in schema.names]
    if missing:
        raise ValueError(f"{path} lacks the columns {missing}: was that view embedded?")
    metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    # The embed pass's losses: with competitor negatives the driver replaces these ranges.
    scalars = _scalars(spec, read_table(path, _scalar_columns(spec)), 0, None)
    losses = {"loss": scalars.loss, "i2t": scalars.loss_i2t, "t2i": scalars.loss_t2i}
    return {
        "rows": int(scalars.ids.size),
        "ranges": {name: histogram_range(values) for name, values in losses.items()},
        "model_id": metadata.get(f"ncl.model_id.{spec.view}"),
        "logit_scale": metadata.get(f"ncl.logit_scale.{labelling}"),
        "image_sha256": "image_sha256" in schema.names,
        "dim": int(schema.field(f"image_embedding_{labelling}").type.list_size),
    }


def embedding_sums_task(spec: LabelSpec, shard: str) -> EmbeddingSums:
    """The labelling view's embedding sums of one shard (they add up to the corpus means)."""
    table = read_table(spec.embeddings_path(shard), _embedding_columns(spec.labelling_view))
    return embedding_sums(*_stored_embeddings(spec, table))


def histogram_task(spec: LabelSpec, shard: str, ranges: dict[str, tuple[float, float]]) -> dict:
    """Loss histograms of one shard over the corpus-wide ranges (they add across shards)."""
    scalars = _load_scalars(spec, shard, 0)
    losses = {"loss": scalars.loss, "i2t": scalars.loss_i2t, "t2i": scalars.loss_t2i}
    return {
        name: build_histogram(values, *ranges[name], bins=spec.mixture.bins)
        for name, values in losses.items()
        if ranges[name][0] <= ranges[name][1]
    }


def count_task(spec: LabelSpec, shard: str, offset: int, fits: dict) -> dict[str, int]:
    scalars = _load_scalars(spec, shard, offset, fits)
    sps = spec.labels.sps
    return partition_counts(
        scalars,
        threshold=spec.mixture.threshold,
        sps_eps1=sps.eps1,
        sps_eps2=sps.eps2,
        rcr_delta=spec.labels.rcr.delta,
    )


def select_task(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    what: str,
    decisions: PartitionDecisions | None,
    prefix: tuple[int, ...],
    fetch: bool,
):
    """One radix-select round over this shard's rows (`pipeline.core.partition.select`)."""
    keys, ids = selection_rows(_load_scalars(spec, shard, offset, fits), what, decisions)
    return select_round(keys, ids, prefix, fetch)


def competitor_rows_task(spec: LabelSpec, shard: str, offset: int, n_stores: int):
    """Every finite pair of one shard (the partitioning view's vectors), split by owner
    (id % n_stores): the rows of the competitor index (`labels.loss_negatives: competitors`)."""
    table = read_table(spec.embeddings_path(shard), _embedding_columns(spec.view))
    u = embedding_matrix(table.column(f"image_embedding_{spec.view}"))
    v = embedding_matrix(table.column(f"text_embedding_{spec.view}"))
    ids = offset + np.arange(table.num_rows, dtype=np.int64)
    rows = np.flatnonzero(np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1))
    parts = []
    for owner in range(n_stores):
        mine = rows[ids[rows] % n_stores == owner]
        parts.append({"ids": ids[mine], "u": u[mine], "v": v[mine]})
    return tuple(parts) if n_stores > 1 else parts[0]


def competitor_loss_task(spec: LabelSpec, shard: str, offset: int, neighbours) -> dict[str, Any]:
    """One shard's InfoNCE against its pairs' corpus competitors, written to
    `spec.competitor_loss_path(shard)`; returns the loss ranges (they replace the embed
    pass's in `range_task`'s summary)."""
    from pipeline.core.losses.competitors import competitor_losses
    from pipeline.io.tables import write_table_atomic

    path = spec.embeddings_path(shard)
    footer = read_embeddings_footer(path)
    if footer is None:
        raise FileNotFoundError(f"{path}: the shard's embeddings table is missing")
    metadata = footer.meta
    scale = float(metadata.get(f"ncl.logit_scale.{spec.view}") or 1 / 0.07)
    table = read_table(path, _embedding_columns(spec.view))
    u = embedding_matrix(table.column(f"image_embedding_{spec.view}"))
    v = embedding_matrix(table.column(f"text_embedding_{spec.view}"))
    ids = offset + np.arange(table.num_rows, dtype=np.int64)
    k = spec.labels.loss_competitors
    i2t, t2i = competitor_losses(neighbours, u, v, ids, k, scale, spec.query_batch)
    schema = pa.schema(
        [("loss_i2t", pa.float32()), ("loss_t2i", pa.float32())],
        metadata={"ncl.competitors": str(k), "ncl.logit_scale": repr(scale)},
    )
    out = pa.table([pa.array(i2t), pa.array(t2i)], schema=schema)
    write_table_atomic(out, spec.competitor_loss_path(shard), schema)
    losses = {"loss": i2t + t2i, "i2t": i2t, "t2i": t2i}
    return {name: histogram_range(values) for name, values in losses.items()}


def index_rows_task(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    decisions: PartitionDecisions,
    n_stores: int,
):
    """Rows of one shard that go into the method's index, split by owner (id % n_stores).

    The partition comes from `spec.view`; the vectors from the labelling view. Each part
    carries the fields the role stores (keys, captions, image groups).
    """
    role = spec.method.index_role(spec.params)
    assert role is not None  # the driver runs this task only for a method with an index
    labelling = spec.labelling_view
    path = spec.embeddings_path(shard)
    extra = {"keys": ["key"], "captions": ["caption"], "groups": []}
    columns = [c for name in role.fields for c in extra[name]]
    hashes_stored = "groups" in role.fields and "image_sha256" in read_schema(path).names
    if hashes_stored:
        columns.append("image_sha256")
    table = read_table(path, _embedding_columns(labelling) + _scalar_columns(spec) + columns)
    scalars = _scalars(spec, table, offset, shard)
    add_posteriors(spec, scalars, fits)
    u, v = _labelling_embeddings(spec, table)
    finite = np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)
    rows = np.flatnonzero(role.rows(shard_masks(scalars, decisions)) & finite)
    fields: dict[str, np.ndarray] = {}
    if "keys" in role.fields:
        fields["keys"] = np.asarray(table.column("key").to_pylist(), dtype=object)
    if "captions" in role.fields:
        fields["captions"] = np.asarray(table.column("caption").to_pylist(), dtype=object)
    if "groups" in role.fields:
        hashes = table.column("image_sha256").to_pylist() if hashes_stored else None
        fields["groups"] = image_groups(hashes, scalars.ids)
    parts = []
    for owner in range(n_stores):
        mine = rows[scalars.ids[rows] % n_stores == owner]
        part = {"ids": scalars.ids[mine], "u": u[mine], "v": v[mine]}
        part.update({name: values[mine] for name, values in fields.items()})
        parts.append(part)
    return tuple(parts) if n_stores > 1 else parts[0]


def load_shard(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    decisions: PartitionDecisions,
    context: dict[str, Any],
) -> tuple[pa.Table, ShardInputs]:
    """One shard's table (key, url, caption, cosine, ...) and the method's `ShardInputs`."""
    view, labelling = spec.view, spec.labelling_view
    labelling_losses = [f"loss_i2t_{labelling}", f"loss_t2i_{labelling}"]
    table = read_table(
        spec.embeddings_path(shard),
        ["key", "shard", "url", "caption", f"cosine_{view}"]
        + _embedding_columns(labelling)
        + _scalar_columns(spec)
        + (labelling_losses if labelling != view else []),
    )
    scalars = _scalars(spec, table, offset, shard)
    add_posteriors(spec, scalars, fits)
    u, v = _labelling_embeddings(spec, table)
    loss_i2t, loss_t2i = scalars.loss_i2t, scalars.loss_t2i
    if labelling != view:
        loss_i2t, loss_t2i = (_float_column(table, name) for name in labelling_losses)
    inputs = ShardInputs(
        scalars=scalars,
        masks=shard_masks(scalars, decisions),
        u=u,
        v=v,
        loss_i2t=loss_i2t,
        loss_t2i=loss_t2i,
        seed=shard_seed(spec, shard),
        logit_scale=float(context["logit_scale"]),
        image_dedup=bool(context["image_groups"]),
        query_batch=spec.query_batch,
    )
    return table, inputs
