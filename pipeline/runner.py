"""`run_job`: the one place that lists the stages in order (docs/architecture.md §1).

Each stage reads the artifacts named for it and writes only its own directory. Checks that can
fail cheaply (config, shard patterns, model weights, a conflicting earlier run) run before Ray
starts, so a bad job fails in seconds with a message instead of a traceback.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
from importlib import metadata
from typing import Any

import numpy as np

from pipeline.config import JobConfig
from pipeline.io.layout import RunLayout
from pipeline.io.shards import DecodeOptions, expand_shard_patterns, shard_name
from pipeline.io.tables import read_json, write_json_atomic
from pipeline.models import ModelSpec, check_weights_available
from pipeline.run_errors import RunFailedError, ShardFailuresError, explain_failure
from pipeline.run_summary import log_coteaching, log_embed_summary, log_round, log_warmup

__all__ = [
    "RunConflictError",
    "RunFailedError",
    "ShardFailuresError",
    "run_job",
    "resolve_inputs",
    "model_specs",
]

EMBED_SECTIONS = ("input", "model", "embed", "seed")

logger = logging.getLogger(__name__)


class RunConflictError(RuntimeError):
    """The output directory holds results of a different configuration."""


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("ncl-pipeline", "torch", "open_clip_torch", "ray", "pyarrow", "faiss-cpu"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def resolve_inputs(job: JobConfig) -> list[str]:
    """The job's shard paths (expand_shard_patterns also refuses two shards with one name)."""
    return expand_shard_patterns(job.input.shards, allow_pipe=job.input.allow_pipe)


def _absolute(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def _with_absolute_paths(job: JobConfig) -> JobConfig:
    """Local paths resolved against the driver's directory: Ray Train runs its workers in a
    directory of its own, so a relative output would land somewhere else."""
    return job.model_copy(
        update={
            "output": _absolute(job.output),
            "eval": job.eval.model_copy(update={"ground_truth": _absolute(job.eval.ground_truth)}),
        }
    )


def decode_options(job: JobConfig) -> DecodeOptions:
    return DecodeOptions(
        image_key=job.input.image_key,
        caption_key=job.input.caption_key,
        max_image_pixels=job.input.max_image_pixels,
    )


def model_specs(job: JobConfig) -> dict[str, ModelSpec]:
    """The model views of round 0: view 'a' is the job's model seeded with the job's seed."""
    return {
        "a": ModelSpec(
            name=job.model.name,
            pretrained=job.model.pretrained,
            precision=job.model.precision,
            seed=job.seed,
        )
    }


def embed_hash(job: JobConfig) -> str:
    """The hash of what the embeddings depend on (input.max_failed_shards does not count)."""
    import hashlib
    import json

    dumped = job.model_dump(mode="json")
    dumped["input"].pop("max_failed_shards", None)
    blob = json.dumps({k: dumped[k] for k in EMBED_SECTIONS}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _check_resume(job: JobConfig, layout: RunLayout) -> dict:
    """Refuse to silently mix outputs of different configurations in one run directory."""
    manifest = read_json(layout.manifest) or {}
    recorded = manifest.get("stage_hashes", {}).get("embed")
    current = embed_hash(job)
    if recorded and recorded != current:
        raise RunConflictError(
            f"output '{layout.output}' holds embeddings of a different configuration "
            f"(input/model/embed/seed changed: {recorded} != {current}). Use a new output "
            f"directory (--set output=...) or delete '{layout.output}/rounds' to recompute."
        )
    return manifest


class _RunRecord:
    """metrics.json and manifest.json of one run, written after every stage."""

    def __init__(self, job: JobConfig, layout: RunLayout, manifest: dict) -> None:
        self.layout = layout
        self.manifest = manifest
        manifest.update(
            {
                "job_name": job.name,
                "job_hash": job.stage_hash(),
                "job": job.model_dump(mode="json"),
                "versions": _versions(),
                "stage_hashes": {"embed": embed_hash(job)},
            }
        )
        manifest.setdefault("stages", {})
        manifest["shards"] = {"failed": [], "changed": [], "duplicate_keys": {}}
        self.stage = "the embed pass (round 0)"  # what runs now, for error messages
        logger.debug(f"versions: {manifest['versions']}")
        write_json_atomic(manifest, layout.manifest)
        self.metrics = read_json(layout.metrics) or {}
        self.rounds = self.metrics.setdefault("rounds", {})
        self.metrics["outputs"] = {
            "embeddings": layout.embeddings_dir(0),
            "quarantine": layout.quarantine_dir,
            "labels": layout.labels_dir,
            "manifest": layout.manifest,
        }

    def record(self, stage: str, round_index: int, key: str, value) -> None:
        self.rounds.setdefault(str(round_index), {})[key] = value
        write_json_atomic(self.metrics, self.layout.metrics)
        self.manifest["stages"][f"round{round_index}/{stage}"] = {
            "complete": True,
            "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        }
        write_json_atomic(self.manifest, self.layout.manifest)

    def write_metrics(self) -> None:
        write_json_atomic(self.metrics, self.layout.metrics)

    def note_shards(self, kind: str, value) -> None:
        """Record failed / changed shards or duplicate keys in the manifest and metrics."""
        shards = self.manifest["shards"]
        if isinstance(shards[kind], list):
            shards[kind].extend(value)
        else:
            shards[kind] = value
        self.metrics["shards"] = shards
        write_json_atomic(self.manifest, self.layout.manifest)
        self.write_metrics()


def run_job(job: JobConfig) -> dict:
    """Run the pipeline for `job` on Ray and return the metrics written to metrics.json.

    Progress and summaries go to this module's logger (and the stages' loggers); what the
    terminal shows is set up by the caller (pipeline.console).

    Raises:
        ShardPatternError: the input pattern matches no file.
        ModelLoadError: model name/weights unusable (checked before Ray starts).
        RunConflictError: the output directory belongs to another configuration.
        ShardFailuresError: more shards could not be read than input.max_failed_shards allows.
        RunFailedError: a stage failed (inside a Ray task or worker); one paragraph naming
            the stage, the cause and what to do, the traceback in <output>/logs/.
    """
    from pipeline.preflight import check_cluster
    from pipeline.runtime import init_ray

    job = _with_absolute_paths(job)
    layout = RunLayout(job.output)
    shard_paths = resolve_inputs(job)
    views = model_specs(job)
    for spec in views.values():
        check_weights_available(spec)
    manifest = _check_resume(job, layout)

    logger.debug(f"input shards: {shard_paths}")
    where = init_ray(job.ray.address, job.ray.num_cpus)
    check_cluster(job)  # refuses in seconds what no node could host (pipeline.preflight)
    logger.info(
        f"ncl-pipeline: job '{job.name}', {len(shard_paths)} shards, {where}, "
        f"output {layout.output}"
    )
    run = _RunRecord(job, layout, manifest)
    try:
        _run_stages(job, layout, shard_paths, views, run)
    except (ShardFailuresError, RunConflictError):
        raise
    except Exception as exc:
        from pipeline.config import JobConfigError

        if isinstance(exc, JobConfigError):
            raise
        raise explain_failure(exc, run.stage, layout.output) from exc
    return run.metrics


def _run_stages(job, layout: RunLayout, shard_paths, views, run: _RunRecord) -> None:
    # 1. Embed every pair with the initial model; this pass also records the quarantine.
    embed = _embed(job, layout, shard_paths, 0, views)
    run.record("embed", 0, "embed", embed)
    log_embed_summary(embed, layout)
    # 1b. Only the shards it completed go on; keys repeated across shards are quarantined.
    run.stage = "the corpus-wide key check"
    usable = _admit_shards(job, layout, shard_paths, embed, run)
    # 2. Warm up models A and B (round 0 training).
    run.stage = "the warm-up (round 0 training)"
    usable = _still_there(layout, usable, run)
    checkpoints = _warm_up(job, layout, usable, run)
    # 3. Co-teaching rounds, then the final round's labels, published (4).
    last = _coteach_rounds(job, layout, usable, run, checkpoints)
    run.stage = "publishing the labels"
    _publish(job, layout, usable, run, last)
    # 5. The HTML report (loss histogram with fits, label histograms, galleries).
    from pipeline.report import write_report

    run.stage = "the report"
    logger.info(f"report: {write_report(layout.output)}")


def _admit_shards(job, layout: RunLayout, shard_paths, embed: dict, run: _RunRecord) -> list:
    """The shards the round-0 embed pass completed, after the corpus-wide key check.

    Raises ShardFailuresError when more failed than input.max_failed_shards allows.
    """
    from pipeline.stages.dedup import run_key_check

    sizes = _shard_sizes(layout, 0, shard_paths)
    errors = {f["path"]: f["error"] for f in embed["shards_failed"]}
    failed = [
        {"shard": shard_name(p), "path": p, "error": errors.get(p, "no embeddings")}
        for p in shard_paths
        if shard_name(p) not in sizes
    ]
    run.note_shards("failed", failed)
    allowed = job.input.failed_shards_allowed(len(shard_paths))
    listing = "\n".join(f"  {f['path']}: {f['error']}" for f in failed)
    if len(failed) > allowed:
        raise ShardFailuresError(
            f"{len(failed)} of {len(shard_paths)} shards could not be read, more than "
            f"input.max_failed_shards={job.input.max_failed_shards} allows ({allowed}); the "
            f"run stopped after the embed pass:\n{listing}\nFix or remove these shards, or "
            "raise input.max_failed_shards, and rerun: the shards already embedded are kept."
        )
    if failed:
        logger.warning(
            f"{len(failed)} shard(s) could not be read and are left out of this run (the next "
            f"run retries them):\n{listing}"
        )
    usable = [p for p in shard_paths if shard_name(p) in sizes]
    keys = run_key_check(layout.output, [shard_name(p) for p in usable])
    run.record("keys", 0, "keys", keys)
    run.note_shards("duplicate_keys", keys["by_shard"])
    return usable


def _still_there(layout: RunLayout, shard_paths: list[str], run: _RunRecord) -> list[str]:
    """`shard_paths` less the shards missing or resized since the embed pass (reported)."""
    import pyarrow.parquet as pq

    from pipeline.io.admitted import SHARD_BYTES_KEY, changed_shards

    recorded = {}
    for path in shard_paths:
        meta = pq.read_metadata(layout.embeddings(0, shard_name(path))).metadata or {}
        size = meta.get(SHARD_BYTES_KEY.encode())
        recorded[shard_name(path)] = (path, int(size) if size else None)
    changed = changed_shards(recorded)
    return _leave_out(shard_paths, changed, run)


def _leave_out(shard_paths: list[str], changed: dict[str, str], run: _RunRecord) -> list[str]:
    if not changed:
        return shard_paths
    run.note_shards("changed", [{"shard": s, "error": e} for s, e in changed.items()])
    logger.warning(
        f"{len(changed)} shard(s) changed or disappeared after the embed pass and are left out "
        "of the rest of this run (rerun to embed them again):\n"
        + "\n".join(f"  {error}" for error in changed.values())
    )
    return [p for p in shard_paths if shard_name(p) not in changed]


def _warm_up(job: JobConfig, layout: RunLayout, shard_paths: list[str], run: _RunRecord):
    """Round 0 training; returns the checkpoints of A and B (none without a warm-up)."""
    from pipeline.stages.train import run_training

    if job.train.warmup_epochs <= 0:
        return {}
    warmup = run_training(warmup_spec(job, layout, shard_paths))
    run.record("warmup", 0, "train", warmup)
    run.rounds["0"]["retrieval"] = warmup.get("retrieval")
    log_warmup(warmup)
    return {view: info["checkpoint"] for view, info in warmup["views"].items()}


def _coteach_rounds(job, layout, shard_paths, run: _RunRecord, checkpoints: dict) -> int:
    """Round r embeds with the models of round r-1 (both views in one pass), labels each view,
    then trains B on A's labels and A on B's. The extra last round only embeds and labels: its
    labels come from the final models and are published. Returns that last round."""
    from pipeline.stages.labels import LabelSpec, run_label_pass
    from pipeline.stages.train import run_training

    last = job.train.rounds + 1
    for round_index in range(1, last + 1):
        run.stage = f"the embed pass of round {round_index}"
        shard_paths = _still_there(layout, shard_paths, run)
        embedded = _embed(job, layout, shard_paths, round_index, round_models(job, checkpoints))
        run.record("embed", round_index, "embed", embedded)
        changed = {c["shard"]: c["error"] for c in embedded["shards_changed"]}
        shard_paths = _leave_out(shard_paths, changed, run)
        run.stage = f"the label passes of round {round_index}"
        for view, trainee in (("a", "b"), ("b", "a")):
            spec = LabelSpec.from_job(
                job, round_index=round_index, view=view, shard_paths=shard_paths,
                trainee_view=trainee,
            )  # fmt: skip
            run.record(f"labels_{view}", round_index, f"labels_{view}", run_label_pass(spec))
        if round_index == last:
            break
        run.stage = f"co-teaching training, round {round_index}"
        shard_paths = _still_there(layout, shard_paths, run)
        trained = run_training(coteach_spec(job, layout, shard_paths, round_index, checkpoints))
        run.record("train", round_index, "train", trained)
        run.rounds[str(round_index)]["retrieval"] = trained.get("retrieval")
        checkpoints = {view: info["checkpoint"] for view, info in trained["views"].items()}
        log_round(trained)
    return last


def _publish(job, layout, shard_paths, run: _RunRecord, last: int) -> None:
    """The final labels/: the last round's two views combined (mean)."""
    from pipeline.stages.publish import publish_labels

    embedded = _shard_sizes(layout, last, shard_paths)
    published = publish_labels(
        {view: layout.labels_round_dir(last, view) for view in ("a", "b")},
        [shard_name(p) for p in shard_paths if shard_name(p) in embedded],
        layout.labels_dir,
        round_index=last,
        job_hash=job.stage_hash(),
        ground_truth=job.eval.ground_truth,
    )
    run.metrics["labels"] = published
    run.metrics["coteaching"] = coteaching_table(job, run.rounds, published)
    run.write_metrics()
    log_coteaching(run.metrics["coteaching"], job)
    logger.info(f"labels: {layout.labels_dir}/ (read with pipeline.read_labels('{layout.output}'))")


def _embed(
    job: JobConfig,
    layout: RunLayout,
    shard_paths: list[str],
    round_index: int,
    views: dict[str, ModelSpec],
) -> dict:
    from pipeline.stages.embed import EmbedSpec, run_embed_pass

    spec = EmbedSpec(
        output=layout.output,
        round_index=round_index,
        views=views,
        seed=job.seed,
        embed=job.embed,
        decode=decode_options(job),
        write_quarantine=round_index == 0,  # the input does not change between rounds
    )
    return run_embed_pass(spec, shard_paths)


def _shard_sizes(layout: RunLayout, round_index: int, shard_paths: list[str]) -> dict[str, int]:
    """Usable samples per shard, from the embed pass's Parquet footers (no data read)."""
    import pyarrow.parquet as pq

    from pipeline.io.tables import file_exists

    sizes = {}
    for path in shard_paths:
        table_path = layout.embeddings(round_index, shard_name(path))
        if file_exists(table_path):
            sizes[shard_name(path)] = pq.read_metadata(table_path).num_rows
    return sizes


def round_models(job: JobConfig, checkpoints: dict[str, str]) -> dict[str, ModelSpec]:
    """Embed views a and b: the latest checkpoints of A and B, else the job's model (seeds
    job.seed and job.seed + 1, so random-init views differ)."""
    return {
        view: ModelSpec(
            job.model.name,
            checkpoints.get(view.upper(), job.model.pretrained),
            job.model.precision,
            seed=job.seed + offset,
        )
        for offset, view in enumerate(("a", "b"))
    }


def _train_settings(job: JobConfig, layout: RunLayout, shard_paths: list[str]) -> dict:
    """TrainSpec fields shared by the warm-up and the co-teaching rounds."""
    from pipeline.runtime import cluster_resources

    _, gpus = cluster_resources()

    def held_out(patterns) -> tuple[str, ...]:
        return tuple(expand_shard_patterns(patterns)) if patterns is not None else ()

    return {
        "output": layout.output,
        "shards": tuple(shard_paths),
        "val_shards": held_out(job.eval.val_shards),
        "test_shards": held_out(job.eval.test_shards),
        "train": job.train,
        "precision": job.model.precision,
        "use_gpu": gpus > 0,
        "decode": decode_options(job),
    }


def warmup_spec(job: JobConfig, layout: RunLayout, shard_paths: list[str]):
    """Round 0 training: warm up views A and B (seeds differ) from the job's model."""
    from pipeline.stages.train import TrainSpec, ViewSpec

    initial = round_models(job, {})
    views = tuple(
        ViewSpec(name=name, init=initial[name.lower()], seed=job.seed + offset)
        for offset, name in enumerate(("A", "B"))
    )
    return TrainSpec(
        **_train_settings(job, layout, shard_paths),
        round_index=0,
        views=views,
        shard_sizes=_shard_sizes(layout, 0, shard_paths),
        mode="warmup",
        max_epochs=job.train.warmup_epochs,
    )


def coteach_spec(
    job: JobConfig,
    layout: RunLayout,
    shard_paths: list[str],
    round_index: int,
    checkpoints: dict[str, str],
):
    """Round r >= 1 training: A on the labels B estimated (labels_b), B on labels_a.

    train.mode vanilla trains both on every pair (weight 1), oracle on the ground-truth clean
    pairs only: the same trainer, data path and schedule, for an honest comparison.
    """
    from pipeline.core.labels import get_method
    from pipeline.stages.publish import write_oracle_labels
    from pipeline.stages.train import TrainSpec, ViewSpec

    train = job.train
    sizes = _shard_sizes(layout, round_index, shard_paths)
    oracle_dir = f"{layout.round_dir(round_index)}/labels_oracle"
    if train.mode == "oracle":
        embeddings = {shard: layout.embeddings(round_index, shard) for shard in sizes}
        sizes = write_oracle_labels(job.eval.ground_truth, embeddings, oracle_dir)
    elif train.mode == "cosine_filter":
        oracle_dir, sizes = _cosine_filter(job, layout, sizes)
    method = get_method(job.labels.method)
    models = round_models(job, checkpoints)
    views = []
    for offset, (name, peer) in enumerate((("A", "b"), ("B", "a"))):
        labels_dir, proxies_dir, target, cut = None, None, "weights", 0.0
        if train.mode == "coteach":
            cut = method.weight_cut(getattr(job.labels, method.name, None))
            labels_dir, target = layout.labels_round_dir(round_index, peer), method.training_target
            if method.proxy_table:
                proxies_dir = layout.sps_proxies_dir(round_index, peer)
        elif train.mode in ("oracle", "cosine_filter"):
            labels_dir = oracle_dir
        views.append(
            ViewSpec(
                name=name,
                init=models[name.lower()],
                # A new data order every round (the epoch counter restarts in each run).
                seed=job.seed + offset + 1000 * round_index,
                labels_dir=labels_dir,
                target=target,
                weight_cut=cut,
                proxies_dir=proxies_dir,
            )
        )
    epochs = train.epochs_per_round
    return TrainSpec(
        **_train_settings(job, layout, shard_paths),
        round_index=round_index,
        views=tuple(views),
        shard_sizes=sizes,
        mode="labels",
        max_epochs=epochs,
        coteach_epochs=((round_index - 1) * epochs, train.rounds * epochs),
    )


def _cosine_filter(job: JobConfig, layout: RunLayout, sizes: dict[str, int]):
    """train.mode cosine_filter: the pairs kept by the warmed models' cosines (round 1's
    embeddings), computed once and reused by every round. Returns (folder, kept per shard)."""
    import pyarrow.parquet as pq

    from pipeline.core.mixture import MixtureFit
    from pipeline.io.tables import file_exists
    from pipeline.stages.cosine_filter import write_cosine_filter

    fraction = job.train.filter_fraction
    if fraction is None:  # the clean share the mixtures found under the warmed models
        weights = []
        for view in ("a", "b"):
            fit = MixtureFit.from_dict(read_json(layout.mixture(1, view))["fits"][job.mixture.kind])
            weights.append(1.0 if fit.no_spread else fit.weights[fit.clean_component])
        fraction = float(np.mean(weights))
    folder = f"{layout.round_dir(1)}/labels_cosine_filter"
    record = read_json(f"{folder}/_filter.json") or {}
    if record.get("fraction") == fraction and all(
        file_exists(f"{folder}/{s}.parquet") for s in sizes
    ):
        return folder, {s: pq.read_metadata(f"{folder}/{s}.parquet").num_rows for s in sizes}
    embeddings = {shard: layout.embeddings(1, shard) for shard in sizes}
    kept = write_cosine_filter(embeddings, folder, fraction)
    write_json_atomic({"fraction": fraction, "kept": kept}, f"{folder}/_filter.json")
    return folder, kept


def coteaching_table(job: JobConfig, rounds: dict, published: dict) -> list[dict]:
    """One row per model generation g (0 = warmed up, g = after co-teaching round g): its
    held-out retrieval and the quality of the labels it estimated (round g + 1's passes)."""
    method = job.labels.method
    rows = []
    for generation in range(job.train.rounds + 1):
        trained = rounds.get(str(generation), {})
        labelled = rounds.get(str(generation + 1), {})
        row: dict[str, Any] = {"models": generation, "labels_round": generation + 1}
        for view in ("a", "b"):
            quality = ((labelled.get(f"labels_{view}") or {}).get("quality") or {}).get(method)
            row[f"auroc_{view}"] = quality and quality.get("auroc")
            row[f"spearman_{view}"] = quality and quality.get("spearman")
        retrieval = trained.get("retrieval") or {}
        for name in ("A", "B", "A+B"):
            row[f"rsum_{name}"] = (retrieval.get(name) or {}).get("rsum")
        rows.append(row)
    combined = (published.get("quality") or {}).get("combined")
    if rows and combined:
        rows[-1]["auroc_combined"] = combined.get("auroc")
        rows[-1]["spearman_combined"] = combined.get("spearman")
    return rows
