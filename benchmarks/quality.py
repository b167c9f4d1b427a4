"""Label quality on the demo corpus at several noise levels (BENCHMARKS.md "Label quality").

For each noise level: `make_corpus` (partial 10 %) into a temporary folder, the embed pass with
the chosen model (`run_job`, no training), then label passes on the same embeddings:
  bicro (BMM, global anchors), rcr (the job default), sps (GMM), cosine -> one JSON line each
  plus the baselines computed in every pass: cosine, GMM posterior, BMM posterior.
Ablations (BENCHMARKS.md):
  bmm_vs_gmm_anchors   BiCro anchors from the BMM vs the GMM split: anchor precision against
                       the ground truth, and each run's AUROC;
  rcr_vs_cosine        RCR's weight w~ vs the raw cosine as the weight on the same set C;
  global_vs_in_batch   BiCro with global (FAISS) anchors vs the reference's per-batch anchors;
  bicro_step_vs_fused  BiCro's step label (BiCro*) vs the fused p + (1 - p) c;
  bicro_nearest_vs_k_anchors  BiCro's consistency over its nearest anchor vs the mean over 5;
  both_directions      BiCro and SPS partitioned on the summed loss's GMM vs on the smaller of
                       the i2t and t2i GMM posteriors (`labels.posterior`);
  loss_permutations    per-sample losses from one batching vs averaged over 8 (the GMM
                       posterior, BiCro's GMM clean split and RCR, re-embedded);
  label_pass_overhead  label pass (fit + index + labels, bicro) time / embed pass time.

Which model labels matters: the packaged `ncl-tiny` with random weights is untrained, so its
labels are near chance. Pass `--model-checkpoint RUN/rounds/0/checkpoints/A/model.pt` (a
warmed-up model, e.g. from `make demo`), or `--warmup-epochs N` to warm one up here first on
the 40 %-noise corpus (the same checkpoint then labels every noise level). Every line says
which model was used.

    python benchmarks/quality.py                       # random tiny model, ~3 min on 2 CPUs
    python benchmarks/quality.py --warmup-epochs 6     # warm-up first

Co-teaching (`--coteach`): per noise level, the corpus `make demo-full` writes (at that noise) and
jobs/demo-full.yaml with only paths and the compared settings overridden, once per train.mode in
`--modes` (default coteach, vanilla, cosine_filter, oracle): the same trainer, data path and
schedule, one shared warm-up (selected on the validation split; rSum reported on the test
split). `--repeats N` repeats with seeds seed..seed+N-1 and reports medians. Per round: each
view's label AUROC/Spearman; per mode: held-out rSum of A, B and A+B, the published labels'
AUROC and the final models' own cosine AUROC; ratios of coteach to every baseline (bars at 40 %:
>= 1.5 vanilla, >= 1.1 cosine_filter, >= 0.9 oracle).

    python benchmarks/quality.py --coteach --noise 0.4                 # ~30 min on 2 CPUs
    python benchmarks/quality.py --coteach --noise 0.4 --modes coteach \
        --set labels.bicro.label=fused                                  # an ablation, ~10 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline.runtime.ray import apply_loopback_defaults  # noqa: E402

apply_loopback_defaults()

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import quality_web  # noqa: E402  (benchmarks/, beside this script)
import yaml  # noqa: E402

from pipeline.clients.read import read_labels  # noqa: E402
from pipeline.config import load_job  # noqa: E402
from pipeline.core.labels import LABEL_METHODS  # noqa: E402
from pipeline.data.synthetic import make_corpus  # noqa: E402
from pipeline.io.layout import RunLayout  # noqa: E402
from pipeline.run.runner import resolve_inputs, run_job  # noqa: E402
from pipeline.stages.labels import LabelSpec, run_label_pass  # noqa: E402

DEMO_CORRUPT = 0.005  # as `make demo-full` (Makefile): a few undecodable samples on purpose

QUALITY_KEYS = ("auroc", "spearman", "precision", "recall", "f1")


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def _job(folder: Path, corpus: Path, shards: int, pretrained: str | None, **extra) -> Path:
    document = {
        "name": "quality",
        "input": {"shards": f"{corpus}/{{00000..{shards - 1:05d}}}.tar"},
        "output": str(folder / "run"),
        "model": {"name": "ncl-tiny", "pretrained": pretrained, "precision": "fp32"},
        "embed": {
            "batch_size": 256,
            "gpus_per_worker": 0,
            "cpus_per_worker": 1,
            "decode_threads": 2,
            "concurrency": "auto",
        },
        "train": {"warmup_epochs": 0, "rounds": 0, "lr": 1.0e-3, "batch_size": 128},
        "eval": {"ground_truth": str(corpus / "ground_truth.parquet")},
        "seed": 0,
    }
    for key, value in extra.items():
        document[key] = {**document.get(key, {}), **value}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _quality_fields(quality: dict) -> dict:
    return {key: quality.get(key) for key in QUALITY_KEYS}


def _anchor_precision(out_dir: str, truth: dict[str, str]) -> tuple[int, float | None]:
    """Anchors are the clean rows that were not queried (no nearest-anchor key)."""
    table = read_labels(out_dir).to_table(columns=["key", "subset", "image_anchor_key"])
    subset = np.array(table.column("subset").to_pylist(), dtype=object)
    named = np.array(table.column("image_anchor_key").to_pylist(), dtype=object)
    keys = table.column("key").to_pylist()
    anchors = [k for k, s, a in zip(keys, subset, named, strict=True) if s == "clean" and a is None]
    if not anchors:
        return 0, None
    return len(anchors), float(np.mean([truth.get(k) == "clean" for k in anchors]))


def _corpus(folder: Path, args, noise: float, seed: int, test_samples: int = 0):
    """The benchmark corpus of one run: (folder/corpus, its shard count, make_corpus summary)."""
    corpus = folder / "corpus"
    summary = make_corpus(
        corpus,
        samples=args.samples,
        noise=noise,
        partial=args.partial,
        seed=seed,
        samples_per_shard=args.samples_per_shard,
        test_samples=test_samples,
    )
    return corpus, max(1, args.samples // args.samples_per_shard), summary


def run_noise_level(noise: float, args, workdir: Path, pretrained: str | None) -> None:
    folder = workdir / f"noise_{int(noise * 100)}"
    corpus, shards, _ = _corpus(folder, args, noise, args.seed)
    job = load_job(_job(folder, corpus, shards, pretrained, ray={"num_cpus": args.num_cpus}))
    started = time.perf_counter()
    metrics = run_job(job)
    embed_seconds = time.perf_counter() - started
    embed = metrics["rounds"]["0"]["embed"]
    paths = resolve_inputs(job)
    layout = RunLayout(job.output)
    truth_table = pq.read_table(corpus / "ground_truth.parquet", columns=["key", "kind"])
    truth = dict(zip(truth_table["key"].to_pylist(), truth_table["kind"].to_pylist(), strict=True))

    def label(name: str, mixture_kind: str | None = None, on=None, **labels) -> dict:
        base = LabelSpec.from_job(
            on or job,
            round_index=0,
            view="a",
            shard_paths=paths,
            out_dir=f"{RunLayout((on or job).output).output}/{name}",
        )
        spec = base.with_labels(**labels)
        if mixture_kind:
            spec = replace(spec, mixture=spec.mixture.model_copy(update={"kind": mixture_kind}))
        return run_label_pass(spec)

    runs = {
        "bicro": label("labels_bicro", method="bicro"),
        "rcr": label("labels_rcr", method="rcr"),
        # SPS partitions with a GMM (docs/methods.md §7); a BMM's posteriors rarely pass 0.99.
        "sps": label("labels_sps", method="sps", mixture_kind="gmm"),
        "cosine": label("labels_cosine", method="cosine"),
    }
    model = runs["bicro"]["model_id"]
    common = {"noise": noise, "partial": args.partial, "samples": embed["embedded"]}
    common["model"] = model + ("" if pretrained else " (random init, untrained)")
    for method, summary in runs.items():
        quality = _quality_fields(summary["quality"][method])
        emit("label_quality", method=method, **common, **quality)
    for baseline in ("bmm_posterior", "gmm_posterior"):
        emit(
            "label_quality",
            method=baseline,
            **common,
            **_quality_fields(runs["bicro"]["quality"][baseline]),
        )

    gmm = label("labels_bicro_gmm", method="bicro", mixture_kind="gmm")
    for kind, summary, name in (("bmm", runs["bicro"], "labels_bicro"), ("gmm", gmm, None)):
        n_anchors, precision = _anchor_precision(
            f"{layout.output}/{name or 'labels_bicro_gmm'}", truth
        )
        emit(
            "ablation_bmm_vs_gmm_anchors",
            mixture=kind,
            **common,
            anchors=n_anchors,
            anchor_precision=precision,
            clean_subset_precision=summary["quality"]["bicro"]["precision"],
            auroc=summary["quality"]["bicro"]["auroc"],
        )
    rcr = runs["rcr"]["quality"]
    emit(
        "ablation_rcr_vs_cosine",
        **common,
        rcr_auroc=rcr["rcr"]["auroc"],
        cosine_on_c_auroc=rcr["rcr_cosine_on_c"]["auroc"],
        rcr_spearman=rcr["rcr"]["spearman"],
        cosine_on_c_spearman=rcr["rcr_cosine_on_c"]["spearman"],
        alpha_mean_auroc=rcr["rcr_alpha_mean"]["auroc"],
    )
    in_batch = label("labels_bicro_in_batch", method="bicro", bicro={"anchors": "in_batch"})
    emit(
        "ablation_global_vs_in_batch",
        **common,
        global_auroc=runs["bicro"]["quality"]["bicro"]["auroc"],
        in_batch_auroc=in_batch["quality"]["bicro"]["auroc"],
        global_spearman=runs["bicro"]["quality"]["bicro"]["spearman"],
        in_batch_spearman=in_batch["quality"]["bicro"]["spearman"],
    )
    fused = label("labels_bicro_fused", method="bicro", bicro={"label": "fused"})
    step_q, fused_q = runs["bicro"]["quality"], fused["quality"]
    emit(
        "ablation_bicro_step_vs_fused",
        **common,
        step_auroc=step_q["bicro"]["auroc"],
        fused_auroc=fused_q["bicro"]["auroc"],
        step_spearman=step_q["bicro"]["spearman"],
        fused_spearman=fused_q["bicro"]["spearman"],
        cosine_auroc=step_q["cosine"]["auroc"],
    )
    k_anchors = label("labels_bicro_k5", method="bicro", bicro={"anchor_k": 5})
    nearest_q, k_q = runs["bicro"]["quality"]["bicro"], k_anchors["quality"]["bicro"]
    emit(
        "ablation_bicro_nearest_vs_k_anchors",
        **common,
        anchor_k=5,
        nearest_auroc=nearest_q["auroc"],
        k_auroc=k_q["auroc"],
        nearest_spearman=nearest_q["spearman"],
        k_spearman=k_q["spearman"],
        cosine_auroc=runs["bicro"]["quality"]["cosine"]["auroc"],
    )
    # The clean posterior from both directions' GMMs (min) instead of the summed loss's GMM
    # (mixture.kind plays no part then).
    for method, base in (("bicro", gmm), ("sps", runs["sps"])):
        both = label(f"labels_{method}_both", method=method, posterior="both_directions")
        summed_q, both_q = base["quality"][method], both["quality"][method]
        emit(
            "ablation_both_directions",
            method=method,
            **common,
            summed_auroc=summed_q["auroc"],
            both_auroc=both_q["auroc"],
            summed_spearman=summed_q["spearman"],
            both_spearman=both_q["spearman"],
            summed_clean_precision=summed_q["precision"],
            both_clean_precision=both_q["precision"],
            summed_clean_recall=summed_q["recall"],
            both_clean_recall=both_q["recall"],
            cosine_auroc=base["quality"]["cosine"]["auroc"],
        )
    # The same model and corpus with losses averaged over 8 batch permutations (§1.1).
    (folder / "loss_permutations").mkdir(exist_ok=True)
    permuted = load_job(
        _job(
            folder / "loss_permutations",
            corpus,
            shards,
            pretrained,
            embed={"loss_permutations": 8},
            ray={"num_cpus": args.num_cpus},
        )
    )
    run_job(permuted)
    rcr_p = label("labels_rcr", method="rcr", on=permuted)["quality"]
    bicro_p = label("labels_bicro_gmm", method="bicro", mixture_kind="gmm", on=permuted)["quality"]
    emit(
        "ablation_loss_permutations",
        **common,
        permutations=8,
        gmm_posterior_auroc=[
            gmm["quality"]["gmm_posterior"]["auroc"],
            bicro_p["gmm_posterior"]["auroc"],
        ],
        gmm_clean_precision=[gmm["quality"]["bicro"]["precision"], bicro_p["bicro"]["precision"]],
        rcr_auroc=[rcr["rcr"]["auroc"], rcr_p["rcr"]["auroc"]],
        rcr_spearman=[rcr["rcr"]["spearman"], rcr_p["rcr"]["spearman"]],
        rcr_precision=[rcr["rcr"]["precision"], rcr_p["rcr"]["precision"]],
        note="[one batching, 8 permutations]",
    )
    label_seconds = runs["bicro"]["seconds"]["total"]
    emit(
        "label_pass_overhead",
        **common,
        embed_seconds=embed["seconds"],
        label_seconds=label_seconds,
        ratio=label_seconds / embed["seconds"] if embed["seconds"] else None,
        job_seconds=embed_seconds,
        note="tiny CPU model: the embed pass is unusually cheap, so the ratio overstates it",
    )


def warm_up(args, workdir: Path) -> str:
    """Warm up views A and B on a 40 %-noise corpus; returns view A's checkpoint."""
    folder = workdir / "warmup"
    corpus, shards, _ = _corpus(folder, args, 0.4, args.seed + 1)
    job = load_job(
        _job(
            folder,
            corpus,
            shards,
            None,
            train={"warmup_epochs": args.warmup_epochs, "rounds": 0},
            ray={"num_cpus": args.num_cpus},
        )
    )
    run_job(job)
    return RunLayout(job.output).model_checkpoint(0, "A")


def _demo_corpus(folder: Path, args, noise: float):
    """The corpus `make demo-full` writes (same generator arguments), at `noise`."""
    corpus = folder / "corpus"
    summary = make_corpus(
        corpus,
        samples=args.samples,
        noise=noise,
        partial=args.partial,
        seed=args.seed,
        samples_per_shard=args.samples_per_shard,
        test_samples=args.test_samples,
        val_samples=args.test_samples,
        corrupt=DEMO_CORRUPT,
    )
    return corpus, summary


def _demo_job(corpus: Path, summary, output: Path, mode: str, seed: int, args):
    """jobs/demo-full.yaml with only paths and the compared settings overridden: exactly what
    `ncl-pipeline run jobs/demo-full.yaml --set ...` runs, so the benchmark and a user's run
    measure one comparison."""
    last = len(summary.shards) - 1
    overrides = {
        "input.shards": f"{corpus}/{{00000..{last:05d}}}.tar",
        "output": str(output),
        "eval.ground_truth": str(corpus / "ground_truth.parquet"),
        "eval.test_shards": str(summary.test_shards[0]),
        "eval.val_shards": str(summary.val_shards[0]),
        "train.mode": mode,
        "train.rounds": args.rounds,
        "train.epochs_per_round": args.epochs_per_round,
        "seed": seed,
    }
    if args.method:
        overrides["labels.method"] = args.method
    if args.mixture:
        overrides["mixture.kind"] = args.mixture
    if args.warmup_epochs:
        overrides["train.warmup_epochs"] = args.warmup_epochs
    if args.num_cpus:
        overrides["ray.num_cpus"] = args.num_cpus
    overrides.update(dict(item.split("=", 1) for item in args.set))
    return load_job("jobs/demo-full.yaml", [f"{k}={v}" for k, v in overrides.items()])


def _runs(args) -> list[tuple[str, str | None]]:
    """(train.mode, labels.method) in order: coteach once per `--methods` entry, then each
    baseline once (the method does not change a baseline's training)."""
    runs = []
    for mode in args.modes:
        methods = args.methods if mode == "coteach" else [None]
        runs += [(mode, method) for method in methods]
    return runs


def run_coteaching(noise: float, args, workdir: Path) -> None:
    """Per repeat (seed): the demo job in every mode (and coteach with every method), sharing
    one warm-up (deterministic on CPU, so each run's own warm-up would be identical); medians
    over the repeats."""
    folder = workdir / f"coteach_{int(noise * 100)}"
    corpus, summary = _demo_corpus(folder, args, noise)
    final: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        warm = None
        for mode, method in _runs(args):
            name = mode if method is None else f"{mode}_{method}"
            run_args = argparse.Namespace(**{**vars(args), "method": method or args.method})
            job = _demo_job(corpus, summary, folder / f"seed{seed}" / name, mode, seed, run_args)
            if warm is not None:
                quality_web.share_warmup(warm, job.output)
            started = time.perf_counter()
            metrics = run_job(job)
            warm = warm or job.output
            table = metrics["coteaching"]
            for row in table:
                emit("coteach_round", noise=noise, mode=mode, seed=seed, **_settings(job), **row)
            final.setdefault(name, []).append(table[-1]["rsum_A+B"])
            emit(
                "coteach_run",
                noise=noise,
                mode=mode,
                seed=seed,
                **_settings(job),
                published_auroc=table[-1].get("auroc_combined"),
                published_spearman=table[-1].get("spearman_combined"),
                final_cosine_auroc=_final_cosine_auroc(metrics),
                rsum_ab=table[-1]["rsum_A+B"],
                seconds=time.perf_counter() - started,
            )
    medians = {name: statistics.median(values) for name, values in final.items()}

    def ratio(a, b):
        return a / b if a is not None and b else None

    baselines = {n: v for n, v in medians.items() if not n.startswith("coteach")}
    for name, value in medians.items():
        if not name.startswith("coteach"):
            continue
        emit(
            "coteach_vs_baselines",
            noise=noise,
            run=name,
            repeats=args.repeats,
            rsum=value,
            **{f"rsum_{b}": v for b, v in baselines.items()},
            **{f"over_{b}": ratio(value, v) for b, v in baselines.items()},
            bars="at 40 %: coteach/vanilla >= 1.5, /cosine_filter >= 1.1, /oracle >= 0.9",
        )


def _settings(job) -> dict:
    return {
        "method": job.labels.method,
        "mixture": job.mixture.kind,
        "bicro_label": job.labels.bicro.label,
        "rounds": job.train.rounds,
        "epochs_per_round": job.train.epochs_per_round,
    }


def _final_cosine_auroc(metrics: dict) -> float | None:
    """AUROC of the final models' own averaged cosine (the published labels must beat it)."""
    quality = (metrics.get("labels") or {}).get("quality") or {}
    return (quality.get("cosine") or {}).get("auroc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    parser.add_argument("--partial", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--samples-per-shard", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-cpus", type=int, default=None, help="local Ray CPUs (all)")
    parser.add_argument(
        "--model-checkpoint", default=None, help="ncl-tiny checkpoint (.pt) to label with"
    )
    parser.add_argument(
        "--warmup-epochs", type=int, default=0, help="warm a checkpoint up here first (0: no)"
    )
    parser.add_argument("--workdir", default=None, help="keep corpora and runs here")
    parser.add_argument("--coteach", action="store_true", help="co-teaching vs vanilla/oracle")
    parser.add_argument(
        "--method", default=None, choices=sorted(LABEL_METHODS), help="default: the demo job's"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[None],
        choices=sorted(LABEL_METHODS),
        help="--coteach: one coteach run per method, sharing the warm-up",
    )
    parser.add_argument("--mixture", default=None, choices=["bmm", "gmm"], help="--coteach")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["coteach", "vanilla", "cosine_filter", "oracle"],
        help="--coteach: train.mode values, run in this order (the first one warms up)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="--coteach: seeds; medians")
    parser.add_argument(
        "--set", action="append", default=[], help="--coteach: extra job overrides key=value"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs-per-round", type=int, default=2)
    parser.add_argument("--test-samples", type=int, default=500)
    parser.add_argument(
        "--corpus",
        choices=["demo", "web"],
        default="demo",
        help="demo: the NCR-protocol corpus (above); web: the web-noise benchmark "
        "(benchmarks/quality_web.py: every train.mode and method from the teacher, 3 seeds)",
    )
    quality_web.add_arguments(parser)
    args = parser.parse_args()
    if args.summarise:
        quality_web.summarise_files(args.summarise)
        return

    from pipeline.runtime.ray import init_ray

    init_ray(None, args.num_cpus)
    with tempfile.TemporaryDirectory(prefix="ncl-quality-") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.corpus == "web":
            if args.methods == [None]:
                args.methods = sorted(LABEL_METHODS)
            quality_web.run_web(args, workdir)
            return
        if args.coteach:
            for noise in args.noise:
                run_coteaching(noise, args, workdir)
            return
        pretrained = args.model_checkpoint
        if pretrained is None and args.warmup_epochs > 0:
            started = time.perf_counter()
            pretrained = warm_up(args, workdir)
            emit("warmup", epochs=args.warmup_epochs, seconds=time.perf_counter() - started)
        for noise in args.noise:
            run_noise_level(noise, args, workdir, pretrained)


if __name__ == "__main__":
    main()
