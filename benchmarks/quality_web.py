"""The web-noise benchmark (`benchmarks/quality.py --corpus web`): does cleaning beat the
CLIP-score filter a user would otherwise run?

Per seed: a web-noise corpus (`make_corpus(noise_model="web")`, docs/corpus.md), then
jobs/demo-web.yaml (co-teaching from the teacher, `make teacher`) once per compared run, with
only paths, the seed and the compared settings overridden, all sharing the first run's
warm-up:
  vanilla                 every pair, weight 1
  oracle                  the ground-truth clean pairs only
  filter_initial_<f>      CLIP-score filtering with the teacher (scored once, DataComp-style),
                          kept fraction f in {0.3, 0.5, fit (the mixture's clean weight), 0.7}
  filter_warmed           the warmed models' cosine, the fitted fraction (today's default)
  coteach_<method>        co-teaching with each method in --methods
  filter_labels_<m>_<f>   the same filter, ranking by our round-1 labels (method m, the two
                          views' mean) instead of the teacher's cosine, fractions as above
The best initial filter is picked per seed by **validation** rSum (the mean of A's and B's
rSum on the validation split after the last epoch); the test split is only reported.

Figures (one JSON line each): `web_teacher` (the label-level gates: the teacher's cosine AUROC
clean vs degree 0, per noise type, and the precision of the pairs each kept fraction retains),
`web_run` per run (test rSum of A+B, validation rSum, published-label AUROC overall and per
noise type, R@1 per test subgroup), and `web_summary` (medians over seeds with min and max, the
gates oracle / best filter >= 1.2 and oracle / vanilla >= 1.5, and each method's ratios).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.clients.read import read_labels
from pipeline.config import load_job
from pipeline.data.synthetic import make_corpus
from pipeline.io.layout import BASELINE_SUMMARY, RunLayout
from pipeline.run.runner import run_job
from pipeline.run.specs import fitted_clean_share

FRACTIONS = (0.3, 0.5, None, 0.7)  # None: the mixture's fitted clean weight
JOB = "jobs/demo-web.yaml"


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def _auroc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    if positive.all() or not positive.any():
        return None
    return float(roc_auc_score(positive, scores))


def _truth(path: str) -> dict[str, np.ndarray]:
    table = pq.read_table(path)
    return {
        name: np.asarray(table.column(name).to_pylist(), dtype=object)
        for name in table.column_names
    }


def _join(truth: dict, keys: list[str]) -> np.ndarray:
    """Rows of `truth` for `keys` (every key must be in the ground truth)."""
    position = {k: i for i, k in enumerate(truth["key"])}
    return np.array([position[k] for k in keys], dtype=np.int64)


def per_noise_type_auroc(scores: np.ndarray, noise_type: np.ndarray, kind: np.ndarray) -> dict:
    """AUROC of `scores` separating clean pairs from each noise type's pairs, and overall
    (clean vs degree 0: every mismatched pair)."""
    clean = kind == "clean"
    out = {
        "all_mismatched": _auroc(
            scores[clean | (kind == "mismatched")], clean[clean | (kind == "mismatched")]
        )
    }
    for name in sorted(set(noise_type[~clean])):
        rows = clean | (noise_type == name)
        out[name] = _auroc(scores[rows], clean[rows])
    return out


def teacher_gate(run_dir: str, truth: dict, fitted: float) -> dict:
    """The teacher's (round-0, view a) cosine against the ground truth."""
    layout = RunLayout(run_dir)
    folder = Path(layout.embeddings_dir(0))
    keys, cosine = [], []
    for path in sorted(folder.glob("*.parquet")):
        table = pq.read_table(path, columns=["key", "cosine_a"])
        keys += table.column("key").to_pylist()
        cosine.append(table.column("cosine_a").to_numpy())
    scores = np.concatenate(cosine).astype(np.float64)
    rows = _join(truth, keys)
    kind, noise_type = truth["kind"][rows], truth["noise_type"][rows]
    order = np.argsort(-scores, kind="stable")
    precision = {}
    for fraction in (0.3, 0.5, fitted, 0.7):
        kept = order[: max(1, round(fraction * len(order)))]
        precision[f"{fraction:.3f}"] = float(np.mean(kind[kept] == "clean"))
    return {
        "pairs": len(keys),
        "clean_share": float(np.mean(kind == "clean")),
        "auroc": per_noise_type_auroc(scores, noise_type, kind),
        "kept_precision": precision,
    }


def published_quality(run_dir: str, truth: dict) -> dict:
    table = read_labels(run_dir).to_table(columns=["key", "soft_label"])
    rows = _join(truth, table.column("key").to_pylist())
    scores = table.column("soft_label").to_numpy().astype(np.float64)
    return per_noise_type_auroc(scores, truth["noise_type"][rows], truth["kind"][rows])


def subgroup_recall(job, round_index: int, test_truth: dict) -> dict:
    """R@1 (both directions, A+B averaged similarity) per test subgroup: cluttered vs plain
    images, and each caption style."""
    import torch

    from pipeline.core.metrics import similarity_for_eval
    from pipeline.io.shards import (
        Rejection,
        decode_record,
        expand_shard_patterns,
        iter_shard_records,
    )
    from pipeline.models import ModelSpec, load_clip
    from pipeline.stages.train.evaluation import embed_eval_set, load_eval_set

    layout = RunLayout(job.output)
    shards = expand_shard_patterns(job.eval.test_shards)
    loaded = {
        view: load_clip(
            ModelSpec(job.model.name, layout.model_checkpoint(round_index, view), "fp32")
        )
        for view in ("A", "B")
    }
    eval_set = load_eval_set(shards, loaded["A"].preprocess, loaded["A"].tokenizer)
    keys = []  # the eval set's text order: every decodable record, in shard order
    for path in shards:
        for record in iter_shard_records(path):
            if not isinstance(record, Rejection) and not isinstance(
                decode_record(record), Rejection
            ):
                keys.append(record.key)
    (ua, ta), (ub, tb) = (embed_eval_set(loaded[v], eval_set) for v in ("A", "B"))
    sim = similarity_for_eval(ua, ta, ub, tb)  # (n_images, n_texts)
    sim = sim.numpy() if isinstance(sim, torch.Tensor) else np.asarray(sim)
    text_image = eval_set.text_to_image
    t2i_hit = sim.argmax(axis=0) == text_image  # (n_texts,)
    i2t_hit = text_image[sim.argmax(axis=1)] == np.arange(sim.shape[0])  # (n_images,)
    rows = _join(test_truth, keys)
    first_text = {}
    for t, image in enumerate(text_image):
        first_text.setdefault(int(image), t)
    image_rows = rows[[first_text[i] for i in range(sim.shape[0])]]
    out = {}
    for column in ("cluttered", "caption_style"):
        for value in sorted(set(test_truth[column][rows]), key=str):
            texts = test_truth[column][rows] == value
            images = test_truth[column][image_rows] == value
            out[f"{column}={value}"] = {
                "t2i_r1": 100.0 * float(t2i_hit[texts].mean()),
                "i2t_r1": 100.0 * float(i2t_hit[images].mean()) if images.any() else None,
                "texts": int(texts.sum()),
            }
    return out


def _runs(methods: list[str]) -> list[tuple[str, dict]]:
    """(name, overrides) in order; the first one warms up for all."""
    runs = [("vanilla", {"train.mode": "vanilla"}), ("oracle", {"train.mode": "oracle"})]
    for fraction in FRACTIONS:
        name = f"filter_initial_{'fit' if fraction is None else fraction}"
        runs.append(
            (
                name,
                {
                    "train.mode": "cosine_filter",
                    "train.filter_scorer": "initial",
                    "train.filter_fraction": "null" if fraction is None else fraction,
                },
            )
        )
    runs.append(("filter_warmed", {"train.mode": "cosine_filter", "train.filter_scorer": "warmed"}))
    runs += [(f"coteach_{m}", {"train.mode": "coteach", "labels.method": m}) for m in methods]
    for method in methods:  # our labels used the way the CLIP score is
        for fraction in FRACTIONS:
            overrides = {
                "train.mode": "cosine_filter",
                "train.filter_scorer": "labels",
                "labels.method": method,
                "train.filter_fraction": "null" if fraction is None else fraction,
            }
            runs.append(
                (f"filter_labels_{method}_{'fit' if fraction is None else fraction}", overrides)
            )
    return runs


def share_warmup(source: str, target: str) -> None:
    """Start `target` from `source`'s round 0 (embeddings, warm-up, quarantine, manifest)."""
    Path(target).mkdir(parents=True, exist_ok=True)
    for name in ("rounds/0", "quarantine"):
        shutil.copytree(Path(source, name), Path(target, name), dirs_exist_ok=True)
    shutil.copy(Path(source, "manifest.json"), Path(target, "manifest.json"))


def _val_rsum(metrics: dict, rounds: int) -> float | None:
    views = ((metrics["rounds"].get(str(rounds)) or {}).get("train") or {}).get("views") or {}
    values = [v["history"][-1]["val_rsum"] for v in views.values() if v.get("history")]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def run_web(args, workdir: Path) -> None:
    teacher = Path(args.teacher)
    if not teacher.is_file():
        raise SystemExit(f"no teacher at {teacher}: run `make teacher` first (or pass --teacher)")
    results: dict[str, list[dict]] = {}
    gates: list[dict] = []
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        folder = workdir / f"web_seed{seed}"
        corpus = folder / "corpus"
        summary = make_corpus(
            corpus,
            noise_model="web",
            samples=args.samples,
            seed=seed,
            samples_per_shard=args.samples_per_shard,
            test_samples=args.test_samples,
            val_samples=args.val_samples,
        )
        truth = _truth(summary.ground_truth)
        test_truth = _truth(summary.test_ground_truth)
        # A vanilla run kept from an earlier call (--only) lends its warm-up to the new runs.
        kept = folder / "vanilla"
        warmed = (kept / "rounds" / "0" / "checkpoints" / "train_summary.json").exists()
        base = str(kept) if warmed else None
        for name, extra in _runs(args.methods):
            if args.only and name not in args.only:
                continue
            overrides = {
                "input.shards": f"{corpus}/{{00000..{len(summary.shards) - 1:05d}}}.tar",
                "output": str(folder / name),
                "model.pretrained": str(teacher.resolve()),
                "eval.ground_truth": summary.ground_truth,
                "eval.test_shards": summary.test_shards[0],
                "eval.val_shards": summary.val_shards[0],
                "seed": seed,
                **({"ray.num_cpus": args.num_cpus} if args.num_cpus else {}),
                **extra,
            }
            overrides.update(dict(item.split("=", 1) for item in args.set))
            job = load_job(JOB, [f"{k}={v}" for k, v in overrides.items()])
            if base is not None and base != job.output:
                share_warmup(base, job.output)
            started = time.perf_counter()
            metrics = run_job(job)
            seconds = time.perf_counter() - started
            base = base or job.output
            if name == "vanilla":
                gate = teacher_gate(
                    job.output, truth, fitted_clean_share(job, RunLayout(job.output))
                )
                gates.append(gate)
                emit("web_teacher", seed=seed, **gate)
            row = metrics["coteaching"][-1]
            record = {
                "run": name,
                "seed": seed,
                "test_rsum_ab": row["rsum_A+B"],
                "val_rsum": _val_rsum(metrics, job.train.rounds),
                "published_auroc": published_quality(job.output, truth),
                "subgroups": subgroup_recall(job, job.train.rounds, test_truth),
                "seconds": seconds,
            }
            if job.train.mode == "cosine_filter":
                record["filter"] = json.loads(
                    Path(
                        RunLayout(job.output).baseline_dir(1, "cosine_filter"), BASELINE_SUMMARY
                    ).read_text()
                )
                record["filter"].pop("kept", None)
            results.setdefault(name, []).append(record)
            emit("web_run", **record)
            if not args.keep_runs and name != "vanilla":
                shutil.rmtree(job.output, ignore_errors=True)
    summarise(results, gates)


def summarise(results: dict[str, list[dict]], gates: list[dict]) -> None:
    """Medians over seeds; the best initial filter is chosen per seed on validation rSum."""
    seeds = sorted({r["seed"] for rows in results.values() for r in rows})
    by_seed = {name: {r["seed"]: r for r in rows} for name, rows in results.items()}
    test = {name: _spread([r["test_rsum_ab"] for r in rows]) for name, rows in results.items()}
    prefixes = {"filter_initial_"} | {
        name.rsplit("_", 1)[0] + "_" for name in results if name.startswith("filter_labels_")
    }
    chosen = []
    for prefix in sorted(prefixes):
        best, picks = _best_by_validation(by_seed, seeds, prefix)
        test[f"{prefix}best_by_val"] = _spread(best)
        chosen += picks if prefix == "filter_initial_" else []
    med = {name: spread["median"] for name, spread in test.items()}

    def ratio(a, b):
        return None if med.get(a) is None or not med.get(b) else med[a] / med[b]

    emit(
        "web_summary",
        seeds=seeds,
        test_rsum=test,
        best_filter_choice=chosen,
        teacher_auroc=_spread([g["auroc"]["all_mismatched"] for g in gates]),
        teacher_auroc_page_swap=_spread([g["auroc"].get("page_swap") for g in gates]),
        gates={
            "oracle_over_best_filter": ratio("oracle", "filter_initial_best_by_val"),
            "oracle_over_vanilla": ratio("oracle", "vanilla"),
            "bars": "oracle/best filter >= 1.2, oracle/vanilla >= 1.5, teacher AUROC <= 0.92",
        },
        methods={
            name: {
                "over_best_filter": ratio(name, "filter_initial_best_by_val"),
                "over_oracle": ratio(name, "oracle"),
                "over_vanilla": ratio(name, "vanilla"),
                "published_auroc": _spread(
                    [r["published_auroc"]["all_mismatched"] for r in results[name]]
                ),
            }
            for name in results
            if name.startswith("coteach_")
        }
        | {
            name: {"over_best_filter": ratio(name, "filter_initial_best_by_val")}
            for name in test
            if name.startswith("filter_labels_") and name.endswith("best_by_val")
        },
    )


def _best_by_validation(by_seed: dict, seeds: list, prefix: str) -> tuple[list, list]:
    """Per seed, the test rSum of the run named `prefix...` with the best validation rSum
    (the kept fraction is picked on validation, never on test), and the runs picked."""
    best, chosen = [], []
    for seed in seeds:
        candidates = [
            by_seed[n][seed]
            for n in by_seed
            if n.startswith(prefix)
            and seed in by_seed[n]
            and by_seed[n][seed]["val_rsum"] is not None
        ]
        if candidates:
            pick = max(candidates, key=lambda r: r["val_rsum"])
            best.append(pick["test_rsum_ab"])
            chosen.append(pick["run"])
    return best, chosen


def summarise_files(paths: list[str]) -> None:
    """`web_summary` over the `web_run` and `web_teacher` lines of earlier outputs (several
    calls with --only, e.g. the baselines first and more methods later)."""
    results: dict[str, dict[int, dict]] = {}
    gates: dict[int, dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if row.get("figure") == "web_run":
                results.setdefault(row["run"], {})[row["seed"]] = row  # the latest wins
            elif row.get("figure") == "web_teacher":
                gates[row["seed"]] = row
    summarise({n: list(rows.values()) for n, rows in results.items()}, list(gates.values()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--corpus web")
    group.add_argument("--teacher", default="data/teacher/model.pt", help="`make teacher` output")
    group.add_argument("--val-samples", type=int, default=500)
    group.add_argument("--only", nargs="+", default=None, help="run only these runs (names above)")
    group.add_argument("--keep-runs", action="store_true", help="keep every run directory")
    group.add_argument(
        "--summarise", nargs="+", default=None, help="only summarise these earlier outputs"
    )
