"""The neighbour-search interface the label methods are written against (docs/methods.md §4).

Pure module: numpy + faiss (through `pipeline.core.search.knn`); no Ray, no I/O.

Contract:
- A label method needs two things from the corpus beyond its own shard: the k nearest rows of
  an index by modality, and stored fields of rows by global id. `NeighbourSearch` is exactly
  that (`search`, `lookup`).
- The database is split into `IndexStore`s by owner = global id % stores. Each store holds an
  image and a text `IndexShard` over the same rows plus their stored fields ("u", "v", and per
  role "keys", "captions", "groups"). `ShardedNeighbours` is the one client: it fans a search
  out to every store and merges with `merge_topk` (canonical order: score desc, id asc), and
  routes lookups to owners. It calls stores through a `dispatch` function, so the same client
  runs over stores in this process (`local_dispatch`: unit tests, notebooks) and over Ray
  actors holding them (the label stage's dispatch): two back-ends, one code path.
- Results never depend on the number of stores: merged top-k over disjoint exact shards equals
  the unsharded top-k, and every tie is broken by global id.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from pipeline.core.search.knn import IndexShard, is_gpu_index, merge_topk, train_index

__all__ = [
    "ROW_FIELDS",
    "BatchLookup",
    "IndexStore",
    "MODALITIES",
    "NeighbourSearch",
    "ShardedNeighbours",
    "build_local_neighbours",
    "image_groups",
    "image_search_distinct",
    "local_dispatch",
    "nearest",
    "neighbour_rows",
    "top1",
]

ROW_FIELDS = ("keys", "captions", "groups")  # stored per row besides the vectors u, v
MODALITIES = ("image", "text")
_COLUMN = {"image": "u", "text": "v"}  # each modality's stored vectors


class NeighbourSearch(Protocol):
    """What a label method may ask of the corpus."""

    def search(self, modality: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of (Q, D) float32 queries in the "image" or "text" index: scores (Q, k)
        float32 and ids (Q, k) int64 global ids, canonical order, -1 / -inf when missing."""
        ...

    def lookup(self, ids: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Stored `fields` ("u", "v", "keys", "captions", "groups") of (M,) ids >= 0."""
        ...


class IndexStore:
    """One owner's share of the database: rows, their fields, an image and a text index.

    Rows arrive in parts (`add`, any order); `build` sorts them by id and indexes them.
    IVF/PQ factories are trained once (`train`, on one store) and the trained empty indexes
    are shared, so every store uses the same codebooks. `gpus` are the CUDA device numbers the
    store may use (those its process was granted); none = CPU, whatever GPUs FAISS can see.
    """

    def __init__(
        self, dim: int, factory: str, nprobe: int | None, seed: int, gpus: Sequence[int] = ()
    ) -> None:
        self.dim, self.factory, self.nprobe, self.seed = dim, factory, nprobe, seed
        self.gpus = list(gpus)
        self.parts: list[dict[str, np.ndarray]] = []
        self.indexes: dict[str, IndexShard] = {}
        self.ids: np.ndarray | None = None

    def add(self, *parts: dict[str, np.ndarray]) -> int:
        """Queue parts {"ids": (n,), "u": (n, D), "v": (n, D), optional ROW_FIELDS}."""
        self.parts.extend(parts)
        return sum(len(p["ids"]) for p in parts)

    def _order(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids of the queued parts, their stable sort order)."""
        ids = (
            np.concatenate([p["ids"] for p in self.parts]) if self.parts else np.empty(0, np.int64)
        )
        return ids, np.argsort(ids, kind="stable")

    def _stacked(self, name: str, order: np.ndarray) -> np.ndarray:
        rows = [p[name] for p in self.parts]
        stacked = np.concatenate(rows)[order] if rows else np.empty((0, self.dim), np.float32)
        return np.ascontiguousarray(stacked, dtype=np.float32)

    def _gather(self) -> None:
        ids, order = self._order()
        self.ids = ids[order]
        self.u, self.v = self._stacked("u", order), self._stacked("v", order)
        for name in ROW_FIELDS:
            values = [p[name] for p in self.parts if name in p]
            setattr(self, name, np.concatenate(values)[order] if values else None)
        self.parts = []

    def train(
        self,
        sample_size: int = 131_072,
        modalities: Sequence[str] = MODALITIES,
        threads: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Train the factory on this store's rows; the serialized empty indexes by modality.
        k-means runs on the store's GPUs, else on `threads` OpenMP threads (`train_index`).

        Each modality trains on its own rows alone, so `train(modalities=("image",))` and
        `train(modalities=("text",))` in two processes give exactly what one `train()` gives
        (the label stage trains them as two tasks, in parallel when two CPUs are free).
        """
        import faiss

        # faiss wants >= 39 training points per IVF list; auto's large factories need more
        # than the default sample.
        lists = re.search(r"IVF(\d+)", self.factory)
        sample_size = max(sample_size, 40 * int(lists.group(1))) if lists else sample_size
        if self.parts:
            _, order = self._order()
            stacked = {name: self._stacked(_COLUMN[name], order) for name in modalities}
        else:
            stacked = {name: getattr(self, _COLUMN[name]) for name in modalities}
        out: dict[str, np.ndarray] = {}
        for name, rows in stacked.items():
            pick = np.random.default_rng(self.seed).permutation(rows.shape[0])[:sample_size]
            trained = train_index(
                self.factory, rows[np.sort(pick)], ngpu=len(self.gpus), threads=threads
            )
            out[name] = faiss.serialize_index(trained)
        return out

    def build(self, trained: dict[str, np.ndarray] | None = None) -> int:
        """Index the rows (with `train`'s output for IVF/PQ); returns the row count.

        On CPU the two modalities are indexed in two threads (FAISS releases the GIL, and each
        add runs on the process's own OpenMP threads, so the indexes are those of a serial
        build); GPU indexes are built one after the other.
        """
        import faiss

        if self.parts or self.ids is None:
            self._gather()
        ids = self.ids
        assert ids is not None  # set by _gather

        def index(name: str) -> IndexShard:
            base = None if trained is None else faiss.deserialize_index(trained[name])
            return IndexShard.build(
                getattr(self, _COLUMN[name]),
                ids,
                self.factory,
                trained=base,
                gpus=self.gpus,
                nprobe=self.nprobe,
                seed=self.seed,
            )

        if self.gpus:
            self.indexes = {name: index(name) for name in MODALITIES}
        else:
            with ThreadPoolExecutor(len(MODALITIES)) as pool:
                self.indexes = dict(zip(MODALITIES, pool.map(index, MODALITIES), strict=True))
        return int(ids.size)

    def search(self, modality: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.indexes[modality].search(queries, k)

    def lookup(self, ids: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        held = self.ids
        assert held is not None, "lookup before build"
        position = np.searchsorted(held, ids)
        if ids.size and (position.max() >= held.size or np.any(held[position] != ids)):
            raise KeyError("lookup of ids this index store does not hold")
        out: dict[str, np.ndarray] = {}
        for name in fields:
            values = getattr(self, name)
            if values is None:
                raise KeyError(f"this index store holds no {name!r} (not needed by its role)")
            out[name] = values[position]
        return out

    def serialized(self, modality: str) -> np.ndarray:
        """(bytes,) uint8: the modality's index as a CPU `IndexIDMap2` answering global ids.

        `IndexShard` numbers rows by position and keeps the global ids beside the index; a
        persisted index must carry them. FAISS refuses to wrap a non-empty index, so the
        wrapper is made around an empty one and pointed at the index (no vector is copied
        before serialization); the wrapper only borrows the index, which outlives it here.
        """
        import faiss

        index = self.indexes[modality].index
        if is_gpu_index(index):
            index = faiss.index_gpu_to_cpu(index)
        wrapper = faiss.IndexIDMap2(faiss.IndexFlat(index.d, index.metric_type))
        wrapper.index = index
        wrapper.ntotal = index.ntotal
        wrapper.is_trained = index.is_trained
        faiss.copy_array_to_vector(np.ascontiguousarray(self.ids, dtype=np.int64), wrapper.id_map)
        return faiss.serialize_index(wrapper)


# dispatch([(store, method name, args), ...]) -> [result, ...] in the same order
Dispatch = Callable[[list[tuple[Any, str, tuple[Any, ...]]]], list[Any]]


def local_dispatch(calls: list[tuple[Any, str, tuple[Any, ...]]]) -> list[Any]:
    """Call stores held in this process."""
    return [getattr(store, method)(*args) for store, method, args in calls]


class ShardedNeighbours:
    """`NeighbourSearch` over stores owning ids % len(stores), reached through `dispatch`."""

    def __init__(self, stores: Sequence[Any], dispatch: Dispatch = local_dispatch) -> None:
        if not stores:
            raise ValueError("ShardedNeighbours needs at least one store")
        self.stores = list(stores)
        self.dispatch = dispatch

    def search(self, modality: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        results = self.dispatch([(s, "search", (modality, queries, k)) for s in self.stores])
        return merge_topk(results, k)

    def lookup(self, ids: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:  # still ask one store: the empty answer carries dtypes and shapes
            empty: dict[str, np.ndarray] = self.dispatch(
                [(self.stores[0], "lookup", (ids, fields))]
            )[0]
            return empty
        owner = ids % len(self.stores)
        picks, calls = [], []
        for index, store in enumerate(self.stores):
            picked = np.flatnonzero(owner == index)
            if picked.size:
                picks.append(picked)
                calls.append((store, "lookup", (ids[picked], fields)))
        out: dict[str, np.ndarray] = {}
        for picked, part in zip(picks, self.dispatch(calls), strict=True):
            for name, values in part.items():
                if name not in out:
                    out[name] = np.empty((ids.size, *values.shape[1:]), dtype=values.dtype)
                out[name][picked] = values
        return out


def build_local_neighbours(
    parts: Sequence[dict[str, np.ndarray]],
    *,
    stores: int = 1,
    dim: int | None = None,
    factory: str = "Flat",
    nprobe: int | None = None,
    seed: int = 0,
) -> ShardedNeighbours:
    """In-process `NeighbourSearch` over row parts (as `IndexStore.add` takes them), split by
    owner = id % stores like the label stage's actors. IVF/PQ is trained on store 0's rows."""
    if dim is None:
        dim = next(p["u"].shape[1] for p in parts)
    owned = [IndexStore(dim, factory, nprobe, seed) for _ in range(stores)]
    for part in parts:
        owner = part["ids"] % stores
        for index, store in enumerate(owned):
            mine = np.flatnonzero(owner == index)
            store.add({name: values[mine] for name, values in part.items()})
    trained = None if factory.replace(" ", "") == "Flat" else owned[0].train()
    for store in owned:
        store.build(trained)
    return ShardedNeighbours(owned)


def image_groups(hashes: list[str | None] | None, ids: np.ndarray) -> np.ndarray:
    """(N,) int64 image group per row, for RCR's image de-duplication (docs/methods.md §6.3).

    Rows with a hex SHA-256 get its first 63 bits (>= 0), so byte-identical images share a
    group (a 2^-63 collision chance per pair of distinct images). Rows without one (tables
    written before the column existed, or a null): -(global id) - 2, unique, never -1 ("no
    entry") and never equal to a hash group, so each such row is its own image.
    """
    groups = -np.asarray(ids, dtype=np.int64) - 2
    if hashes is None:
        return groups
    present = np.array([h is not None and len(h) >= 16 for h in hashes], dtype=bool)
    if present.any():
        prefix = b"".join(bytes.fromhex(h[:16]) for h in hashes if h is not None and len(h) >= 16)
        bits = np.frombuffer(prefix, dtype=">u8").astype(np.uint64) >> np.uint64(1)
        groups[present] = bits.astype(np.int64)
    return groups


def nearest(
    neighbours: NeighbourSearch, modality: str, queries: np.ndarray, k: int, batch: int
) -> np.ndarray:
    """(Q, k) int64 ids of each query's k nearest rows, canonical order (-1: fewer rows than
    k), searched in batches of `batch` queries."""
    out = np.full((queries.shape[0], k), -1, dtype=np.int64)
    for start in range(0, queries.shape[0], batch):
        _, ids = neighbours.search(modality, queries[start : start + batch], k)
        out[start : start + batch, : ids.shape[1]] = ids[:, :k]
    return out


def top1(neighbours: NeighbourSearch, modality: str, queries: np.ndarray, batch: int) -> np.ndarray:
    """(Q,) int64 id of each query's nearest row (-1: empty index), searched in batches."""
    return nearest(neighbours, modality, queries, 1, batch)[:, 0]


def neighbour_rows(
    neighbours: NeighbourSearch, nn: np.ndarray, fields: tuple[str, ...], dim: int
) -> dict[str, np.ndarray]:
    """Stored rows of the neighbours `nn` (-1: none -> zero vectors, None keys/captions)."""
    found = nn >= 0
    out = {
        name: np.zeros((nn.size, dim), np.float32)
        if name in ("u", "v")
        else np.full(nn.size, None, dtype=object)
        for name in fields
    }
    if found.any():
        for name, values in neighbours.lookup(nn[found], fields).items():
            out[name][found] = values
    return out


class BatchLookup:
    """ids -> rows of one prefetched block (sorted unique ids), for re-scoring in the core.

    Ids outside the block (the core asks for id 0 in place of a missing -1, then discards the
    answer) get some row of the block, or zeros when the block is empty.
    """

    def __init__(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.ids, self.rows = ids, rows

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        if self.ids.size == 0:
            return np.zeros((np.size(ids), *self.rows.shape[1:]), dtype=self.rows.dtype)
        return self.rows[np.minimum(np.searchsorted(self.ids, ids), self.ids.size - 1)]


def _distinct_per_row(groups: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """(Q,) number of distinct groups among the valid entries of each row of (Q, M)."""
    order = np.lexsort((groups, ~valid), axis=1)  # valid entries first, grouped
    g = np.take_along_axis(groups, order, axis=1)
    ok = np.take_along_axis(valid, order, axis=1)
    new = ok.copy()
    new[:, 1:] &= g[:, 1:] != g[:, :-1]
    counts: np.ndarray = new.sum(axis=1)
    return counts


def _groups_of(neighbours: NeighbourSearch, ids: np.ndarray) -> np.ndarray:
    """(Q, M) image groups of the ids (Q, M) (-1 ids -> -1)."""
    valid = ids >= 0
    unique = np.unique(ids[valid])
    groups = BatchLookup(unique, neighbours.lookup(unique, ("groups",))["groups"])
    return np.where(valid, groups(np.maximum(ids, 0)), -1)


def image_search_distinct(
    neighbours: NeighbourSearch, queries: np.ndarray, want: int, max_depth: int
) -> np.ndarray:
    """Image-index ids (Q, M) deep enough to hold `want` distinct image groups per row.

    Duplicated images occupy several rows of the index, so the top-`want` rows may hold fewer
    than `want` distinct images. Rows that come back full yet short of groups are searched
    again, twice as deep each time, up to `max_depth`; a row with a missing (-1) entry has
    exhausted the index (or its IVF probes). Past `max_depth` (one image repeated hundreds of
    times, e.g. a placeholder picture) the row keeps fewer groups and its NDCG a smaller K_eff.
    """
    _, ids = neighbours.search("image", queries, want)
    pending = np.arange(queries.shape[0])
    while pending.size:
        sub = ids[pending]
        valid = sub >= 0
        short = valid.all(axis=1) & (_distinct_per_row(_groups_of(neighbours, sub), valid) < want)
        pending = pending[short]
        if not pending.size or ids.shape[1] >= max_depth:
            break
        depth = min(2 * ids.shape[1], max_depth)
        _, deeper = neighbours.search("image", queries[pending], depth)
        ids = np.pad(ids, ((0, 0), (0, depth - ids.shape[1])), constant_values=-1)
        ids[pending] = deeper
    return ids
