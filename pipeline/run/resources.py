"""What a job asks of Ray, collected from the stages it runs, for the preflight
(`pipeline.runtime.preflight.check_cluster`; docs/architecture.md §4.7).

Each stage module declares its Ray options once and derives `ray_requests(job, cluster_gpus)`
from them; this module only maps the stage kinds of `stage_graph(job)` to those declarations,
so a stage the job does not run (training with `train.warmup_epochs: 0` and `train.rounds: 0`)
asks for nothing, and a new kind without an entry fails `job_requests` at once.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.config import JobConfig
from pipeline.run.graph import stage_graph
from pipeline.runtime.preflight import Request
from pipeline.stages import embed, keys, publish
from pipeline.stages.baselines import cosine_filter
from pipeline.stages.labels import resources as labels
from pipeline.stages.train import driver as train

__all__ = ["STAGE_REQUESTS", "job_requests"]

RequestsOf = Callable[[JobConfig, float], list[Request]]

# Stage kind (run.graph) -> the declarations of what it asks of Ray; the oracle's labels are
# written by the driver, without Ray.
STAGE_REQUESTS: dict[str, tuple[RequestsOf, ...]] = {
    "embed": (embed.ray_requests,),
    "keys": (keys.ray_requests,),
    "warmup": (train.ray_requests,),
    "labels": (labels.ray_requests,),
    "oracle": (),
    "filter": (cosine_filter.ray_requests,),
    "train": (train.ray_requests,),
    "publish": (publish.ray_requests,),
}


def job_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """Every request of the stages `job` runs, on a cluster with `cluster_gpus` GPUs in all
    (each stage's once, however many rounds run it)."""
    kinds = dict.fromkeys(stage.kind for stage in stage_graph(job))
    missing = sorted(kind for kind in kinds if kind not in STAGE_REQUESTS)
    if missing:
        raise KeyError(f"stage kind(s) {missing} declare no Ray requests in STAGE_REQUESTS")
    declared = dict.fromkeys(fn for kind in kinds for fn in STAGE_REQUESTS[kind])
    return [request for requests_of in declared for request in requests_of(job, cluster_gpus)]
