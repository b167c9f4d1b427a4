"""`run_job`: one loop over the job's stage graph (docs/architecture.md §1, §4.3).

The graph (`pipeline.run.graph`) lists the stages; the plan function decides reuse or
recompute; the stage kinds (`pipeline.run.kinds`) run them. Checks that can fail cheaply
(config, shard patterns, model weights, a conflicting earlier run) run before Ray starts, so a
bad job fails in seconds with a message instead of a traceback.
"""

from __future__ import annotations

import logging
import signal
from functools import partial

from pipeline.config import JobConfig, JobConfigError
from pipeline.errors import RunFailedError, RunInterrupted, ShardFailuresError
from pipeline.io.layout import RunLayout
from pipeline.io.shards import expand_sources
from pipeline.models import check_weights_available
from pipeline.models.fetch import fetch_weights
from pipeline.run.context import RunContext
from pipeline.run.failures import explain_failure
from pipeline.run.graph import Stage, plan_stage, stage_graph
from pipeline.run.interrupts import Interrupts, catch_interrupts
from pipeline.run.kinds import KINDS, job_requests, outputs_present
from pipeline.run.lease import acquire_lease
from pipeline.run.manifest import RunConflictError, check_resume
from pipeline.run.specs import (
    check_decode,
    embeddings_source,
    model_specs,
    with_absolute_paths,
    with_decode_for,
)
from pipeline.run.state import round0_shard_keys

__all__ = [
    "RunConflictError",
    "RunFailedError",
    "RunInterrupted",
    "ShardFailuresError",
    "resolve_inputs",
    "run_job",
]

logger = logging.getLogger(__name__)


def resolve_inputs(job: JobConfig) -> list[str]:
    """The job's shard paths, tagged with their source under input.sources (expand_sources
    also refuses two shards with one name)."""
    return expand_sources(job.input.shard_specs(), allow_pipe=job.input.allow_pipe)


class _StopAfter(Exception):
    """Raised when a stage starts after `run_job(..., until=...)`'s stage finished."""


def run_job(job: JobConfig, until: str | None = None) -> dict:
    """Run the pipeline for `job` on Ray and return the metrics written to metrics.json.

    Progress and summaries go to this module's logger (and the stages' loggers); what the
    terminal shows is set up by the caller (pipeline.runtime.console). The run holds the
    output's lease while it runs (pipeline.run.lease) and stops on SIGINT / SIGTERM
    (pipeline.run.interrupts). `until` names a stage of the job's graph
    (`pipeline.run.graph.stage_graph`, e.g. "round0/keys"): the run stops once it is done.

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
    job = with_absolute_paths(job)
    layout = RunLayout(job.output)
    shard_paths = resolve_inputs(job)
    for spec in model_specs(job).values():
        check_weights_available(spec)
        fetch_weights(spec)  # once, here: the workers then find the weights cached
    check_decode(job)
    embeddings_source(job)  # a folder that cannot be ingested fails here, before Ray
    from pipeline.runtime.tracking import job_tracking

    with (
        catch_interrupts() as interrupts,
        acquire_lease(layout, job.name),
        job_tracking(job, layout.output),  # a missing tracker package fails here, before Ray
    ):
        manifest = check_resume(job, layout)
        return _run_held(job, layout, shard_paths, manifest, interrupts, until)


def _run_held(job, layout: RunLayout, shard_paths, manifest, interrupts: Interrupts, until=None):
    """The run, once it holds the output's lease: Ray, preflight, the stages."""
    from pipeline.run.space import check_output_space, embedded_pairs, remaining_space_note
    from pipeline.runtime.preflight import check_cluster
    from pipeline.runtime.ray import cluster_resources, init_ray

    logger.debug(f"input shards: {shard_paths}")
    run = None
    try:
        where = init_ray(job.ray.address, job.ray.num_cpus, job.ray.object_store_memory)
        interrupts.install()  # ray.init installs handlers of its own
        job = with_decode_for(job, cluster_resources()[1])
        check_cluster(job, partial(job_requests, job))  # refuses what no node could host
        check_output_space(job, layout, shard_paths, manifest.get("stages") or {})
        logger.info(
            f"ncl-pipeline: job '{job.name}', {len(shard_paths)} shards, {where}, "
            f"output {layout.output}"
        )
        run = RunContext(job, layout, manifest, shard_paths)
        _run_stages(run, until)
        if interrupts.signum is not None:  # a signal some library swallowed
            raise RunInterrupted(interrupts.signum)
    except _StopAfter as stop:
        logger.debug(f"stopped after {stop} (until=)")
    except KeyboardInterrupt:  # ours, or Ray's get raising its own for our signal
        raise _interrupted(interrupts.signum or signal.SIGINT, run) from None
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
    assert run is not None  # set before _run_stages, the one source of _StopAfter
    return run.metrics


def _interrupted(signum: int, run: RunContext | None) -> RunInterrupted:
    """Stop Ray (its workers with it) and name the stage the signal stopped."""
    import ray

    stage = run.stage if run is not None else "the start-up (before any stage)"
    logger.debug(f"signal {signum} in {stage}: stopping Ray")
    if ray.is_initialized():
        ray.shutdown()
    return RunInterrupted(signum, stage)


def _run_stages(ctx: RunContext, until: str | None) -> None:
    """Each stage of the graph in order: plan it, run or reuse it, record it."""
    graph = stage_graph(ctx.job)
    if until is not None and until not in {stage.name for stage in graph}:
        names = ", ".join(stage.name for stage in graph)
        raise JobConfigError(f"until={until!r} is not a stage of this job; its stages: {names}")
    for stage in graph:
        kind = KINDS[stage.kind]
        ctx.stage = kind.describe(stage)
        if kind.checks_shards(stage):
            ctx.check_still_there()
        summary = kind.execute(ctx, stage, plan(ctx, stage))
        kind.after(ctx, stage, summary)
        if stage.name == until:
            raise _StopAfter(until)
    from pipeline.reporting.report import write_report

    ctx.stage = "the report"
    logger.info(f"report: {write_report(ctx.layout.output)}")


def plan(ctx: RunContext, stage: Stage):
    """`plan_stage` over the shards the stage reads (round 0's embed pass: every input shard,
    whose round-0 keys it fixes)."""
    first = stage.name == "round0/embed"
    if first:
        ctx.shard_keys = round0_shard_keys(ctx.job, stage, ctx.state.tokens, ctx.paths)
    names = KINDS[stage.kind].shards(ctx, stage)
    return plan_stage(
        ctx.job,
        ctx.layout,
        stage,
        ctx.state,
        {name: ctx.shard_keys[name] for name in names},
        lambda s, shards: outputs_present(ctx.layout, s, shards),
        paths=ctx.paths if first else None,
    )
