"""Resource preflight: before any work, can the cluster's nodes host what each stage requests?
(docs/architecture.md §4.7 lists each stage's requests and why.)

Contract:
- Each stage module declares its Ray options once and derives its `ray_requests(job,
  cluster_gpus) -> list[Request]` from them (`resources_of`); the run layer collects those of
  the stages a job runs (`pipeline.run.kinds.job_requests`). Nothing here restates them.
- `check_requests` is the pure part: requests and the nodes' resources in, `Findings` out:
  problems (a request that would wait forever) and warnings (one that runs, but slower than it
  could), each naming the key to change.
- `check_cluster` reads the connected cluster's live nodes, asks for the requests for its GPU
  count, logs the warnings and raises `JobConfigError` in seconds on any problem, instead of
  Ray waiting forever on a request no node can satisfy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.config import JobConfig, JobConfigError

__all__ = ["Findings", "Request", "check_cluster", "check_requests", "more_cpus", "resources_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What one stage asks of Ray at once."""

    what: str  # e.g. "embed worker"
    keys: str  # the job keys that set it, for the message ("" when none does)
    unit: dict[str, float]  # resources of one actor/worker/task, in Ray's names (CPU, GPU)
    count: int = 1  # units that must all be placed at the same time (a gang)
    beside_cpus: int = 0  # CPUs the gang's own tasks need beside it, or it waits forever
    wanted_cpus: int = 0  # CPUs those tasks would use beside it; fewer only slow it down
    beside: str = "the tasks beside them"  # what those tasks are, for the message
    fix: str = ""  # what to change, for the message


@dataclass(frozen=True)
class Findings:
    """What `check_requests` found: problems refuse the job, warnings are only logged."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def resources_of(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources (Ray's names) of one task or actor started with `.options(**options)`;
    the stages declare `num_cpus` explicitly, so no Ray default is assumed here."""
    names = {"num_cpus": "CPU", "num_gpus": "GPU"}
    return {names[key]: float(value) for key, value in options.items() if key in names and value}


def more_cpus(job: JobConfig) -> str:
    """How to get more CPUs: the embedded local Ray takes `ray.num_cpus`; a cluster, nodes."""
    return "raise ray.num_cpus" if job.ray.address is None else "add CPUs to the cluster's nodes"


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


def _merged(requests: list[Request]) -> list[Request]:
    """Requests that differ only in who asks merged into one, so that e.g. every stage's
    1-CPU tasks give one message, not one per stage."""
    groups: dict[tuple, Request] = {}
    for request in requests:
        same: tuple = (tuple(sorted(request.unit.items())), request.count, request.beside_cpus)
        same += (request.wanted_cpus, request.beside, request.fix)
        if (first := groups.get(same)) is None:
            groups[same] = request
            continue
        keys = ", ".join(k for k in dict.fromkeys((first.keys, request.keys)) if k)
        groups[same] = replace(first, what=f"{first.what} / {request.what}", keys=keys)
    return list(groups.values())


def _unhostable(request: Request, nodes: list[dict[str, float]]) -> str:
    largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
    keys = f" ({request.keys})" if request.keys else ""
    has = " + ".join(f"{largest.get(name, 0.0):g} {name}" for name in request.unit)
    return (
        f"each {request.what} asks for {_show(request.unit)} on one node{keys}, but no node "
        f"has that much (largest: {has}): {request.fix}"
    )


def check_requests(requests: list[Request], nodes: list[dict[str, float]]) -> Findings:
    """Check `requests` against a cluster of `nodes` (each node's total resources, as in
    `ray.nodes()[i]["Resources"]`); no problems when every request can be hosted."""
    findings = Findings()
    cluster = {name: sum(node.get(name, 0.0) for node in nodes) for name in ("CPU", "GPU")}
    for request in _merged(requests):
        if not any(_fits(node, request.unit) for node in nodes):
            findings.problems.append(_unhostable(request, nodes))
            continue
        left = _place(nodes, request.unit, request.count)
        # Tasks beside a gang go to any node with a free CPU (Ray Data prefers the gang's own).
        free = sum(int(node.get("CPU", 0.0) + 1e-9) for node in left) if left is not None else 0
        gang = f"{request.count} {request.what}s ({request.keys})"
        if left is None or free < request.beside_cpus:
            need = {k: v * request.count for k, v in request.unit.items()}
            beside = (
                f" plus {request.beside_cpus} CPU for {request.beside}"
                if request.beside_cpus
                else ""
            )
            findings.problems.append(
                f"{gang} need {_show(need)}{beside} at the same time, but the cluster has "
                f"{_show(cluster)}: {request.fix}"
            )
        elif free < request.wanted_cpus:
            findings.warnings.append(
                f"{gang} leave {free} CPU for {request.beside}, fewer than "
                f"the {request.wanted_cpus} they would use ({request.wanted_cpus // request.count}"
                f" each), so they may wait on them: {request.fix}"
            )
    return findings


RequestsFor = Callable[[float], list[Request]]  # the cluster's GPU count -> the job's requests


def _live_nodes() -> list[dict[str, float]]:
    import ray

    return [
        {name: float(value) for name, value in node["Resources"].items()}
        for node in ray.nodes()
        if node.get("Alive")
    ]


def check_cluster(job: JobConfig, requests_for: RequestsFor) -> None:
    """Compare `job`'s requests with the connected Ray cluster's live nodes.

    Args:
        job: the job (its name and `ray` section).
        requests_for: the job's requests on a cluster with that many GPUs in all (the stages
            use GPUs only when the cluster has some), e.g.
            `functools.partial(pipeline.run.kinds.job_requests, job)`.

    Raises:
        JobConfigError: a request no node (or not the whole cluster) can host; the message
            names the keys to change. Skipped with `ray.preflight: false` (an autoscaling
            cluster whose nodes are not up yet).
    """
    if not job.ray.preflight:
        return
    nodes = _live_nodes()
    findings = check_requests(requests_for(sum(node.get("GPU", 0.0) for node in nodes)), nodes)
    for warning in findings.warnings:
        logger.warning(f"job '{job.name}': {warning}")
    if findings.problems:
        lines = "\n".join(f"  - {p}" for p in findings.problems)
        raise JobConfigError(
            f"job '{job.name}' cannot run on this cluster (it would wait forever):\n{lines}\n"
            "(on an autoscaling cluster whose nodes are not up yet, set ray.preflight: false)"
        )
    logger.debug(f"preflight: {len(nodes)} node(s) can host every stage")
