"""`run_label_pass`: the label pass of one round and view, orchestrated on Ray.

Contract (docs/architecture.md, "The label pass"):
- Reads `rounds/<r>/embeddings/<shard>.parquet` (view `spec.view`; the labelling view too) and
  writes `spec.out_dir/<shard>.parquet` in the label-table schema, one row per embedded sample;
  also `rounds/<r>/mixture_<view>.json` (every fit), the method's proxies table if it has one,
  the FAISS index shards under `rounds/<r>/index_<view>/`, and last `spec.out_dir/
  _label_pass.json` (the summary). Whether a pass runs at all is the run state's decision
  (`pipeline.run.state`): called, it always computes.
- Steps, each a Ray task per shard (or an actor per index shard); the driver folds only O(bins)
  histograms, counts, a few cut points and metrics, never a per-sample list:
  1. rows and loss ranges; 2. histograms -> BMM/GMM fits; 3. partition counts and the method's
  decisions (radix selects), and each modality's corpus mean when the method centres (exact
  sums per shard); 4. index rows -> index actors; 5. label tasks.
  With `labels.loss_negatives: competitors`, between 1 and 2: an index of every pair (the
  partitioning view), each shard's InfoNCE against its pairs' competitors written to
  `spec.out_dir/_competitor_loss/<shard>.parquet`, and that loss is what every later step reads.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from typing import Any

import numpy as np

from pipeline.core.labels.centring import corpus_means, merge_sums
from pipeline.core.mixture.fit import MIXTURES, MixtureFit, merge_histograms, merge_ranges
from pipeline.core.partition.decisions import PartitionDecisions
from pipeline.core.partition.select import radix_select
from pipeline.core.search.index_factory import auto_factory
from pipeline.io.ground_truth import quality_from_parts
from pipeline.io.labels import SUBSET_VALUES
from pipeline.io.layout import LABEL_PASS_SUMMARY, RUN_STATE_FIELD, RunLayout
from pipeline.io.tables import file_exists, write_json_atomic
from pipeline.stages.labels import shard_tasks
from pipeline.stages.labels.index_actors import (
    actor_neighbours,
    build_index_actors,
    remove_restore_tables,
    report_restarts,
    save_indexes,
)
from pipeline.stages.labels.label_task import label_task
from pipeline.stages.labels.resources import TASK_OPTIONS
from pipeline.stages.labels.spec import LabelSpec

__all__ = ["SUMMARY_NAME", "run_label_pass"]

logger = logging.getLogger(__name__)

SUMMARY_NAME = LABEL_PASS_SUMMARY


def _remote(fn, **options):
    import ray

    return ray.remote(fn).options(**{**TASK_OPTIONS, **options})


def _map(fn, spec: LabelSpec, shards: list[str], *per_shard, shared=()) -> list:
    """Run `fn(spec, shard, *per_shard_args, *shared)` as one task per shard; results in order."""
    import ray

    task = _remote(fn)
    columns = list(zip(*per_shard, strict=True)) if per_shard else [()] * len(shards)
    return ray.get(
        [task.remote(spec, s, *c, *shared) for s, c in zip(shards, columns, strict=True)]
    )


# A pass's fits, per loss they are fitted on: (the fit's name, its kind in MIXTURES).
FITS = {
    "loss": (("bmm", "bmm"), ("gmm", "gmm")),
    "i2t": (("gmm_i2t", "gmm"),),
    "t2i": (("gmm_t2i", "gmm"),),
}


def _fit_mixtures(spec: LabelSpec, shards: list[str], infos: list[dict]) -> dict[str, MixtureFit]:
    """Steps 1-2: corpus-wide loss ranges, histograms per shard, fits on the driver (O(bins))."""
    ranges = {}
    for name in shard_tasks.FIT_LOSSES:
        merged = (math.inf, -math.inf)
        for info in infos:
            merged = merge_ranges(merged, info["ranges"][name])
        ranges[name] = merged
    histograms = _map(shard_tasks.histogram_task, spec, shards, shared=(ranges,))
    fits: dict[str, MixtureFit] = {}
    for name, fitted in FITS.items():
        parts = [h[name] for h in histograms if name in h]
        if not parts:
            raise ValueError(f"no finite {name} loss in any shard: cannot fit a mixture")
        hist = parts[0]
        for other in parts[1:]:
            hist = merge_histograms(hist, other)
        for fit_name, kind in fitted:
            fits[fit_name] = MIXTURES[kind](hist)
    return fits


def _competitor_losses(spec, shards, offsets, infos, dim) -> list[dict]:
    """Step 1b: an index over every pair, then per shard the competitor InfoNCE (written to
    `_competitor_loss/`); returns `infos` with the loss ranges of those losses."""
    import ray

    n_actors = spec.index.shards
    task = _remote(shard_tasks.competitor_rows_task, num_returns=n_actors)
    row_refs = [task.remote(spec, s, o, n_actors) for s, o in zip(shards, offsets, strict=True)]
    if n_actors == 1:
        row_refs = [[ref] for ref in row_refs]
    actors: list = []
    try:
        actors, sizes = build_index_actors(spec, row_refs, dim)
        logger.debug(f"labels: competitor index: {sum(sizes)} rows in {len(actors)} actor(s)")
        neighbours = actor_neighbours(actors)
        ranges = _map(shard_tasks.competitor_loss_task, spec, shards, offsets, shared=(neighbours,))
    finally:
        for actor in actors:
            ray.kill(actor)
    return [{**info, "ranges": r} for info, r in zip(infos, ranges, strict=True)]


def _centred(spec: LabelSpec, shards: list[str]) -> LabelSpec:
    """The spec with each modality's corpus mean when the method centres (shards send only
    their exact fixed-point sums; `pipeline.core.labels.centring`)."""
    if not spec.method.centred(spec.params):
        return spec
    sums = merge_sums(_map(shard_tasks.embedding_sums_task, spec, shards))
    mean_u, mean_v = corpus_means(sums)
    logger.debug(
        f"labels: centring on the corpus means of {sums.rows} pairs (norms: image "
        f"{np.linalg.norm(mean_u):.3f}, text {np.linalg.norm(mean_v):.3f})"
    )
    return replace(spec, embedding_means=(mean_u, mean_v))


def _decide(spec, shards, offsets, fits_ref) -> tuple[PartitionDecisions, dict]:
    """Step 3: summed partition counts, then the method's decisions with distributed selects."""
    import ray

    counts = _map(shard_tasks.count_task, spec, shards, offsets, shared=(fits_ref,))
    count = {key: sum(c.get(key, 0) for c in counts) for key in counts[0]}
    select_task = _remote(shard_tasks.select_task)

    def select(what, k, in_play, decisions=None, with_id=True):
        def run_round(prefix, fetch):
            return ray.get(
                [
                    select_task.remote(spec, s, o, fits_ref, what, decisions, prefix, fetch)
                    for s, o in zip(shards, offsets, strict=True)
                ]
            )

        return radix_select(
            run_round, k, in_play, with_id=with_id, fetch_limit=spec.select_fetch_limit
        )

    return spec.method.decide(count, select, spec.mixture.threshold, spec.params)


def _build_index(spec, shards, offsets, fits_ref, decisions, dim) -> tuple[list, dict]:
    """Step 4: the method's index over the rows its role names (none: no actors)."""
    role = spec.method.index_role(spec.params)
    info: dict[str, Any] = {"role": role and role.name}
    if role is None:
        return [], info
    n_actors = spec.index.shards
    task = _remote(shard_tasks.index_rows_task, num_returns=n_actors)
    row_refs = [
        task.remote(spec, s, o, fits_ref, decisions, n_actors)
        for s, o in zip(shards, offsets, strict=True)
    ]
    if n_actors == 1:
        row_refs = [[ref] for ref in row_refs]
    actors, sizes = build_index_actors(spec, row_refs, dim)
    info.update(
        factory=spec.index.factory, shards=len(actors), rows=sum(sizes), nprobe=spec.index.nprobe
    )
    logger.debug(f"labels: index over {role.name}: {sum(sizes)} rows in {len(actors)} actor(s)")
    if spec.write_index:
        info["dir"] = save_indexes(spec, actors, role.name, sizes, shards, offsets, dim)
    return actors, info


def _label_shards(spec, shards, offsets, fits_ref, decisions, actors, context, total) -> list:
    """Step 5: one label task per shard, reported as they finish."""
    import ray

    task = _remote(label_task)
    neighbours = actor_neighbours(actors) if actors else None
    shared = [ray.put(decisions), neighbours, ray.put(context)]
    pending = {
        task.remote(spec, s, o, fits_ref, *shared): s for s, o in zip(shards, offsets, strict=True)
    }
    from pipeline.runtime.progress import Progress, as_completed

    results = []
    what = f"labels round {spec.round_index} view {spec.view}"
    # The pass's closing line says the counts; the bar's own closing line is for -v.
    with Progress(what, total, "pairs", log=logger, closing_level=logging.DEBUG) as progress:
        for _, result in as_completed(list(pending)):
            results.append(result)
            logger.debug(
                f"  [{len(results)}/{len(shards)}] {result['shard']}: {result['rows']} "
                f"labelled, {result['seconds']:.1f}s"
            )
            progress.advance(result["rows"], note=f"{len(results)}/{len(shards)} shards")
    order = {shard: i for i, shard in enumerate(shards)}
    return sorted(results, key=lambda r: order[r["shard"]])


class _Clock:
    """Seconds per step, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def step(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self._last = now - self._last, now


def _embedded_shards(spec: LabelSpec) -> tuple[list[str], list[str]]:
    """(shards with embeddings, shards without: their embed pass failed)."""
    shards = [s for s in spec.shards if file_exists(spec.embeddings_path(s))]
    missing = [s for s in spec.shards if s not in shards]
    if missing:
        logger.warning(
            f"labels: {len(missing)} shard(s) have no embeddings (failed embed), skipped"
        )
    if not shards:
        layout = RunLayout(spec.output)
        raise ValueError(
            f"no embeddings under {layout.embeddings_dir(spec.round_index)}: "
            "run the embed pass first"
        )
    return shards, missing


def _scan(spec: LabelSpec, shards: list[str]) -> tuple[list[dict], list[int], int]:
    """Step 1: per-shard rows, loss ranges and metadata; the global id offsets."""
    infos = _map(shard_tasks.range_task, spec, shards)
    rows = [info["rows"] for info in infos]
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64).tolist()
    total = int(sum(rows))
    if total == 0:
        raise ValueError("the embeddings tables hold no sample: nothing to label")
    return infos, offsets, total


def _write_mixture(spec: LabelSpec, fits: dict[str, MixtureFit]) -> dict[str, Any]:
    mixture = {
        "round": spec.round_index,
        "view": spec.view,
        "loss": spec.labels.loss,
        "kind": spec.mixture_kind,
        "threshold": spec.mixture.threshold,
        "fits": {name: fit.to_dict() for name, fit in fits.items()},
    }
    write_json_atomic(mixture, RunLayout(spec.output).mixture(spec.round_index, spec.view))
    configured = fits[spec.mixture_kind]
    logger.debug(
        f"labels: {spec.mixture_kind.upper()} on {spec.labels.loss}: {configured.describe()}"
    )
    return mixture


def _context(spec: LabelSpec, infos: list[dict], mixture: dict) -> dict[str, Any]:
    """What every label task needs besides the spec (shipped once through the object store)."""
    import pipeline

    logit_scale = next((i["logit_scale"] for i in infos if i["logit_scale"]), None)
    return {
        "version": pipeline.__version__,
        "model_id": _model_id(spec, infos),
        "logit_scale": logit_scale if logit_scale is not None else repr(1 / 0.07),
        # RCR ranks unique images when any table has image_sha256 (old tables: rows).
        "image_groups": any(info["image_sha256"] for info in infos),
        "mixture": mixture,
        "shard_paths": dict(zip(spec.shards, spec.shard_paths, strict=False)),
    }


def _model_id(spec: LabelSpec, infos: list[dict]) -> str:
    return spec.model_id or next((i["model_id"] for i in infos if i["model_id"]), "unknown")


def run_label_pass(spec: LabelSpec) -> dict[str, Any]:
    """Run the label pass of one round and view on the connected Ray cluster.

    Returns:
        JSON-ready summary: counts per subset, partition decisions, every mixture fit, index
        layout, seconds per step and, with ground truth, the label-quality table.

    Raises:
        ValueError: no embedded sample at all, or the embeddings lack the view's columns.
    """
    import ray

    clock = _Clock()
    shards, missing = _embedded_shards(spec)
    infos, offsets, total = _scan(spec, shards)
    logger.debug(f"labels: {total} pairs in {len(shards)} shards (view {spec.view})")
    if spec.index.factory == "auto":
        # Sized by the pass's pairs: the index holds at most that many rows.
        chosen = auto_factory(total, infos[0]["dim"])
        spec = replace(spec, index=spec.index.model_copy(update={"factory": chosen}))
        logger.debug(f"labels: index.factory auto -> {chosen} for {total:,} pairs")
    clock.step("ranges")
    if spec.competitors:
        try:
            infos = _competitor_losses(spec, shards, offsets, infos, infos[0]["dim"])
        finally:
            remove_restore_tables(spec)
        clock.step("competitors")
    fits = _fit_mixtures(spec, shards, infos)
    mixture = _write_mixture(spec, fits)
    fits_ref = ray.put(fits)
    clock.step("fit")
    decisions, partition = _decide(spec, shards, offsets, fits_ref)
    spec = _centred(spec, shards)
    clock.step("partition")
    logger.debug(f"labels: partition {json.dumps(partition, sort_keys=True)}")
    if spec.labelling_view != spec.view:
        logger.debug(
            f"labels: partition from view {spec.view}, labels from view {spec.labelling_view}"
        )
    actors: list = []
    try:
        dim = infos[0]["dim"]
        actors, index_info = _build_index(spec, shards, offsets, fits_ref, decisions, dim)
        clock.step("index")
        context = _context(spec, infos, mixture)
        results = _label_shards(spec, shards, offsets, fits_ref, decisions, actors, context, total)
        report_restarts(actors)
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_restore_tables(spec)  # also after a failed build
    clock.step("labels")
    summary = _summary(spec, shards, missing, total, results, fits, partition, index_info)
    summary["model_id"] = context["model_id"]
    summary["seconds"] = {**clock.seconds, "total": sum(clock.seconds.values())}
    if spec.run_state is not None:
        summary[RUN_STATE_FIELD] = spec.run_state
    write_json_atomic(summary, f"{spec.out_dir}/{SUMMARY_NAME}")
    subsets = summary["subsets"]
    auroc = ((summary["quality"] or {}).get(spec.labels.method) or {}).get("auroc")
    logger.info(
        f"labels round {spec.round_index} view {spec.view}: {total:,} pairs "
        f"({', '.join(f'{k} {v}' for k, v in subsets.items())})"
        + (f", label AUROC {auroc:.3f}" if auroc is not None else "")
        + f" in {summary['seconds']['total']:.1f}s -> {spec.out_dir}"
    )
    return summary


def _summary(spec, shards, missing, total, results, fits, partition, index_info) -> dict:
    subsets = {name: sum(r["subsets"][name] for r in results) for name in SUBSET_VALUES}
    summary: dict[str, Any] = {
        "round": spec.round_index,
        "view": spec.view,
        "labelling_view": spec.labelling_view,
        "method": spec.labels.method,
        "loss": spec.labels.loss,
        "mixture_kind": spec.mixture_kind,
        "job_hash": spec.job_hash,
        "model_id": None,
        "out_dir": spec.out_dir,
        "ground_truth": spec.ground_truth,
        "mixture_file": RunLayout(spec.output).mixture(spec.round_index, spec.view),
        "shards_labelled": shards,
        "shards_missing": missing,
        "samples": total,
        "invalid": sum(r["invalid"] for r in results),
        "subsets": subsets,
        "anchors": sum(r["anchors"] for r in results),
        "partition": partition,
        "mixture": {name: _fit_summary(fit) for name, fit in fits.items()},
        "index": index_info,
        "centring": _centring(spec),
        "seconds": {},
        "quality": None,
    }
    if spec.ground_truth:
        summary["quality"] = quality_from_parts([r["quality"] for r in results if "quality" in r])
        _log_quality(summary["quality"], summary)
    return summary


def _centring(spec: LabelSpec) -> dict[str, float] | None:
    """The norms of the means the labels were centred on (near 1: a collapsed space)."""
    if spec.embedding_means is None:
        return None
    mean_u, mean_v = spec.embedding_means
    return {
        "image_mean_norm": float(np.linalg.norm(mean_u)),
        "text_mean_norm": float(np.linalg.norm(mean_v)),
    }


def _fit_summary(fit: MixtureFit) -> dict[str, Any]:
    """The fit without its likelihood trace (the mixture file keeps everything)."""
    out = fit.to_dict()
    out.pop("log_likelihood_trace", None)
    return out


def _log_quality(quality: dict, summary: dict) -> None:
    def fmt(value) -> str:
        return "   -  " if value is None else f"{value:6.3f}"

    lines = [
        "",
        f"label quality (round {summary['round']}, view {summary['view']}, "
        f"{summary['samples']} pairs): AUROC clean vs mismatched, Spearman vs degree, "
        "clean-subset precision/recall",
        f"  {'score':<18} {'AUROC':>6} {'Spear.':>6} {'prec.':>6} {'recall':>6}",
    ]
    for name, q in quality.items():
        lines.append(
            f"  {name:<18} {fmt(q['auroc'])} {fmt(q['spearman'])} "
            f"{fmt(q['precision'])} {fmt(q['recall'])}"
        )
    # The run's co-teaching table sums these up; each pass's own table is for -v and metrics.
    logger.debug("\n".join(lines))
