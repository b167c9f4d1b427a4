"""What the label pass asks of Ray, declared once: the options its tasks and index actors are
started with, and the preflight's requests derived from them (docs/architecture.md §4.7).

- Shard tasks (`TASK_OPTIONS`): one CPU each, retried, since their writes are atomic and
  idempotent.
- Index actors (`index_actor_options`): on CPU no resources (Ray places them on a node with a
  CPU but they hold none); with `index.gpus_per_actor` those GPUs and one CPU, all
  `index.shards` at once, with a CPU beside them for the label tasks that query them.
- Codebook training (`codebook_task_options`): a shard task's options, and an index actor's
  resources when the index is on GPU; so its unit is one of the two above.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import IndexConfig, JobConfig
from pipeline.runtime.preflight import Request, more_cpus, resources_of

__all__ = [
    "INDEX_ACTOR_RESTARTS",
    "TASK_OPTIONS",
    "codebook_task_options",
    "index_actor_options",
    "ray_requests",
]

TASK_OPTIONS = {"num_cpus": 1, "max_retries": 3}  # shard tasks: atomic, idempotent writes
# Restarts of one index actor within a pass (each a lost node or process); beyond that the pass
# fails and names the actor.
INDEX_ACTOR_RESTARTS = 3


def _actor_resources(index: IndexConfig) -> dict[str, float]:
    # Resources only for a GPU index: once any resource is given Ray holds the actor's CPU for
    # its whole life instead of only to place it, and `index.shards` CPU actors on a 2-CPU node
    # would leave no CPU for the label tasks that query them (a silent hang).
    gpus = index.gpus_per_actor
    return {"num_gpus": gpus, "num_cpus": 1} if gpus > 0 else {}


def index_actor_options(index: IndexConfig) -> dict[str, Any]:
    """Ray options of one `IndexStoreActor`."""
    # A threaded actor: FAISS releases the GIL, so an actor with a CPU-less placement still
    # searches for several label tasks at once (each waits for it, holding its CPU), where a
    # one-thread actor kept one core busy for the whole pass. FAISS GPU indexes are not
    # thread-safe: a GPU actor serves one search at a time.
    return {
        "max_restarts": INDEX_ACTOR_RESTARTS,
        "max_task_retries": INDEX_ACTOR_RESTARTS,
        "max_concurrency": 1 if index.gpus_per_actor > 0 else index.search_threads,
        **_actor_resources(index),
    }


def codebook_task_options(index: IndexConfig) -> dict[str, Any]:
    """Ray options of the IVF/PQ codebook training task: a GPU index trains on the GPUs an
    index actor gets (free then: the actors start after training), a CPU one on one CPU."""
    return {**TASK_OPTIONS, **_actor_resources(index)}


def ray_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What the label pass asks of Ray (index actors ask for their GPUs on any cluster: a GPU
    index on a cluster without GPUs is refused here, not left waiting)."""
    requests = [Request("label-pass task", "", resources_of(TASK_OPTIONS), fix=more_cpus(job))]
    actor = resources_of(index_actor_options(job.index))
    if actor:
        requests.append(
            Request(
                "index actor",
                "index.shards, index.gpus_per_actor",
                actor,
                count=job.index.shards,
                beside_cpus=1,
                beside="the label tasks that query them",
                fix="lower index.shards or index.gpus_per_actor, or set index.gpus_per_actor: 0",
            )
        )
    return requests
