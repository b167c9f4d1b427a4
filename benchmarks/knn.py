"""kNN figures of BENCHMARKS.md, as ratios measured side by side in one run.

Two figures, one JSON line per measurement:
  exact_knn        our sharded exact FAISS search (Flat; 1 and 4 shards) vs brute-force torch
                   matmul + topk on the same blobs: fraction of identical top-k id lists, and
                   speed ratio (medians of --reps).
  approximate_knn  an IVF/PQ index with exact re-scoring vs the exact index, database N=1e6,
                   d=512: search speed ratio, recall@10, and the Spearman correlation between the
                   RCR text-direction NDCG@10 (`ndcg_at_k`, a soft label) computed from each
                   index's neighbours of the same queries.

Sizes default to what fits in ~5 minutes on 2 CPU cores: the exact 1e6 search costs ~20-40 ms
per query there, so BENCHMARKS' 10k queries would take 4-7 minutes per list alone; pass
--approx-queries 10000 on a bigger machine. IVF/PQ ("IVF1024,PQ64", nprobe 64, 4x candidates
rescored exactly) is trained on a 65,536-vector sample with 10 k-means iterations (~25 s on
2 cores; IVF4096 would cost ~4x in training and in adding). The blobs have a low intrinsic
dimension (see `Blobs`); with isotropic 512-d noise no partitioning index finds neighbours.

    python benchmarks/knn.py                       # defaults below
    python benchmarks/knn.py --approx-n 200000     # quicker smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from scipy.stats import spearmanr

from pipeline.core.labels.rcr import ndcg_at_k
from pipeline.core.search.exact import exact_topk_torch
from pipeline.core.search.knn import ShardedIndex, resolve_ngpu, train_index


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def timed(fn, reps: int):
    """(median seconds over `reps` calls, result of the last call)."""
    times, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def unit_rows(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


class Blobs:
    """Clustered unit vectors with a low intrinsic dimension, like CLIP embeddings.

    A point of cluster c is normalise(P (centre_c + spread z) + iso e): centres and z live in a
    `latent`-dimensional space mapped into `dim` by a random orthonormal P, plus a little
    isotropic noise e. Isotropic noise in all 512 dimensions instead makes every point nearly
    equidistant from every other (no index but Flat finds neighbours there; real embeddings are
    not like that). Defaults give a 10th-neighbour similarity of ~0.77.
    """

    def __init__(self, rng, clusters: int, dim: int, latent: int, spread: float, iso: float):
        self.rng = rng
        self.spread, self.iso, self.dim = spread, iso, dim
        self.projection = np.linalg.qr(rng.standard_normal((dim, latent)))[0].astype(np.float32)
        self.centers = unit_rows(rng.standard_normal((clusters, latent), dtype=np.float32))

    def draw(self, labels: np.ndarray) -> np.ndarray:
        """(len(labels), dim) float32 unit rows; built in chunks to bound peak memory."""
        out = np.empty((labels.size, self.dim), dtype=np.float32)
        for start in range(0, labels.size, 100_000):
            part = labels[start : start + 100_000]
            latent = self.centers[part] + self.spread * self.rng.standard_normal(
                (part.size, self.centers.shape[1]), dtype=np.float32
            )
            noise = self.rng.standard_normal((part.size, self.dim), dtype=np.float32)
            out[start : start + part.size] = unit_rows(
                latent @ self.projection.T + self.iso * noise
            )
        return out


def exact_figure(args, rng: np.random.Generator) -> None:
    dim, k = args.dim, args.k
    gen = Blobs(rng, 1000, dim, args.latent, args.spread, args.iso)
    database = gen.draw(rng.integers(0, 1000, args.exact_n))
    queries = gen.draw(rng.integers(0, 1000, args.exact_queries))
    torch_s, (_, torch_ids) = timed(
        lambda: exact_topk_torch(queries, database, k, device="cpu"), args.reps
    )
    reference = None
    for shards in (1, 4):
        start = time.perf_counter()
        index = ShardedIndex.build(database, shards=shards, factory="Flat", ngpu=args.ngpu)
        build_s = time.perf_counter() - start
        faiss_s, (_, ids) = timed(lambda index=index: index.search(queries, k), args.reps)
        reference = ids if reference is None else reference
        emit(
            "exact_knn",
            n=args.exact_n,
            d=dim,
            queries=args.exact_queries,
            k=k,
            shards=shards,
            ngpu=resolve_ngpu(args.ngpu),
            identical_lists_vs_torch=float(np.mean(np.all(ids == torch_ids, axis=1))),
            identical_sets_vs_torch=float(
                np.mean(np.all(np.sort(ids, 1) == np.sort(torch_ids, 1), axis=1))
            ),
            identical_lists_vs_1_shard=float(np.mean(np.all(ids == reference, axis=1))),
            speedup_vs_torch=torch_s / faiss_s,
            faiss_search_s=faiss_s,
            torch_search_s=torch_s,
            build_s=build_s,
            reps=args.reps,
        )
        del index


def approximate_figure(args, rng: np.random.Generator) -> None:
    n, dim, k, q = args.approx_n, args.dim, args.k, args.approx_queries
    clusters = max(1, n // 50)
    gen = Blobs(rng, clusters, dim, args.latent, args.spread, args.iso)
    labels = rng.integers(0, clusters, n)
    start = time.perf_counter()
    texts = gen.draw(labels)  # the database: every pair's caption
    # Query pairs: their caption is in the database (self ids), their image is near the same
    # centre, except a `noise` fraction whose image comes from another cluster (mismatched).
    self_ids = rng.choice(n, q, replace=False)
    image_labels = labels[self_ids].copy()
    noisy = rng.random(q) < args.noise
    image_labels[noisy] = rng.integers(0, clusters, int(noisy.sum()))
    images = gen.draw(image_labels)
    captions = texts[self_ids]
    data_s = time.perf_counter() - start

    start = time.perf_counter()
    sample = texts[np.sort(rng.choice(n, min(n, args.train_sample), replace=False))]
    trained = train_index(args.factory, sample, ngpu=args.ngpu, niter=args.niter)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    approx = ShardedIndex.build(
        texts,
        trained=trained,
        factory=args.factory,
        nprobe=args.nprobe,
        k_factor=args.k_factor,
        ngpu=args.ngpu,
    )
    add_s = time.perf_counter() - start
    exact = ShardedIndex.build(texts, factory="Flat", ngpu=args.ngpu)

    depth = k + 1  # RCR lists: top-(K+1), self included
    exact_s, (_, exact_i2t) = timed(lambda: exact.search(images, depth), args.exact_reps)
    _, exact_t2t = exact.search(captions, depth)
    approx_s, (_, approx_i2t) = timed(lambda: approx.search(images, depth), args.reps)
    _, approx_t2t = approx.search(captions, depth)

    recall = np.mean(
        [len(set(a[:k]) & set(b[:k])) / k for a, b in zip(approx_i2t, exact_i2t, strict=True)]
    )
    label_exact = ndcg_at_k(images, captions, exact_i2t, exact_t2t, texts, k=k)["ndcg"]
    label_approx = ndcg_at_k(images, captions, approx_i2t, approx_t2t, texts, k=k)["ndcg"]
    rho = spearmanr(label_exact, label_approx).statistic
    emit(
        "approximate_knn",
        n=n,
        d=dim,
        queries=q,
        k=k,
        factory=args.factory,
        nprobe=args.nprobe,
        k_factor=args.k_factor,
        train_sample=int(sample.shape[0]),
        niter=args.niter,
        ngpu=resolve_ngpu(args.ngpu),
        speedup_vs_exact=exact_s / approx_s,
        recall_at_10=float(recall),
        soft_label="rcr_ndcg_txt@10",
        soft_label_spearman=float(rho),
        soft_label_max_abs_diff=float(np.max(np.abs(label_exact - label_approx))),
        approx_search_s=approx_s,
        exact_search_s=exact_s,
        reps=args.reps,
        exact_reps=args.exact_reps,
        data_s=data_s,
        train_s=train_s,
        add_s=add_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--latent", type=int, default=64, help="intrinsic dimension of blobs")
    parser.add_argument("--spread", type=float, default=0.07, help="latent noise per dimension")
    parser.add_argument("--iso", type=float, default=0.01, help="isotropic noise per dimension")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ngpu", type=int, default=-1, help="-1: all GPUs FAISS sees")
    parser.add_argument("--exact-n", type=int, default=200_000)
    parser.add_argument("--exact-queries", type=int, default=2_000)
    parser.add_argument("--approx-n", type=int, default=1_000_000)
    parser.add_argument("--approx-queries", type=int, default=2_000)
    parser.add_argument("--exact-reps", type=int, default=3, help="reps of the slow 1e6 search")
    parser.add_argument("--factory", default="IVF1024,PQ64")
    parser.add_argument("--train-sample", type=int, default=65_536)
    parser.add_argument("--niter", type=int, default=10)
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument("--k-factor", type=int, default=4, help="candidates rescored per k")
    parser.add_argument("--noise", type=float, default=0.3, help="mismatched query fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-exact", action="store_true")
    parser.add_argument("--skip-approx", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if not args.skip_exact:
        exact_figure(args, rng)
    if not args.skip_approx:
        approximate_figure(args, rng)


if __name__ == "__main__":
    main()
