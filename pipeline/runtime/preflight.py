"""Resource preflight: before any work, can the cluster's nodes host what each stage requests?
(docs/architecture.md §4.7 lists each stage's requests and why.)

Contract:
- `plan_requests(job, ...)` restates what each stage asks of Ray (embed workers, index actors
  and their shard tasks, training workers plus one reader CPU each, 1-CPU tasks); kept in step
  with the stages.
- `check_requests` is the pure part: planned requests and the nodes' resources in, the
  problems out, each naming the key to change.
- `check_cluster` reads the connected cluster and raises `JobConfigError` in seconds, instead
  of Ray waiting forever on a request no node can satisfy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.config import JobConfig, JobConfigError

__all__ = ["Request", "check_cluster", "check_requests", "plan_requests"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What one stage asks of Ray at once."""

    what: str  # e.g. "embed worker"
    keys: str  # the job keys that set it, for the message
    unit: dict[str, float]  # resources of one actor/worker/task
    count: int = 1  # units that must all be placed at the same time (a gang)
    beside_cpus: int = 0  # 1-CPU tasks that must run beside the gang (Ray Data readers)
    fix: str = ""  # what to change, for the message


def _show(resources: dict[str, float]) -> str:
    return " + ".join(f"{value:g} {name}" for name, value in resources.items() if value) or "none"


def _fits(node: dict[str, float], unit: dict[str, float]) -> bool:
    return all(node.get(name, 0.0) >= value - 1e-9 for name, value in unit.items() if value)


def _place(nodes: list[dict[str, float]], unit: dict[str, float], count: int) -> list | None:
    """The nodes' resources left after placing `count` units first-fit; None if they do not
    fit (identical units: first-fit is as good as any order here)."""
    left = [dict(node) for node in nodes]
    for _ in range(count):
        host = next((node for node in left if _fits(node, unit)), None)
        if host is None:
            return None
        for name, value in unit.items():
            host[name] = host.get(name, 0.0) - value
    return left


def check_requests(requests: list[Request], nodes: list[dict[str, float]]) -> list[str]:
    """Problems of `requests` on a cluster of `nodes` (each node's total resources, as in
    `ray.nodes()[i]["Resources"]`); empty when every request can be hosted."""
    problems = []
    cluster = {name: sum(node.get(name, 0.0) for node in nodes) for name in ("CPU", "GPU")}
    for request in requests:
        if not any(_fits(node, request.unit) for node in nodes):
            largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
            problems.append(
                f"each {request.what} asks for {_show(request.unit)} on one node ({request.keys}),"
                f" but no node has that much (largest: "
                f"{_show({k: largest.get(k, 0.0) for k in request.unit})}): {request.fix}"
            )
            continue
        left = _place(nodes, request.unit, request.count)
        readers = sum(int(node.get("CPU", 0.0) + 1e-9) for node in left) if left is not None else 0
        if left is None or readers < request.beside_cpus:
            need = {k: v * request.count for k, v in request.unit.items()}
            beside = (
                f" plus {request.beside_cpus} CPU for the Ray Data tasks reading their data"
                if request.beside_cpus
                else ""
            )
            problems.append(
                f"{request.count} {request.what}s ({request.keys}) need {_show(need)}{beside} at "
                f"the same time, but the cluster has {_show(cluster)}: {request.fix}"
            )
    return problems


def plan_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What `job`'s stages will ask of Ray on a cluster with `cluster_gpus` GPUs in all (the
    stages use GPUs only when the cluster has some)."""
    gpus = cluster_gpus > 0
    local = job.ray.address is None
    more_cpus = "raise ray.num_cpus" if local else "add CPUs to the cluster's nodes"
    embed_unit = {"CPU": job.embed.cpus_per_worker}
    if gpus and job.embed.gpus_per_worker > 0:
        embed_unit["GPU"] = job.embed.gpus_per_worker
    embed_keys = "embed.cpus_per_worker" + (
        " or embed.gpus_per_worker" if "GPU" in embed_unit else ""
    )
    requests = [
        Request(
            "embed worker",
            embed_keys,
            embed_unit,
            fix=f"lower {embed_keys}, or {more_cpus}",
        ),
        Request("shard task", "dedup, labels, publish", {"CPU": 1.0}, fix=more_cpus),
    ]
    if job.index.gpus_per_actor > 0:
        requests.append(
            Request(
                "index actor",
                "index.shards, index.gpus_per_actor",
                {"GPU": job.index.gpus_per_actor, "CPU": 1.0},
                count=job.index.shards,
                beside_cpus=1,
                fix="lower index.shards or index.gpus_per_actor, or set index.gpus_per_actor: 0",
            )
        )
    if job.train.warmup_epochs > 0 or job.train.rounds > 0:
        workers = job.train.workers
        requests.append(
            Request(
                "training worker",
                "train.workers",
                {"GPU": 1.0} if gpus else {"CPU": 1.0},
                count=workers,
                beside_cpus=workers,
                fix=f"lower train.workers (to {max(1, workers // 2)}?) or {more_cpus}",
            )
        )
    return requests


def check_cluster(job: JobConfig) -> None:
    """Compare `job`'s requests with the connected Ray cluster's live nodes.

    Raises:
        JobConfigError: a request no node (or not the whole cluster) can host; the message
            names the keys to change. Skipped with `ray.preflight: false` (an autoscaling
            cluster whose nodes are not up yet).
    """
    if not job.ray.preflight:
        return
    import ray

    nodes = [
        {name: float(value) for name, value in node["Resources"].items()}
        for node in ray.nodes()
        if node.get("Alive")
    ]
    gpus = sum(node.get("GPU", 0.0) for node in nodes)
    problems = check_requests(plan_requests(job, gpus), nodes)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise JobConfigError(
            f"job '{job.name}' cannot run on this cluster (it would wait forever):\n{lines}\n"
            "(on an autoscaling cluster whose nodes are not up yet, set ray.preflight: false)"
        )
    logger.debug(f"preflight: {len(nodes)} node(s) can host every stage")
