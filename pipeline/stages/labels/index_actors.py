"""The FAISS index of a label pass, held by Ray actors (one `IndexStore` each).

`build_index_actors` starts `index.shards` actors, streams every shard's index rows to their
owners through the object store (no vector passes through the driver), trains IVF/PQ once and
builds. `actor_neighbours` is the `NeighbourSearch` the label tasks use: the core's
`ShardedNeighbours` with a dispatch that calls the actors. `save_indexes` persists each
actor's two indexes under `rounds/<r>/index_<view>/` and describes them in `_index.json`.

Actors restart when they die (their node was lost, the process killed): `IndexStoreActor.load`
adds the rows, builds and then writes the store's rows to a restore table
(`index_<view>/_restore/<pass id>/store_<i>.parquet`); a restarted actor's constructor finds
that table and rebuilds the same index from it (exact FAISS, or IVF/PQ with the same trained
codebooks), and Ray retries the search or lookup that was in flight (both read-only). An actor
lost during `load` itself restarts empty and Ray retries `load` (its row parts are outputs of
retryable tasks, recomputed by lineage when their node is gone). Restore tables are deleted at
the end of the pass. Why not Ray's constructor arguments: an actor created with arguments in
the object store cannot restart once they are lost (ray-project/ray#53727).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.search.neighbours import MODALITIES, ROW_FIELDS, IndexStore, ShardedNeighbours
from pipeline.io.layout import INDEX_DESCRIPTION, RunLayout
from pipeline.io.tables import (
    file_exists,
    open_atomic,
    read_table,
    remove_path,
    write_json_atomic,
)
from pipeline.stages.labels.resources import codebook_task_options, index_actor_options
from pipeline.stages.labels.spec import LabelSpec

__all__ = [
    "IndexStoreActor",
    "actor_neighbours",
    "build_index_actors",
    "remove_restore_tables",
    "report_restarts",
    "save_indexes",
    "train_options",
    "train_task",
]

logger = logging.getLogger(__name__)


def _store_table(store: IndexStore) -> pa.Table:
    """The store's rows (ids, u, v, stored fields), exactly."""
    dim = store.dim
    columns = {
        "ids": pa.array(store.ids, pa.int64()),
        "u": pa.FixedSizeListArray.from_arrays(pa.array(store.u.reshape(-1)), dim),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(store.v.reshape(-1)), dim),
    }
    for name in ROW_FIELDS:
        values = getattr(store, name)
        if values is not None:
            kind = pa.string() if values.dtype == object else None
            columns[name] = pa.array(values.tolist() if kind else values, kind)
    return pa.table(columns)


def _restore_store(store: IndexStore, table: pa.Table) -> None:
    """Give `store` the rows of a `_store_table`."""
    dim = store.dim
    store.parts = []
    store.ids = table["ids"].to_numpy()
    for name in ("u", "v"):
        flat = table[name].combine_chunks().flatten().to_numpy()
        setattr(store, name, np.ascontiguousarray(flat.reshape(-1, dim), dtype=np.float32))
    for name in ROW_FIELDS:
        column = table[name] if name in table.column_names else None
        setattr(store, name, None if column is None else column.to_numpy(zero_copy_only=False))


def _codebook_path(restore: str, modality: str) -> str:
    """The trained empty IVF/PQ index beside a restore table (too big for Parquet metadata:
    IVF65536 at D=512 is 128 MB)."""
    return f"{restore.removesuffix('.parquet')}_trained_{modality}.faiss"


class IndexStoreActor(IndexStore):
    """An `IndexStore` that rebuilds itself from its restore table when Ray restarts it, and
    can write its indexes (the Ray actor class).

    It indexes on exactly the GPUs Ray granted it (`index.gpus_per_actor`), on CPU without a
    grant even on a GPU node, and fails at once when a granted GPU is unusable by faiss.
    """

    def __init__(self, dim: int, factory: str, nprobe: int | None, seed: int, restore: str) -> None:
        from pipeline.runtime.devices import granted_faiss_gpus

        super().__init__(dim, factory, nprobe, seed, gpus=granted_faiss_gpus("index actor"))
        self.restore = restore
        self.rebuilt = ""  # what a restart did, for the driver to say (`report_restarts`)
        if file_exists(restore):  # a restart: the same rows, the same codebooks, same index
            _restore_store(self, read_table(restore))
            trained = {}
            for modality in ("image", "text"):
                path = _codebook_path(restore, modality)
                if file_exists(path):
                    with fsspec.open(path, "rb") as handle:
                        trained[modality] = np.frombuffer(handle.read(), dtype=np.uint8)
            super().build(trained or None)
            self.rebuilt = f"index actor restarted, rebuilt {self.rows()} rows from {restore}"
            logger.warning(f"labels: {self.rebuilt}")

    def restarts(self) -> str:
        """What Ray's restart of this actor did ("" when it was never restarted)."""
        return self.rebuilt

    def rows(self) -> int:
        return 0 if self.ids is None else int(self.ids.size)

    def load(self, trained_image: dict | None, trained_text: dict | None, *parts: dict) -> int:
        """Add the rows, build (IVF/PQ: with `train_task`'s codebooks of each modality), then
        write the restore table; returns the row count."""
        if self.ids is not None and not self.parts and self.indexes:
            return int(self.ids.size)  # restored from the table: this call is Ray's retry
        self.parts = []
        self.add(*parts)
        trained = (
            None
            if trained_image is None or trained_text is None
            else {**trained_image, **trained_text}
        )
        rows = self.build(trained)
        for modality, blob in (trained or {}).items():
            with open_atomic(_codebook_path(self.restore, modality)) as handle:
                handle.write(memoryview(blob))
        with open_atomic(self.restore) as handle:  # last: it marks the store restorable
            pq.write_table(_store_table(self), handle)
        return rows

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
                handle.write(memoryview(blob))  # type: ignore[arg-type]
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


def report_restarts(actors: list) -> None:
    """Say on the driver's console which index actors Ray restarted (their own log lines stay
    in Ray's worker logs, which the console does not forward)."""
    import ray

    for note in ray.get([actor.restarts.remote() for actor in actors]):
        if note:
            logger.warning(f"labels: {note}")


def actor_neighbours(actors: list) -> ShardedNeighbours:
    """The label tasks' `NeighbourSearch` over the index actors."""
    return ShardedNeighbours(actors, _ray_dispatch)


def train_task(
    dim: int, factory: str, nprobe: int | None, seed: int, modality: str, *parts: dict
) -> dict:
    """One modality's IVF/PQ codebooks, trained on one store's rows (a plain task: lineage
    can redo it). k-means runs on the GPUs Ray granted the task (`train_options`: those of an
    index actor), else on as many OpenMP threads as CPUs it was granted: one by default, and
    the modalities train as two tasks, so two CPUs of a node work on it at once."""
    from pipeline.runtime.devices import granted_cpu_count, granted_faiss_gpus

    gpus = granted_faiss_gpus("codebook training task")
    store = IndexStore(dim, factory, nprobe, seed, gpus=gpus)
    store.add(*parts)
    return store.train(modalities=(modality,), threads=granted_cpu_count())


def train_options(spec: LabelSpec) -> dict:
    """Ray options of `train_task` (declared in `pipeline.stages.labels.resources`)."""
    return codebook_task_options(spec.index)


def _restore_dir(spec: LabelSpec) -> str:
    return f"{RunLayout(spec.output).index_dir(spec.round_index, spec.view)}/_restore"


def remove_restore_tables(spec: LabelSpec) -> None:
    """Delete the pass's restore tables (the actors are gone; the labels are written)."""
    remove_path(_restore_dir(spec))


def build_index_actors(spec: LabelSpec, row_refs: list, dim: int) -> tuple[list, list[int]]:
    """Train (IVF/PQ) once, start the actors and have each load its rows.

    Args:
        spec: the pass.
        row_refs: per shard, the refs of `index_rows_task`'s parts (one per actor).
        dim: embedding dimension.

    Returns:
        (actors, rows held by each).
    """
    import ray

    n_actors = spec.index.shards
    index = (dim, spec.index.factory, spec.index.nprobe, spec.seed)
    parts = [[out[i] for out in row_refs] for i in range(n_actors)]
    trained = [None] * len(MODALITIES)
    if spec.index.factory.replace(" ", "") != "Flat":
        # Refs: the codebooks go task -> actors without passing through the driver.
        task = ray.remote(train_task).options(**train_options(spec))
        trained = [task.remote(*index, modality, *parts[0]) for modality in MODALITIES]
    actor_class = ray.remote(IndexStoreActor).options(**index_actor_options(spec.index))
    restore = f"{_restore_dir(spec)}/{uuid.uuid4().hex[:12]}"  # this pass's tables only
    actors = [
        actor_class.remote(*index, f"{restore}/store_{i:03d}.parquet") for i in range(n_actors)
    ]
    # Refs passed as arguments: the rows go from the object store straight to each actor.
    sizes = ray.get([actor.load.remote(*trained, *parts[i]) for i, actor in enumerate(actors)])
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
    if spec.embedding_means is not None:
        # Centred vectors (labels.bicro.centre): centre a query the same way before searching.
        mean_u, mean_v = spec.embedding_means
        description["centred_on"] = {"image": mean_u.tolist(), "text": mean_v.tolist()}
    write_json_atomic(description, f"{folder}/{INDEX_DESCRIPTION}")
    return folder
