"""`ncl-pipeline status RUN`: a run directory's stages (done, pending, stale), their times, and
what a rerun would reuse and recompute; no Ray, nothing written.

The prediction is the runner's loop as a dry run: the same graph and plan function
(`pipeline.run.graph`) on what is on disk: the manifest's stage records, the embeddings footers, the
stages' outputs and the input shards' sizes. It assumes that a shard without embeddings is
embedded by the rerun, except a shard that failed last time (`shards.failed` in the manifest):
that one is assumed to fail again (said in the output).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.config import JobConfig
from pipeline.errors import UserError
from pipeline.io.layout import RunLayout
from pipeline.io.shards import expand_sources, shard_name
from pipeline.run.graph import plan_stage, stage_graph
from pipeline.run.lease import LeaseHolder, read_holder
from pipeline.run.manifest import REBUILT, read_manifest
from pipeline.run.specs import with_decode_for
from pipeline.run.state import Decision, RunState, round0_shard_keys, table_keys

__all__ = ["RunStatusError", "Prediction", "predict_rerun", "run_status"]


class RunStatusError(UserError, ValueError):
    """The directory is not a run directory (no manifest.json); the message says so."""


@dataclass(frozen=True)
class Prediction:
    decisions: dict[str, Decision]  # stage -> reuse or recompute (and why), in run order
    shards: int  # input shards of the job
    retried: list[str]  # shards that failed last time, assumed to fail again


def _manifest(run_dir: str) -> dict:
    manifest = read_manifest(RunLayout(run_dir), keep_aside=False)
    if not manifest or "job" not in manifest:
        raise RunStatusError(f"{run_dir} is not a run directory: it has no manifest.json")
    return manifest


def predict_rerun(run_dir: str, job: JobConfig, manifest: dict | None = None) -> Prediction:
    """What `run_job(job)` into `run_dir` would reuse and recompute, stage by stage: the
    runner's loop with the same plan function (`pipeline.run.graph.plan_stage`), nothing run."""
    from pipeline.run.kinds import outputs_present

    manifest = manifest if manifest is not None else _manifest(run_dir)
    job = _decode_as_recorded(job, manifest)
    layout = RunLayout(run_dir)
    graph = stage_graph(job)
    paths = {shard_name(p): p for p in expand_sources(job.input.shard_specs())}
    keys = round0_shard_keys(job, graph[0], {}, paths)
    found = table_keys({name: layout.embeddings(0, name) for name in keys})
    failed = {f["shard"] for f in (manifest.get("shards") or {}).get("failed", [])}
    retried = sorted(name for name in keys if found[name] is None and name in failed)
    usable = {name: key for name, key in keys.items() if name not in retried}
    state = RunState(dict(manifest.get("stages") or {}))
    decisions: dict[str, Decision] = {}
    for stage in graph:
        first = stage.name == "round0/embed"
        planned = plan_stage(
            job,
            layout,
            stage,
            state,
            keys if first else usable,
            lambda s, shards: outputs_present(layout, s, shards),
            expected_to_fail=retried if first else (),
            paths=paths if first else None,
        )
        state.tokens[stage.name] = planned.token
        if planned.recomputes:
            state.recomputed.add(stage.name)
        decisions[stage.name] = planned.decision
    return Prediction(decisions, len(paths), retried)


def _decode_as_recorded(job: JobConfig, manifest: dict) -> JobConfig:
    """`embed.decode: auto` as the recorded run resolved it: status starts no Ray, so it
    assumes the recorded run's cluster (without GPUs when the record does not say)."""
    if job.embed.decode != "auto":
        return job
    recorded = ((manifest.get("job") or {}).get("embed") or {}).get("decode")
    return with_decode_for(job, 1.0 if recorded == "device" else 0.0)


def _state(record: dict | None, decision: Decision, running: bool = False) -> str:
    if record is None:
        return "pending"
    if record.get("status") != "done":
        return "running" if running else "pending (interrupted)"
    return "done" if decision.reuse else "stale"


def _lease_line(run_dir: str, holder: LeaseHolder | None) -> str | None:
    """What the output's lease says: a run in progress, or one that stopped heartbeating."""
    if holder is None:
        return None
    if holder.live():
        return f"  running now: {holder.describe()}"
    return f"  a run held this output and stopped ({holder.describe()}); the next run takes it over"


def _damaged_status(run_dir: str, job: JobConfig | None, label: str, holder, rebuilt) -> str:
    """The status of a run directory whose manifest.json is damaged (warned about already):
    the stage records `rebuilt` from the outputs (`pipeline.run.manifest.rebuild_stages`)."""
    records = rebuilt.get("stages") or {}
    lines = [
        f"run {run_dir}: manifest.json is damaged; the stage records are rebuilt from the "
        f"outputs ({len(records)} stage summaries hold their keys)"
    ]
    if (line := _lease_line(run_dir, holder)) is not None:
        lines.append(line)
    lines += [
        f"  {stage:<17} done (recorded in {record['rebuilt_from']})"
        for stage, record in records.items()
    ]
    if job is None:
        lines.append(
            "  (with --job JOB_FILE, status says what a rerun would reuse: the stages above "
            "whose keys it computes again, and the embeddings tables by the keys in their "
            "footers)"
        )
        return "\n".join(lines)
    theirs = predict_rerun(run_dir, job, rebuilt)
    lines.append(f"a rerun of {label or 'the given job'} into this directory would:")
    lines += [f"  {s:<17} {d.describe()}" for s, d in theirs.decisions.items()]
    return "\n".join(lines)


def _took(record: dict | None) -> str:
    seconds = (record or {}).get("seconds")
    return "-" if seconds is None else f"{seconds:.1f}s"


def run_status(run_dir: str | os.PathLike, job: JobConfig | None = None, label: str = "") -> str:
    """The status of `run_dir` as text; with `job`, also what a rerun of `job` would do.

    Raises:
        RunStatusError: no manifest.json, or its recorded job no longer validates.
    """
    from pipeline.reporting.inspect import quarantine_lines

    run_dir = os.fspath(run_dir).rstrip("/")
    holder = read_holder(RunLayout(run_dir))
    manifest = read_manifest(RunLayout(run_dir), keep_aside=False)
    if manifest is not None and REBUILT in manifest:
        return _damaged_status(run_dir, job, label, holder, manifest)
    if (not manifest or "job" not in manifest) and holder is not None and holder.live():
        return f"run {run_dir}: starting, no stage has run yet\n{_lease_line(run_dir, holder)}"
    manifest = _manifest(run_dir) if not manifest or "job" not in manifest else manifest
    try:
        recorded = JobConfig.model_validate(manifest["job"])
    except ValueError as exc:
        raise RunStatusError(f"the job recorded in {run_dir}/manifest.json: {exc}") from exc
    mine = predict_rerun(run_dir, recorded, manifest)
    records = manifest.get("stages") or {}
    lines = [
        f"run {run_dir}: job '{manifest.get('job_name')}', {mine.shards} input shards",
        f"  {'stage':<17} {'state':<21} {'finished (UTC)':<26} {'took':>8}  rerun of the "
        "recorded job",
    ]
    running = holder is not None and holder.live()
    if (line := _lease_line(run_dir, holder)) is not None:
        lines.insert(1, line)
    for stage, decision in mine.decisions.items():
        record = records.get(stage)
        finished = (record or {}).get("finished_at") or "-"
        state = _state(record, decision, running)
        lines.append(
            f"  {stage:<17} {state:<21} {finished:<26} {_took(record):>8}  {decision.describe()}"
        )
    if mine.retried:
        lines.append(
            f"  {len(mine.retried)} shard(s) failed last time and are retried by a rerun "
            f"(assumed to fail again above): {', '.join(mine.retried)}"
        )
    if job is not None:
        theirs = predict_rerun(run_dir, job, manifest)
        lines.append(f"a rerun of {label or 'the given job'} into this directory would:")
        lines += [f"  {s:<17} {d.describe()}" for s, d in theirs.decisions.items()]
    lines += quarantine_lines(run_dir)
    return "\n".join(lines)
