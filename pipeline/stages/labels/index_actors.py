"""The FAISS index of a label pass, held by Ray actors (one `IndexStore` each).

`build_index_actors` starts `index.shards` actors, streams every shard's index rows to their
owners through the object store (no vector passes through the driver), trains IVF/PQ once and
builds. `actor_neighbours` is the `NeighbourSearch` the label tasks use: the core's
`ShardedNeighbours` with a dispatch that calls the actors. `save_indexes` persists each
actor's two indexes under `rounds/<r>/index_<view>/` and describes them in `_index.json`.

Actors do not restart (their index would come back empty): a lost actor fails the pass, and a
rerun recomputes it from the embeddings; the label tables stay the resumable artifact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.neighbours import IndexStore, ShardedNeighbours
from pipeline.io.layout import RunLayout
from pipeline.io.tables import open_atomic, write_json_atomic
from pipeline.stages.labels.spec import LabelSpec

__all__ = ["IndexStoreActor", "actor_neighbours", "build_index_actors", "save_indexes"]


class IndexStoreActor(IndexStore):
    """An `IndexStore` that can also write its indexes (the Ray actor class).

    It indexes on exactly the GPUs Ray granted it (`index.gpus_per_actor`), on CPU without a
    grant even on a GPU node, and fails at once when a granted GPU is unusable by faiss.
    """

    def __init__(self, dim: int, factory: str, nprobe: int | None, seed: int) -> None:
        from pipeline.devices import granted_faiss_gpus

        gpus = granted_faiss_gpus("index actor")
        super().__init__(dim, factory, nprobe, seed, gpus=gpus)

    def save(self, folder: str, role: str, shard: int) -> dict[str, str]:
        """Write both indexes to `<folder>/<role>_<modality>_<shard:03d>.faiss`, atomically,
        one modality at a time (the extra memory is one serialized index).

        Returns:
            modality -> file name (relative to `folder`).
        """
        out = {}
        for modality in self.indexes:
            name = f"{role}_{modality}_{shard:03d}.faiss"
            blob = self.serialized(modality)
            with open_atomic(f"{folder}/{name}") as handle:
                handle.write(memoryview(blob))
            del blob
            out[modality] = name
        return out


def _ray_dispatch(calls: list[tuple[Any, str, tuple]]) -> list:
    """Call actor methods; an array argument shared by several calls is put in the object store
    once (a search sends the same queries to every actor)."""
    import ray

    refs: dict[int, Any] = {}

    def shipped(arg):
        if isinstance(arg, np.ndarray) and arg.size > 1024:
            if id(arg) not in refs:
                refs[id(arg)] = ray.put(arg)
            return refs[id(arg)]
        return arg

    return ray.get(
        [getattr(actor, method).remote(*map(shipped, args)) for actor, method, args in calls]
    )


def actor_neighbours(actors: list) -> ShardedNeighbours:
    """The label tasks' `NeighbourSearch` over the index actors."""
    return ShardedNeighbours(actors, _ray_dispatch)


def build_index_actors(spec: LabelSpec, row_refs: list, dim: int) -> tuple[list, list[int]]:
    """Start the actors, hand each its rows, train (IVF/PQ) and build.

    Args:
        spec: the pass.
        row_refs: per shard, the refs of `index_rows_task`'s parts (one per actor).
        dim: embedding dimension.

    Returns:
        (actors, rows held by each).
    """
    import ray

    n_actors = spec.index.shards
    actor_class = ray.remote(IndexStoreActor).options(
        max_restarts=0, max_task_retries=0, num_gpus=spec.index.gpus_per_actor
    )
    actors = [
        actor_class.remote(dim, spec.index.factory, spec.index.nprobe, spec.seed)
        for _ in range(n_actors)
    ]
    # Refs passed as arguments: the rows go from the object store straight to each actor.
    ray.get([actor.add.remote(*[out[i] for out in row_refs]) for i, actor in enumerate(actors)])
    if spec.index.factory.replace(" ", "") == "Flat":
        sizes = ray.get([actor.build.remote(None) for actor in actors])
    else:
        trained = actors[0].train.remote()  # a ref: the codebooks go actor -> actor
        sizes = ray.get([actor.build.remote(trained) for actor in actors])
    return actors, [int(size) for size in sizes]


def save_indexes(
    spec: LabelSpec,
    actors: list,
    role: str,
    sizes: list[int],
    shards: list[str],
    offsets: list[int],
    dim: int,
) -> str:
    """Persist the index shards and describe them in `_index.json` (written last); returns the
    folder. A later pass of the same round and view replaces `_index.json`; files of another
    role stay beside it, unlisted."""
    import ray

    folder = RunLayout(spec.output).index_dir(spec.round_index, spec.view)
    files = ray.get([actor.save.remote(folder, role, i) for i, actor in enumerate(actors)])
    description = {
        "round": spec.round_index,
        "view": spec.view,
        "embeddings_view": spec.labelling_view,  # whose vectors are indexed
        "method": spec.labels.method,
        "role": role,  # anchors (BiCro) | reliable (SPS) | all (RCR)
        "factory": spec.index.factory,
        "nprobe": spec.index.nprobe,
        "metric": "inner_product",
        "dim": dim,
        "shards": len(actors),
        "rows_per_shard": sizes,
        "files": {modality: [f[modality] for f in files] for modality in ("image", "text")},
        "format": "faiss.read_index: an IndexIDMap2 (on CPU) whose ids are global sample ids",
        "ids": (
            "global sample id = offset of the sample's embeddings table + its row in it; tables "
            "in `embedding_shards` order with `shard_offsets`; index shard s holds ids % shards "
            "== s; L2-normalised vectors, so scores are cosines"
        ),
        "embedding_shards": list(shards),
        "shard_offsets": [int(o) for o in offsets],
        "job_hash": spec.job_hash,
    }
    write_json_atomic(description, f"{folder}/_index.json")
    return folder
