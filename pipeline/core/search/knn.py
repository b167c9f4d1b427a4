"""Inner-product k-nearest-neighbour search over L2-normalised embeddings: FAISS, sharded.

Pure module: numpy, faiss and torch only; no Ray, no I/O, no config objects.

Contract:
- Scores are inner products (cosine for L2-normalised vectors); larger is nearer.
- Every top-k list this module returns is in **canonical order**: score descending, then id
  ascending; missing entries (fewer than k candidates, or an IVF probe that found too few) are
  id -1 with score -inf and sit at the end.
- "Exact" scores are recomputed from stored float32 embeddings in float64 and rounded once to
  float32 (`exact_scores`), per pair and independent of batching, so the same pair always gets
  the same bits. An approximate index only proposes candidates; its scores never leave here
  once a shard holds its vectors (docs/methods.md §4.2).
- `IndexShard.search` over an exact (`Flat`) index returns the shard's exact canonical top-k,
  ties included: it widens its FAISS query until no unseen vector can reach the k-th exact score.
  Hence `merge_topk` over disjoint shards equals the unsharded top-k bit for bit
  (docs/architecture.md §4.5).
- The GPU is a runtime argument, not a code path (faiss contrib style): `ngpu=-1` uses every GPU
  `faiss.get_num_gpus()` reports, `ngpu=0` forces CPU; the same calls run either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from pipeline.core.search.faiss_gpu import GPU_MAX_K

__all__ = [
    "EmbeddingLookup",
    "IndexShard",
    "ShardedIndex",
    "build_index",
    "canonical_topk",
    "candidates_per_neighbour",
    "exact_scores",
    "is_gpu_index",
    "merge_topk",
    "rescore",
    "resolve_ngpu",
    "set_nprobe",
    "train_index",
]

# ids (M,) int64 -> (M, D) float32 embeddings; lets a caller keep the database out of memory.
EmbeddingLookup = Callable[[np.ndarray], np.ndarray]
FaissIndex = Any  # a faiss.Index: faiss ships no type information

# Rows x candidates x dim of float64 scratch per chunk in `exact_scores` (~32 MB).
_EXACT_CHUNK_ELEMENTS = 4_000_000
# Default number of training vectors sampled for IVF/PQ (faiss wants >= 39 per centroid).
_DEFAULT_TRAIN_SAMPLE = 131_072


def _require_faiss() -> ModuleType:
    """The faiss module, imported on first use: processes that only read the configuration
    (the driver, training workers) never load it, nor its loader's log lines."""
    try:  # faiss is an optional extra: `pip install ncl-pipeline[cpu]` (or `[gpu]`).
        import faiss
    except ImportError as err:  # pragma: no cover - exercised only on installs without the extra
        raise ImportError(
            "faiss is not installed: install the `cpu` extra (pip install 'ncl-pipeline[cpu]') "
            "or the `gpu` extra on CUDA machines."
        ) from err
    return faiss


def _as_matrix(x: ArrayLike, name: str) -> np.ndarray:
    """(N, D) C-contiguous float32 view or copy of `x`, validated."""
    array = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if array.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (N, D) array, got shape {array.shape}")
    return array


def resolve_ngpu(ngpu: int = -1) -> int:
    """Number of GPUs to use: -1 -> all that FAISS sees (0 on faiss-cpu), else `ngpu`.

    Raises:
        ImportError: `ngpu > 0` was asked for but this FAISS build has no GPU support.
    """
    lib = _require_faiss()
    available = lib.get_num_gpus() if hasattr(lib, "get_num_gpus") else 0
    if ngpu < 0:
        return available
    if ngpu > available:
        raise ImportError(
            f"ngpu={ngpu} asked for but FAISS sees {available} GPU(s): install the `gpu` extra "
            "(faiss-gpu) on a CUDA machine, or pass ngpu=0/-1."
        )
    return ngpu


def candidates_per_neighbour(factory: str) -> int:
    """Candidates an `IndexShard` over `factory` fetches per wanted neighbour and rescores
    exactly: 4 for product-quantized codes (PQ), whose scores err by more than the gaps
    between close neighbours; 2 otherwise (Flat, IVF<n>,Flat, 8-bit scalar codes SQ8, which
    found the exact top-10 as often as full vectors in `tests/test_knn.py`)."""
    coded = any(part.startswith("PQ") for part in factory.replace(" ", "").split(","))
    return 4 if coded else 2


def _needs_training(factory: str, dim: int) -> bool:
    lib = _require_faiss()
    return not lib.index_factory(dim, factory, lib.METRIC_INNER_PRODUCT).is_trained


def train_index(
    factory: str,
    sample: np.ndarray,
    *,
    ngpu: int = -1,
    niter: int | None = None,
    threads: int | None = None,
) -> FaissIndex:
    """An empty, trained CPU index for `factory` (IVF/PQ codebooks learned on `sample`).

    Train once and `faiss.clone_index` the result into every shard, so all shards share one
    coarse quantizer and one PQ codebook (their scores are then comparable when merged).
    Returns a trained `faiss.Index` with METRIC_INNER_PRODUCT and no vectors.

    Args:
        factory: FAISS index_factory string, e.g. "Flat", "IVF1024,PQ64", "IVF4096,Flat".
        sample: (S, D) float32 L2-normalised training vectors.
        ngpu: GPUs for the k-means assignment step (-1 all, 0 CPU); the index stays on CPU.
        niter: k-means iterations for the coarse quantizer and the PQ codebooks (FAISS
            default when None); the main knob on training time.
        threads: OpenMP threads while training (None: the process's own). Centroids differ
            bitwise with it (and on a GPU); neighbours within `tests/test_knn.py`'s tolerance.
    """
    lib = _require_faiss()
    sample = _as_matrix(sample, "sample")
    index = lib.index_factory(sample.shape[1], factory, lib.METRIC_INNER_PRODUCT)
    if index.is_trained:
        return index
    ngpu = resolve_ngpu(ngpu)
    ivf = lib.try_extract_index_ivf(index)
    if ivf is not None:
        concrete = lib.downcast_index(ivf)
        # Polysemous training (on by default for IVF..,PQ..) only serves Hamming pre-filtering,
        # which we never enable, and it is most of an IVF..,PQ.. training (docs/development.md).
        if hasattr(concrete, "do_polysemous_training"):
            concrete.do_polysemous_training = False
        if niter is not None:
            ivf.cp.niter = niter
            if getattr(concrete, "pq", None) is not None:
                concrete.pq.cp.niter = niter
    previous = lib.omp_get_max_threads()
    lib.omp_set_num_threads(threads or previous)
    clustering = None
    if ngpu > 0 and ivf is not None:
        # The k-means assignment dominates training; faiss's own benchmarks put it on the GPU
        # through `clustering_index` (inner product, as the quantizer it trains).
        clustering = lib.index_cpu_to_all_gpus(lib.IndexFlatIP(sample.shape[1]), ngpu=ngpu)
        ivf.clustering_index = clustering
    index.train(sample)
    lib.omp_set_num_threads(previous)
    if ivf is not None:
        ivf.clustering_index = None
    if clustering is not None:
        # The IVF only borrowed it: free its GPU memory and resources now, not at exit.
        clustering.reset()
        del clustering
    return index


def set_nprobe(index: FaissIndex, nprobe: int) -> None:
    """Set the number of IVF lists probed per query on a CPU or GPU index (no-op for Flat)."""
    lib = _require_faiss()
    if lib.try_extract_index_ivf(index) is None and not is_gpu_index(index):
        return
    # GpuParameterSpace also knows the GPU index classes; ParameterSpace recurses through
    # IndexIDMap, IndexShards and IndexReplicas wrappers.
    space = lib.GpuParameterSpace() if is_gpu_index(index) else lib.ParameterSpace()
    space.set_index_parameter(index, "nprobe", float(nprobe))


def is_gpu_index(index: FaissIndex) -> bool:
    lib = _require_faiss()
    if not hasattr(lib, "GpuIndex"):
        return False
    inner = lib.downcast_index(index)
    while True:
        if isinstance(inner, lib.GpuIndex):
            return True
        child = getattr(inner, "index", None)
        if child is None:
            # IndexReplicas/IndexShards hold their children in `at(i)`.
            return hasattr(inner, "count") and inner.count() > 0 and is_gpu_index(inner.at(0))
        inner = lib.downcast_index(child)


def build_index(
    vectors: np.ndarray,
    ids: np.ndarray | None = None,
    factory: str = "Flat",
    *,
    train_sample: int | np.ndarray | None = None,
    trained: FaissIndex | None = None,
    ngpu: int = -1,
    gpus: Sequence[int] | None = None,
    nprobe: int | None = None,
    seed: int = 0,
) -> FaissIndex:
    """Build an inner-product FAISS index over `vectors`, keeping `ids`.

    Args:
        vectors: (N, D) float32, L2-normalised database embeddings.
        ids: (N,) int64 ids returned by searches. None -> row positions 0..N-1 (no id map).
            Flat indexes get an IndexIDMap2 (which can also `reconstruct` by id); IVF indexes
            store ids natively (`add_with_ids`).
        factory: FAISS index_factory string: "Flat" (exact), "IVF1024,PQ64", "IVF4096,Flat", ...
        train_sample: rows to train IVF/PQ on: an int (that many rows drawn without replacement
            with `seed`; default min(N, 131072)) or an (S, D) array. Ignored for Flat.
        trained: an already trained empty index (from `train_index`) to clone instead of
            training; shards of one database should share one.
        ngpu: -1 -> all GPUs FAISS sees (CPU on faiss-cpu), 0 -> CPU, n -> the first n.
        gpus: explicit GPU device ids (overrides `ngpu`); e.g. `[shard % n_gpus]`.
        nprobe: IVF lists probed per query (FAISS default 1 when None).
        seed: seed of the training-sample draw.

    Returns:
        A `faiss.Index` (on GPU when any is used; replicated across several GPUs) holding N
        vectors, metric METRIC_INNER_PRODUCT.
    """
    lib = _require_faiss()
    vectors = _as_matrix(vectors, "vectors")
    n, dim = vectors.shape
    if ids is not None:
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
        if ids.shape != (n,):
            raise ValueError(f"ids must have shape ({n},), got {ids.shape}")
    use_gpus = list(gpus) if gpus is not None else list(range(resolve_ngpu(ngpu)))

    if trained is not None:
        index = lib.clone_index(trained)
    elif _needs_training(factory, dim):
        if isinstance(train_sample, np.ndarray):
            sample = train_sample
        else:
            size = min(n, train_sample or _DEFAULT_TRAIN_SAMPLE)
            rows = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
            sample = vectors[rows]
        index = train_index(factory, sample, ngpu=len(use_gpus))
    else:
        index = lib.index_factory(dim, factory, lib.METRIC_INNER_PRODUCT)
    if index.d != dim:
        raise ValueError(f"trained index has dimension {index.d}, vectors have {dim}")

    if ids is not None and lib.try_extract_index_ivf(index) is None:
        index = lib.IndexIDMap2(index)
    if use_gpus:
        # The empty (trained) index goes to the GPU first and the vectors are added there: a
        # CPU IVF add runs on the caller's OpenMP threads (one in a Ray actor without CPUs),
        # the GPU's is parallel. The cloner handles IDMap2 (inner index to the GPU); one clone
        # per listed device (IndexReplicas when several).
        options = lib.GpuMultipleClonerOptions()
        # float16 lookup tables let GPU IVFPQ hold many sub-quantizers (PQ64) in shared memory;
        # its scores are rescored anyway. Never for Flat/IVFFlat, where the same option would
        # store the vectors in float16 and break exactness.
        options.useFloat16 = (
            "PQ" in factory.upper() and lib.try_extract_index_ivf(index) is not None
        )
        index = lib.index_cpu_to_gpus_list(index, co=options, gpus=use_gpus)
    if ids is None:
        index.add(vectors)
    else:
        index.add_with_ids(vectors, ids)
    if nprobe is not None:
        set_nprobe(index, nprobe)
    return index


def _gather(database: np.ndarray | EmbeddingLookup, ids: np.ndarray) -> np.ndarray:
    """(M, D) float32 embeddings of `ids` (M,) int64, all valid (>= 0)."""
    if callable(database):
        rows = np.asarray(database(ids), dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] != ids.shape[0]:
            shape = f"shape {rows.shape} for {ids.shape[0]} ids"
            raise ValueError(f"lookup returned {shape}; it must return one (D,) row per id")
        return rows
    return np.asarray(database[ids], dtype=np.float32)


def exact_scores(
    queries: np.ndarray,
    database: np.ndarray | EmbeddingLookup,
    ids: np.ndarray,
    *,
    dtype: DTypeLike = np.float32,
) -> np.ndarray:
    """Exact inner products of each query with its candidates, -inf for missing ids.

    Each score is a float64 sum of exact float32 products over the last axis (numpy's fixed
    pairwise summation), rounded once to `dtype`: it depends only on the two vectors, never on
    the batch, so equal inputs give equal bits (the basis of exact tie-breaking).

    Args:
        queries: (Q, D) float32 or float64 query embeddings.
        database: (N, D) embeddings indexed by id, or a lookup `ids (M,) int64 -> (M, D)`.
        ids: (Q, k) int64 candidate ids; -1 marks a missing candidate.
        dtype: output dtype (float32 by default; float64 keeps full precision).

    Returns:
        (Q, k) scores of `dtype`; -inf where `ids < 0`.
    """
    queries = np.asarray(queries)
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[0] != queries.shape[0]:
        raise ValueError(f"ids must be (Q, k) with Q={queries.shape[0]}, got {ids.shape}")
    out = np.full(ids.shape, -np.inf, dtype=dtype)
    valid = ids >= 0
    if not valid.any():
        return out
    if callable(database):
        # One lookup per distinct id, so a remote/sharded store is asked once per row.
        unique, inverse = np.unique(ids[valid], return_inverse=True)
        table = _gather(database, unique)
        positions = np.zeros(ids.shape, dtype=np.int64)
        positions[valid] = inverse
    else:
        table = database
        positions = np.where(valid, ids, 0)
    dim = queries.shape[1]
    chunk = max(1, _EXACT_CHUNK_ELEMENTS // max(1, ids.shape[1] * dim))
    for start in range(0, ids.shape[0], chunk):
        stop = start + chunk
        cand = np.asarray(table[positions[start:stop]], dtype=np.float64)  # (q, k, D)
        query = np.asarray(queries[start:stop], dtype=np.float64)[:, None, :]  # (q, 1, D)
        scores = (cand * query).sum(axis=-1)  # (q, k), products of float32 are exact in f64
        out[start:stop] = np.where(valid[start:stop], scores, -np.inf).astype(dtype)
    return out


def canonical_topk(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row by (score desc, id asc), missing (-1) last, and keep k columns.

    Args:
        scores: (Q, M) float scores.
        ids: (Q, M) int64 ids, -1 for missing.
        k: columns to keep; rows shorter than k are padded with (-inf, -1).

    Returns:
        scores (Q, k) float32 with -inf for missing, ids (Q, k) int64.
    """
    scores = np.asarray(scores, dtype=np.float32)
    ids = np.asarray(ids, dtype=np.int64)
    missing = ids < 0
    scores = np.where(missing, np.float32(-np.inf), scores)
    # lexsort: the last key is primary. Missing rows last, then score desc, then id asc.
    order = np.lexsort((ids, -scores, missing), axis=-1)[:, :k]
    top_scores = np.take_along_axis(scores, order, axis=1)
    top_ids = np.where(
        np.take_along_axis(missing, order, axis=1), -1, np.take_along_axis(ids, order, axis=1)
    )
    if top_ids.shape[1] < k:
        pad = k - top_ids.shape[1]
        top_scores = np.pad(top_scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        top_ids = np.pad(top_ids, ((0, 0), (0, pad)), constant_values=-1)
    return top_scores.astype(np.float32), top_ids.astype(np.int64)


def merge_topk(
    results: Sequence[tuple[np.ndarray, np.ndarray]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-shard top-k lists of the same queries into one canonical top-k.

    Shards must hold disjoint ids. When each shard's list is its exact canonical top-k (see
    `IndexShard.search`), the merge is the exact canonical top-k of the union.

    Args:
        results: per shard, (scores (Q, k_s) float32, ids (Q, k_s) int64) with -1 for missing.
        k: neighbours to keep.

    Returns:
        scores (Q, k) float32 (-inf for missing), ids (Q, k) int64 (-1 for missing).
    """
    if not results:
        raise ValueError("merge_topk needs at least one shard result")
    scores = np.concatenate([np.asarray(s, dtype=np.float32) for s, _ in results], axis=1)
    ids = np.concatenate([np.asarray(i, dtype=np.int64) for _, i in results], axis=1)
    return canonical_topk(scores, ids, k)


def rescore(
    queries: np.ndarray,
    database: np.ndarray | EmbeddingLookup,
    ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Replace approximate scores by exact ones and re-sort (docs/methods.md §4.2).

    Args:
        queries: (Q, D) float32 query embeddings.
        database: (N, D) float32 stored embeddings indexed by id, or a lookup function
            `ids (M,) int64 -> (M, D) float32`.
        ids: (Q, k) int64 candidate ids from any index; -1 (FAISS's "not found") allowed.

    Returns:
        scores (Q, k) float32 exact, -inf for missing; ids (Q, k) int64; canonical order.
    """
    ids = np.asarray(ids, dtype=np.int64)
    return canonical_topk(exact_scores(queries, database, ids), ids, ids.shape[1])


class IndexShard:
    """One shard of a database: a FAISS index over its rows plus their global ids.

    The FAISS index numbers rows 0..n-1 (positions); `ids[pos]` maps them to global ids, so no
    id map is needed and exact rescoring reads `vectors[pos]` directly. A Ray actor can hold one
    `IndexShard` and expose `search`.

    Attributes:
        index: the FAISS index (positions as ids).
        ids: (n,) int64 global ids of the shard's rows.
        vectors: (n, D) float32 stored embeddings, or None (then scores are FAISS's own and
            exact tie-breaking is not guaranteed).
        exact: True when `index` is exhaustive (Flat): search then widens until ties resolve
            (on GPU it stops at FAISS's 2048-neighbour limit, so a tie group wider than that
            may be cut arbitrarily).
        k_factor: candidates fetched per wanted neighbour before exact rescoring (>= 1).
        tol: bound on |FAISS score - exact score| for the exact index (float32 rounding).
    """

    def __init__(
        self,
        index: FaissIndex,
        ids: np.ndarray,
        vectors: np.ndarray | None = None,
        *,
        exact: bool = False,
        k_factor: int = 2,
        tol: float | None = None,
    ) -> None:
        self.index = index
        self.ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
        if self.ids.shape != (index.ntotal,):
            raise ValueError(f"ids must have shape ({index.ntotal},), got {self.ids.shape}")
        self.vectors = None if vectors is None else _as_matrix(vectors, "vectors")
        if self.vectors is not None and self.vectors.shape[0] != index.ntotal:
            raise ValueError("vectors and index disagree on the number of rows")
        if k_factor < 1:
            raise ValueError(f"k_factor must be >= 1, got {k_factor}")
        self.exact = exact
        self.k_factor = k_factor
        # float32 dot products of unit vectors err by at most ~d * 2^-24; keep a 2x margin.
        self.tol = tol if tol is not None else max(1e-5, 2.0 * index.d * 2.0**-24)
        self._max_k = GPU_MAX_K if is_gpu_index(index) else None

    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        ids: np.ndarray | None = None,
        factory: str = "Flat",
        *,
        keep_vectors: bool = True,
        trained: FaissIndex | None = None,
        train_sample: int | np.ndarray | None = None,
        ngpu: int = -1,
        gpus: Sequence[int] | None = None,
        nprobe: int | None = None,
        k_factor: int | None = None,
        seed: int = 0,
    ) -> IndexShard:
        """Index `vectors` (N, D) float32 L2-normalised with global `ids` (N,) int64.

        `keep_vectors` keeps a reference (no copy for a contiguous slice) for exact rescoring;
        `k_factor` None: `candidates_per_neighbour(factory)`; the other arguments are those of
        `build_index`.
        """
        vectors = _as_matrix(vectors, "vectors")
        if ids is None:
            ids = np.arange(vectors.shape[0], dtype=np.int64)
        index = build_index(
            vectors,
            None,
            factory,
            train_sample=train_sample,
            trained=trained,
            ngpu=ngpu,
            gpus=gpus,
            nprobe=nprobe,
            seed=seed,
        )
        return cls(
            index,
            ids,
            vectors if keep_vectors else None,
            exact=factory.replace(" ", "") == "Flat",
            k_factor=candidates_per_neighbour(factory) if k_factor is None else k_factor,
        )

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def _faiss_search(self, queries: np.ndarray, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        scores, positions = self.index.search(queries, fetch)
        return scores, positions.astype(np.int64, copy=False)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of each query in this shard, canonical order.

        Args:
            queries: (Q, D) float32 L2-normalised queries.
            k: neighbours wanted.

        Returns:
            scores (Q, k) float32 (exact when `vectors` is kept; -inf for missing), ids (Q, k)
            int64 global ids (-1 for missing).
        """
        queries = _as_matrix(queries, "queries")
        n_queries, n = queries.shape[0], self.ntotal
        k_eff = min(k, n)
        if k_eff <= 0 or n_queries == 0:
            return canonical_topk(
                np.empty((n_queries, 0), np.float32), np.empty((n_queries, 0), np.int64), k
            )
        if self.vectors is None:
            scores, positions = self._faiss_search(queries, k_eff)
            return canonical_topk(scores, self._to_ids(positions), k)

        out_scores = np.empty((n_queries, k_eff), dtype=np.float32)
        out_ids = np.empty((n_queries, k_eff), dtype=np.int64)
        pending = np.arange(n_queries)
        fetch = min(n, k_eff * self.k_factor)
        if self._max_k is not None:
            fetch = min(fetch, self._max_k)
        while pending.size:
            approx, positions = self._faiss_search(queries[pending], fetch)
            exact = exact_scores(queries[pending], self.vectors, positions)
            top_scores, top_ids = canonical_topk(exact, self._to_ids(positions), k_eff)
            done = np.ones(pending.size, dtype=bool)
            can_widen = fetch < n and (self._max_k is None or fetch < self._max_k)
            if self.exact and can_widen:
                # Every unseen vector scores <= the last FAISS score; its exact score is within
                # tol of that. Unless that bound is strictly below the k-th exact score, an
                # unseen vector could enter the top-k or tie with it: fetch more and retry.
                last = approx[:, -1].astype(np.float64)
                full = positions[:, -1] >= 0
                done = ~full | (last + self.tol < top_scores[:, k_eff - 1])
            out_scores[pending[done]] = top_scores[done]
            out_ids[pending[done]] = top_ids[done]
            pending = pending[~done]
            fetch = min(n, fetch * 2)
            if self._max_k is not None:
                fetch = min(fetch, self._max_k)
        return canonical_topk(out_scores, out_ids, k)

    def _to_ids(self, positions: np.ndarray) -> np.ndarray:
        return np.where(positions >= 0, self.ids[np.maximum(positions, 0)], -1)


class ShardedIndex:
    """A database split into shards, searched shard by shard and merged by `merge_topk`.

    In one process this is the reference for the Ray label pass, which holds one `IndexShard`
    per actor and merges the actors' answers with the same `merge_topk`.
    """

    def __init__(self, shards: Sequence[IndexShard]) -> None:
        if not shards:
            raise ValueError("ShardedIndex needs at least one shard")
        self.shards = list(shards)

    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        ids: np.ndarray | None = None,
        *,
        shards: int = 1,
        split: str = "contiguous",
        factory: str = "Flat",
        keep_vectors: bool = True,
        trained: FaissIndex | None = None,
        train_sample: int | np.ndarray | None = None,
        ngpu: int = -1,
        nprobe: int | None = None,
        k_factor: int | None = None,
        seed: int = 0,
    ) -> ShardedIndex:
        """Split `vectors` (N, D) float32 with `ids` (N,) int64 into `shards` indexes.

        Args:
            split: "contiguous" (row ranges: slices are views, nothing is copied) or "modulo"
                (shard = id % shards: stable when the corpus grows, new ids spread evenly).
            factory: FAISS factory string. IVF/PQ is trained once on a sample of the whole
                database and cloned into every shard, so the shards share codebooks.
            trained: an already trained empty index for `factory` (from `train_index`), e.g.
                trained by the driver before the shards are built on workers.
            ngpu: GPUs (-1 all); shard s goes to GPU s % ngpu.
            Other arguments: see `build_index` and `IndexShard`.
        """
        vectors = _as_matrix(vectors, "vectors")
        n = vectors.shape[0]
        ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        if ids.shape != (n,):
            raise ValueError(f"ids must have shape ({n},), got {ids.shape}")
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if split == "contiguous":
            bounds = np.linspace(0, n, shards + 1).astype(np.int64)
            parts: list[slice | np.ndarray] = [
                slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
        elif split == "modulo":
            parts = [np.flatnonzero(ids % shards == s) for s in range(shards)]
        else:
            raise ValueError(f"split must be 'contiguous' or 'modulo', got {split!r}")
        n_gpus = resolve_ngpu(ngpu)
        if trained is None and _needs_training(factory, vectors.shape[1]):
            if isinstance(train_sample, np.ndarray):
                sample = train_sample
            else:
                size = min(n, train_sample or _DEFAULT_TRAIN_SAMPLE)
                rows = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
                sample = vectors[rows]
            trained = train_index(factory, sample, ngpu=n_gpus)
        built = [
            IndexShard.build(
                vectors[part],
                ids[part],
                factory,
                keep_vectors=keep_vectors,
                trained=trained,
                gpus=[s % n_gpus] if n_gpus else [],
                nprobe=nprobe,
                k_factor=k_factor,
                seed=seed,
            )
            for s, part in enumerate(parts)
        ]
        return cls(built)

    @property
    def ntotal(self) -> int:
        return sum(shard.ntotal for shard in self.shards)

    def set_nprobe(self, nprobe: int) -> None:
        for shard in self.shards:
            set_nprobe(shard.index, nprobe)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k over all shards: scores (Q, k) float32, ids (Q, k) int64, canonical order."""
        return merge_topk([shard.search(queries, k) for shard in self.shards], k)
