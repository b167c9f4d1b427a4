"""Embed-pass efficiency, as ratios measured side by side in one run (BENCHMARKS.md).

Three ways to embed the same shards with the same model and batch size:
  pipeline   our Ray Data embed pass (decode, preprocess, model, losses, Parquet write), once
             per `--decode` mode (cpu: PIL in the decode threads; device: torchvision's batched
             JPEG decode on the pass's device, which is the CPU without a GPU), on `--workers`
             workers sharing `--threads` CPUs (on CPU the job default: one per CPU);
  forward    the model's forward alone on tensors decoded and tokenised beforehand, in one
             process on `--threads` threads; with more than one worker also
             `forward_parallel`: that many one-thread processes at once, each forwarding its
             share in the same wall-clock window (pairs/s summed);
  hand_loop  a plain webdataset + torch DataLoader loop (what clip-retrieval does), no write.
Each is repeated, the ways interleaved within a repetition; medians are reported. Prints one
JSON line per figure.

    python benchmarks/embed.py --corpus data/demo --reps 3 --decode cpu device
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline.runtime.ray import apply_loopback_defaults  # noqa: E402

apply_loopback_defaults()

import torch  # noqa: E402

from pipeline.io.shards import decode_record, iter_shard_records  # noqa: E402
from pipeline.models import ModelSpec, encode_pairs, load_clip  # noqa: E402


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def time_pipeline(
    shards, spec: ModelSpec, args, decode: str, gpus: float = 0.0
) -> tuple[float, float]:
    """(end-to-end pairs/s incl. actor start, steady pairs/s from per-shard busy time)."""
    from pipeline.config import EmbedConfig
    from pipeline.stages.embed import EmbedSpec, run_embed_pass

    with tempfile.TemporaryDirectory() as out:
        embed_spec = EmbedSpec(
            output=out,
            round_index=0,
            views={"a": spec},
            seed=0,
            embed=EmbedConfig(
                batch_size=args.batch,
                forward_batch_size=args.forward_batch or args.batch,
                decode=decode,
                decode_threads=args.decode_threads or max(1, args.threads // args.workers),
                concurrency=args.workers,
                cpus_per_worker=args.threads / args.workers,
                gpus_per_worker=gpus,
            ),
        )
        summary = run_embed_pass(embed_spec, shards)
        busy = summary["actor_seconds"] / args.workers  # summed over workers running at once
        return summary["embedded"] / summary["seconds"], summary["embedded"] / busy


def predecode(shards, loaded):
    images, captions = [], []
    for path in shards:
        for record in iter_shard_records(path):
            sample = decode_record(record) if not hasattr(record, "reason") else record
            if hasattr(sample, "image"):
                images.append(loaded.preprocess(sample.image))
                captions.append(sample.caption)
    return torch.stack(images), loaded.tokenizer(captions)


def time_forward(loaded, pixels, tokens, batch: int) -> float:
    """Forward-only pairs/s at the pass's forward batch."""
    started = time.perf_counter()
    for start in range(0, len(pixels), batch):
        encode_pairs(loaded, pixels[start : start + batch], tokens[start : start + batch])
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
    return len(pixels) / (time.perf_counter() - started)


def _forward_in_window(shards, spec: ModelSpec, batch: int, seconds: float, ready, counts):
    """Pairs forwarded on one thread for `seconds` from the moment every process is ready
    (`ready`: a barrier; images decoded beforehand), put on `counts`: processes running at
    once are timed over one window."""
    torch.set_num_threads(1)
    loaded = load_clip(spec, "cpu")
    pixels, tokens = predecode(shards, loaded)
    ready.wait()
    end, done, i = time.perf_counter() + seconds, 0, 0
    while time.perf_counter() < end:
        part = slice(i, i + batch)
        encode_pairs(loaded, pixels[part], tokens[part])
        done += len(pixels[part])
        i = i + batch if i + batch < len(pixels) else 0
    counts.put(done)


def time_forward_parallel(shards, spec: ModelSpec, args) -> float:
    """Forward-only pairs/s of `--workers` one-thread processes at once (counts summed)."""
    import multiprocessing

    ctx, seconds = multiprocessing.get_context("spawn"), 5.0
    ready, counts = ctx.Barrier(args.workers), ctx.Queue()
    batch = args.forward_batch or args.batch
    procs = [
        ctx.Process(
            target=_forward_in_window,
            args=(shards[w :: args.workers], spec, batch, seconds, ready, counts),
        )
        for w in range(args.workers)
    ]
    for proc in procs:
        proc.start()
    total = sum(counts.get(timeout=900) for _ in procs)  # a dead process: raise, not hang
    for proc in procs:
        proc.join()
    return total / seconds


def time_hand_loop(shards, loaded, batch: int) -> float:
    import webdataset as wds

    dataset = (
        wds.WebDataset(shards, shardshuffle=False, handler=wds.warn_and_continue)
        .decode("pil", handler=wds.warn_and_continue)
        .to_tuple("jpg", "txt", handler=wds.warn_and_continue)
        .map_tuple(lambda im: loaded.preprocess(im.convert("RGB")), lambda t: t)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=1)
    count = 0
    started = time.perf_counter()
    for pixels, captions in loader:
        encode_pairs(loaded, pixels, loaded.tokenizer(list(captions)))
        count += len(captions)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", default="data/demo")
    parser.add_argument("--model", default="ncl-tiny")
    parser.add_argument("--batch", type=int, default=256, help="loss batch (embed.batch_size)")
    parser.add_argument(
        "--forward-batch", type=int, default=256, help="embed.forward_batch_size (0: --batch)"
    )
    parser.add_argument("--decode", nargs="+", default=["cpu", "device"], help="embed.decode")
    parser.add_argument("--threads", type=int, default=2, help="torch + decode threads")
    parser.add_argument(
        "--decode-threads", type=int, default=0, help="embed.decode_threads (0: --threads)"
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="embed workers (0: one per thread on CPU, 1 on GPU)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per actor)")
    args = parser.parse_args()

    shards = sorted(glob.glob(os.path.join(args.corpus, "[0-9]*.tar")))
    if not shards:
        raise SystemExit(f"no shards in {args.corpus}: run `make demo` (or make-corpus) first")
    torch.set_num_threads(args.threads)
    spec = ModelSpec(name=args.model, pretrained=None, precision=args.precision, seed=0)
    loaded = load_clip(spec, args.device)
    pixels, tokens = predecode(shards, loaded)

    from pipeline.runtime.ray import init_ray

    init_ray(None, num_cpus=args.threads)
    results: dict[str, list[float]] = {"forward": [], "hand_loop": []}
    gpus = 1.0 if args.device.startswith("cuda") else 0.0
    args.workers = args.workers or (1 if gpus else args.threads)
    for _ in range(args.reps):
        for decode in args.decode:
            e2e, steady = time_pipeline(shards, spec, args, decode, gpus)
            results.setdefault(f"pipeline_e2e.{decode}", []).append(e2e)
            results.setdefault(f"pipeline_steady.{decode}", []).append(steady)
        results["forward"].append(
            time_forward(loaded, pixels, tokens, args.forward_batch or args.batch)
        )
        results["hand_loop"].append(time_hand_loop(shards, loaded, args.batch))
        if args.workers > 1 and not gpus:
            parallel = time_forward_parallel(shards, spec, args)
            results.setdefault("forward_parallel", []).append(parallel)
    med = {name: statistics.median(values) for name, values in results.items()}
    common = {
        "pairs": int(len(pixels)),
        "model": args.model,
        "batch": args.batch,
        "forward_batch": args.forward_batch or args.batch,
        "reps": args.reps,
        "device": args.device,
        "precision": args.precision,
        "threads": args.threads,
        "workers": args.workers,
        "decode_threads": args.decode_threads or max(1, args.threads // args.workers),
        "load_1min": round(os.getloadavg()[0], 1),  # others' work on the machine, at the end
    }
    for name, value in med.items():
        emit(f"pairs_per_s.{name}", median=round(value, 1), **common)
    against = [("embed_efficiency", "forward", 0.85), ("embed_vs_hand_loop", "hand_loop", 1.0)]
    if "forward_parallel" in med:  # the model alone in the pass's own layout
        against.append(("embed_efficiency_same_layout", "forward_parallel", 0.85))
    for decode in args.decode:
        steady, e2e = med[f"pipeline_steady.{decode}"], med[f"pipeline_e2e.{decode}"]
        for figure, base, bar in against:
            ratios = {"ratio": steady / med[base], "ratio_end_to_end": e2e / med[base]}
            emit(
                figure,
                decode=decode,
                **{k: round(v, 3) for k, v in ratios.items()},
                bar=bar,
                **common,
            )


if __name__ == "__main__":
    main()
