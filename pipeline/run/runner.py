"""`run_job`: the one place that lists the stages in order (docs/architecture.md §1).

Each stage reads the artifacts named for it and writes only its own directory. Checks that can
fail cheaply (config, shard patterns, model weights, a conflicting earlier run) run before Ray
starts, so a bad job fails in seconds with a message instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import replace
from importlib import metadata
from typing import Any

from pipeline.config import JobConfig, JobConfigError
from pipeline.errors import RunFailedError, RunInterrupted, ShardFailuresError, UserError
from pipeline.io.layout import RunLayout
from pipeline.io.shards import expand_sources, shard_name, split_source
from pipeline.io.tables import remove_path, write_json_atomic
from pipeline.models import ModelSpec, check_weights_available
from pipeline.models.fetch import fetch_weights
from pipeline.run.failures import explain_failure
from pipeline.run.interrupts import Interrupts, catch_interrupts
from pipeline.run.lease import acquire_lease
from pipeline.run.manifest import REBUILT, read_manifest
from pipeline.run.state import (
    RunState,
    embed_key,
    embed_plan,
    embed_reason,
    outputs_present,
    round0_shard_keys,
    shards_token,
    stage_graph,
    stage_key,
    table_keys,
)
from pipeline.run.summary import log_coteaching, log_embed_summary, log_round, log_warmup
from pipeline.run.train_specs import (
    coteach_spec,
    decode_options,
    round_models,
    shard_sizes,
    warmup_spec,
)

__all__ = [
    "RunConflictError",
    "RunInterrupted",
    "RunFailedError",
    "ShardFailuresError",
    "coteach_spec",
    "decode_options",
    "embeddings_source",
    "model_specs",
    "resolve_inputs",
    "round_models",
    "run_job",
    "warmup_spec",
]

logger = logging.getLogger(__name__)


class RunConflictError(UserError, RuntimeError):
    """The output directory holds the results of another job (another job name)."""


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("ncl-pipeline", "torch", "open_clip_torch", "ray", "pyarrow", "faiss-cpu"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


def resolve_inputs(job: JobConfig) -> list[str]:
    """The job's shard paths, tagged with their source under input.sources (expand_sources
    also refuses two shards with one name)."""
    return expand_sources(job.input.shard_specs(), allow_pipe=job.input.allow_pipe)


def _absolute(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def _with_absolute_paths(job: JobConfig) -> JobConfig:
    """Local paths resolved against the driver's directory: Ray Train runs its workers in a
    directory of its own, so a relative output (checkpoint, weights cache) would be looked for
    elsewhere."""
    pretrained = job.model.pretrained
    if pretrained and os.path.isfile(os.path.expanduser(pretrained)):  # not a pretrained tag
        pretrained = _absolute(pretrained)
    model = {"pretrained": pretrained, "cache_dir": _absolute(job.model.cache_dir)}
    return job.model_copy(
        update={
            "output": _absolute(job.output),
            "model": job.model.model_copy(update=model),
            "eval": job.eval.model_copy(update={"ground_truth": _absolute(job.eval.ground_truth)}),
        }
    )


def model_specs(job: JobConfig) -> dict[str, ModelSpec]:
    """The model views of round 0: view 'a' is the job's model seeded with the job's seed."""
    return {"a": round_models(job, {})["a"]}


def embeddings_source(job: JobConfig):
    """The job's embed.from_embeddings folder, checked (layout, row counts, dimension against
    the model's config when it has one); None without one."""
    given = job.embed.from_embeddings
    if given is None:
        return None
    from pipeline.io.clip_retrieval import check_dim, open_embeddings_folder
    from pipeline.models.spec import config_embed_dim

    folder = open_embeddings_folder(given.path, given.key_column)
    check_dim(folder, config_embed_dim(job.model.name), job.model.name)
    return folder


def _check_resume(job: JobConfig, layout: RunLayout) -> dict:
    """The output directory's manifest; refuse a directory that holds another job's results.

    A changed configuration of the same job is not refused: the run state recomputes what it
    changed (docs/architecture.md §4.3). Another job name is: running it there would replace
    the other job's labels, which is more likely a wrong `output` than an intent.
    """
    manifest = read_manifest(layout, keep_aside=True) or {}
    recorded = manifest.get("job_name")
    if recorded and recorded != job.name and manifest.get("stages"):
        raise RunConflictError(
            f"output '{layout.output}' holds the results of job '{recorded}', not '{job.name}'; "
            f"running it there would replace them. Use a new output directory (--set "
            f"output=...), or --set name={recorded} to update that run with this configuration."
        )
    return manifest


class _RunRecord:
    """metrics.json and manifest.json of one run; the manifest's `stages` is the run state."""

    def __init__(
        self, job: JobConfig, layout: RunLayout, manifest: dict, until: str | None = None
    ) -> None:
        self.job = job
        self.layout = layout
        self.manifest = manifest
        manifest.update(
            {
                "job_name": job.name,
                "job_hash": job.stage_hash(),
                "job": job.model_dump(mode="json"),
                "versions": _versions(),
            }
        )
        manifest.pop("stage_hashes", None)  # older run directories; `stages` replaces it
        manifest.pop(REBUILT, None)  # a damaged manifest's records, rebuilt from the outputs
        stages = manifest.get("stages") or {}
        manifest["stages"] = {k: v for k, v in stages.items() if isinstance(v, dict)}
        manifest["shards"] = {"failed": [], "changed": [], "duplicate_keys": {}}
        self.state = RunState(manifest["stages"], save=self.save_manifest)
        self.graph = {node.stage: node for node in stage_graph(job)}
        if until is not None and until not in self.graph:
            raise JobConfigError(
                f"until={until!r} is not a stage of this job; its stages: {', '.join(self.graph)}"
            )
        self.until = until
        self.until_done = False
        self.shard_keys: dict[str, str] = {}  # round-0 key of every input shard
        self.stage = "the embed pass (round 0)"  # what runs now, for error messages
        logger.debug(f"versions: {manifest['versions']}")
        self.save_manifest()
        # Rebuilt by every run: reused stages contribute their recorded summaries.
        self.metrics: dict[str, Any] = {"rounds": {}}
        self.rounds = self.metrics["rounds"]
        self.metrics["outputs"] = {
            "embeddings": layout.embeddings_dir(0),
            "quarantine": layout.quarantine_dir,
            "labels": layout.labels_dir,
            "manifest": layout.manifest,
        }

    def save_manifest(self) -> None:
        write_json_atomic(self.manifest, self.layout.manifest)

    def record(self, round_index: int, key: str, value) -> None:
        self.rounds.setdefault(str(round_index), {})[key] = value
        self.write_metrics()

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
        self.save_manifest()
        self.write_metrics()

    def starting(self, stage: str) -> None:
        """Called as each stage starts: stop the run if `until`'s stage came before it (its
        caller has recorded its summary by then)."""
        if self.until_done:
            raise _StopAfter(self.until)
        self.until_done = stage == self.until

    def run_stage(self, stage: str, shard_paths, compute, clear=None) -> dict:
        """Reuse `stage`'s recorded summary, or clear its old outputs and compute it.

        `compute(stamp)` runs the stage and writes `stamp` (its key, `StageKey.stamp`) into the
        summary it writes last, so that a damaged manifest is rebuilt from the outputs.
        """
        self.starting(stage)
        node = self.graph[stage]
        names = [shard_name(p) for p in shard_paths]
        token = shards_token({name: self.shard_keys[name] for name in names})
        current = stage_key(self.job, node, self.state.tokens, token)
        recorded = self.state.records.get(stage) or {}
        present = True
        if recorded.get("key") == current.key and recorded.get("status") == "done":
            present = outputs_present(self.layout, node, names)
        decision = self.state.decide(current, present)
        if decision.reuse:
            return self.state.summary(stage)
        if clear is not None and not decision.resume:
            clear()
        self.state.start(current)
        summary = compute(current.stamp())
        self.state.finish(stage, summary)
        return summary


class _StopAfter(Exception):
    """Raised when a stage starts after `run_job(..., until=...)`'s stage finished."""


def run_job(job: JobConfig, until: str | None = None) -> dict:
    """Run the pipeline for `job` on Ray and return the metrics written to metrics.json.

    Progress and summaries go to this module's logger (and the stages' loggers); what the
    terminal shows is set up by the caller (pipeline.runtime.console). The run holds the
    output's lease while it runs (pipeline.run.lease) and stops on SIGINT / SIGTERM
    (pipeline.run.interrupts). `until` names a stage of the job's graph
    (`pipeline.run.state.stage_graph`, e.g. "round0/keys"): the run stops once it is done.

    Raises:
        ShardPatternError: the input pattern matches no file.
        ModelLoadError: model name/weights unusable (checked before Ray starts).
        OutputInUseError: another live run writes to the output (checked before Ray starts).
        RunConflictError: the output directory holds the results of another job (name).
        ShardFailuresError: more shards could not be read than input.max_failed_shards allows.
        RunFailedError: a stage failed (inside a Ray task or worker); one paragraph naming
            the stage, the cause and what to do, the traceback in <output>/logs/.
        RunInterrupted: SIGINT or SIGTERM; Ray is stopped, the finished stages are kept.
    """
    job = _with_absolute_paths(job)
    layout = RunLayout(job.output)
    shard_paths = resolve_inputs(job)
    views = model_specs(job)
    for spec in views.values():
        check_weights_available(spec)
        fetch_weights(spec)  # once, here: the workers then find the weights cached
    embeddings_source(job)  # a folder that cannot be ingested fails here, before Ray
    from pipeline.runtime.tracking import job_tracking

    with (
        catch_interrupts() as interrupts,
        acquire_lease(layout, job.name),
        job_tracking(job, layout.output),  # a missing tracker package fails here, before Ray
    ):
        manifest = _check_resume(job, layout)
        return _run_held(job, layout, shard_paths, views, manifest, interrupts, until)


def _run_held(
    job, layout: RunLayout, shard_paths, views, manifest, interrupts: Interrupts, until=None
):
    """The run, once it holds the output's lease: Ray, preflight, the stages."""
    from pipeline.run.space import check_output_space, embedded_pairs, remaining_space_note
    from pipeline.runtime.preflight import check_cluster
    from pipeline.runtime.ray import init_ray

    logger.debug(f"input shards: {shard_paths}")
    run = None
    try:
        where = init_ray(job.ray.address, job.ray.num_cpus, job.ray.object_store_memory)
        interrupts.install(ray_started=True)  # ray.init (and Ray Train) install their own
        check_cluster(job)  # refuses in seconds what no node could host
        check_output_space(job, layout, shard_paths, manifest.get("stages") or {})
        logger.info(
            f"ncl-pipeline: job '{job.name}', {len(shard_paths)} shards, {where}, "
            f"output {layout.output}"
        )
        run = _RunRecord(job, layout, manifest, until)
        _run_stages(job, layout, shard_paths, views, run)
    except _StopAfter as stop:
        logger.debug(f"stopped after {stop} (until=)")
    except RunInterrupted as exc:
        raise _interrupted(exc.signum, run) from None
    except (ShardFailuresError, RunConflictError):
        raise
    except Exception as exc:
        if interrupts.signum is not None:  # a signal that surfaced as another error
            raise _interrupted(interrupts.signum, run) from exc
        if isinstance(exc, JobConfigError) or run is None:
            raise
        records = run.state.records
        note = lambda: remaining_space_note(  # noqa: E731
            job, layout, records, embedded_pairs(run.metrics, shard_paths)
        )
        raise explain_failure(exc, run.stage, layout.output, space_note=note) from exc
    return run.metrics


def _interrupted(signum: int, run: _RunRecord | None) -> RunInterrupted:
    """Stop Ray (its workers with it) and name the stage the signal stopped."""
    import ray

    stage = run.stage if run is not None else "the start-up (before any stage)"
    logger.debug(f"signal {signum} in {stage}: stopping Ray")
    if ray.is_initialized():
        ray.shutdown()
    return RunInterrupted(signum, stage)


def _run_stages(job, layout: RunLayout, shard_paths, views, run: _RunRecord) -> None:
    # 1. Embed every pair with the initial model; this pass also records the quarantine.
    embed = _embed(run, shard_paths, 0, views)
    run.record(0, "embed", embed)
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
    from pipeline.reporting.report import write_report

    run.stage = "the report"
    logger.info(f"report: {write_report(layout.output)}")


def _admit_shards(job, layout: RunLayout, shard_paths, embed: dict, run: _RunRecord) -> list:
    """The shards the round-0 embed pass completed, after the corpus-wide key check.

    Raises ShardFailuresError when more failed than input.max_failed_shards allows.
    """
    from pipeline.stages.keys import run_key_check

    sizes = shard_sizes(layout, 0, shard_paths)
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
    names = [shard_name(p) for p in usable]
    sources = {shard_name(p): split_source(p)[0] for p in usable}
    keys = run.run_stage(
        "round0/keys",
        usable,
        lambda stamp: run_key_check(layout.output, names, run_state=stamp, sources=sources),
    )
    run.record(0, "keys", keys)
    run.note_shards("duplicate_keys", keys["by_shard"])
    return usable


def _still_there(layout: RunLayout, shard_paths: list[str], run: _RunRecord) -> list[str]:
    """`shard_paths` less the shards missing or resized since the embed pass (reported)."""
    from pipeline.io.admitted import changed_shards, read_embeddings_footer

    recorded = {}
    for path in shard_paths:
        footer = read_embeddings_footer(layout.embeddings(0, shard_name(path)))
        recorded[shard_name(path)] = (path, footer.shard_bytes if footer else None)
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
    warmup = run.run_stage(
        "round0/warmup",
        shard_paths,
        lambda stamp: run_training(replace(warmup_spec(job, layout, shard_paths), run_state=stamp)),
        clear=lambda: _clear_training(layout, 0),
    )
    run.record(0, "train", warmup)
    run.rounds["0"]["retrieval"] = warmup.get("retrieval")
    log_warmup(warmup)
    return {view: layout.model_checkpoint(0, view) for view in warmup["views"]}


def _coteach_rounds(job, layout, shard_paths, run: _RunRecord, checkpoints: dict) -> int:
    """Round r embeds with the models of round r-1 (both views in one pass), labels each view,
    then trains B on A's labels and A on B's. The extra last round only embeds and labels: its
    labels come from the final models and are published. Returns that last round."""
    last = job.train.rounds + 1
    for round_index in range(1, last + 1):
        run.stage = f"the embed pass of round {round_index}"
        shard_paths = _still_there(layout, shard_paths, run)
        embedded = _embed(run, shard_paths, round_index, round_models(job, checkpoints))
        run.record(round_index, "embed", embedded)
        changed = {c["shard"]: c["error"] for c in embedded["shards_changed"]}
        shard_paths = _leave_out(shard_paths, changed, run)
        run.stage = f"the label passes of round {round_index}"
        _label_passes(job, layout, shard_paths, run, round_index)
        if round_index == last:
            break
        run.stage = f"co-teaching training, round {round_index}"
        shard_paths = _still_there(layout, shard_paths, run)
        checkpoints = _train_round(job, layout, shard_paths, run, round_index, checkpoints)
    return last


def _label_passes(job, layout: RunLayout, shard_paths, run: _RunRecord, round_index: int) -> None:
    from pipeline.stages.labels import LabelSpec, run_label_pass

    for view, trainee in (("a", "b"), ("b", "a")):
        spec = LabelSpec.from_job(
            job, round_index=round_index, view=view, shard_paths=shard_paths, trainee_view=trainee
        )
        stale = (
            layout.labels_round_dir(round_index, view),
            layout.index_dir(round_index, view),
            layout.sps_proxies_dir(round_index, view),
            layout.mixture(round_index, view),
        )
        summary = run.run_stage(
            f"round{round_index}/labels_{view}",
            shard_paths,
            lambda stamp, spec=spec: run_label_pass(replace(spec, run_state=stamp)),
            clear=lambda stale=stale: _remove(*stale),
        )
        run.record(round_index, f"labels_{view}", summary)


def _train_round(job, layout, shard_paths, run: _RunRecord, round_index: int, checkpoints):
    """Co-teaching training of one round; returns the new checkpoints of A and B."""
    from pipeline.stages.train import run_training

    trained = run.run_stage(
        f"round{round_index}/train",
        shard_paths,
        lambda stamp: run_training(
            replace(
                coteach_spec(job, layout, shard_paths, round_index, checkpoints), run_state=stamp
            )
        ),
        clear=lambda: _clear_training(layout, round_index),
    )
    run.record(round_index, "train", trained)
    run.rounds[str(round_index)]["retrieval"] = trained.get("retrieval")
    log_round(trained)
    return {view: layout.model_checkpoint(round_index, view) for view in trained["views"]}


def _clear_training(layout: RunLayout, round_index: int) -> None:
    """A round's training outputs, before it is trained again under another key: its resume
    state must not be resumed, its summary and weights must not be read."""
    folder = layout.round_dir(round_index)
    stale = [f"{folder}/checkpoints", f"{folder}/ray_train", f"{folder}/labels_oracle"]
    if round_index == 1:
        stale.append(f"{folder}/labels_cosine_filter")
    _remove(*stale)


def _remove(*paths: str) -> None:
    """Delete files or folders (local or fsspec URLs); missing ones are fine."""
    for path in paths:
        remove_path(path)


def _publish(job, layout, shard_paths, run: _RunRecord, last: int) -> None:
    """The final labels/: the last round's two views combined (mean)."""
    from pipeline.runtime.tracking import track_coteaching
    from pipeline.stages.publish import publish_labels

    embedded = shard_sizes(layout, last, shard_paths)
    published_paths = [p for p in shard_paths if shard_name(p) in embedded]
    published = run.run_stage(
        "publish",
        published_paths,
        lambda stamp: publish_labels(
            {view: layout.labels_round_dir(last, view) for view in ("a", "b")},
            [shard_name(p) for p in published_paths],
            layout.labels_dir,
            round_index=last,
            job_hash=job.stage_hash(),
            ground_truth=job.eval.ground_truth,
            run_state=stamp,
        ),
        # No clear: the new labels go to a new generation and replace the old ones in one
        # switch (pipeline.io.generations), so a reader sees one run's labels, never none.
    )
    run.metrics["labels"] = published
    run.metrics["coteaching"] = coteaching_table(job, run.rounds, published)
    run.write_metrics()
    log_coteaching(run.metrics["coteaching"], job)
    track_coteaching(run.metrics["coteaching"])
    logger.info(f"labels: {layout.labels_dir}/ (read with pipeline.read_labels('{layout.output}'))")


def _embed(run: _RunRecord, shard_paths: list[str], round_index: int, views) -> dict:
    """An embed pass over the shards whose table is missing or of another key."""
    from pipeline.stages.embed import EmbedSpec, run_embed_pass

    job, layout, state = run.job, run.layout, run.state
    node = run.graph[f"round{round_index}/embed"]
    run.starting(node.stage)
    paths = {shard_name(p): p for p in shard_paths}
    if round_index == 0:
        run.shard_keys = round0_shard_keys(job, node, state.tokens, paths)
    plan = embed_plan(
        job, node, state.tokens, state.recomputed, layout, {n: run.shard_keys[n] for n in paths}
    )
    base, expected, found, pending = plan.base, plan.expected, plan.found, plan.pending
    tables = {name: layout.embeddings(round_index, name) for name in paths}
    recorded = state.records.get(node.stage)
    if pending:
        why = embed_reason(base, recorded, pending, found, state.recomputed)
        logger.info(
            f"{node.stage}: recomputed because {why}; {len(paths) - len(pending)} of "
            f"{len(paths)} shards reused"
        )
        _remove(*(tables[name] for name in pending if found[name] is not None))
        state.start(base)
    spec = EmbedSpec(
        output=layout.output,
        round_index=round_index,
        views=views,
        seed=job.seed,
        embed=job.embed,
        decode=decode_options(job),
        write_quarantine=round_index == 0,  # the input does not change between rounds
        shard_keys=expected,
        source=embeddings_source(job) if round_index == 0 and pending else None,
        source_name=getattr(job.embed.from_embeddings, "source", None),
    )
    summary = run_embed_pass(spec, [paths[name] for name in pending], len(paths) - len(pending))
    after = {**found, **table_keys({name: tables[name] for name in pending})}
    final = embed_key(base, {n: k for n, k in expected.items() if after.get(n) == k})
    if not pending:
        logger.info(f"{node.stage}: reused")
        if recorded and recorded.get("key") == final.key and recorded.get("status") == "done":
            state.tokens[node.stage] = final.key
            return summary
        state.start(base)  # every table is there under its key, only the record is not
    written = any(after.get(name) == expected[name] for name in pending)
    state.finish(node.stage, summary, final=final, recomputed=written)
    return summary


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
