"""Label pass: embeddings -> mixture fit -> partition -> FAISS -> soft-label tables (DESIGN §2).

Contract:
- `run_label_pass(spec)` reads `rounds/<r>/embeddings/<shard>.parquet` (view `spec.view`) and
  writes `spec.out_dir/<shard>.parquet` in the `labels.v1` schema (DESIGN §4.4), one row per
  embedded sample, so `labels/` and `quarantine/` cover the input exactly once. It also writes
  `rounds/<r>/mixture_<view>.json` (every fit), for SPS `rounds/<r>/sps_proxies_<view>/` (the
  proxy pairs), and last `spec.out_dir/_label_pass.json` (the summary; it marks the pass
  complete, and a rerun with the same job hash returns it without recomputing).
- Every step is a Ray task per shard (or a Ray actor per index shard); the driver only folds
  O(bins) histograms, counts, a few thresholds and metrics:
  1. ranges: per-shard min/max of the losses, merged (`merge_ranges`);
  2. histograms over the global range, merged; BMM and GMM fitted on the configured loss, one
     GMM per InfoNCE direction (RCR) -> `mixture_<view>.json`;
  3. counts of the partition (clean / reliable / in C) per shard; the §1.6 fallbacks and the
     BiCro anchors need order statistics ("the value at sorted position N/100", "the
     ceil(rho |C|) lowest-loss clean pairs", ties by sample id). They are found by a distributed
     radix select on (float32 key, sample id): each round, every shard returns a sparse
     histogram of the next 16-bit digit among the rows still in play; once at most
     `select_fetch_limit` rows are in play they are fetched and resolved on the driver. So no
     per-sample list (not even the anchors' ids) comes back, whatever the corpus size.
  4. FAISS: `index_shards` actors, each an `IndexShard` pair (image and text) over the rows with
     global id % index_shards == actor: BiCro's anchors, SPS's reliable set, or every pair for
     RCR. Rows travel from the shard tasks to the actors through the object store. IVF/PQ is
     trained once on actor 0's rows and cloned into the others, so the shards share codebooks.
     Each actor then writes its two indexes to `rounds/<r>/index_<view>/<role>_<modality>_
     <shard:03d>.faiss` (a CPU IndexIDMap2 answering global sample ids), and the driver writes
     `_index.json` beside them last (`write_index=False` skips this).
  5. labels: a task per shard computes clean_prob, subset, the configured method's label and
     the cosine; it queries the actors in batches (`query_batch`), merges their answers with
     `merge_topk`, fetches neighbour embeddings from their owners and re-scores them exactly.
- Sample ids: shard i's row j has global id offset_i + j (shards in `spec.shards` order). Every
  tie (equal losses, equal similarities) is broken by this id, so labels do not depend on the
  number of index shards or on task scheduling.
- Label quality (only when `spec.ground_truth` is set, i.e. demo and benchmark corpora): each
  task joins the ground truth by key and returns a few float32 scores per sample to the driver,
  which computes AUROC/Spearman/precision/recall with `pipeline.core.metrics.label_quality`.
  This is the one place per-sample values reach the driver, and it is off for real corpora.

Method notes (METHODS §2.5, §4.9, §5.3):
- BiCro: `soft_label` is BiCro* (labels <= theta set to 0; theta=0 gives plain BiCro), the
  `bicro` column the raw label; the anchor-key columns name a* and b*. `anchors: in_batch` runs
  the released per-batch anchors inside each shard (no index), for the ablation.
- RCR: `rcr` is w for every pair, `soft_label` w masked by C; clean_prob stays the configured
  mixture on the configured loss, while C uses the per-direction GMMs. Images are ranked as
  unique images (§5.3 step 4): the index actors hold an int64 group per row from the
  embeddings' `image_sha256` (byte-identical files share it), rcr_ndcg keeps the first row of
  each group, and image searches deepen until they hold K + 1 distinct images (at most
  32 (K + 1) rows). Texts are ranked per row. Tables without `image_sha256` (written before it
  existed) make every row its own image, as before.
- SPS: reliable 1, quasi-clean p + (1 - p) P^, noisy 0 (the original caption is discarded); the
  proxy pairs and their labels y_p go to the proxies table (with the proxy caption, so training
  needs no lookup), and the anchor-key columns of noisy rows name the nearest reliable pair by
  image and by text. P^ batches are drawn within a shard. With `trainee_view` (the model that
  trains on the labels, §4.1), the partition and p still come from `view` (the peer's
  mixture) while P^, the reliable-set indexes, the noisy queries and the logit scale come from
  the trainee's losses and embeddings; the `loss` and `cosine` columns stay `view`'s. BiCro,
  RCR and cosine ignore `trainee_view` (the peer computes their labels, as in BiCro/NCR).
- Rows whose loss is NaN/inf get soft_label 0, clean_prob 0 and subset noisy, and are counted
  (`n_invalid`).
- Index actors do not restart (their index would come back empty): a lost actor fails the pass
  and a rerun recomputes it. Shard tasks are retried (their writes are atomic and idempotent).
  The persisted index files are for other consumers (inspection, training-time lookups); a
  rerun rebuilds the indexes from the embeddings rather than reading them back, and the label
  tables stay the resumable artifact.
- Actors hold float32 vectors twice (the FAISS Flat copy and the re-scoring copy); RCR indexes
  every pair, so size `index_shards` so that 2 x 2 x N x D x 4 bytes / shards fits an actor,
  plus one more index while it is serialized to disk (and as much disk under `index_<view>/`).
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.knn import IndexShard, merge_topk
from pipeline.core.mixture import (
    MixtureFit,
    build_histogram,
    clean_posterior,
    fit_bmm,
    fit_gmm,
    histogram_range,
    merge_histograms,
    merge_ranges,
)
from pipeline.core.partition import CLEAN, NOISY, QUASI_CLEAN
from pipeline.core.soft_labels import (
    bicro_in_batch_anchors,
    bicro_labels,
    cosine_labels,
    rcr_ndcg,
    rcr_weights,
    sps_proxy_labels,
    sps_quasi_clean_label,
)
from pipeline.io.labels import (
    LABELS_SCHEMA,
    SPS_PROXIES_SCHEMA,
    SUBSET_VALUES,
    labels_file_metadata,
)
from pipeline.io.layout import RunLayout
from pipeline.io.tables import file_exists, read_json, write_json_atomic, write_table_atomic

__all__ = [
    "BicroParams",
    "LabelSpec",
    "METHODS",
    "RcrParams",
    "SpsParams",
    "quality_arrays",
    "quality_from_parts",
    "run_label_pass",
]

METHODS = ("bicro", "rcr", "sps", "cosine")
LOSSES = ("infonce_sum", "triplet")
SUMMARY_NAME = "_label_pass.json"  # leading '_': dataset readers (pyarrow, Spark) skip it
KIND_CODES = ("clean", "partial", "mismatched")  # ground-truth kinds, sent as int8 codes
_DIGITS = 6  # radix-select digits of 16 bits: 2 for the float32 key, 4 for the int64 id
_MAX_KEYS_PER_QUERY_BATCH = 1 << 16
_MAX_IMAGE_DEPTH_FACTOR = 32  # RCR de-dup: image lists grow to at most (K + 1) x this rows


@dataclass(frozen=True)
class BicroParams:
    anchor_fraction: float = 0.1  # rho: share of the clean set used as anchors
    clean_floor: float = 0.5  # label of a clean non-anchor is floor + (1 - floor) * consistency
    theta: float = 0.5  # BiCro* cut on soft_label
    ratio: str = "similarity"  # "similarity" (code) or "distance" (paper Eq. 9-11)
    anchors: str = "global"  # "global" (FAISS over the whole clean set) or "in_batch"
    batch_size: int = 128  # in_batch anchors: batch size within a shard


@dataclass(frozen=True)
class RcrParams:
    k: int = 10  # NDCG@K
    delta: float = 0.5  # C = both directions' GMM posteriors > delta
    include_self: bool = True  # both rankings may contain the pair's own item


@dataclass(frozen=True)
class SpsParams:
    eps1: float = 0.99  # reliable: clean_prob > eps1
    eps2: float = 0.5  # noisy: clean_prob <= eps2
    gamma: float = 1.0  # proxy label scale
    beta: float = 0.5  # proxy labels below beta become 0
    batch_size: int = 128  # proxy-pair batch for P^


@dataclass(frozen=True)
class LabelSpec:
    """Everything the label pass needs; plain data so Ray can ship it to workers."""

    output: str  # run directory (embeddings are read from rounds/<round_index>/embeddings)
    round_index: int
    view: str  # embeddings column suffix, e.g. "a"
    shards: tuple[str, ...]  # shard names (basenames), in a fixed order: it defines sample ids
    out_dir: str  # where <shard>.parquet label tables go (labels/ or rounds/<r>/labels_<view>)
    method: str = "bicro"  # bicro | rcr | sps | cosine -> soft_label
    mixture_kind: str = "bmm"  # bmm | gmm: clean_prob and the partitions of BiCro/SPS/cosine
    bins: int = 4096  # loss histogram bins
    threshold: float = 0.5  # delta of the clean split
    loss: str = "infonce_sum"  # infonce_sum | triplet: the loss the mixture is fitted on
    bicro: BicroParams = field(default_factory=BicroParams)
    rcr: RcrParams = field(default_factory=RcrParams)
    sps: SpsParams = field(default_factory=SpsParams)
    index_factory: str = "Flat"  # FAISS index_factory string
    index_shards: int = 1  # index actors
    nprobe: int | None = 32  # IVF lists probed (ignored by Flat)
    ground_truth: str | None = None  # ground_truth.parquet -> label quality in the summary
    job_hash: str = ""  # written into every table; a rerun with the same hash is skipped
    model_id: str | None = None  # None: taken from the embeddings' metadata
    shard_paths: tuple[str, ...] = ()  # source tars aligned with `shards` (report thumbnails)
    seed: int = 0  # in-batch anchors and P^ batches
    query_batch: int = 1024  # queries per actor call
    select_fetch_limit: int = 65536  # radix select fetches the rows in play below this count
    proxies_dir: str | None = None  # SPS proxy tables; None -> rounds/<r>/sps_proxies_<view>
    # SPS only: the view trained on these labels (its embeddings and losses give P^ and the
    # proxies); `view` gives the partition (the peer's mixture, METHODS §4.1). None: `view`.
    trainee_view: str | None = None
    write_index: bool = True  # persist the FAISS shards under rounds/<r>/index_<view>/

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.mixture_kind not in ("bmm", "gmm"):
            raise ValueError(f"mixture_kind must be 'bmm' or 'gmm', got {self.mixture_kind!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not self.shards:
            raise ValueError("a label pass needs at least one shard")
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("shard names must be unique")
        if self.shard_paths and len(self.shard_paths) != len(self.shards):
            raise ValueError("shard_paths must be empty or aligned with shards")
        if self.index_shards < 1 or self.query_batch < 1 or self.select_fetch_limit < 1:
            raise ValueError("index_shards, query_batch and select_fetch_limit must be >= 1")
        if not self.sps.eps1 > self.sps.eps2:
            raise ValueError(
                f"SPS needs eps1 > eps2, got eps1={self.sps.eps1} and eps2={self.sps.eps2}"
            )
        if self.bicro.anchors not in ("global", "in_batch"):
            raise ValueError(f"bicro anchors must be global or in_batch: {self.bicro.anchors!r}")

    @classmethod
    def from_job(
        cls,
        job,
        *,
        round_index: int,
        view: str,
        shard_paths: list[str] | tuple[str, ...],
        out_dir: str | None = None,
        model_id: str | None = None,
        trainee_view: str | None = None,
    ) -> LabelSpec:
        """The spec of a `JobConfig`'s label pass over `shard_paths` (tar paths).

        Args:
            job: the validated `pipeline.config.JobConfig`.
            round_index: round whose embeddings are labelled.
            view: embeddings view ("a", "b").
            shard_paths: the job's resolved input shards (their basenames name the tables).
            out_dir: label table folder; default `rounds/<r>/labels_<view>`.
            model_id: override of the model id recorded in the tables.
            trainee_view: SPS only: the view that will train on the labels (P^ and proxies from
                its embeddings and losses); None: `view`. Other methods ignore it.
        """
        from pipeline.io.shards import shard_name

        layout = RunLayout(job.output)
        labels = job.labels
        return cls(
            output=layout.output,
            round_index=round_index,
            view=view,
            shards=tuple(shard_name(p) for p in shard_paths),
            shard_paths=tuple(shard_paths),
            out_dir=out_dir or layout.labels_round_dir(round_index, view),
            method=labels.method,
            mixture_kind=job.mixture.kind,
            bins=job.mixture.bins,
            threshold=job.mixture.threshold,
            loss=labels.loss,
            bicro=BicroParams(**labels.bicro.model_dump()),
            rcr=RcrParams(**labels.rcr.model_dump()),
            sps=SpsParams(**labels.sps.model_dump()),
            index_factory=job.index.factory,
            index_shards=job.index.shards,
            nprobe=job.index.nprobe,
            ground_truth=job.eval.ground_truth,
            job_hash=job.stage_hash(),
            model_id=model_id,
            seed=job.seed,
            trainee_view=trainee_view,
        )


# ----------------------------------------------------------------------------------------------
# Worker side: reading one shard
# ----------------------------------------------------------------------------------------------


def _embeddings_path(spec: LabelSpec, shard: str) -> str:
    return RunLayout(spec.output).embeddings(spec.round_index, shard)


def _read_table(path: str, columns: list[str] | None = None) -> pa.Table:
    import fsspec
    import pyarrow.parquet as pq

    fs, fs_path = fsspec.core.url_to_fs(path)
    return pq.read_table(fs_path, columns=columns, filesystem=fs)


def _file_schema(path: str) -> pa.Schema:
    """The Parquet schema (footer only), with its key/value metadata."""
    import fsspec
    import pyarrow.parquet as pq

    fs, fs_path = fsspec.core.url_to_fs(path)
    with fs.open(fs_path, "rb") as handle:
        return pq.read_schema(handle)


def _trainee(spec: LabelSpec) -> str:
    """The view whose embeddings and losses make the labels: SPS's `trainee_view` when set
    (P^ and proxies from the model trained on them, METHODS §4.1), else `view`."""
    if spec.method == "sps" and spec.trainee_view:
        return spec.trainee_view
    return spec.view


def _embedding_columns(view: str) -> list[str]:
    return [f"image_embedding_{view}", f"text_embedding_{view}"]


def _matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """(N, D) float32 rows of a fixed_size_list column, L2-renormalised after fp16 storage."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dim = array.type.list_size
    flat = array.flatten().to_numpy(zero_copy_only=False)
    rows = flat.astype(np.float32).reshape(-1, dim)  # (N, D)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norms > 0, rows / norms, rows).astype(np.float32)


def _float_column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy().astype(np.float32)


def _scalar_columns(spec: LabelSpec) -> list[str]:
    view = spec.view
    columns = [f"loss_i2t_{view}", f"loss_t2i_{view}"]
    if spec.loss == "triplet":
        columns.append(f"loss_triplet_{view}")
    return columns


@dataclass
class _Scalars:
    """Per-sample scalars of one shard that every step needs (cheap: no embeddings)."""

    ids: np.ndarray  # (N,) int64 global sample ids
    loss: np.ndarray  # (N,) float32 the mixture's loss
    loss_i2t: np.ndarray  # (N,) float32
    loss_t2i: np.ndarray  # (N,) float32
    prob: np.ndarray | None = None  # (N,) float32 clean posterior of the configured fit
    alpha_i2t: np.ndarray | None = None  # (N,) float32 RCR per-direction posteriors
    alpha_t2i: np.ndarray | None = None


def _scalars_from_table(spec: LabelSpec, table: pa.Table, offset: int) -> _Scalars:
    view = spec.view
    i2t = _float_column(table, f"loss_i2t_{view}")
    t2i = _float_column(table, f"loss_t2i_{view}")
    # The InfoNCE sum in float32: the `loss` column holds exactly the value the mixture saw.
    loss = _float_column(table, f"loss_triplet_{view}") if spec.loss == "triplet" else i2t + t2i
    ids = offset + np.arange(table.num_rows, dtype=np.int64)
    return _Scalars(ids=ids, loss=loss, loss_i2t=i2t, loss_t2i=t2i)


def _load_scalars(
    spec: LabelSpec, shard: str, offset: int, fits: dict[str, MixtureFit] | None = None
) -> _Scalars:
    table = _read_table(_embeddings_path(spec, shard), _scalar_columns(spec))
    scalars = _scalars_from_table(spec, table, offset)
    if fits is not None:
        _add_posteriors(spec, scalars, fits)
    return scalars


def _add_posteriors(spec: LabelSpec, scalars: _Scalars, fits: dict[str, MixtureFit]) -> None:
    scalars.prob = clean_posterior(fits[spec.mixture_kind], scalars.loss)
    if spec.method == "rcr":
        scalars.alpha_i2t = clean_posterior(fits["gmm_i2t"], scalars.loss_i2t)
        scalars.alpha_t2i = clean_posterior(fits["gmm_t2i"], scalars.loss_t2i)


# ----------------------------------------------------------------------------------------------
# Steps 1-2: ranges and histograms (tasks)
# ----------------------------------------------------------------------------------------------

_FIT_LOSSES = ("loss", "i2t", "t2i")


def _fit_inputs(scalars: _Scalars) -> dict[str, np.ndarray]:
    return {"loss": scalars.loss, "i2t": scalars.loss_i2t, "t2i": scalars.loss_t2i}


def _range_task(spec: LabelSpec, shard: str) -> dict[str, Any]:
    """Rows, loss ranges and embedding metadata of one shard.

    Raises:
        ValueError: the table lacks a column of the view (or of the SPS trainee view).
    """
    path = _embeddings_path(spec, shard)
    schema = _file_schema(path)
    trainee = _trainee(spec)
    needed = _scalar_columns(spec) + _embedding_columns(spec.view) + [f"cosine_{spec.view}"]
    if trainee != spec.view:
        needed += _embedding_columns(trainee) + [f"loss_i2t_{trainee}", f"loss_t2i_{trainee}"]
    missing = [name for name in needed if name not in schema.names]
    if missing:
        raise ValueError(f"{path} lacks the columns {missing}: was that view embedded?")
    metadata = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    table = _read_table(path, _scalar_columns(spec))
    scalars = _scalars_from_table(spec, table, 0)
    return {
        "rows": table.num_rows,
        "ranges": {name: histogram_range(v) for name, v in _fit_inputs(scalars).items()},
        "model_id": metadata.get(f"ncl.model_id.{spec.view}"),
        "logit_scale": metadata.get(f"ncl.logit_scale.{trainee}"),
        "image_sha256": "image_sha256" in schema.names,
    }


def _histogram_task(spec: LabelSpec, shard: str, ranges: dict[str, tuple[float, float]]) -> dict:
    scalars = _load_scalars(spec, shard, 0)
    return {
        name: build_histogram(values, *ranges[name], bins=spec.bins)
        for name, values in _fit_inputs(scalars).items()
        if ranges[name][0] <= ranges[name][1]
    }


# ----------------------------------------------------------------------------------------------
# Step 3: partition counts and the distributed radix select
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Decisions:
    """Global partition decisions, applied per shard by the label tasks (plain data)."""

    threshold: float  # delta on clean_prob after the 1 % rule (BiCro, cosine)
    guard_cut: tuple[int, int] | None = None  # symmetric guard: valid (loss key, id) <= cut
    anchor_cut: tuple[int, int] | None = None  # BiCro anchors: clean (loss key, id) <= cut
    sps_eps2: float = 0.5  # SPS eps2 after the 1 % rule
    rcr_guard_cut: tuple[int, int] | None = None  # RCR fallback: valid (-min alpha, id) <= cut


def _order_keys(values: np.ndarray) -> np.ndarray:
    """(N,) uint64 keys < 2^32 ordered exactly like the float32 values (-0.0 taken as 0.0)."""
    bits = (np.asarray(values, dtype=np.float32) + np.float32(0.0)).view(np.uint32)
    bits = bits.astype(np.uint64)
    negative = (bits >> np.uint64(31)) == 1
    return np.where(negative, bits ^ np.uint64(0xFFFFFFFF), bits | np.uint64(0x80000000))


def _key_value(key: int) -> float:
    """Inverse of `_order_keys` for one key."""
    bits = key ^ 0x80000000 if key & 0x80000000 else key ^ 0xFFFFFFFF
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _digit(keys: np.ndarray, ids: np.ndarray, level: int) -> np.ndarray:
    """16-bit digit `level` of the composite key (value key: levels 0-1, id: levels 2-5)."""
    if level < 2:
        return (keys >> np.uint64(16 * (1 - level))) & np.uint64(0xFFFF)
    return (ids.astype(np.uint64) >> np.uint64(16 * (5 - level))) & np.uint64(0xFFFF)


def _at_or_below(keys: np.ndarray, ids: np.ndarray, cut: tuple[int, int]) -> np.ndarray:
    """(N,) bool: composite (key, id) <= cut."""
    key, sample = np.uint64(cut[0]), cut[1]
    return (keys < key) | ((keys == key) & (ids <= sample))


def _masks(spec: LabelSpec, scalars: _Scalars, decisions: _Decisions) -> dict[str, np.ndarray]:
    """The partition of one shard from the global decisions."""
    prob = scalars.prob
    valid = np.isfinite(prob)
    loss_keys = _order_keys(np.where(valid, scalars.loss, 0.0))
    with np.errstate(invalid="ignore"):
        if decisions.guard_cut is None:
            clean = valid & (prob > decisions.threshold)
        else:
            clean = valid & _at_or_below(loss_keys, scalars.ids, decisions.guard_cut)
        anchor = np.zeros_like(clean)
        if decisions.anchor_cut is not None:
            anchor = clean & _at_or_below(loss_keys, scalars.ids, decisions.anchor_cut)
        sps_codes = np.full(prob.shape, NOISY, dtype=np.int8)
        kept = valid & (prob > decisions.sps_eps2)
        sps_codes[kept] = QUASI_CLEAN
        sps_codes[kept & (prob > spec.sps.eps1)] = CLEAN
    out = {"valid": valid, "clean": clean, "anchor": anchor, "sps": sps_codes}
    if scalars.alpha_i2t is not None:
        a, b = scalars.alpha_i2t, scalars.alpha_t2i
        rcr_valid = np.isfinite(a) & np.isfinite(b)
        if decisions.rcr_guard_cut is None:
            with np.errstate(invalid="ignore"):
                in_c = rcr_valid & (a > spec.rcr.delta) & (b > spec.rcr.delta)
        else:
            keys = _order_keys(np.where(rcr_valid, -np.minimum(a, b), 0.0))
            in_c = rcr_valid & _at_or_below(keys, scalars.ids, decisions.rcr_guard_cut)
        out.update(rcr_valid=rcr_valid, in_c=in_c)
    return out


def _partition_counts(spec: LabelSpec, scalars: _Scalars) -> dict[str, int]:
    """Per-shard counts behind the global partition decisions (they add across shards)."""
    prob = scalars.prob
    valid = np.isfinite(prob)
    with np.errstate(invalid="ignore"):
        counts = {
            "rows": int(prob.size),
            "valid": int(valid.sum()),
            "above_delta": int((prob > spec.threshold).sum()),
            "above_eps2": int((prob > spec.sps.eps2).sum()),
            "above_eps1": int((prob > spec.sps.eps1).sum()),
        }
        if scalars.alpha_i2t is not None:
            a, b = scalars.alpha_i2t, scalars.alpha_t2i
            rcr_valid = np.isfinite(a) & np.isfinite(b)
            counts["rcr_valid"] = int(rcr_valid.sum())
            counts["in_c"] = int((rcr_valid & (a > spec.rcr.delta) & (b > spec.rcr.delta)).sum())
    return counts


def _count_task(spec: LabelSpec, shard: str, offset: int, fits: dict) -> dict[str, int]:
    return _partition_counts(spec, _load_scalars(spec, shard, offset, fits))


def _selection_rows(
    spec: LabelSpec, scalars: _Scalars, what: str, decisions: _Decisions | None
) -> tuple[np.ndarray, np.ndarray]:
    """(keys uint64, ids int64) of the rows a selection ranks."""
    valid = np.isfinite(scalars.prob)
    if what == "prob":
        return _order_keys(scalars.prob[valid]), scalars.ids[valid]
    if what == "loss_valid":
        return _order_keys(scalars.loss[valid]), scalars.ids[valid]
    if what == "loss_clean":
        clean = _masks(spec, scalars, decisions)["clean"]
        return _order_keys(scalars.loss[clean]), scalars.ids[clean]
    if what == "rcr_guard":
        a, b = scalars.alpha_i2t, scalars.alpha_t2i
        rcr_valid = np.isfinite(a) & np.isfinite(b)
        return _order_keys(-np.minimum(a, b)[rcr_valid]), scalars.ids[rcr_valid]
    raise ValueError(f"unknown selection {what!r}")


def _select_round(keys: np.ndarray, ids: np.ndarray, prefix: tuple[int, ...], fetch: bool):
    """One radix-select round over one shard's rows: a sparse histogram of the next digit among
    the rows matching `prefix` ((digits, counts) int64), or those rows themselves (fetch)."""
    in_play = np.ones(keys.shape, dtype=bool)
    for level, digit in enumerate(prefix):
        in_play &= _digit(keys, ids, level) == np.uint64(digit)
    if fetch:
        return keys[in_play], ids[in_play]
    digits, counts = np.unique(_digit(keys[in_play], ids[in_play], len(prefix)), return_counts=True)
    return digits.astype(np.int64), counts.astype(np.int64)


def _select_task(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    what: str,
    decisions: _Decisions | None,
    prefix: tuple[int, ...],
    fetch: bool,
):
    scalars = _load_scalars(spec, shard, offset, fits)
    keys, ids = _selection_rows(spec, scalars, what, decisions)
    return _select_round(keys, ids, prefix, fetch)


def _radix_select(
    run_round: Callable[[tuple[int, ...], bool], list],
    k: int,
    total: int,
    *,
    with_id: bool,
    fetch_limit: int,
) -> tuple[int, int | None, int]:
    """The k-th smallest (1-based) composite key among `total` rows spread over shards.

    Args:
        run_round: (prefix, fetch) -> per-shard results of `_select_task`.
        k: rank wanted, 1 <= k <= total.
        total: rows ranked.
        with_id: rank (value, id) pairs (unique) or values only.
        fetch_limit: fetch the rows in play once at most this many remain.

    Returns:
        (value key, id or None, number of rows with key <= the result: by value when
        `with_id` is False, exactly k otherwise).
    """
    levels = _DIGITS if with_id else 2
    prefix: tuple[int, ...] = ()
    below, in_play = 0, total
    while len(prefix) < levels and in_play > fetch_limit:
        merged: dict[int, int] = {}
        for digits, counts in run_round(prefix, False):
            for d, c in zip(digits.tolist(), counts.tolist(), strict=True):
                merged[d] = merged.get(d, 0) + c
        for d in sorted(merged):
            if below + merged[d] >= k:
                prefix, in_play = (*prefix, d), merged[d]
                break
            below += merged[d]
    if len(prefix) == levels:
        key = (prefix[0] << 16) | prefix[1]
        sample = None
        if with_id:
            sample = (prefix[2] << 48) | (prefix[3] << 32) | (prefix[4] << 16) | prefix[5]
        return key, sample, below + in_play
    parts = run_round(prefix, True)
    keys = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.uint64)
    ids = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
    order = np.lexsort((ids, keys))
    chosen = order[k - below - 1]
    key = int(keys[chosen])
    if with_id:
        return key, int(ids[chosen]), k
    return key, None, below + int((keys <= keys[chosen]).sum())


# ----------------------------------------------------------------------------------------------
# Step 4: index actors
# ----------------------------------------------------------------------------------------------


def _image_groups(hashes: list[str | None] | None, ids: np.ndarray) -> np.ndarray:
    """(N,) int64 image group per row, for RCR's image de-duplication (METHODS §5.3 step 4).

    Rows with a hash: its first 63 bits (>= 0), so byte-identical images share a group (a 2^-63
    collision chance per pair of distinct images). Rows without one (tables written before the
    column existed, or a null): -(global id) - 2, unique, never -1 (the core's "missing" mark)
    and never equal to a hash group, so such rows are each their own image.
    """
    groups = -np.asarray(ids, dtype=np.int64) - 2
    if hashes is None:
        return groups
    present = np.array([h is not None and len(h) >= 16 for h in hashes], dtype=bool)
    if present.any():
        prefix = b"".join(
            bytes.fromhex(h[:16]) for h, ok in zip(hashes, present, strict=True) if ok
        )
        bits = np.frombuffer(prefix, dtype=">u8").astype(np.uint64) >> np.uint64(1)
        groups[present] = bits.astype(np.int64)
    return groups


def _index_rows_task(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    decisions: _Decisions,
    role: str,
    n_actors: int,
):
    """Rows of one shard that go into the index, split by owner actor (id % n_actors).

    The partition comes from `spec.view`; the vectors from `_trainee(spec)` (SPS's reliable set
    is searched in the trainee's space). Each part carries what the label tasks look up later:
    keys (BiCro, SPS), captions (SPS: the proxy caption), image groups (RCR).
    """
    trainee = _trainee(spec)
    extra = {"anchors": ["key"], "reliable": ["key", "caption"], "all": []}[role]
    if role == "all" and "image_sha256" in _file_schema(_embeddings_path(spec, shard)).names:
        extra = ["image_sha256"]
    columns = _embedding_columns(trainee) + _scalar_columns(spec) + extra
    table = _read_table(_embeddings_path(spec, shard), columns)
    scalars = _scalars_from_table(spec, table, offset)
    _add_posteriors(spec, scalars, fits)
    u = _matrix(table.column(f"image_embedding_{trainee}"))
    v = _matrix(table.column(f"text_embedding_{trainee}"))
    finite = np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)
    masks = _masks(spec, scalars, decisions)
    if role == "anchors":
        chosen = masks["anchor"] & finite
    elif role == "reliable":
        chosen = (masks["sps"] == CLEAN) & finite
    else:  # "all" (RCR: the database is every pair)
        chosen = finite
    rows = np.flatnonzero(chosen)
    fields: dict[str, np.ndarray] = {}
    if "key" in extra:
        fields["keys"] = np.asarray(table.column("key").to_pylist(), dtype=object)
    if "caption" in extra:
        fields["captions"] = np.asarray(table.column("caption").to_pylist(), dtype=object)
    if role == "all":
        hashes = table.column("image_sha256").to_pylist() if "image_sha256" in extra else None
        fields["groups"] = _image_groups(hashes, scalars.ids)
    parts = []
    for actor in range(n_actors):
        mine = rows[scalars.ids[rows] % n_actors == actor]
        part = {"ids": scalars.ids[mine], "u": u[mine], "v": v[mine]}
        part.update({name: values[mine] for name, values in fields.items()})
        parts.append(part)
    return tuple(parts) if n_actors > 1 else parts[0]


_ROW_FIELDS = ("keys", "captions", "groups")  # per-row extras an actor may hold besides u, v


class IndexShardActor:
    """Ray actor holding one shard of an image index and a text index over the same rows."""

    def __init__(self, dim: int, factory: str, nprobe: int | None, seed: int) -> None:
        self.dim, self.factory, self.nprobe, self.seed = dim, factory, nprobe, seed
        self.parts: list[dict] = []
        self.indexes: dict[str, IndexShard] = {}

    def add(self, *parts: dict) -> int:
        self.parts.extend(parts)
        return sum(len(p["ids"]) for p in parts)

    def _gather(self) -> None:
        parts = self.parts
        ids = np.concatenate([p["ids"] for p in parts]) if parts else np.empty(0, np.int64)
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        stack = {}
        for name in ("u", "v"):
            rows = [p[name] for p in parts]
            stack[name] = (
                np.concatenate(rows)[order] if rows else np.empty((0, self.dim), np.float32)
            )
            stack[name] = np.ascontiguousarray(stack[name], dtype=np.float32)
        self.u, self.v = stack["u"], stack["v"]
        for name in _ROW_FIELDS:
            values = [p[name] for p in parts if name in p]
            setattr(self, name, np.concatenate(values)[order] if values else None)
        self.parts = []

    def train(self, sample_size: int = 131_072):
        """Train the factory on this actor's rows (image and text); serialized empty indexes."""
        import faiss

        from pipeline.core.knn import train_index

        self._gather()
        out = {}
        for name, rows in (("image", self.u), ("text", self.v)):
            pick = np.random.default_rng(self.seed).permutation(rows.shape[0])[:sample_size]
            out[name] = faiss.serialize_index(train_index(self.factory, rows[np.sort(pick)]))
        return out

    def build(self, trained: dict | None = None) -> int:
        import faiss

        if self.parts or not hasattr(self, "ids"):
            self._gather()
        for name, rows in (("image", self.u), ("text", self.v)):
            base = None if trained is None else faiss.deserialize_index(trained[name])
            self.indexes[name] = IndexShard.build(
                rows, self.ids, self.factory, trained=base, nprobe=self.nprobe, seed=self.seed
            )
        return int(self.ids.size)

    def save(self, folder: str, role: str, shard: int) -> dict[str, str]:
        """Write both indexes to `<folder>/<role>_<modality>_<shard:03d>.faiss`, atomically.

        Each file is a CPU `IndexIDMap2` whose ids are the global sample ids, so
        `faiss.read_index(path).search` answers with them directly. Modalities are serialized
        one at a time: the extra memory is one index, not two.

        Returns:
            modality -> file name (relative to `folder`).
        """
        from pipeline.io.tables import open_atomic

        out = {}
        for modality, shard_index in self.indexes.items():
            name = f"{role}_{modality}_{shard:03d}.faiss"
            blob = _serialize_with_ids(shard_index.index, self.ids)
            with open_atomic(f"{folder}/{name}") as handle:
                handle.write(memoryview(blob))
            del blob
            out[modality] = name
        return out

    def search(self, modality: str, queries: np.ndarray, k: int):
        return self.indexes[modality].search(queries, k)

    def lookup(self, ids: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        position = np.searchsorted(self.ids, ids)
        if ids.size and (position.max() >= self.ids.size or np.any(self.ids[position] != ids)):
            raise KeyError("lookup of ids this index shard does not hold")
        out = {}
        for name in fields:
            values = getattr(self, name)
            if values is None:
                raise KeyError(f"this index shard holds no {name!r} (not needed by its role)")
            out[name] = values[position]
        return out


def _serialize_with_ids(index, ids: np.ndarray) -> np.ndarray:
    """(bytes,) uint8 of a CPU `IndexIDMap2` over `index` (positions 0..n-1) mapping to `ids`.

    `IndexShard` numbers rows by position and keeps the global ids beside the index; a
    persisted index must carry them. FAISS refuses to wrap a non-empty index, so the wrapper is
    made around an empty one and pointed at `index` (no vector is re-added or copied before
    serialization); the wrapper only borrows `index`, which outlives it here.
    """
    import faiss

    from pipeline.core.knn import _is_gpu_index

    if _is_gpu_index(index):
        index = faiss.index_gpu_to_cpu(index)
    wrapper = faiss.IndexIDMap2(faiss.IndexFlat(index.d, index.metric_type))
    wrapper.index = index
    wrapper.ntotal = index.ntotal
    wrapper.is_trained = index.is_trained
    faiss.copy_array_to_vector(np.ascontiguousarray(ids, dtype=np.int64), wrapper.id_map)
    return faiss.serialize_index(wrapper)


class _Indexes:
    """Task-side client of the index actors: merged top-k search and lookups by id."""

    def __init__(self, actors: list) -> None:
        self.actors = actors

    def search(self, modality: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import ray

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        ref = ray.put(queries)
        results = ray.get([a.search.remote(modality, ref, k) for a in self.actors])
        return merge_topk(results, k)

    def lookup(self, ids: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Rows of `fields` ("u", "v", "keys") for `ids` (all >= 0), in the order given."""
        import ray

        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:  # still ask one actor: the empty answer carries dtypes and shapes
            return ray.get(self.actors[0].lookup.remote(ids, fields))
        owner = ids % len(self.actors)
        calls = []
        for actor_index, actor in enumerate(self.actors):
            picked = np.flatnonzero(owner == actor_index)
            if picked.size:
                calls.append((picked, actor.lookup.remote(ids[picked], fields)))
        out: dict[str, np.ndarray] = {}
        for picked, ref in calls:
            part = ray.get(ref)
            for name, values in part.items():
                if name not in out:
                    shape = (ids.size, *values.shape[1:])
                    out[name] = np.empty(shape, dtype=values.dtype)
                out[name][picked] = values
        return out


# ----------------------------------------------------------------------------------------------
# Step 5: the label task
# ----------------------------------------------------------------------------------------------


def _top1(indexes: _Indexes, modality: str, queries: np.ndarray, batch: int) -> np.ndarray:
    out = np.full(queries.shape[0], -1, dtype=np.int64)
    for start in range(0, queries.shape[0], batch):
        _, ids = indexes.search(modality, queries[start : start + batch], 1)
        out[start : start + batch] = ids[:, 0]
    return out


def _neighbour_rows(indexes: _Indexes, nn: np.ndarray, fields: tuple[str, ...], dim: int):
    """Rows of the neighbours `nn` (-1: none -> zero vectors, None keys and captions)."""
    found = nn >= 0
    out = {
        name: np.zeros((nn.size, dim), np.float32)
        if name in ("u", "v")
        else np.full(nn.size, None, dtype=object)
        for name in fields
    }
    if found.any():
        rows = indexes.lookup(nn[found], fields)
        for name, values in rows.items():
            out[name][found] = values
    return out


def _bicro_global(spec, u, v, scalars, masks, indexes: _Indexes) -> dict[str, np.ndarray]:
    n, dim = u.shape
    finite = np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)
    queries = np.flatnonzero(~masks["anchor"] & finite)
    image_nn = np.full(n, -1, dtype=np.int64)
    text_nn = np.full(n, -1, dtype=np.int64)
    image_nn[queries] = _top1(indexes, "image", u[queries], spec.query_batch)
    text_nn[queries] = _top1(indexes, "text", v[queries], spec.query_batch)
    by_image = _neighbour_rows(indexes, image_nn, ("u", "v", "keys"), dim)
    by_text = _neighbour_rows(indexes, text_nn, ("u", "v", "keys"), dim)
    labels = bicro_labels(
        u,
        v,
        by_image["u"],
        by_image["v"],
        by_text["v"],
        by_text["u"],
        masks["anchor"],
        masks["clean"],
        clean_floor=spec.bicro.clean_floor,
        theta=spec.bicro.theta,
        ratio=spec.bicro.ratio,
    )
    no_anchor = (image_nn < 0) & ~masks["anchor"]  # empty anchor set: nothing to compare with
    raw = np.where(no_anchor, 0.0, labels["bicro"]).astype(np.float32)
    star = np.where(no_anchor, 0.0, labels["bicro_star"]).astype(np.float32)
    return {
        "soft_label": star,
        "bicro": raw,
        "subset": np.where(masks["clean"], CLEAN, NOISY).astype(np.int8),
        "image_anchor_key": by_image["keys"],
        "text_anchor_key": by_text["keys"],
    }


def _bicro_in_batch(spec, shard, u, v, scalars, masks) -> dict[str, np.ndarray]:
    n = u.shape[0]
    clean = masks["clean"]
    raw = np.zeros(n, dtype=np.float32)
    star = np.zeros(n, dtype=np.float32)
    anchor = np.zeros(n, dtype=bool)
    if clean.any():
        labels = bicro_in_batch_anchors(
            u,
            v,
            np.where(masks["valid"], scalars.loss, np.inf),
            clean,
            ids=scalars.ids,
            batch_size=spec.bicro.batch_size,
            seed=_shard_seed(spec, shard),
            clean_floor=spec.bicro.clean_floor,
            theta=spec.bicro.theta,
            ratio=spec.bicro.ratio,
        )
        raw, star, anchor = labels["bicro"], labels["bicro_star"], labels["is_anchor"]
    masks["anchor"] = anchor
    return {
        "soft_label": np.nan_to_num(star, nan=0.0).astype(np.float32),
        "bicro": np.nan_to_num(raw, nan=0.0).astype(np.float32),
        "subset": np.where(clean, CLEAN, NOISY).astype(np.int8),
    }


class _BatchLookup:
    """ids -> rows from one prefetched block (sorted unique ids), for `rcr_ndcg`'s rescoring.

    Ids outside the block (the core asks for id 0 in place of a missing -1 and then discards
    the answer) get some row of the block, or zeros when the block is empty.
    """

    def __init__(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.ids, self.rows = ids, rows

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        if self.ids.size == 0:
            return np.zeros((np.size(ids), *self.rows.shape[1:]), dtype=self.rows.dtype)
        return self.rows[np.minimum(np.searchsorted(self.ids, ids), self.ids.size - 1)]


def _distinct_per_row(groups: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """(Q,) number of distinct groups among the valid entries of each row of (Q, M)."""
    order = np.lexsort((groups, ~valid), axis=1)  # valid entries first, grouped
    g = np.take_along_axis(groups, order, axis=1)
    ok = np.take_along_axis(valid, order, axis=1)
    new = ok.copy()
    new[:, 1:] &= g[:, 1:] != g[:, :-1]
    return new.sum(axis=1)


def _groups_of(indexes: _Indexes, ids: np.ndarray) -> np.ndarray:
    """(Q, M) image groups of the ids (Q, M) from their owner actors (-1 ids -> -1)."""
    valid = ids >= 0
    unique = np.unique(ids[valid])
    groups = _BatchLookup(unique, indexes.lookup(unique, ("groups",))["groups"])
    return np.where(valid, groups(np.maximum(ids, 0)), -1)


def _image_search_distinct(
    indexes: _Indexes, queries: np.ndarray, want: int, max_depth: int
) -> np.ndarray:
    """Image-index ids (Q, M) deep enough to hold `want` distinct image groups per row.

    Duplicated images occupy several rows of the index, so the top-`want` rows may hold fewer
    than `want` distinct images (rcr_ndcg keeps the first row of each group). Rows that come
    back full yet short of groups are searched again, twice as deep each time, up to
    `max_depth`; a row with a missing (-1) entry has exhausted the index (or its IVF probes).
    Past `max_depth` (one image repeated hundreds of times, e.g. a placeholder picture) the
    row keeps fewer groups and its NDCG uses a smaller K_eff.
    """
    _, ids = indexes.search("image", queries, want)
    pending = np.arange(queries.shape[0])
    while pending.size:
        sub = ids[pending]
        valid = sub >= 0
        short = valid.all(axis=1) & (_distinct_per_row(_groups_of(indexes, sub), valid) < want)
        pending = pending[short]
        if not pending.size or ids.shape[1] >= max_depth:
            break
        depth = min(2 * ids.shape[1], max_depth)
        _, deeper = indexes.search("image", queries[pending], depth)
        ids = np.pad(ids, ((0, 0), (0, depth - ids.shape[1])), constant_values=-1)
        ids[pending] = deeper
    return ids


def _rcr(spec, u, v, scalars, masks, indexes: _Indexes, dedup: bool) -> dict[str, np.ndarray]:
    """RCR weights of one shard. `dedup`: some embeddings table has `image_sha256`, so images
    are ranked as unique images (the actors hold a group per row); else every row is its own
    image and the image lists are plain top-(K+1) rows."""
    n = u.shape[0]
    depth = spec.rcr.k + 1
    weight = np.zeros(n, dtype=np.float32)
    finite = np.isfinite(u).all(axis=1) & np.isfinite(v).all(axis=1)
    # Bound the prefetched neighbour rows: 4 lists of depth ids per query.
    batch = max(1, min(spec.query_batch, _MAX_KEYS_PER_QUERY_BATCH // (2 * depth)))
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        ub, vb = u[start:stop], v[start:stop]
        _, i2t = indexes.search("text", ub, depth)
        _, t2t = indexes.search("text", vb, depth)
        if dedup:
            max_depth = depth * _MAX_IMAGE_DEPTH_FACTOR
            t2i = _image_search_distinct(indexes, vb, depth, max_depth)
            i2i = _image_search_distinct(indexes, ub, depth, max_depth)
        else:
            _, t2i = indexes.search("image", vb, depth)
            _, i2i = indexes.search("image", ub, depth)
        text_ids = np.unique(np.concatenate([i2t.ravel(), t2t.ravel()]))
        image_ids = np.unique(np.concatenate([t2i.ravel(), i2i.ravel()]))
        if dedup and not spec.rcr.include_self:
            # The core excludes the query's own group, looked up by its id: fetch it too (rows
            # with non-finite vectors are not indexed; their NDCG is NaN anyway).
            own = scalars.ids[start:stop][finite[start:stop]]
            image_ids = np.union1d(image_ids, own)
        text_ids, image_ids = text_ids[text_ids >= 0], image_ids[image_ids >= 0]
        text_db = _BatchLookup(text_ids, indexes.lookup(text_ids, ("v",))["v"])
        image_rows = indexes.lookup(image_ids, ("u", "groups") if dedup else ("u",))
        image_db = _BatchLookup(image_ids, image_rows["u"])
        groups = _BatchLookup(image_ids, image_rows["groups"]) if dedup else None
        out = rcr_ndcg(
            ub,
            vb,
            i2t,
            t2t,
            t2i,
            i2i,
            text_db,
            image_db,
            k=spec.rcr.k,
            self_ids=scalars.ids[start:stop],
            include_self=spec.rcr.include_self,
            image_group_ids=groups,
        )
        weight[start:stop] = np.nan_to_num(out["w"], nan=0.0)
    in_c = masks["in_c"]
    return {
        "soft_label": rcr_weights(weight, in_c),
        "rcr": weight,
        "subset": np.where(in_c, CLEAN, NOISY).astype(np.int8),
    }


def _sps(spec, shard, u, v, scalars, masks, indexes: _Indexes, logit_scale: float, losses):
    """SPS labels of one shard (METHODS §4.9).

    The partition (`masks`, `scalars.prob`) is the peer's (`spec.view`); u, v (N, D), `losses`
    (loss_i2t, loss_t2i) (N,) each and `logit_scale` are the trainee's: P^ of the quasi-clean
    label, the proxy search and the proxy P^ are the trained model's own (§4.1, §4.5).
    """
    n, dim = u.shape
    codes = masks["sps"]
    label = np.zeros(n, dtype=np.float32)
    label[codes == CLEAN] = 1.0
    quasi = codes == QUASI_CLEAN
    loss_i2t, loss_t2i = losses
    label[quasi] = sps_quasi_clean_label(scalars.prob[quasi], loss_i2t[quasi], loss_t2i[quasi])
    noisy = np.flatnonzero(codes == NOISY)
    image_keys = np.full(n, None, dtype=object)
    text_keys = np.full(n, None, dtype=object)
    proxies = None
    if noisy.size:
        image_nn = _top1(indexes, "image", u[noisy], spec.query_batch)
        text_nn = _top1(indexes, "text", v[noisy], spec.query_batch)
        by_image = _neighbour_rows(indexes, image_nn, ("u", "v", "keys", "captions"), dim)
        by_text = _neighbour_rows(indexes, text_nn, ("u", "v", "keys"), dim)
        out = sps_proxy_labels(
            u[noisy],
            v[noisy],
            image_nn,
            by_image["u"],
            by_image["v"],
            text_nn,
            by_text["u"],
            by_text["v"],
            logit_scale=logit_scale,
            gamma=spec.sps.gamma,
            beta=spec.sps.beta,
            batch_size=spec.sps.batch_size,
            seed=_shard_seed(spec, shard),
        )
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
        }
    return (
        {
            "soft_label": label,
            "sps": label.copy(),
            "subset": codes,
            "image_anchor_key": image_keys,
            "text_anchor_key": text_keys,
        },
        proxies,
    )


def _shard_seed(spec: LabelSpec, shard: str) -> int:
    return (spec.seed * 1_000_003 + spec.round_index * 7919 + zlib.crc32(shard.encode())) % 2**32


def _nullable_float(values: np.ndarray | None, n: int) -> pa.Array:
    if values is None:
        return pa.nulls(n, pa.float32())
    return pa.array(np.asarray(values, dtype=np.float32), type=pa.float32())


def _nullable_string(values: np.ndarray | None, n: int) -> pa.Array:
    if values is None:
        return pa.nulls(n, pa.string())
    return pa.array(list(values), type=pa.string())


def quality_arrays(
    ground_truth: str, keys: list[str], scores: dict[str, np.ndarray], subsets: dict
) -> dict[str, Any]:
    """Ground truth joined by key, with the scores to evaluate (float32) for the driver.

    Args:
        ground_truth: ground_truth.parquet (key, kind, degree).
        keys: (N,) the shard's keys, aligned with every array of `scores` and `subsets`.
        scores: {name: (N,) float score}; subsets: {name: (N,) bool clean subset}.

    Returns:
        Compact per-pair arrays (kind as int8 codes of KIND_CODES) for `quality_from_parts`.
    """
    import pyarrow.compute as pc

    truth = _read_table(ground_truth, ["key", "kind", "degree"])
    truth = truth.filter(pc.is_in(truth.column("key"), value_set=pa.array(keys, pa.string())))
    position = {key: i for i, key in enumerate(keys)}
    rows = np.array([position[k] for k in truth.column("key").to_pylist()], dtype=np.int64)
    kinds = truth.column("kind").to_pylist()
    return {
        "kind": np.array([KIND_CODES.index(k) for k in kinds], dtype=np.int8),
        "degree": truth.column("degree").to_numpy().astype(np.float32),
        "scores": {name: values[rows].astype(np.float32) for name, values in scores.items()},
        "subsets": {name: values[rows] for name, values in subsets.items()},
    }


def _label_task(
    spec: LabelSpec,
    shard: str,
    offset: int,
    fits: dict,
    decisions: _Decisions,
    actors: list | None,
    context: dict[str, Any],
) -> dict[str, Any]:
    """Label one shard and write its table (and its SPS proxies). Returns the shard summary."""
    started = time.perf_counter()
    view, trainee = spec.view, _trainee(spec)
    trainee_losses = [f"loss_i2t_{trainee}", f"loss_t2i_{trainee}"] if trainee != view else []
    table = _read_table(
        _embeddings_path(spec, shard),
        ["key", "shard", "url", "caption", f"cosine_{view}"]
        + _embedding_columns(trainee)
        + _scalar_columns(spec)
        + trainee_losses,
    )
    n = table.num_rows
    scalars = _scalars_from_table(spec, table, offset)
    _add_posteriors(spec, scalars, fits)
    masks = _masks(spec, scalars, decisions)
    # The labelling model's vectors (SPS: the trainee's; every other method: the view's).
    u = _matrix(table.column(f"image_embedding_{trainee}"))
    v = _matrix(table.column(f"text_embedding_{trainee}"))
    indexes = _Indexes(actors) if actors else None

    proxies = None
    if spec.method == "bicro":
        if spec.bicro.anchors == "global":
            result = _bicro_global(spec, u, v, scalars, masks, indexes)
        else:
            result = _bicro_in_batch(spec, shard, u, v, scalars, masks)
    elif spec.method == "rcr":
        result = _rcr(spec, u, v, scalars, masks, indexes, context["image_groups"])
    elif spec.method == "sps":
        losses = (scalars.loss_i2t, scalars.loss_t2i)
        if trainee != view:
            losses = tuple(_float_column(table, name) for name in trainee_losses)
        result, proxies = _sps(
            spec, shard, u, v, scalars, masks, indexes, float(context["logit_scale"]), losses
        )
    else:
        result = {
            "soft_label": cosine_labels(u, v),
            "subset": np.where(masks["clean"], CLEAN, NOISY).astype(np.int8),
        }

    valid = masks["valid"]
    soft = np.where(valid, np.nan_to_num(result["soft_label"], nan=0.0), 0.0)
    soft = np.clip(soft, 0.0, 1.0).astype(np.float32)
    subset = np.where(valid, result["subset"], NOISY).astype(np.int8)
    clean_prob = np.where(valid, scalars.prob, 0.0).astype(np.float32)
    cosine = table.column(f"cosine_{view}").to_numpy().astype(np.float32)

    metadata = labels_file_metadata(
        pipeline_version=context["version"],
        job_hash=spec.job_hash,
        model_id=context["model_id"],
        mixture=context["mixture"],
        extra={
            "ncl.method": spec.method,
            "ncl.round": str(spec.round_index),
            "ncl.view": view,
            "ncl.trainee_view": trainee,
            "ncl.loss": spec.loss,
            "ncl.shard_path": context["shard_paths"].get(shard, ""),
        },
    )
    schema = LABELS_SCHEMA.with_metadata(metadata)
    columns = {
        "key": table.column("key"),
        "shard": table.column("shard"),
        "url": table.column("url"),
        "caption": table.column("caption"),
        "soft_label": pa.array(soft, pa.float32()),
        "clean_prob": pa.array(clean_prob, pa.float32()),
        "subset": pa.DictionaryArray.from_arrays(
            pa.array(subset, pa.int8()), pa.array(SUBSET_VALUES, pa.string())
        ),
        "loss": pa.array(scalars.loss, pa.float32()),
        "cosine": pa.array(cosine, pa.float32()),
        "bicro": _nullable_float(result.get("bicro"), n),
        "rcr": _nullable_float(result.get("rcr"), n),
        "sps": _nullable_float(result.get("sps"), n),
        "image_anchor_key": _nullable_string(result.get("image_anchor_key"), n),
        "text_anchor_key": _nullable_string(result.get("text_anchor_key"), n),
        "round": pa.array(np.full(n, spec.round_index, dtype=np.int16), pa.int16()),
    }
    out_table = pa.table([columns[name] for name in schema.names], schema=schema)
    write_table_atomic(out_table, f"{spec.out_dir}/{shard}.parquet", schema)
    if spec.method == "sps":
        _write_proxies(spec, shard, table, proxies)

    summary: dict[str, Any] = {
        "shard": shard,
        "rows": n,
        "invalid": int((~valid).sum()),
        "subsets": {name: int((subset == code).sum()) for code, name in enumerate(SUBSET_VALUES)},
        "anchors": int(masks["anchor"].sum()),
        "seconds": time.perf_counter() - started,
    }
    if spec.ground_truth:
        summary["quality"] = quality_arrays(
            spec.ground_truth,
            table.column("key").to_pylist(),
            *_quality_scores(spec, fits, scalars, masks, result, soft, subset, cosine),
        )
    return summary


def _quality_scores(spec, fits, scalars, masks, result, soft, subset, cosine):
    """Scores and clean subsets to evaluate: the method and the baselines."""
    bmm = clean_posterior(fits["bmm"], scalars.loss)
    gmm = clean_posterior(fits["gmm"], scalars.loss)
    scores = {spec.method: soft, "cosine": cosine, "bmm_posterior": bmm, "gmm_posterior": gmm}
    with np.errstate(invalid="ignore"):
        subsets = {
            spec.method: subset == CLEAN,
            "bmm_posterior": bmm > spec.threshold,
            "gmm_posterior": gmm > spec.threshold,
        }
    if spec.method == "bicro":
        scores["bicro_raw"] = result["bicro"]
        subsets["bicro_raw"] = subset == CLEAN
    if spec.method == "rcr":
        # The paper's ablation weights: mean per-direction posterior, and w unmasked.
        scores["rcr_unmasked"] = result["rcr"]
        scores["rcr_alpha_mean"] = 0.5 * (scalars.alpha_i2t + scalars.alpha_t2i)
        scores["rcr_cosine_on_c"] = np.where(masks["in_c"], cosine, -1.0)
        subsets["rcr_alpha_mean"] = masks["in_c"]
    return scores, subsets


def _write_proxies(spec: LabelSpec, shard: str, table: pa.Table, proxies: dict | None) -> None:
    folder = spec.proxies_dir or RunLayout(spec.output).sps_proxies_dir(spec.round_index, spec.view)
    if proxies is None:
        arrays = [pa.array([], f.type) for f in SPS_PROXIES_SCHEMA]
    else:
        keys = table.column("key").take(pa.array(proxies["rows"], pa.int64()))
        arrays = [keys]
        for f in list(SPS_PROXIES_SCHEMA)[1:]:
            values = proxies[f.name]
            arrays.append(pa.array(list(values) if f.type == pa.string() else values, f.type))
    out = pa.table(arrays, schema=SPS_PROXIES_SCHEMA)
    write_table_atomic(out, f"{folder}/{shard}.parquet", SPS_PROXIES_SCHEMA)


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _previous_summary(spec: LabelSpec, shards: list[str]) -> dict | None:
    summary = read_json(f"{spec.out_dir}/{SUMMARY_NAME}")
    if not summary or not spec.job_hash:
        return None
    same = (
        summary.get("job_hash") == spec.job_hash
        and summary.get("round") == spec.round_index
        and summary.get("view") == spec.view
        and summary.get("method") == spec.method
        and summary.get("trainee_view", spec.view) == _trainee(spec)
        and summary.get("shards_labelled") == shards
    )
    if same and all(file_exists(f"{spec.out_dir}/{s}.parquet") for s in shards):
        return summary
    return None


def run_label_pass(spec: LabelSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the label pass of one round and view on the connected Ray cluster.

    Args:
        spec: the pass (see `LabelSpec`; `LabelSpec.from_job` maps a job config onto it).
        log: progress lines.

    Returns:
        JSON-ready summary: counts per subset, partition decisions, every mixture fit, index
        layout, seconds per step and, with ground truth, the label-quality table.

    Raises:
        ValueError: no embedded sample at all, or the embeddings lack the view's columns.
    """
    import ray

    import pipeline

    timings: dict[str, float] = {}
    clock = time.perf_counter()
    shards = [s for s in spec.shards if file_exists(_embeddings_path(spec, s))]
    missing = [s for s in spec.shards if s not in shards]
    if missing:
        log(f"labels: {len(missing)} shard(s) have no embeddings (failed embed), skipped")
    previous = _previous_summary(spec, shards)
    if previous is not None:
        log(f"labels: {spec.out_dir} already complete for this job, skipped")
        return {**previous, "skipped": True}
    if not shards:
        raise ValueError(
            f"no embeddings under {RunLayout(spec.output).embeddings_dir(spec.round_index)}: "
            "run the embed pass first"
        )

    def remote(fn, **options):
        return ray.remote(fn).options(num_cpus=1, max_retries=3, **options)

    def step(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now

    # 1. Rows, ranges and metadata.
    infos = ray.get([remote(_range_task).remote(spec, s) for s in shards])
    rows = [info["rows"] for info in infos]
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64).tolist()
    total = int(sum(rows))
    if total == 0:
        raise ValueError("the embeddings tables hold no sample: nothing to label")
    ranges = {}
    for name in _FIT_LOSSES:
        merged = (math.inf, -math.inf)
        for info in infos:
            merged = merge_ranges(merged, info["ranges"][name])
        ranges[name] = merged
    model_id = spec.model_id or next((i["model_id"] for i in infos if i["model_id"]), "unknown")
    logit_scale = next((i["logit_scale"] for i in infos if i["logit_scale"]), None)
    step("ranges")

    # 2. Histograms -> fits on the driver (O(bins)).
    histograms = ray.get([remote(_histogram_task).remote(spec, s, ranges) for s in shards])
    fits: dict[str, MixtureFit] = {}
    for name, fitted in (("loss", ("bmm", "gmm")), ("i2t", ("gmm_i2t",)), ("t2i", ("gmm_t2i",))):
        parts = [h[name] for h in histograms if name in h]
        if not parts:
            raise ValueError(f"no finite {name} loss in any shard: cannot fit a mixture")
        hist = parts[0]
        for other in parts[1:]:
            hist = merge_histograms(hist, other)
        for fit_name in fitted:
            fits[fit_name] = fit_bmm(hist) if fit_name == "bmm" else fit_gmm(hist)
    mixture = {
        "round": spec.round_index,
        "view": spec.view,
        "loss": spec.loss,
        "kind": spec.mixture_kind,
        "threshold": spec.threshold,
        "fits": {name: fit.to_dict() for name, fit in fits.items()},
    }
    layout = RunLayout(spec.output)
    write_json_atomic(mixture, layout.mixture(spec.round_index, spec.view))
    fits_ref = ray.put(fits)
    step("fit")
    configured = fits[spec.mixture_kind]
    log(
        f"labels: {total} pairs in {len(shards)} shards; {spec.mixture_kind.upper()} on "
        f"{spec.loss}: clean mean {_component(configured, 'clean')}, noisy mean "
        f"{_component(configured, 'noisy')}" + (" (no loss spread)" if configured.no_spread else "")
    )

    # 3. Partition: counts, fallbacks and anchors by radix select.
    counts = ray.get(
        [
            remote(_count_task).remote(spec, s, o, fits_ref)
            for s, o in zip(shards, offsets, strict=True)
        ]
    )
    count = {key: sum(c.get(key, 0) for c in counts) for key in counts[0]}

    def select(what: str, k: int, in_play: int, decisions=None, with_id=True):
        task = remote(_select_task)

        def run_round(prefix, fetch):
            return ray.get(
                [
                    task.remote(spec, s, o, fits_ref, what, decisions, prefix, fetch)
                    for s, o in zip(shards, offsets, strict=True)
                ]
            )

        return _radix_select(
            run_round, k, in_play, with_id=with_id, fetch_limit=spec.select_fetch_limit
        )

    decisions, partition = _decide(spec, count, select)
    step("partition")
    log(f"labels: partition {json.dumps(partition, sort_keys=True)}")
    if _trainee(spec) != spec.view:
        log(f"labels: partition from view {spec.view}, P^ and proxies from {_trainee(spec)}")

    # 4-5. Index actors, then the label tasks that query them.
    role = _index_role(spec)
    index_info: dict[str, Any] = {"role": role}
    actors: list = []
    try:
        if role is not None:
            actors = _build_index_actors(spec, shards, offsets, fits_ref, decisions, role, remote)
            if spec.index_factory.replace(" ", "") == "Flat":
                sizes = ray.get([actor.build.remote(None) for actor in actors])
            else:
                sizes = _train_and_build(actors)
            index_info.update(
                factory=spec.index_factory,
                shards=len(actors),
                rows=int(sum(sizes)),
                nprobe=spec.nprobe,
            )
            log(f"labels: index over {role}: {sum(sizes)} rows in {len(actors)} actor(s)")
            if spec.write_index:
                index_info["dir"] = _save_indexes(spec, actors, role, sizes, shards, offsets)
        step("index")
        context = {
            "version": pipeline.__version__,
            "model_id": model_id,
            "logit_scale": logit_scale if logit_scale is not None else repr(1 / 0.07),
            # RCR ranks unique images when any table has image_sha256 (old tables: rows).
            "image_groups": any(info["image_sha256"] for info in infos),
            "mixture": mixture,
            "shard_paths": dict(zip(spec.shards, spec.shard_paths, strict=False)),
        }
        decisions_ref, context_ref = ray.put(decisions), ray.put(context)
        task = remote(_label_task)
        pending = {
            task.remote(spec, s, o, fits_ref, decisions_ref, actors or None, context_ref): s
            for s, o in zip(shards, offsets, strict=True)
        }
        results = []
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                result = ray.get(ref)
                results.append(result)
                log(
                    f"  [{len(results)}/{len(shards)}] {result['shard']}: {result['rows']} "
                    f"labelled, {result['seconds']:.1f}s"
                )
    finally:
        for actor in actors:
            ray.kill(actor)
    step("labels")

    results.sort(key=lambda r: shards.index(r["shard"]))
    subsets = {name: sum(r["subsets"][name] for r in results) for name in SUBSET_VALUES}
    summary: dict[str, Any] = {
        "round": spec.round_index,
        "view": spec.view,
        "trainee_view": _trainee(spec),
        "method": spec.method,
        "loss": spec.loss,
        "mixture_kind": spec.mixture_kind,
        "job_hash": spec.job_hash,
        "model_id": model_id,
        "out_dir": spec.out_dir,
        "ground_truth": spec.ground_truth,
        "mixture_file": layout.mixture(spec.round_index, spec.view),
        "shards_labelled": shards,
        "shards_missing": missing,
        "samples": total,
        "invalid": sum(r["invalid"] for r in results),
        "subsets": subsets,
        "anchors": sum(r["anchors"] for r in results),
        "partition": partition,
        "mixture": {name: _fit_summary(fit) for name, fit in fits.items()},
        "index": index_info,
        "seconds": timings,
        "quality": None,
    }
    if spec.ground_truth:
        summary["quality"] = quality_from_parts([r["quality"] for r in results if "quality" in r])
        _print_quality(summary["quality"], summary, log)
    timings["total"] = sum(timings.values())
    write_json_atomic(summary, f"{spec.out_dir}/{SUMMARY_NAME}")
    log(
        f"labels: wrote {total} rows to {spec.out_dir} "
        f"({', '.join(f'{k}: {v}' for k, v in subsets.items())}) in {timings['total']:.1f}s"
    )
    return {**summary, "skipped": False}


def _component(fit: MixtureFit, which: str) -> str:
    if fit.no_spread or fit.means is None:
        return "n/a"
    index = fit.clean_component if which == "clean" else fit.noisy_component
    return f"{fit.means[index]:.3f} (weight {fit.weights[index]:.2f})"


def _fit_summary(fit: MixtureFit) -> dict[str, Any]:
    """The fit without its likelihood trace (the mixture file keeps everything)."""
    out = fit.to_dict()
    out.pop("log_likelihood_trace", None)
    return out


def _index_role(spec: LabelSpec) -> str | None:
    if spec.method == "bicro" and spec.bicro.anchors == "global":
        return "anchors"
    if spec.method == "rcr":
        return "all"
    if spec.method == "sps":
        return "reliable"
    return None


def _decide(spec: LabelSpec, count: dict[str, int], select) -> tuple[_Decisions, dict]:
    """Global partition decisions (METHODS §1.6, §2.5 step 4, §4.3, §5.3) from counts + selects."""
    valid = count["valid"]
    invalid = count["rows"] - valid
    threshold, eps2 = spec.threshold, spec.sps.eps2
    guard_cut = anchor_cut = rcr_cut = None
    partition: dict[str, Any] = {}

    if spec.method in ("bicro", "cosine"):
        n_clean = count["above_delta"]
        one_percent = valid > 0 and n_clean == valid
        if one_percent:
            # split_prob's 1 % rule: the threshold becomes the value at sorted position N // 100.
            key, _, n_le = select("prob", valid // 100 + 1, valid, with_id=False)
            threshold = _key_value(key)
            n_clean = valid - n_le
        guard = valid > 0 and n_clean == 0
        if guard:
            k = max(1, valid // 100)
            key, sample, _ = select("loss_valid", k, valid)
            guard_cut, n_clean = (key, sample), k
        partition["clean_split"] = {
            "threshold": threshold,
            "one_percent_rule": bool(one_percent),
            "symmetric_guard": bool(guard),
            "n_selected": int(n_clean),
            "n_invalid": int(invalid),
        }
        if spec.method == "bicro" and spec.bicro.anchors == "global" and n_clean > 0:
            fraction = Fraction(repr(float(spec.bicro.anchor_fraction)))
            k = max(1, math.ceil(fraction * n_clean))
            interim = _Decisions(threshold=threshold, guard_cut=guard_cut, sps_eps2=eps2)
            key, sample, _ = select("loss_clean", k, n_clean, decisions=interim)
            anchor_cut = (key, sample)
            partition["anchors"] = {"n_anchors": k, "fraction": spec.bicro.anchor_fraction}
    elif spec.method == "sps":
        kept = count["above_eps2"]
        one_percent = valid > 0 and kept == valid
        if one_percent:
            key, _, n_le = select("prob", valid // 100 + 1, valid, with_id=False)
            eps2 = _key_value(key)
            kept = valid - n_le
        partition["sps_split"] = {
            "threshold": eps2,
            "eps1": spec.sps.eps1,
            "one_percent_rule": bool(one_percent),
            "symmetric_guard": False,
            "n_selected": int(kept),
            "n_invalid": int(invalid),
            # METHODS §4.9 step 5: no reliable pair -> no proxies, every noisy label 0.
            "n_reliable": int(count["above_eps1"]),
            "no_reliable_set": count["above_eps1"] == 0,
        }
    elif spec.method == "rcr":
        rcr_valid, in_c = count["rcr_valid"], count["in_c"]
        guard = rcr_valid > 0 and in_c == 0
        if guard:
            k = max(1, rcr_valid // 100)
            key, sample, _ = select("rcr_guard", k, rcr_valid)
            rcr_cut, in_c = (key, sample), k
        partition["rcr_candidates"] = {
            "threshold": spec.rcr.delta,
            "one_percent_rule": False,
            "symmetric_guard": bool(guard),
            "n_selected": int(in_c),
            "n_invalid": int(count["rows"] - rcr_valid),
        }
    decisions = _Decisions(
        threshold=threshold,
        guard_cut=guard_cut,
        anchor_cut=anchor_cut,
        sps_eps2=eps2,
        rcr_guard_cut=rcr_cut,
    )
    return decisions, partition


def _build_index_actors(spec, shards, offsets, fits_ref, decisions, role, remote) -> list:
    import ray

    n_actors = spec.index_shards
    dim = _embedding_dim(spec, shards[0])
    actor_class = ray.remote(IndexShardActor).options(max_restarts=0, max_task_retries=0)
    actors = [
        actor_class.remote(dim, spec.index_factory, spec.nprobe, spec.seed) for _ in range(n_actors)
    ]
    task = remote(_index_rows_task, num_returns=n_actors)
    outputs = [
        task.remote(spec, s, o, fits_ref, decisions, role, n_actors)
        for s, o in zip(shards, offsets, strict=True)
    ]
    if n_actors == 1:
        outputs = [[ref] for ref in outputs]
    # Refs passed as arguments: the rows go from the object store straight to each actor.
    ray.get([actor.add.remote(*[out[i] for out in outputs]) for i, actor in enumerate(actors)])
    return actors


def _save_indexes(spec, actors, role, sizes, shards, offsets) -> str:
    """Persist the index shards (DESIGN §2 barrier 3) and describe them; returns the folder.

    Each actor writes its own two files (no vector passes through the driver); `_index.json`,
    written last, lists them and says how to read their ids. A later pass of the same round
    and view replaces `_index.json`; files of another role stay beside it, unlisted.
    """
    import ray

    folder = RunLayout(spec.output).index_dir(spec.round_index, spec.view)
    files = ray.get([actor.save.remote(folder, role, i) for i, actor in enumerate(actors)])
    description = {
        "round": spec.round_index,
        "view": spec.view,
        "embeddings_view": _trainee(spec),  # whose vectors are indexed
        "method": spec.method,
        "role": role,  # anchors (BiCro) | reliable (SPS) | all (RCR)
        "factory": spec.index_factory,
        "nprobe": spec.nprobe,
        "metric": "inner_product",
        "dim": _embedding_dim(spec, shards[0]),
        "shards": len(actors),
        "rows_per_shard": [int(size) for size in sizes],
        "files": {modality: [f[modality] for f in files] for modality in ("image", "text")},
        "format": "faiss.read_index: an IndexIDMap2 (on CPU) whose ids are global sample ids",
        "ids": (
            "global sample id = offset of the sample's embeddings table + its row in it; tables "
            "in `embedding_shards` order with `shard_offsets`; index shard s holds ids % shards "
            "== s; L2-normalised vectors, so scores are cosines"
        ),
        "embedding_shards": list(shards),
        "shard_offsets": [int(o) for o in offsets],
        "job_hash": spec.job_hash,
    }
    write_json_atomic(description, f"{folder}/_index.json")
    return folder


def _train_and_build(actors: list) -> list[int]:
    import ray

    trained = actors[0].train.remote()  # a ref: the codebooks go actor -> actor, not via here
    return ray.get([actor.build.remote(trained) for actor in actors])


def _embedding_dim(spec: LabelSpec, shard: str) -> int:
    import fsspec
    import pyarrow.parquet as pq

    fs, fs_path = fsspec.core.url_to_fs(_embeddings_path(spec, shard))
    with fs.open(fs_path, "rb") as handle:
        schema = pq.read_schema(handle)
    column = schema.field(f"image_embedding_{_trainee(spec)}")
    return int(column.type.list_size)


# ----------------------------------------------------------------------------------------------
# Label quality (ground truth only)
# ----------------------------------------------------------------------------------------------


def quality_from_parts(parts: list[dict]) -> dict[str, Any] | None:
    """Label quality per score over every shard's `quality_arrays` (None without parts)."""
    from pipeline.core.metrics import label_quality

    if not parts:
        return None
    kinds = np.array(KIND_CODES)[np.concatenate([p["kind"] for p in parts])]
    degree = np.concatenate([p["degree"] for p in parts])
    out = {}
    for name in parts[0]["scores"]:
        scores = np.concatenate([p["scores"][name] for p in parts])
        subset = None
        if name in parts[0]["subsets"]:
            subset = np.concatenate([p["subsets"][name] for p in parts])
        out[name] = label_quality(scores, kinds, degree, subset)
    return out


def _print_quality(quality: dict, summary: dict, log: Callable[[str], None]) -> None:
    def fmt(value) -> str:
        return "   -  " if value is None else f"{value:6.3f}"

    log("")
    log(
        f"label quality (round {summary['round']}, view {summary['view']}, "
        f"{summary['samples']} pairs): AUROC clean vs mismatched, Spearman vs degree, "
        "clean-subset precision/recall"
    )
    log(f"  {'score':<18} {'AUROC':>6} {'Spear.':>6} {'prec.':>6} {'recall':>6}")
    for name, q in quality.items():
        log(
            f"  {name:<18} {fmt(q['auroc'])} {fmt(q['spearman'])} "
            f"{fmt(q['precision'])} {fmt(q['recall'])}"
        )
