"""The embed pass's driver side: where its workers run (`worker_options`, `decode_on`), what
it asks of Ray, and the pass itself (`run_embed_pass`): shards mapped onto workers, one log
line per finished shard, the pass summary."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

from pipeline.config import EmbedConfig, JobConfig
from pipeline.io.clip_retrieval import ingest_sentence
from pipeline.runtime.preflight import Request, more_cpus, resources_of
from pipeline.stages.embed.shard import (
    NOT_INGESTED_EXAMPLES,
    EmbedShardStage,
    EmbedSpec,
    embed_shards_on_cpu,
)

logger = logging.getLogger(__name__)


@dataclass
class _PassTally:
    """The pass summary's counters, folded from per-shard rows as they stream back."""

    totals: Counter = field(default_factory=Counter)
    actor_seconds: float = 0.0
    reasons: Counter = field(default_factory=Counter)
    ignored: Counter = field(default_factory=Counter)
    failed: list[dict] = field(default_factory=list)
    truncated: list[dict] = field(default_factory=list)
    changed: list[dict] = field(default_factory=list)
    not_ingested: Counter = field(default_factory=Counter)  # why -> pairs the model embedded
    not_ingested_keys: list[str] = field(default_factory=list)  # "<key> (shard <shard>)"

    def add(self, row: dict) -> tuple[int, str]:
        """Count one shard's summary row; returns (log level, status) for its log line."""
        self.totals.update(
            records=int(row["records"]),
            embedded=int(row["embedded"]),
            quarantined=int(row["quarantined"]),
            short_batches=int(row["short_batches"]),
            ingested=int(row["ingested"]),
        )
        missed = json.loads(row["not_ingested"])
        self.not_ingested.update(missed["reasons"])
        for key in missed["examples"][: NOT_INGESTED_EXAMPLES - len(self.not_ingested_keys)]:
            self.not_ingested_keys.append(f"{key} (shard {row['shard']})")
        self.actor_seconds += float(row["seconds"])
        self.reasons.update(json.loads(row["reasons"]))
        self.ignored.update(json.loads(row["ignored_members"]))
        status = f"FAILED ({row['error']})" if row["error"] else "ok"
        level = logging.WARNING if row["error"] or row["warning"] else logging.INFO
        if row["changed"]:
            status, level = f"CHANGED ({row['changed']}; left out)", logging.WARNING
            self.changed.append(
                {"shard": row["shard"], "path": row["path"], "error": row["changed"]}
            )
        elif row["error"]:
            self.failed.append({"shard": row["shard"], "path": row["path"], "error": row["error"]})
        elif row["warning"]:
            status = f"TRUNCATED ({row['warning']})"
            self.truncated.append(
                {"shard": row["shard"], "path": row["path"], "error": row["warning"]}
            )
        return level, status


def worker_options(embed: EmbedConfig, cluster_gpus: float) -> dict[str, float]:
    """Ray options of one embed worker: a GPU actor when the cluster has GPUs and
    `embed.gpus_per_worker` > 0, else a CPU task."""
    gpus = embed.gpus_per_worker if cluster_gpus > 0 else 0.0
    return {"num_cpus": embed.cpus_per_worker, **({"num_gpus": gpus} if gpus > 0 else {})}


def decode_on(embed: EmbedConfig, cluster_gpus: float) -> Literal["cpu", "device"]:
    """Where `embed.decode` decodes on a cluster with `cluster_gpus`: auto is the device when
    each embed worker holds a GPU (Ray hides every GPU from a worker that asks for none), else
    the CPU. Runs key their embed pass with this, not "auto": the two decodes' pixels differ."""
    if embed.decode != "auto":
        return embed.decode
    return "device" if "num_gpus" in worker_options(embed, cluster_gpus) else "cpu"


def ray_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What the embed pass asks of Ray: one worker must fit on one node (Ray Data starts as
    many as resources allow; its input is in memory, so no read task needs a CPU beside)."""
    options = worker_options(job.embed, cluster_gpus)
    keys = "embed.cpus_per_worker" + (" or embed.gpus_per_worker" if "num_gpus" in options else "")
    unit = resources_of(options)
    return [Request("embed worker", keys, unit, fix=f"lower {keys}, or {more_cpus(job)}")]


def pool_size(spec: EmbedSpec, pending: int, cpus: float, gpus: float) -> tuple[int, dict]:
    """(actors, `worker_options`) for `pending` shards on a cluster of `cpus` and `gpus`."""
    options = worker_options(spec.embed, gpus)
    size: float = 0.0
    if spec.embed.concurrency != "auto":
        size = spec.embed.concurrency
    elif "num_gpus" in options:
        size = gpus // options["num_gpus"]
    else:
        size = cpus // spec.embed.cpus_per_worker  # one per CPU by default
    return max(1, min(int(size), pending)), options


def _embed_pending(spec: EmbedSpec, pending: list[str], tally: _PassTally, started: float) -> None:
    """Map `pending` shard paths onto GPU actors or CPU tasks, logging one line per finished
    shard."""
    import ray

    from pipeline.runtime.ray import cluster_resources

    cpus, gpus = cluster_resources()
    decode = decode_on(spec.embed, gpus)  # a run's job has it resolved; a direct caller's not
    spec = replace(spec, embed=spec.embed.model_copy(update={"decode": decode}))
    size, options = pool_size(spec, len(pending), cpus, gpus)
    use_gpus = "num_gpus" in options
    workers = "actor(s)" if use_gpus else "task(s) at a time"
    logger.info(
        f"embed round {spec.round_index}: {len(pending)} shards on {size} {workers}, "
        f"{options.get('num_gpus', 0):g} GPU and {options['num_cpus']:g} CPU each"
    )
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the pass shows its own progress (pipeline.runtime.progress)
    dataset = ray.data.from_items([{"path": p} for p in pending], override_num_blocks=len(pending))
    if use_gpus:
        how = dict(
            fn=EmbedShardStage,
            fn_constructor_kwargs={"spec": spec},
            compute=ray.data.ActorPoolStrategy(size=size),
        )
    else:
        how = dict(
            fn=embed_shards_on_cpu,
            fn_kwargs={"spec": spec},
            compute=ray.data.TaskPoolStrategy(size=size),
        )
    summaries = dataset.map_batches(**how, batch_size=1, **options)
    from pipeline.runtime.progress import Progress

    what = f"embed round {spec.round_index}"
    with Progress(what, len(pending), "shards", log=logger) as progress:
        for done, row in enumerate(summaries.iter_rows(), start=1):
            level, status = tally.add(row)
            elapsed = time.perf_counter() - started
            embedded = tally.totals["embedded"]
            pairs = f"{embedded:,} pairs, {embedded / elapsed:.0f}/s"
            # Each shard's line for -v; a failed or truncated one is a warning, always shown.
            logger.log(
                level if level > logging.INFO else logging.DEBUG,
                f"  [{done}/{len(pending)}] {row['shard']}: {int(row['embedded'])} embedded, "
                f"{int(row['quarantined'])} quarantined, {float(row['seconds']):.1f}s {status}",
            )
            progress.update(done, note=pairs)


def run_embed_pass(spec: EmbedSpec, shard_paths: list[str], reused: int = 0) -> dict:
    """Embed every shard of `shard_paths` on a Ray Data actor pool (the driver chose them:
    `reused` more shards of the pass already have their table).

    The actors send nothing to the terminal: each returns its shard's summary row and the
    driver logs one line per finished shard (a warning for a failed or truncated shard).

    Returns the pass summary: counts (read, embedded, quarantined by reason), throughput and
    failed shards, aggregated from the per-shard rows as they stream back.
    """
    tally = _PassTally()
    started = time.perf_counter()
    if shard_paths:
        _embed_pending(spec, list(shard_paths), tally, started)
    seconds = time.perf_counter() - started
    totals = tally.totals
    if spec.source is not None and spec.round_index == 0 and shard_paths:
        _log_ingest(spec.source.path, totals, tally)
    return {
        "round": spec.round_index,
        "shards": len(shard_paths) + reused,
        "shards_skipped": reused,
        "shards_failed": tally.failed,
        "shards_truncated": tally.truncated,
        "shards_changed": tally.changed,
        "records_read": totals["records"],
        "embedded": totals["embedded"],
        "quarantined": totals["quarantined"],
        "quarantined_by_reason": dict(sorted(tally.reasons.items())),
        "ignored_members": dict(sorted(tally.ignored.items())),
        "short_loss_batches": totals["short_batches"],
        "seconds": seconds,
        # Summed per-shard busy time: throughput without start-up.
        "actor_seconds": tally.actor_seconds,
        "pairs_per_second": totals["embedded"] / seconds if seconds > 0 and shard_paths else None,
        "ingested": totals["ingested"],
        "not_ingested": dict(sorted(tally.not_ingested.items())),
    }


def _log_ingest(folder: str, totals: Counter, tally: _PassTally) -> None:
    """One sentence: how many pairs came from the folder, and which the model embedded."""
    line = ingest_sentence(
        folder, totals["ingested"], totals["embedded"], tally.not_ingested, tally.not_ingested_keys
    )
    logger.log(logging.WARNING if tally.not_ingested else logging.INFO, line)
