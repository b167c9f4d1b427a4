"""Scale: embed + one label pass at growing corpus sizes, measured side by side in one run.

For each size N (default 10k, 100k, 1M pairs) a fresh driver process embeds the first N pairs
of one synthetic corpus (32 px, `ncl-tiny`, random init) on a local Ray, then runs one label
pass per method on those embeddings with `index.factory: auto` (Flat, IVF or IVF-PQ by N).
Every size runs in its own process so the driver's peak RSS is that size's own.

Prints one JSON line per size and method, then the bars of issue 11 (BENCHMARKS.md):
  - driver peak RSS at the largest size <= 1.2x at the one before;
  - time per pair (embed + label pass) grows <= 1.3x per 10x;
  - embed end-to-end pairs/s at the largest size >= 0.9x its steady-state rate;
  - label pass time / embed time <= 0.3.

    python benchmarks/scale.py                       # 10k, 100k, 1M (about an hour on 2 CPUs)
    python benchmarks/scale.py --sizes 10000 100000  # minutes

Many shards (issue 37 item 7): the same number of pairs in --many-shards tiny shards and in
--few-shards large ones, each embedded and labelled (bicro) in its own driver process, side by
side; one JSON line per layout (seconds, driver peak RSS) and the per-shard overhead:

    python benchmarks/scale.py --many-shards 1000 --many-pairs 2000   # minutes on 2 CPUs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def make_shards(corpus: Path, pairs: int, image_size: int, shard_pairs: int) -> list[str]:
    """The corpus's shards (made once, reused while it is as large and of the same shapes)."""
    from pipeline.data.synthetic import make_corpus

    params = {"samples": pairs, "image_size": image_size, "samples_per_shard": shard_pairs}
    stamp = corpus / "scale_params.json"
    made = json.loads(stamp.read_text()) if stamp.exists() else None
    # A larger corpus with the same shapes serves too: each size reads its first shards.
    if not (made and made["samples"] >= pairs and {**made, "samples": pairs} == params):
        started = time.perf_counter()
        make_corpus(corpus, test_samples=0, noise=0.4, partial=0.1, seed=0, **params)
        stamp.write_text(json.dumps(params))
        print(f"# corpus: {pairs:,} pairs in {time.perf_counter() - started:.0f}s", flush=True)
    return sorted(str(p) for p in corpus.glob("[0-9]*.tar"))


def run_one(
    shards: list[str], out: str, methods: list[str], cpus: int, search_threads: int
) -> dict:
    """Embed `shards` and run one label pass per method in this process; the figures."""
    from pipeline.config import EmbedConfig, IndexConfig, LabelsConfig
    from pipeline.models import ModelSpec
    from pipeline.runtime.ray import init_ray
    from pipeline.stages.embed import EmbedSpec, run_embed_pass
    from pipeline.stages.labels import LabelSpec, run_label_pass

    init_ray(None, num_cpus=cpus)
    spec = EmbedSpec(
        output=out,
        round_index=0,
        views={"a": ModelSpec(name="ncl-tiny", pretrained=None, precision="fp32", seed=0)},
        seed=0,
        embed=EmbedConfig(batch_size=256, decode_threads=cpus, concurrency=1, cpus_per_worker=cpus),
    )
    started = time.perf_counter()
    embedded = run_embed_pass(spec, shards)
    embed_seconds = time.perf_counter() - started
    names = [Path(s).stem for s in shards]
    figures = {
        "pairs": embedded["embedded"],
        "embed_s": embed_seconds,
        "embed_pairs_per_s": embedded["embedded"] / embed_seconds,
        "embed_steady_pairs_per_s": embedded["embedded"] / embedded["actor_seconds"],
        "labels": {},
    }
    for method in methods:
        label_spec = LabelSpec(
            output=out,
            round_index=0,
            view="a",
            shards=tuple(names),
            out_dir=f"{out}/labels_{method}",
            labels=LabelsConfig(method=method),
            index=IndexConfig(factory="auto", search_threads=search_threads),
            write_index=False,
        )
        started = time.perf_counter()
        summary = run_label_pass(label_spec)
        figures["labels"][method] = {
            "seconds": time.perf_counter() - started,
            "factory": (summary.get("index") or {}).get("factory"),
        }
    # ru_maxrss: KiB on Linux; the driver's own peak (Ray's workers are other processes).
    figures["driver_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--methods", nargs="+", default=["bicro", "rcr"])
    parser.add_argument("--corpus", default="data/scale", help="made here once, then reused")
    parser.add_argument("--out", default="runs/scale")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--shard-pairs", type=int, default=10_000, help="pairs per tar")
    parser.add_argument(
        "--search-threads", type=int, default=2, help="index.search_threads of the label passes"
    )
    parser.add_argument("--many-shards", type=int, help="measure N tiny shards vs few large")
    parser.add_argument("--many-pairs", type=int, default=2000, help="pairs of both layouts")
    parser.add_argument("--few-shards", type=int, default=2, help="shards of the large layout")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one size
    parser.add_argument("--one-layout", help=argparse.SUPPRESS)  # child: one shard layout
    args = parser.parse_args()
    if args.many_shards or args.one_layout:
        many_shards(args)
        return

    sizes = sorted(set(args.sizes))
    corpus = Path(args.corpus)
    if args.one is not None:
        count = -(-args.one // args.shard_pairs)  # shards holding the first `one` pairs
        shards = sorted(str(p) for p in corpus.glob("[0-9]*.tar"))[:count]
        out = f"{args.out}/{args.one}"
        shutil.rmtree(out, ignore_errors=True)
        figures = run_one(shards, out, args.methods, args.cpus, args.search_threads)
        print(json.dumps(figures), flush=True)
        return

    make_shards(corpus, sizes[-1], args.image_size, args.shard_pairs)
    results = {}
    for size in sizes:
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(size), *_passed(args)],
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.stderr.write(child.stdout[-4000:] + child.stderr[-4000:])
            raise SystemExit(f"scale: size {size} failed (exit {child.returncode})")
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        results[size] = figures
        for method, label in figures["labels"].items():
            total = figures["embed_s"] + label["seconds"]
            emit(
                "scale",
                pairs=figures["pairs"],
                method=method,
                index_factory=label["factory"],
                embed_s=round(figures["embed_s"], 1),
                embed_pairs_per_s=round(figures["embed_pairs_per_s"], 1),
                embed_steady_pairs_per_s=round(figures["embed_steady_pairs_per_s"], 1),
                label_s=round(label["seconds"], 1),
                label_over_embed=round(label["seconds"] / figures["embed_s"], 3),
                ms_per_pair=round(1000 * total / figures["pairs"], 3),
                driver_peak_rss_mb=round(figures["driver_peak_rss_mb"]),
            )
    _bars(sizes, results, args.methods)


def many_shards(args) -> None:
    """The same pairs in many tiny shards and in a few large ones, side by side."""
    layouts = {"few": args.few_shards, "many": args.many_shards}
    if args.one_layout:  # child: one layout, in a process of its own (its own peak RSS)
        shards = sorted(str(p) for p in Path(args.corpus, args.one_layout).glob("[0-9]*.tar"))
        out = f"{args.out}/shards_{args.one_layout}"
        shutil.rmtree(out, ignore_errors=True)
        figures = run_one(shards, out, args.methods, args.cpus, args.search_threads)
        print(json.dumps({"shards": len(shards), **figures}), flush=True)
        return
    results = {}
    for name, count in layouts.items():
        per_shard = -(-args.many_pairs // count)
        make_shards(Path(args.corpus, name), args.many_pairs, args.image_size, per_shard)
        child = subprocess.run(
            [sys.executable, __file__, "--one-layout", name, *_passed(args)],
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.stderr.write(child.stdout[-4000:] + child.stderr[-4000:])
            raise SystemExit(f"scale: the {name}-shards layout failed (exit {child.returncode})")
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        total = figures["embed_s"] + sum(m["seconds"] for m in figures["labels"].values())
        results[name] = {**figures, "total_s": total}
        emit(
            "shard_layout",
            layout=name,
            shards=figures["shards"],
            pairs=figures["pairs"],
            embed_s=round(figures["embed_s"], 1),
            label_s={m: round(v["seconds"], 1) for m, v in figures["labels"].items()},
            total_s=round(total, 1),
            s_per_shard=round(total / figures["shards"], 4),
            driver_peak_rss_mb=round(figures["driver_peak_rss_mb"]),
        )
    few, many = results["few"], results["many"]
    extra = many["shards"] - few["shards"]
    emit(
        "per_shard_overhead",
        pairs=many["pairs"],
        shards=[few["shards"], many["shards"]],
        overhead_s_per_shard=round((many["total_s"] - few["total_s"]) / extra, 4),
        driver_rss_growth_mb_per_1k_shards=round(
            1000 * (many["driver_peak_rss_mb"] - few["driver_peak_rss_mb"]) / extra, 1
        ),
    )


def _passed(args) -> list[str]:
    return [
        "--methods", *args.methods, "--corpus", args.corpus, "--out", args.out,
        "--image-size", str(args.image_size), "--cpus", str(args.cpus),
        "--shard-pairs", str(args.shard_pairs), "--search-threads", str(args.search_threads),
    ]  # fmt: skip


def _bars(sizes: list[int], results: dict, methods: list[str]) -> None:
    last = results[sizes[-1]]
    emit(
        "embed_end_to_end_over_steady",
        pairs=last["pairs"],
        ratio=round(last["embed_pairs_per_s"] / last["embed_steady_pairs_per_s"], 3),
        bar=0.9,
    )
    if len(sizes) < 2:
        return
    before = results[sizes[-2]]
    emit(
        "driver_rss_growth",
        pairs=[before["pairs"], last["pairs"]],
        ratio=round(last["driver_peak_rss_mb"] / before["driver_peak_rss_mb"], 3),
        bar=1.2,
    )
    for method in methods:
        for small, large in zip(sizes, sizes[1:], strict=False):
            per_pair = [
                (results[n]["embed_s"] + results[n]["labels"][method]["seconds"])
                / results[n]["pairs"]
                for n in (small, large)
            ]
            growth = (per_pair[1] / per_pair[0]) ** (1 / math.log10(large / small))
            emit(
                "time_per_pair_growth_per_10x",
                method=method,
                pairs=[small, large],
                ratio=round(growth, 3),
                bar=1.3,
            )
        emit(
            "label_over_embed",
            method=method,
            pairs=last["pairs"],
            ratio=round(last["labels"][method]["seconds"] / last["embed_s"], 3),
            bar=0.3,
        )


if __name__ == "__main__":
    main()
