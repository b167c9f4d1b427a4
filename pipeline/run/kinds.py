"""What each kind of stage does in a run (docs/architecture.md §4.3): how it runs (the spec it
builds from the job), what it clears before running again under another key, which outputs a
reused stage must still have, and what it records afterwards.

`KINDS[stage.kind]` is looked up by the runner's loop (`pipeline.run.runner`), for
`outputs_present` by the plan function both the runner and `ncl-pipeline status` use
(`pipeline.run.graph.plan_stage`), and for `requests` (each stage module's own declaration of
what it asks of Ray) by the preflight (`job_requests`). A kind's `execute` is the generic
reuse-or-compute step; the embed pass decides per shard and overrides it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from pipeline.errors import ShardFailuresError
from pipeline.io.layout import BASELINE_SUMMARY, LABEL_PASS_SUMMARY, RUN_STATE_FIELD, RunLayout
from pipeline.io.shards import split_source
from pipeline.io.tables import remove_path, write_json_atomic
from pipeline.run.context import RunContext
from pipeline.run.graph import Planned, Stage, stage_graph
from pipeline.run.specs import (
    baseline_labels,
    coteach_spec,
    embed_spec,
    embeddings_source,
    shard_sizes,
    warmup_spec,
)
from pipeline.run.state import embed_key, table_keys
from pipeline.run.summary import (
    coteaching_table,
    log_coteaching,
    log_embed_summary,
    log_round,
    log_warmup,
)
from pipeline.runtime.preflight import Request

__all__ = ["KINDS", "StageKind", "job_requests", "outputs_present"]

logger = logging.getLogger(__name__)


class StageKind:
    """The generic stage: reused under the same key, else cleared and computed."""

    def describe(self, stage: Stage) -> str:
        """The stage in an error message ("... failed: ...", "interrupted in ...")."""
        return stage.name

    def checks_shards(self, stage: Stage) -> bool:
        """Whether the usable shards are checked for changes before it (it reads the tars)."""
        return False

    def shards(self, ctx: RunContext, stage: Stage) -> list[str]:
        """The shard names it reads (its key hashes their round-0 keys)."""
        return ctx.usable

    def stale(self, layout: RunLayout, stage: Stage) -> list[str]:
        """Outputs of an earlier computation, removed before it runs under another key."""
        return []

    def outputs_present(self, layout: RunLayout, stage: Stage, shards: Collection[str]) -> bool:
        return True

    def requests(self, job, cluster_gpus: float) -> list[Request]:
        """What it asks of Ray (the stage module's own declaration), for the preflight."""
        return []

    def run(self, ctx: RunContext, stage: Stage, stamp: dict) -> dict:
        raise NotImplementedError

    def after(self, ctx: RunContext, stage: Stage, summary: dict) -> None:
        """Record the summary (metrics.json, the console), reused or computed."""

    def execute(self, ctx: RunContext, stage: Stage, planned: Planned) -> dict:
        decision, state = planned.decision, ctx.state
        logger.info(f"{stage.name}: {decision.describe()}")
        if decision.reuse:
            state.tokens[stage.name] = planned.key.key
            return state.summary(stage.name)
        if not decision.resume:
            for path in self.stale(ctx.layout, stage):
                remove_path(path)
        state.start(planned.key)
        summary = self.run(ctx, stage, planned.key.stamp())
        state.finish(stage.name, summary)
        return summary


def outputs_present(layout: RunLayout, stage: Stage, shards: Collection[str]) -> bool:
    return KINDS[stage.kind].outputs_present(layout, stage, shards)


def _folder_has(folder: str, summary: str, shards: Collection[str]) -> bool:
    from pipeline.io.paths import folder_names

    have = folder_names(folder)
    return summary in have and all(f"{s}.parquet" in have for s in shards)


class Embed(StageKind):
    def requests(self, job, cluster_gpus: float) -> list[Request]:
        from pipeline.stages.embed import ray_requests

        return ray_requests(job, cluster_gpus)

    def describe(self, stage: Stage) -> str:
        r = stage.round_index
        return "the embed pass (round 0)" if r == 0 else f"the embed pass of round {r}"

    def checks_shards(self, stage: Stage) -> bool:
        return stage.round_index > 0

    def shards(self, ctx: RunContext, stage: Stage) -> list[str]:
        return list(ctx.paths) if stage.round_index == 0 else ctx.usable

    def execute(self, ctx: RunContext, stage: Stage, planned: Planned) -> dict:
        """The shards whose table is missing or of another key; the others are reused."""
        from pipeline.stages.embed import run_embed_pass

        state, plan = ctx.state, planned.embed
        assert plan is not None
        base, expected, found, pending = plan.base, plan.expected, plan.found, plan.pending
        tables = {name: ctx.layout.embeddings(stage.round_index, name) for name in expected}
        recorded = state.records.get(stage.name)
        if pending:
            logger.info(
                f"{stage.name}: {planned.decision.describe()}; {len(expected) - len(pending)} "
                f"of {len(expected)} shards reused"
            )
            for name in pending:
                if found[name] is not None:
                    remove_path(tables[name])
            state.start(base)
        spec = embed_spec(ctx.job, ctx.layout, stage.round_index, ctx.checkpoints, expected)
        if stage.round_index == 0 and pending:  # embed.from_embeddings: round 0 ingests
            spec = replace(spec, source=embeddings_source(ctx.job))
        paths = [ctx.paths[name] for name in pending]
        summary = run_embed_pass(spec, paths, len(expected) - len(pending))
        after = {**found, **table_keys({name: tables[name] for name in pending})}
        final = embed_key(base, {n: k for n, k in expected.items() if after.get(n) == k})
        if not pending:
            logger.info(f"{stage.name}: reused")
            if recorded and recorded.get("key") == final.key and recorded.get("status") == "done":
                state.tokens[stage.name] = final.key
                return summary
            state.start(base)  # every table is there under its key, only the record is not
        written = any(after.get(name) == expected[name] for name in pending)
        state.finish(stage.name, summary, final=final, recomputed=written)
        return summary

    def after(self, ctx: RunContext, stage: Stage, summary: dict) -> None:
        ctx.record(stage.round_index, "embed", summary)
        if stage.round_index == 0:
            log_embed_summary(summary, ctx.layout)
            _admit(ctx, summary)
        else:
            ctx.leave_out({c["shard"]: c["error"] for c in summary["shards_changed"]})


def _admit(ctx: RunContext, embed: dict) -> None:
    """The round-0 embed pass's output: the shards it completed go on (`ctx.usable`).

    Raises ShardFailuresError when more failed than input.max_failed_shards allows.
    """
    job = ctx.job
    sizes = shard_sizes(ctx.layout, 0, list(ctx.paths.values()))
    errors = {f["path"]: f["error"] for f in embed["shards_failed"]}
    failed = [
        {"shard": name, "path": path, "error": errors.get(path, "no embeddings")}
        for name, path in ctx.paths.items()
        if name not in sizes
    ]
    ctx.note_shards("failed", failed)
    allowed = job.input.failed_shards_allowed(len(ctx.paths))
    listing = "\n".join(f"  {f['path']}: {f['error']}" for f in failed)
    if len(failed) > allowed:
        raise ShardFailuresError(
            f"{len(failed)} of {len(ctx.paths)} shards could not be read, more than "
            f"input.max_failed_shards={job.input.max_failed_shards} allows ({allowed}); the "
            f"run stopped after the embed pass:\n{listing}\nFix or remove these shards, or "
            "raise input.max_failed_shards, and rerun: the shards already embedded are kept."
        )
    if failed:
        logger.warning(
            f"{len(failed)} shard(s) could not be read and are left out of this run (the next "
            f"run retries them):\n{listing}"
        )
    ctx.usable = [name for name in ctx.paths if name in sizes]


class Keys(StageKind):
    def requests(self, job, cluster_gpus: float) -> list[Request]:
        from pipeline.stages.keys import ray_requests

        return ray_requests(job, cluster_gpus)

    def describe(self, stage: Stage) -> str:
        return "the corpus-wide key check"

    def run(self, ctx: RunContext, stage: Stage, stamp: dict) -> dict:
        from pipeline.stages.keys import run_key_check

        sources = {name: split_source(ctx.paths[name])[0] for name in ctx.usable}
        return run_key_check(ctx.layout.output, ctx.usable, run_state=stamp, sources=sources)

    def after(self, ctx: RunContext, stage: Stage, summary: dict) -> None:
        ctx.record(0, "keys", summary)
        ctx.note_shards("duplicate_keys", summary["by_shard"])


class Training(StageKind):
    """The warm-up (round 0) and each co-teaching round: both views' new checkpoints."""

    def requests(self, job, cluster_gpus: float) -> list[Request]:
        from pipeline.stages.train.driver import ray_requests

        return ray_requests(job, cluster_gpus)

    def describe(self, stage: Stage) -> str:
        if stage.kind == "warmup":
            return "the warm-up (round 0 training)"
        return f"co-teaching training, round {stage.round_index}"

    def checks_shards(self, stage: Stage) -> bool:
        return True

    def stale(self, layout: RunLayout, stage: Stage) -> list[str]:
        # Its resume state must not be resumed, its summary and weights must not be read.
        folder = layout.round_dir(stage.round_index)
        return [f"{folder}/checkpoints", f"{folder}/ray_train"]

    def outputs_present(self, layout: RunLayout, stage: Stage, shards: Collection[str]) -> bool:
        from pipeline.io.paths import folder_names

        r = stage.round_index
        return all(
            layout.model_checkpoint(r, view).rsplit("/", 1)[-1]
            in folder_names(layout.checkpoint_dir(r, view))
            for view in ("A", "B")
        )

    def run(self, ctx: RunContext, stage: Stage, stamp: dict) -> dict:
        from pipeline.stages.train import run_training

        job, layout, paths = ctx.job, ctx.layout, ctx.usable_paths()
        if stage.kind == "warmup":
            spec = warmup_spec(job, layout, paths)
        else:
            source = next((s for s in stage.inputs if s.endswith(("/oracle", "/filter"))), None)
            baseline = None if source is None else baseline_labels(ctx.state.summary(source))
            spec = coteach_spec(
                job, layout, paths, stage.round_index, ctx.checkpoints, baseline=baseline
            )
        return run_training(replace(spec, run_state=stamp))

    def after(self, ctx: RunContext, stage: Stage, summary: dict) -> None:
        r = stage.round_index
        ctx.record(r, "train", summary)
        ctx.rounds[str(r)]["retrieval"] = summary.get("retrieval")
        (log_warmup if stage.kind == "warmup" else log_round)(summary)
        ctx.checkpoints = {view: ctx.layout.model_checkpoint(r, view) for view in summary["views"]}


class Labels(StageKind):
    """One view's label pass of a round; its peer trains on its labels."""

    def requests(self, job, cluster_gpus: float) -> list[Request]:
        from pipeline.stages.labels.resources import ray_requests

        return ray_requests(job, cluster_gpus)

    def describe(self, stage: Stage) -> str:
        return f"the label passes of round {stage.round_index}"

    def stale(self, layout: RunLayout, stage: Stage) -> list[str]:
        r, view = stage.round_index, stage.view
        return [
            layout.labels_round_dir(r, view),
            layout.index_dir(r, view),
            layout.sps_proxies_dir(r, view),
            layout.mixture(r, view),
        ]

    def outputs_present(self, layout: RunLayout, stage: Stage, shards: Collection[str]) -> bool:
        folder = layout.labels_round_dir(stage.round_index, stage.view)
        return _folder_has(folder, LABEL_PASS_SUMMARY, shards)

    def run(self, ctx: RunContext, stage: Stage, stamp: dict) -> dict:
        from pipeline.stages.labels import LabelSpec, run_label_pass

        view = stage.view
        spec = LabelSpec.from_job(
            ctx.job,
            round_index=stage.round_index,
            view=view,
            shard_paths=ctx.usable_paths(),
            trainee_view="b" if view == "a" else "a",
        )
        return run_label_pass(replace(spec, run_state=stamp))

    def after(self, ctx: RunContext, stage: Stage, summary: dict) -> None:
        ctx.record(stage.round_index, f"labels_{stage.view}", summary)


class Baseline(StageKind):
    """train.mode oracle's tables (the ground truth's clean pairs) or cosine_filter's (the pairs
    the scorer keeps): label sources the co-teaching path trains on like any other."""

    def describe(self, stage: Stage) -> str:
        return f"the {stage.kind} tables of round {stage.round_index}"

    def _folder(self, layout: RunLayout, stage: Stage) -> str:
        mode = "oracle" if stage.kind == "oracle" else "cosine_filter"
        return layout.baseline_dir(stage.round_index, mode)

    def stale(self, layout: RunLayout, stage: Stage) -> list[str]:
        return [self._folder(layout, stage)]

    def outputs_present(self, layout: RunLayout, stage: Stage, shards: Collection[str]) -> bool:
        return _folder_has(self._folder(layout, stage), BASELINE_SUMMARY, shards)

    def run(self, ctx: RunContext, stage: Stage, stamp: dict) -> dict:
        from pipeline.run.specs import write_baseline

        folder = self._folder(ctx.layout, stage)
        summary = write_baseline(
            ctx.job, ctx.layout, stage.kind, stage.round_index, ctx.usable_paths(), folder
        )
        summary = {**summary, "folder": folder, RUN_STATE_FIELD: stamp}
        write_json_atomic(summary, f"{folder}/{BASELINE_SUMMARY}")  # last: the stage is done
        return summary


class Filter(Baseline):
    def requests(self, job, cluster_gpus: float) -> list[Request]:
        from pipeline.stages.baselines.cosine_filter import ray_requests

        return ray_requests(job, cluster_gpus)


class Publish(StageKind):
    def requests(self, job, cluster_gpus: float) -> list[Request]:
        from pipeline.stages.publish import ray_requests

        return ray_requests(job, cluster_gpus)

    def describe(self, stage: Stage) -> str:
        return "publishing the labels"

    def shards(self, ctx: RunContext, stage: Stage) -> list[str]:
        embedded = shard_sizes(ctx.layout, stage.round_index, ctx.usable_paths())
        return [name for name in ctx.usable if name in embedded]

    def outputs_present(self, layout: RunLayout, stage: Stage, shards: Collection[str]) -> bool:
        from pipeline.io.generations import published_labels_folder

        return _folder_has(published_labels_folder(layout.labels_dir), LABEL_PASS_SUMMARY, shards)

    # No stale(): the new labels go to a new generation and replace the old ones in one switch
    # (pipeline.io.generations), so a reader sees one run's labels, never none.
    def run(self, ctx: RunContext, stage: Stage, stamp: dict) -> dict:
        from pipeline.stages.publish import publish_labels

        layout, last = ctx.layout, stage.round_index
        rounds = range(1, last + 1)  # every labels round, for the label-free diagnostics
        diagnose = {
            r: (layout.labels_round_dir(r, "a"), layout.labels_round_dir(r, "b")) for r in rounds
        }
        return publish_labels(
            {view: layout.labels_round_dir(last, view) for view in ("a", "b")},
            self.shards(ctx, stage),
            layout.labels_dir,
            round_index=last,
            job_hash=ctx.job.stage_hash(),
            ground_truth=ctx.job.eval.ground_truth,
            run_state=stamp,
            diagnose=diagnose,
        )

    def after(self, ctx: RunContext, stage: Stage, summary: dict) -> None:
        from pipeline.runtime.tracking import track_coteaching

        ctx.metrics["labels"] = summary
        ctx.metrics["coteaching"] = coteaching_table(ctx.job, ctx.rounds, summary)
        ctx.write_metrics()
        log_coteaching(ctx.metrics["coteaching"], ctx.job)
        track_coteaching(ctx.metrics["coteaching"])
        output = ctx.layout.output
        logger.info(
            f"labels: {ctx.layout.labels_dir}/ (read with pipeline.read_labels('{output}'))"
        )


_TRAINING = Training()  # one kind for the warm-up and the rounds: asks Ray once
KINDS: dict[str, StageKind] = {
    "embed": Embed(),
    "keys": Keys(),
    "warmup": _TRAINING,
    "labels": Labels(),
    "oracle": Baseline(),  # written by the driver, without Ray
    "filter": Filter(),
    "train": _TRAINING,
    "publish": Publish(),
}


def job_requests(job, cluster_gpus: float) -> list[Request]:
    """Every request of the stages `job` runs, on a cluster with `cluster_gpus` GPUs in all
    (each kind's once, however many rounds run it): what the preflight places
    (`pipeline.runtime.preflight.check_cluster`; docs/architecture.md §4.7)."""
    kinds = dict.fromkeys(KINDS[stage.kind] for stage in stage_graph(job))
    return [request for kind in kinds for request in kind.requests(job, cluster_gpus)]
