"""The selection benchmark, DataComp's protocol: what is a student trained from scratch on what
each scorer keeps worth? (docs/benchmarks.md "Subset selection")

Per seed: the web pool (`make_corpus(noise_model="web")` with `WEB_POOL`; `--pool ncr`: the
classic one), one `jobs/demo-web.yaml` run per label method (co-teaching from the teacher,
`make teacher`; the published labels), then one student per arm: ncl-tiny from random init,
plain InfoNCE, the same number of samples seen for every arm (`--samples-seen`; DataComp's
fixed-compute rule: a smaller subset is seen for more epochs). Arms, each keeping the top
fraction f of the pool for f in `--fractions`:
  none                    every pair (no f)
  random                  a seeded random f (the control)
  oracle                  the ground-truth clean pairs (no f)
  teacher                 the teacher's CLIP score (what users run today)
  negclip                 negCLIPLoss (Wang et al., NeurIPS 2024) on the teacher's embeddings
  teacher_in_clean        the teacher's top f among the truly clean pairs (the headroom arm:
                          what perfect correspondence knowledge adds to the teacher)
  labels_<m>              our published soft labels, through `ncl-pipeline export
                          --keep-fraction f --rank-by soft_label --format keys`
  weights_<m>             every pair, its InfoNCE term weighted by its soft label (no f)
  fusion_<m>              the mean percentile rank of our label and the run's CLIP score,
                          through `export --keep-fraction f --rank-by fusion`
Each arm's f is picked on the **validation** rSum; the test split is only reported (rSum, per
caption style, and the attribute accuracy below). Medians over seeds with min-max.

Attribute accuracy (zero-shot): for every test image and each attribute (shape, colour, size,
position, count, background), the student ranks the image's true full caption against the
captions that differ in that attribute only; the share ranked first, per attribute and mean.

Figures (JSON lines): `selection_scorers` per seed (AUROC and kept precision of each scorer),
`selection_arm` per seed and arm and f, `selection_summary` (medians, picked f, the gates:
oracle >= 1.3x none, teacher_in_clean >= 1.1x teacher; the win: best label arm >= 1.1x teacher,
>= 1.05x negclip, >= 0.95x teacher_in_clean).

    python benchmarks/selection.py --seeds 0 1 2 --out benchmarks/results/selection.jsonl
    python benchmarks/selection.py --summarise benchmarks/results/selection.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline.runtime.ray import apply_loopback_defaults  # noqa: E402

apply_loopback_defaults()

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from quality_web import _join, _truth, per_noise_type_auroc, share_warmup  # noqa: E402
from web_screen import decode  # noqa: E402

from pipeline.clients.read import read_labels  # noqa: E402
from pipeline.config import load_job  # noqa: E402
from pipeline.core.losses.training import weighted_infonce  # noqa: E402
from pipeline.core.metrics import retrieval_recall, similarity_for_eval  # noqa: E402
from pipeline.core.selection import neg_clip_loss, top_fraction  # noqa: E402
from pipeline.data.scenes import (  # noqa: E402
    ALLOWED_COLOURS,
    BACKGROUNDS,
    COUNTS,
    POSITIONS,
    SHAPES,
    SIZES,
    parse_caption,
    render_caption,
)
from pipeline.data.synthetic import WebNoise, make_corpus  # noqa: E402
from pipeline.io.layout import RunLayout  # noqa: E402
from pipeline.io.shards import Rejection, decode_record, iter_shard_records  # noqa: E402
from pipeline.models import ModelSpec, load_clip  # noqa: E402
from pipeline.run.runner import run_job  # noqa: E402
from pipeline.stages.export.driver import ExportSpec, export_run  # noqa: E402
from pipeline.stages.train.evaluation import embed_eval_set, load_eval_set  # noqa: E402

JOB = "jobs/demo-web.yaml"
FRACTIONS = (0.3, 0.5, 0.7)
GATES = {"oracle_over_none": 1.3, "headroom": 1.1}
WIN = {"teacher": 1.1, "negclip": 1.05, "teacher_in_clean": 0.95}


def emit(out, figure: str, **values) -> None:
    line = json.dumps({"figure": figure, **values})
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


# --------------------------------------------------------------------------------------------
# Scorers


def teacher_scores(run: str, keys: list[str], batch_size: int) -> dict[str, np.ndarray]:
    """The teacher's CLIP score and negCLIPLoss per pool key, from the run's round-0 embeddings
    (the teacher embeds the pool before any training)."""
    folder = Path(RunLayout(run).embeddings_dir(0))
    tables = [pq.read_table(p) for p in sorted(folder.glob("*.parquet"))]
    scale = float(
        pq.read_schema(sorted(folder.glob("*.parquet"))[0]).metadata[b"ncl.logit_scale.a"]
    )
    got = [k for t in tables for k in t.column("key").to_pylist()]
    image = np.concatenate(
        [np.stack(t.column("image_embedding_a").to_numpy(False)) for t in tables]
    )
    text = np.concatenate([np.stack(t.column("text_embedding_a").to_numpy(False)) for t in tables])
    cosine = np.concatenate([t.column("cosine_a").to_numpy() for t in tables]).astype(np.float64)
    neg = neg_clip_loss(image, text, scale, batch_size=batch_size)
    where = {k: i for i, k in enumerate(got)}
    rows = np.array([where[k] for k in keys])
    return {"teacher": cosine[rows], "negclip": neg[rows]}


def published_labels(run: str, keys: list[str]) -> np.ndarray:
    table = read_labels(run).to_table(columns=["key", "soft_label"])
    where = {k: i for i, k in enumerate(table.column("key").to_pylist())}
    labels = table.column("soft_label").to_numpy().astype(np.float64)
    return np.array([labels[where[k]] if k in where else np.nan for k in keys])


def exported_keys(run: str, out: Path, fraction: float, rank_by: str) -> set[str]:
    """The keys `ncl-pipeline export --keep-fraction f --rank-by R --format keys` writes:
    what a user of the labels trains on."""
    spec = ExportSpec(
        run=run, out=str(out), format="keys", keep_fraction=fraction, rank_by=rank_by,
        overwrite=True,
    )  # fmt: skip
    export_run(spec)
    return set(pq.read_table(out / "keys.parquet", columns=["key"]).column("key").to_pylist())


# --------------------------------------------------------------------------------------------
# The student


def train_student(pixels, tokens, rows, weights, args, seed: int):
    """ncl-tiny from random init on pool rows `rows` ((n,) int64) for `args.samples_seen`
    samples: AdamW, linear warm-up then cosine, InfoNCE weighted by `weights` (None: 1)."""
    loaded = load_clip(ModelSpec(args.model, None, "fp32", seed=seed))
    model = loaded.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    steps = args.samples_seen // args.batch
    batches = max(1, len(rows) // args.batch)
    step = 0
    while step < steps:
        order = rows[torch.randperm(len(rows), generator=generator)]
        for b in range(batches):
            if step == steps:
                break
            scale = (
                min(1.0, (step + 1) / args.lr_warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
            )
            for group in optimizer.param_groups:
                group["lr"] = args.lr * scale
            batch = order[b * args.batch : (b + 1) * args.batch]
            image_emb, text_emb, logit_scale = model(pixels[batch], tokens[batch])
            w = torch.ones(len(batch)) if weights is None else weights[batch]
            loss = weighted_infonce(image_emb, text_emb, logit_scale, w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
    model.eval()
    return loaded


def rsum_by_style(loaded, eval_set, styles: np.ndarray | None) -> dict[str, float]:
    """rSum of the whole split and, with `styles` (one per caption), within each style."""
    image_emb, text_emb = embed_eval_set(loaded, eval_set)
    out = {
        "all": retrieval_recall(similarity_for_eval(image_emb, text_emb), eval_set.text_to_image)[
            "rsum"
        ]
    }
    for style in sorted(set(styles)) if styles is not None else []:
        texts = np.flatnonzero(styles == style)
        images = np.unique(eval_set.text_to_image[texts])
        remap = {int(j): i for i, j in enumerate(images)}
        sim = similarity_for_eval(image_emb[images], text_emb[texts])
        target = np.array([remap[int(j)] for j in eval_set.text_to_image[texts]])
        out[style] = retrieval_recall(sim, target)["rsum"]
    return {k: round(float(v), 1) for k, v in out.items()}


ATTRIBUTE_VALUES = {
    "shape": SHAPES,
    "size": SIZES,
    "position": POSITIONS,
    "count": COUNTS,
    "background": tuple(BACKGROUNDS),
}


def attribute_probe(test_dir: str, loaded_preprocess) -> tuple[torch.Tensor, list, list]:
    """Test images, their scenes, and per attribute the candidate captions' scenes."""
    truth = pq.read_table(f"{test_dir}/ground_truth.parquet", columns=["key", "caption"])
    scenes = {k: parse_caption(c) for k, c in zip(*truth.to_pydict().values(), strict=True)}
    pixels, kept = [], []
    for path in sorted(Path(test_dir).glob("[0-9]*.tar")):
        for record in iter_shard_records(str(path)):
            sample = record if isinstance(record, Rejection) else decode_record(record)
            if not isinstance(sample, Rejection) and scenes.get(record.key) is not None:
                pixels.append(loaded_preprocess(sample.image))
                kept.append(scenes[record.key])
    return torch.stack(pixels), kept, list(ATTRIBUTE_VALUES) + ["colour"]


def attribute_accuracy(loaded, probe) -> dict[str, float]:
    """Zero-shot accuracy per attribute (see the module docstring) and their mean."""
    pixels, scenes, attributes = probe
    out = {}
    with torch.no_grad():
        image = torch.nn.functional.normalize(loaded.model.encode_image(pixels).float(), dim=-1)
        for attribute in attributes:
            options = [
                ALLOWED_COLOURS[s.background]
                if attribute == "colour"
                else ATTRIBUTE_VALUES[attribute]
                for s in scenes
            ]
            captions = [
                render_caption(dataclasses.replace(s, **{attribute: v}))
                for s, values in zip(scenes, options, strict=True)
                for v in values
            ]
            text = torch.cat(
                [
                    loaded.model.encode_text(loaded.tokenizer(captions[i : i + 1024])).float()
                    for i in range(0, len(captions), 1024)
                ]
            )
            text = torch.nn.functional.normalize(text, dim=-1)
            hits, start = [], 0
            for i, (scene, values) in enumerate(zip(scenes, options, strict=True)):
                pick = int((text[start : start + len(values)] @ image[i]).argmax())
                hits.append(values[pick] == getattr(scene, attribute))
                start += len(values)
            out[attribute] = round(float(np.mean(hits)), 3)
    out["mean"] = round(float(np.mean(list(out.values()))), 3)
    return out


# --------------------------------------------------------------------------------------------
# One seed


# The web pool is the web corpus with more of the noise the teacher sees (random swaps 0.20 ->
# 0.26, boilerplate 0.08 -> 0.10) in place of some partial captions (partial 0.10 -> 0.05, page
# captions 0.06 -> 0.03), so the clean share stays 0.475: the teacher's AUROC moves toward a
# real CLIP scorer's 0.80-0.90 (0.79 on the plain web corpus). docs/benchmarks.md.
WEB_POOL = {"random_swap": 0.26, "boilerplate": 0.10, "partial": 0.05, "page_caption": 0.03}


def corpus_and_runs(args, seed: int, workdir: Path):
    folder = workdir / (f"seed{seed}" if args.pool == "web" else f"{args.pool}-seed{seed}")
    summary = make_corpus(
        folder / "corpus",
        noise_model=args.pool,  # ncr: 40% random swaps, 10% one attribute changed
        web=WebNoise(**WEB_POOL) if args.pool == "web" else None,
        samples=args.samples,
        seed=seed,
        samples_per_shard=500,
        test_samples=args.test_samples,
        val_samples=args.val_samples,
    )
    runs, base, seconds = {}, None, {}
    for method in args.methods:
        overrides = {
            "input.shards": f"{folder}/corpus/{{00000..{len(summary.shards) - 1:05d}}}.tar",
            "output": str(folder / method),
            "model.pretrained": str(Path(args.teacher).resolve()),
            "eval.ground_truth": summary.ground_truth,
            "eval.test_shards": summary.test_shards[0],
            "eval.val_shards": summary.val_shards[0],
            "labels.method": method,
            "seed": seed,
        }
        job = load_job(JOB, [f"{k}={v}" for k, v in overrides.items()])
        if base is not None:
            share_warmup(base, job.output)  # one warm-up per seed: the methods differ after it
        started = time.perf_counter()
        run_job(job)
        seconds[method] = round(time.perf_counter() - started, 1)
        base = base or job.output
        runs[method] = job.output
    return folder, summary, runs, seconds


def arms_for(scores: dict, clean: np.ndarray, keys: np.ndarray, args, rng, exports) -> dict:
    """{(arm, f or None): (rows, weights or None)} over pool rows."""
    n = len(keys)
    arms: dict = {
        ("none", None): (np.arange(n), None),
        ("oracle", None): (np.flatnonzero(clean), None),
    }
    for method, labels in scores["labels"].items():
        arms[(f"weights_{method}", None)] = (np.arange(n), np.nan_to_num(labels, nan=0.0))
    for f in args.fractions:
        arms[("random", f)] = (np.sort(rng.permutation(n)[: round(f * n)]), None)
        for name in ("teacher", "negclip"):
            arms[(name, f)] = (np.flatnonzero(top_fraction(scores[name], keys, f)), None)
        in_clean = np.where(clean, scores["teacher"], np.nan)
        arms[("teacher_in_clean", f)] = (np.flatnonzero(top_fraction(in_clean, keys, f)), None)
        for method in scores["labels"]:
            for arm, rank_by in (("labels", "soft_label"), ("fusion", "fusion")):
                kept = exports[(method, f, rank_by)]
                arms[(f"{arm}_{method}", f)] = (np.flatnonzero([k in kept for k in keys]), None)
    return arms


def run_seed(args, seed: int, workdir: Path, out) -> None:
    folder, summary, runs, seconds = corpus_and_runs(args, seed, workdir)
    student = load_clip(ModelSpec(args.model, None, "fp32"))
    pixels, tokens, keys = decode(str(folder / "corpus"), student)
    truth = _truth(summary.ground_truth)
    rows = _join(truth, keys)
    kind = truth["kind"][rows]
    noise_type = truth.get("noise_type", truth["kind"])[rows]  # ncr: the kind is the type
    clean = kind == "clean"
    first = runs[args.methods[0]]
    scores = teacher_scores(first, keys, args.batch)
    scores["labels"] = {m: published_labels(r, keys) for m, r in runs.items()}
    flat = {"teacher": scores["teacher"], "negclip": scores["negclip"]}
    flat |= {f"labels_{m}": v for m, v in scores["labels"].items()}
    emit(
        out,
        "selection_scorers",
        seed=seed,
        pool=args.pool,
        pool_knobs=WEB_POOL if args.pool == "web" else {},
        pairs=len(keys),
        clean_share=round(float(clean.mean()), 3),
        auroc={
            name: {
                t: round(v, 3)
                for t, v in per_noise_type_auroc(
                    np.nan_to_num(s, nan=-1.0), noise_type, kind
                ).items()
                if v is not None
            }
            for name, s in flat.items()
        },
        run_seconds=seconds,
        kept_precision={
            name: {
                str(f): round(float(clean[top_fraction(s, np.array(keys), f)].mean()), 3)
                for f in args.fractions
            }
            for name, s in flat.items()
        },
    )
    exports = {
        (m, f, by): exported_keys(r, folder / f"export_{m}_{f}_{by}", f, by)
        for m, r in runs.items()
        for f in args.fractions
        for by in ("soft_label", "fusion")
    }
    rng = np.random.default_rng(seed)
    arms = arms_for(scores, clean, np.array(keys), args, rng, exports)
    val = load_eval_set(summary.val_shards, student.preprocess, student.tokenizer)
    test = load_eval_set(summary.test_shards, student.preprocess, student.tokenizer)
    test_truth = _truth(summary.test_ground_truth)
    styles = test_truth.get("caption_style")  # one per test caption (web only)
    styles = styles if styles is not None and len(styles) == test.n_texts else None
    probe = attribute_probe(str(Path(summary.test_shards[0]).parent), student.preprocess)
    for (arm, f), (kept, weights) in arms.items():
        if args.arms and arm not in args.arms:
            continue
        started = time.perf_counter()
        model = train_student(
            pixels,
            tokens,
            torch.from_numpy(kept),
            None if weights is None else torch.tensor(weights, dtype=torch.float32),
            args,
            seed,
        )
        emit(
            out,
            "selection_arm",
            seed=seed,
            arm=arm,
            fraction=f,
            pairs=len(kept),
            precision=round(float(clean[kept].mean()), 3) if len(kept) else None,
            val_rsum=rsum_by_style(model, val, None)["all"],
            test_rsum=rsum_by_style(model, test, styles),
            attributes=attribute_accuracy(model, probe),
            seconds=round(time.perf_counter() - started, 1),
        )


# --------------------------------------------------------------------------------------------
# Summary


def _spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarise(lines: list[dict]) -> dict:
    """Per arm: f picked per seed on validation rSum, then medians of its test figures."""
    by_seed_arm: dict = {}
    for line in lines:
        if line.get("figure") == "selection_arm":
            by_seed_arm.setdefault((line["seed"], line["arm"]), []).append(line)
    per_arm: dict = {}
    for (_seed, arm), options in sorted(by_seed_arm.items()):
        best = max(options, key=lambda r: r["val_rsum"])
        per_arm.setdefault(arm, []).append(best)
    table = {}
    for arm, picks in per_arm.items():
        styles = sorted(picks[0]["test_rsum"])
        table[arm] = {
            "fractions": [p["fraction"] for p in picks],
            "seeds": [p["seed"] for p in picks],
            "test_rsum": _spread([p["test_rsum"]["all"] for p in picks]),
            "val_rsum": _spread([p["val_rsum"] for p in picks]),
            "precision": _spread([p["precision"] for p in picks]),
            "attribute_mean": _spread([p["attributes"]["mean"] for p in picks]),
            "test_rsum_by_style": {
                s: statistics.median(p["test_rsum"][s] for p in picks) for s in styles if s != "all"
            },
        }

    def ratio(a: str, b: str) -> float | None:
        if a not in table or b not in table:
            return None
        return round(table[a]["test_rsum"]["median"] / table[b]["test_rsum"]["median"], 3)

    label_arms = [a for a in table if a.split("_")[0] in ("labels", "weights", "fusion")]
    best = max(label_arms, key=lambda a: table[a]["val_rsum"]["median"]) if label_arms else None
    gates = {
        "oracle_over_none": ratio("oracle", "none"),
        "headroom": ratio("teacher_in_clean", "teacher"),
    }
    win = {f"over_{b}": ratio(best, b) for b in WIN} if best else {}
    per_seed: dict = {}  # (scorer, seed) -> AUROC; a later invocation's line adds scorers
    for line in lines:
        if line.get("figure") == "selection_scorers":
            for name, values in line["auroc"].items():
                per_seed[(name, line["seed"])] = values["all_mismatched"]
    auroc = {
        name: _spread([v for (n, _), v in per_seed.items() if n == name])
        for name in dict.fromkeys(n for n, _ in per_seed)
    }
    return {
        "scorer_auroc": auroc,
        "arms": table,
        "gates": gates,
        "gates_hold": {k: v is not None and v >= GATES[k] for k, v in gates.items()},
        "best_label_arm": best,
        "win": win,
        "win_holds": {
            k: v is not None and v >= WIN[k.removeprefix("over_")] for k, v in win.items()
        },
    }


ARM_NAMES = {
    "none": "no filter (every pair)",
    "random": "random f (the control)",
    "oracle": "the true clean pairs (oracle)",
    "teacher": "the teacher's CLIP score (DataComp's baseline)",
    "negclip": "negCLIPLoss on the teacher (Wang et al. 2024)",
    "teacher_in_clean": "the teacher's top f among the true clean pairs (headroom)",
    "labels": "our soft labels, top f (`export --keep-fraction`)",
    "weights": "our soft labels as per-pair weights",
    "fusion": "rank fusion of our labels and the run's CLIP score (`--rank-by fusion`)",
}


def _arm_order(arm: str, order: list[str]) -> tuple[int, str]:
    kind = arm if arm in order else arm.partition("_")[0]
    return order.index(kind), arm


def markdown_table(summary: dict) -> str:
    """The README / docs table: test rSum, picked f, kept precision, attribute accuracy."""

    def cell(spread: dict, digits: int = 1) -> str:
        return (
            f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"
        )

    rows = [
        "| kept pairs | f picked on validation | precision | test rSum | attribute accuracy |",
        "|---|---|---|---|---|",
    ]
    order = list(ARM_NAMES)
    for arm, row in sorted(summary["arms"].items(), key=lambda item: _arm_order(item[0], order)):
        kind, _, method = arm.partition("_")
        name = ARM_NAMES.get(arm) or f"{ARM_NAMES[kind]}, {method}"
        picked = "-" if row["fractions"][0] is None else " / ".join(map(str, row["fractions"]))
        bold = "**" if arm == summary["best_label_arm"] else ""
        rows.append(
            f"| {name} | {picked} | {cell(row['precision'], 2)} | {bold}{cell(row['test_rsum'])}"
            f"{bold} | {cell(row['attribute_mean'], 3)} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["assign"], help="label methods (runs)")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--arms", nargs="*", help="only these arms (default: all)")
    parser.add_argument("--pool", choices=("web", "ncr"), default="web", help="noise model")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--val-samples", type=int, default=500)
    parser.add_argument("--test-samples", type=int, default=500)
    parser.add_argument("--samples-seen", type=int, default=12_000, help="per student, every arm")
    parser.add_argument("--model", default="ncl-tiny")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-warmup", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--teacher", default="data/teacher/model.pt")
    parser.add_argument("--workdir", default="/tmp/selection-bench")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--summarise", nargs="+", default=None, help="summarise JSON-line files")
    args = parser.parse_args()
    if args.summarise:
        lines = [
            json.loads(x) for p in args.summarise for x in Path(p).read_text().splitlines() if x
        ]
        summary = summarise(lines)
        print(json.dumps({"figure": "selection_summary", **summary}, indent=1))
        print(markdown_table(summary))
        return
    if not Path(args.teacher).exists():
        sys.exit(f"{args.teacher} is missing: run `make teacher` first")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (appended as it goes)
    lines = []
    started = time.perf_counter()
    for seed in args.seeds:
        run_seed(args, seed, Path(args.workdir), out)
    if args.out:
        out.close()
        lines = [json.loads(x) for x in Path(args.out).read_text().splitlines() if x]
        summary = summarise(lines)
        with open(args.out, "a") as handle:
            handle.write(
                json.dumps(
                    {
                        "figure": "selection_summary",
                        "seconds": round(time.perf_counter() - started),
                        **summary,
                    }
                )
                + "\n"
            )
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
