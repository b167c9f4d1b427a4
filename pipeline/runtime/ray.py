"""Starting or joining Ray: the embedded local Ray binds to 127.0.0.1 only.

Contract: `init_ray(None)` starts a private local Ray whose every port listens on loopback
(Ray's local-only mode, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`), with usage stats off.
`init_ray(address)` or `RAY_ADDRESS` joins an existing cluster instead, and then the loopback
mode is NOT applied: a driver on a cluster node must advertise its real address. The defaults
go into the environment (without overriding explicit user settings) before Ray is imported,
so the raylet and workers that Ray spawns inherit them.
"""

from __future__ import annotations

import json
import os

__all__ = [
    "LOOPBACK_ENV",
    "apply_loopback_defaults",
    "cluster_resources",
    "init_ray",
]

# Set before `import ray`: Ray reads some of these at import time.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # local-only mode: all ports bind 127.0.0.1
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Ray Train's controller polls its workers every 2 s by default, so a training round would
    # end up to 2 s after its last step (docs/development.md).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # Its preemption watcher (an extra actor per training round) waits for a node drain, which
    # a single machine never announces, and starting it delays every round.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


IDLE_WORKERS = 8  # the fewest idle worker processes a local Ray keeps for reuse


def apply_loopback_defaults() -> None:
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


# Every worker process of the job sets up its logging this way (pipeline.runtime.console); worker
# code itself configures none.
WORKER_SETUP_HOOK = "pipeline.runtime.console.setup_worker_logging"


def _worker_runtime_env() -> dict:
    """The job's runtime env: the worker set-up hook, unless the job was submitted with a hook
    of its own (Ray refuses to merge a ray.init runtime env that sets the same field)."""
    submitted = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by the Ray Jobs API
    if submitted:
        try:
            runtime_env = json.loads(submitted).get("runtime_env") or {}
        except (ValueError, AttributeError):
            runtime_env = {}
        if "worker_process_setup_hook" in runtime_env:
            return {}
    return {"worker_process_setup_hook": WORKER_SETUP_HOOK}


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
) -> str:
    """Start (or connect to) Ray once per process.

    Args:
        address: None for the embedded local Ray (unless RAY_ADDRESS is set); "auto" or
            "ray://host:10001" for a cluster.
        num_cpus: CPUs of the embedded local Ray; None means all of this machine.
        object_store_memory: bytes of the embedded local Ray's object store; None means Ray's
            default. A cluster's store is the cluster's own setting.

    Returns:
        A short description of where the job runs, for the log.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not address:
        apply_loopback_defaults()
    import ray

    from pipeline.runtime.console import ray_init_options

    if ray.is_initialized():
        return "existing Ray session"
    output = ray_init_options()  # what Ray prints on this terminal (pipeline.runtime.console)
    if address:
        ray.init(address=address, runtime_env=_worker_runtime_env(), **output)
        return f"Ray cluster at {address}"
    ray.init(
        # A new private instance even when another Ray runs on this machine (`ray start`
        # leaves /tmp/ray/ray_current_cluster, which a bare ray.init() would join).
        address="local",
        num_cpus=num_cpus,
        object_store_memory=object_store_memory,  # a full store spills objects to disk
        include_dashboard=False,
        configure_logging=True,
        runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK},
        # Ray keeps only num_cpus idle workers and ends the others within a second, so on a
        # small machine each training round's decode tasks would start in fresh processes that
        # import torch and open_clip again; a few more idle workers keep them warm
        # (docs/architecture.md §4.8).
        _system_config={
            "num_workers_soft_limit": max(IDLE_WORKERS, num_cpus or os.cpu_count() or 1)
        },
        **output,
    )
    return "local Ray (127.0.0.1)"


def cluster_resources() -> tuple[float, float]:
    """(CPUs, GPUs) of the connected cluster."""
    import ray

    resources = ray.cluster_resources()
    return float(resources.get("CPU", 0.0)), float(resources.get("GPU", 0.0))
