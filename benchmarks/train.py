"""Training engine figures, measured in one run (BENCHMARKS.md; issue: training engine).

1. Throughput: our trainer (`run_training`: Ray Data streaming from the tar shards, decode,
   preprocess, one view, one worker) vs a plain PyTorch loop over the same pairs decoded
   beforehand, same model, batch, optimizer (`build_optimizer`: fused AdamW) and loss. Ratio
   of samples/s (median over epochs after the first; the plain loop runs before the rounds
   and after them, its median over both), and the round's end-to-end rate (pairs trained /
   wall seconds of the whole `run_training` call, start-up included) against the plain
   loop's. With
   `--throughput-only` the vanilla round also runs on Ray Train (one worker, as before the
   trainer ran a single worker in one Ray task) and without the pixel cache
   (`train.pixel_cache_gb: 0`, every epoch decodes): each beside the plain loop in one run.
   Every round starts with an empty pixel cache of its own.
2. Retrieval rSum on the clean test split after training the demo model on the demo corpus at
   40% noise, same epochs: warm-up as configured in jobs/demo.yaml (BiCro-style selection once
   off the plateau), vanilla (all pairs, no selection) and oracle (ground-truth clean pairs only,
   joined as a label table).

3. With `--readers`, only the training readers (`round_batches`, the Ray Data pipeline of one
   view, iterated without training) on the same pairs as 64 px JPEGs for ncl-tiny and as
   256 px JPEGs for ViT-B-32's 224 px transform, with the pixel cache (`train.pixel_cache_gb`)
   and without: samples/s of the first epoch and of the later ones (median), and the machine's
   CPU seconds per 1,000 samples, what a GPU node's reader CPUs must supply.

    python benchmarks/train.py --samples 4000 --epochs 8   (the demo settings)
    python benchmarks/train.py --samples 2000 --epochs 3 --throughput-only   (1. only)
    python benchmarks/train.py --samples 2000 --epochs 4 --readers   (3. only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline.runtime.ray import apply_loopback_defaults  # noqa: E402

apply_loopback_defaults()

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from pipeline.config import TrainConfig  # noqa: E402
from pipeline.core.losses.training import symmetric_infonce  # noqa: E402
from pipeline.data.synthetic import make_corpus  # noqa: E402
from pipeline.io.shards import Rejection, decode_record, iter_shard_records, shard_name  # noqa: E402
from pipeline.models import ModelSpec, load_clip  # noqa: E402
from pipeline.stages.train import TrainSpec, ViewSpec, run_training  # noqa: E402
from pipeline.stages.train.loop import build_optimizer  # noqa: E402


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def decoded_pairs(shards, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Every usable pair of `shards`, decoded once: (N, 3, H, W) float32 pixels, (N, L) tokens."""
    loaded = load_clip(spec, "cpu")
    pixels, captions = [], []
    for path in shards:
        for record in iter_shard_records(str(path)):
            sample = record if isinstance(record, Rejection) else decode_record(record)
            if not isinstance(sample, Rejection):
                pixels.append(loaded.preprocess(sample.image))
                captions.append(sample.caption)
    return torch.stack(pixels), loaded.tokenizer(captions)


def plain_loop_rates(pairs, spec: ModelSpec, train: TrainConfig, epochs: int) -> list[float]:
    """Samples/s of each epoch after the first of a plain loop over the decoded `pairs`: the
    trainer's model, batch, loss, optimiser (`build_optimizer`) and gradient clip."""
    pixels, tokens = pairs
    torch.set_num_threads(train.torch_threads)
    model = load_clip(spec, "cpu").model.train()
    optimizer = build_optimizer(model, train, torch.device("cpu"))
    batch, rates = train.batch_size, []
    for epoch in range(epochs):
        order = torch.randperm(len(pixels), generator=torch.Generator().manual_seed(epoch))
        started, seen = time.perf_counter(), 0
        for start in range(0, len(order) - batch + 1, batch):
            idx = order[start : start + batch]
            image_emb, text_emb, scale = model(pixels[idx], tokens[idx])
            loss = symmetric_infonce(image_emb, text_emb, scale)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            optimizer.step()
            seen += batch
        rates.append(seen / (time.perf_counter() - started))
    return rates[1:] or rates


def _training_engine(name: str):
    """`run_training`, or for "..._ray_train" the same with its one worker on Ray Train's
    TorchTrainer (what `run_training` does for several workers), to compare the two."""
    if not name.endswith("ray_train"):
        return run_training
    import pipeline.stages.train.driver as driver

    def on_ray_train(spec: TrainSpec) -> dict:
        one_worker = driver._run_one_worker
        driver._run_one_worker = driver._run_on_ray_train
        try:
            return run_training(spec)
        finally:
            driver._run_one_worker = one_worker

    return on_ray_train


def oracle_labels(corpus, out_dir: Path) -> str:
    """A label table holding only the truly clean pairs: the reader skips every other key."""
    truth = pq.read_table(corpus.ground_truth).to_pandas()
    clean = truth[truth["kind"] == "clean"]
    out_dir.mkdir(parents=True, exist_ok=True)
    for shard, rows in clean.groupby("shard"):
        table = pa.table(
            {"key": rows["key"].tolist(), "soft_label": pa.array([1.0] * len(rows), pa.float32())}
        )
        pq.write_table(table, out_dir / f"{shard}.parquet")
    return str(out_dir)


def train_config(
    batch: int, lr: float, epochs: int, select: bool, cache_dir: str, cache_gb: float = 20.0
) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "pixel_cache_dir": cache_dir,  # the run's own: its first epoch starts cold
            "pixel_cache_gb": cache_gb,
            "batch_size": batch,
            "lr": lr,
            "weight_decay": 0.1,
            "warmup": {"mode": "select" if select else "all", "patience": epochs},
            "checkpoint_every_steps": 0,
            "torch_threads": 2,
            "lr_warmup_steps": 100,
        }
    )


def train_spec(corpus, output: str, *, views, mode, epochs, train) -> TrainSpec:
    sizes = {
        shard_name(str(p)): pq.read_metadata(str(p).replace(".tar", ".parquet")).num_rows
        for p in corpus.shards
    }
    return TrainSpec(
        output=output,
        round_index=0,
        views=views,
        shards=tuple(str(p) for p in corpus.shards),
        shard_sizes=sizes,
        test_shards=tuple(str(p) for p in corpus.test_shards),
        round_kind=mode,
        max_epochs=epochs,
        train=train,
    )


def reader_rates(corpus, model: ModelSpec, tmp: str, cache_gb: float, epochs: int) -> dict:
    """The training readers alone, epoch after epoch: samples/s and machine CPU-s per 1,000."""
    import psutil

    from pipeline.stages.train.data import round_batches

    train = train_config(64, 1e-3, epochs, False, f"{tmp}/pixels-{model.name}", cache_gb)
    spec = train_spec(corpus, f"{tmp}/readers", views=(), mode="warmup", epochs=epochs, train=train)
    view = ViewSpec("A", model, seed=0)
    seen = [0] * epochs
    ends = [(time.perf_counter(), sum(psutil.cpu_times()[:2]))] * (epochs + 1)  # at each end
    for epoch, batch in round_batches(spec, view, 0, 0, 1):
        seen[epoch] += len(batch["tokens"])
        ends[epoch + 1] = (time.perf_counter(), sum(psutil.cpu_times()[:2]))
    rates = [seen[e] / (ends[e + 1][0] - ends[e][0]) for e in range(epochs)]
    cpu_per_1k = [(ends[e + 1][1] - ends[e][1]) / seen[e] * 1000 for e in range(epochs)]
    return {
        "first_epoch_samples_per_s": round(rates[0], 1),
        "later_samples_per_s": round(statistics.median(rates[1:]), 1),
        "first_epoch_cpu_s_per_1k": round(cpu_per_1k[0], 3),
        "later_cpu_s_per_1k": round(statistics.median(cpu_per_1k[1:]), 3),
    }


def demo_corpus(tmp: str, args, test_samples: int, image_size: int = 64):
    """The benchmark's corpus: the demo's noise, 500 pairs per shard."""
    return make_corpus(
        Path(tmp) / "corpus",
        samples=args.samples,
        noise=args.noise,
        partial=0.1,
        seed=0,
        samples_per_shard=500,
        test_samples=test_samples,
        image_size=image_size,
    )


def readers(args) -> None:
    for image_size, name in ((64, "ncl-tiny"), (256, "ViT-B-32")):
        with tempfile.TemporaryDirectory() as tmp:
            corpus = demo_corpus(tmp, args, 100, image_size)
            for cache_gb in (0.0, 20.0):
                rates = reader_rates(corpus, ModelSpec(name, None), tmp, cache_gb, args.epochs)
                emit(
                    "reader_throughput",
                    model=name,
                    jpeg_px=image_size,
                    pixel_cache=cache_gb > 0,
                    pairs=args.samples,
                    epochs=args.epochs,
                    load_average=round(os.getloadavg()[0], 1),
                    **rates,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--noise", type=float, default=0.4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--throughput-only", action="store_true", help="figure 1 only")
    parser.add_argument("--readers", action="store_true", help="figure 3 only")
    args = parser.parse_args()

    from pipeline.runtime.ray import init_ray

    init_ray(None, num_cpus=2)
    if args.readers:
        readers(args)
        return
    spec = ModelSpec("ncl-tiny", None, "fp32", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = demo_corpus(tmp, args, 500)
        common = {
            "pairs": args.samples,
            "noise": args.noise,
            "epochs": args.epochs,
            "batch": args.batch,
            "model": "ncl-tiny",
            "device": "cpu",
        }

        # The plain loop runs before the trainer's rounds and after them: on a shared machine the
        # load moves between phases, and its rates on both sides bracket the rounds'.
        train = train_config(args.batch, args.lr, args.epochs, False, f"{tmp}/pixels")
        pairs = decoded_pairs(corpus.shards, spec)
        plain_epochs = min(args.epochs, 3)
        load_before = os.getloadavg()[0]
        plain_before = plain_loop_rates(pairs, spec, train, plain_epochs)
        results, seconds = {}, {}
        runs = [("vanilla", "warmup", False, None)]  # (name, round kind, selection, labels)
        if not args.throughput_only:
            runs.append(("warmup_select", "warmup", True, None))
            runs.append(("oracle", "labels", False, oracle_labels(corpus, Path(tmp) / "oracle")))
        if args.throughput_only:
            runs.append(("vanilla_ray_train", "warmup", False, None))
            runs.append(("vanilla_no_pixel_cache", "warmup", False, None))
        for name, mode, select, labels in runs:
            cache_gb = 0.0 if name.endswith("no_pixel_cache") else 20.0
            views = (ViewSpec("A", spec, seed=0, labels_dir=labels),)
            started = time.perf_counter()
            summary = _training_engine(name)(
                train_spec(
                    corpus,
                    f"{tmp}/{name}",
                    views=views,
                    mode=mode,
                    epochs=args.epochs,
                    train=train_config(
                        args.batch, args.lr, args.epochs, select, f"{tmp}/pixels-{name}", cache_gb
                    ),
                ),
            )
            seconds[name] = time.perf_counter() - started
            results[name] = summary
            emit(
                f"rsum.{name}",
                rsum=round(summary["retrieval"]["A"]["rsum"], 1),
                kept_epoch=summary["views"]["A"]["kept_epoch"],
                **common,
            )

        plain_after = plain_loop_rates(pairs, spec, train, plain_epochs)
        load_after = os.getloadavg()[0]
        plain = statistics.median(plain_before + plain_after)
        for name in [n for n in results if n.startswith("vanilla")]:
            history = results[name]["views"]["A"]["history"]
            ours = statistics.median(h["samples_per_s"] for h in history[1:])
            end_to_end = sum(h["pairs"] for h in history) / seconds[name]
            emit(
                "train_throughput",
                engine="ray_train" if name.endswith("ray_train") else "run_training",
                pixel_cache=not name.endswith("no_pixel_cache"),
                ours_samples_per_s=round(ours, 1),
                plain_samples_per_s=round(plain, 1),
                plain_before=round(statistics.median(plain_before), 1),
                plain_after=round(statistics.median(plain_after), 1),
                ratio=round(ours / plain, 3),
                round_seconds=round(seconds[name], 1),
                epoch_seconds=round(sum(h["seconds"] for h in history), 1),
                end_to_end_samples_per_s=round(end_to_end, 1),
                end_to_end_ratio=round(end_to_end / plain, 3),
                load_average=[round(load_before, 1), round(load_after, 1)],
                **common,
            )
        if args.throughput_only:
            return
        vanilla = results["vanilla"]["retrieval"]["A"]["rsum"]
        emit(
            "rsum_ratios",
            warmup_vs_vanilla=round(
                results["warmup_select"]["retrieval"]["A"]["rsum"] / max(vanilla, 1e-9), 3
            ),
            oracle_vs_vanilla=round(
                results["oracle"]["retrieval"]["A"]["rsum"] / max(vanilla, 1e-9), 3
            ),
            **common,
        )


if __name__ == "__main__":
    main()
