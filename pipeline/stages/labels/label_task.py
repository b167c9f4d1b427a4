"""The last per-shard step: label one shard with the method and write its tables.

`label_task` runs as one Ray task per shard. It reads the shard (`shard_tasks.load_shard`),
asks the registry's method for its labels through a `NeighbourSearch` over the index actors,
applies the rules every method shares, writes `<out_dir>/<shard>.parquet` in the label-table
schema (and SPS's proxies table), and returns a summary of counts; with ground truth, also
the per-pair scores the driver evaluates.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.labels import SCORE_COLUMNS, ShardInputs, ShardLabels, label_shard
from pipeline.core.labels.sps import PROXY_COLUMNS
from pipeline.core.mixture.fit import clean_posterior
from pipeline.core.partition.decisions import CLEAN
from pipeline.core.search.neighbours import NeighbourSearch
from pipeline.io.ground_truth import quality_arrays
from pipeline.io.labels import (
    LABELLING_VIEW_KEY,
    LABELS_SCHEMA,
    SPS_PROXIES_SCHEMA,
    SUBSET_VALUES,
    labels_file_metadata,
)
from pipeline.io.layout import RunLayout
from pipeline.io.tables import write_table_atomic
from pipeline.stages.labels.shard_tasks import load_shard
from pipeline.stages.labels.spec import LabelSpec

__all__ = ["label_task"]


def _nullable(values: np.ndarray | None, n: int, kind: pa.DataType) -> pa.Array:
    if values is None:
        return pa.nulls(n, kind)
    if kind == pa.string():
        return pa.array(list(values), type=kind)
    return pa.array(np.asarray(values, dtype=np.float32), type=kind)


def _label_table(
    spec: LabelSpec,
    table: pa.Table,
    inputs: ShardInputs,
    labels: ShardLabels,
    cosine: np.ndarray,
    context: dict[str, Any],
    shard: str,
) -> pa.Table:
    n = table.num_rows
    valid = inputs.masks.valid
    prob = inputs.scalars.prob
    assert prob is not None  # load_shard ran add_posteriors
    metadata = labels_file_metadata(
        pipeline_version=context["version"],
        job_hash=spec.job_hash,
        model_id=context["model_id"],
        mixture=context["mixture"],
        extra={
            "ncl.method": spec.labels.method,
            "ncl.round": str(spec.round_index),
            "ncl.view": spec.view,
            LABELLING_VIEW_KEY: spec.labelling_view,
            "ncl.loss": spec.labels.loss,
            "ncl.shard_path": context["shard_paths"].get(shard, ""),
        },
    )
    schema = LABELS_SCHEMA.with_metadata(metadata)
    columns = {
        "key": table.column("key"),
        "shard": table.column("shard"),
        "url": table.column("url"),
        "caption": table.column("caption"),
        "soft_label": pa.array(labels.soft_label, pa.float32()),
        "clean_prob": pa.array(np.where(valid, prob, 0.0), pa.float32()),
        "subset": pa.DictionaryArray.from_arrays(
            pa.array(labels.subset, pa.int8()), pa.array(SUBSET_VALUES, pa.string())
        ),
        "loss": pa.array(inputs.scalars.loss, pa.float32()),
        "cosine": pa.array(cosine, pa.float32()),
        "image_anchor_key": _nullable(labels.image_anchor_key, n, pa.string()),
        "text_anchor_key": _nullable(labels.text_anchor_key, n, pa.string()),
        "round": pa.array(np.full(n, spec.round_index, dtype=np.int16), pa.int16()),
    }
    for name in SCORE_COLUMNS:
        columns[name] = _nullable(labels.scores.get(name), n, pa.float32())
    # Columns this pass does not produce (added by later stages) are null here.
    arrays = [columns.get(f.name, pa.nulls(n, f.type)) for f in schema]
    return pa.table(arrays, schema=schema)


def _write_proxies(spec: LabelSpec, shard: str, table: pa.Table, proxies: dict | None) -> None:
    folder = spec.proxies_dir or RunLayout(spec.output).sps_proxies_dir(spec.round_index, spec.view)
    if proxies is None:
        arrays = [pa.array([], f.type) for f in SPS_PROXIES_SCHEMA]
    else:
        rows = pa.array(proxies["rows"], pa.int64())
        # The noisy pair's own caption T_n comes from the label table (the method sees no text).
        columns = {name: table.column(name).take(rows) for name in ("key", "caption")}
        for name in PROXY_COLUMNS:
            kind = SPS_PROXIES_SCHEMA.field(name).type
            values = proxies[name]
            columns[name] = pa.array(list(values) if kind == pa.string() else values, kind)
        arrays = [columns[f.name] for f in SPS_PROXIES_SCHEMA]
    out = pa.table(arrays, schema=SPS_PROXIES_SCHEMA)
    write_table_atomic(out, f"{folder}/{shard}.parquet", SPS_PROXIES_SCHEMA)


def _quality_scores(spec: LabelSpec, fits, inputs: ShardInputs, labels: ShardLabels, cosine):
    """Scores and clean subsets to evaluate: the method, the baselines, the method's extras."""
    loss = inputs.scalars.loss
    bmm = clean_posterior(fits["bmm"], loss)
    gmm = clean_posterior(fits["gmm"], loss)
    name, threshold = spec.labels.method, spec.mixture.threshold
    scores = {name: labels.soft_label, "cosine": cosine, "bmm_posterior": bmm, "gmm_posterior": gmm}
    with np.errstate(invalid="ignore"):
        subsets = {
            name: labels.subset == CLEAN,
            "bmm_posterior": bmm > threshold,
            "gmm_posterior": gmm > threshold,
        }
    extra_scores, extra_subsets = spec.method.quality_scores(inputs, labels, cosine)
    return {**scores, **extra_scores}, {**subsets, **extra_subsets}


def _method_params(spec: LabelSpec, fits: dict):
    """The method's settings, with a `mass` left null set to the partitioning mixture's clean
    weight pi_c (assign's partial OT transports that share of the mass)."""
    params = spec.params
    if params is None or "mass" not in type(params).model_fields or params.mass is not None:
        return params
    fit = fits[spec.mixture_kind]
    weight = 1.0 if fit.weights is None else float(fit.weights[fit.clean_component])
    return params.model_copy(update={"mass": min(max(weight, 1e-3), 1.0)})


def label_task(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    decisions,
    neighbours: NeighbourSearch | None,
    context: dict[str, Any],
) -> dict[str, Any]:
    """Label one shard and write its table (and its SPS proxies). Returns the shard summary."""
    started = time.perf_counter()
    table, inputs = load_shard(spec, shard, offset, fits, decisions, context)
    labels = label_shard(spec.method, inputs, neighbours, _method_params(spec, fits))
    cosine = table.column(f"cosine_{spec.view}").to_numpy().astype(np.float32)
    out = _label_table(spec, table, inputs, labels, cosine, context, shard)
    write_table_atomic(out, f"{spec.out_dir}/{shard}.parquet", out.schema)
    if spec.method.proxy_table:  # SPS: its proxy pairs (an empty table when there are none)
        _write_proxies(spec, shard, table, labels.proxies)
    subset = labels.subset
    summary: dict[str, Any] = {
        "shard": shard,
        "rows": table.num_rows,
        "invalid": int((~inputs.masks.valid).sum()),
        "subsets": {name: int((subset == code).sum()) for code, name in enumerate(SUBSET_VALUES)},
        "anchors": int(inputs.masks.anchor.sum()),
        "seconds": time.perf_counter() - started,
    }
    if spec.ground_truth:
        summary["quality"] = quality_arrays(
            spec.ground_truth,
            table.column("key").to_pylist(),
            *_quality_scores(spec, fits, inputs, labels, cosine),
        )
    return summary
