"""Screen a web-corpus setting in minutes before paying for pipeline runs (the web benchmark's
gates, docs/benchmarks.md "Web-like noise").

A plain PyTorch loop, one model, no Ray: decode a corpus once, then fine-tune the teacher on
(a) the ground-truth clean pairs (oracle), (b) every pair (vanilla), (c) the top fraction by the
teacher's own cosine (CLIP-score filtering), with the same schedule, and print held-out rSum
per epoch. With `--teacher-corpus`, the teacher itself is first trained here from random init
on that (clean) corpus. It answers "can any label beat the filter on this corpus?" (oracle /
filter >= 1.2, oracle / vanilla >= 1.5) in a few minutes on 2 CPU cores; the pipeline benchmark
(`benchmarks/quality.py --corpus web`, 3 seeds) then measures the methods.

    python benchmarks/web_screen.py --corpus data/demo-web --teacher data/teacher/model.pt
    python benchmarks/web_screen.py --corpus /tmp/web --teacher-corpus /tmp/teacher \
        --teacher-out /tmp/teacher.pt --teacher-epochs 10 --epochs 10
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from pipeline.core.losses.training import symmetric_infonce  # noqa: E402
from pipeline.io.shards import Rejection, decode_record, iter_shard_records  # noqa: E402
from pipeline.models import ModelSpec, encode_pairs, load_clip  # noqa: E402
from pipeline.stages.train.evaluation import evaluate_models, load_eval_set  # noqa: E402


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def decode(folder: str, loaded) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(N, 3, H, W) pixels, (N, L) tokens and the keys of every decodable training pair."""
    pixels, captions, keys = [], [], []
    for path in sorted(glob.glob(f"{folder}/[0-9]*.tar")):
        for record in iter_shard_records(path):
            sample = record if isinstance(record, Rejection) else decode_record(record)
            if not isinstance(sample, Rejection):
                pixels.append(loaded.preprocess(sample.image))
                captions.append(sample.caption)
                keys.append(record.key)
    return torch.stack(pixels), loaded.tokenizer(captions), keys


def train(loaded, pixels, tokens, rows, args, test=None, seed: int = 0) -> list[float]:
    """Fine-tune `loaded` in place on `rows` (AdamW, linear warm-up then cosine); the test
    rSum after each epoch (empty without a test set)."""
    model = loaded.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)
    per_epoch = len(rows) // args.batch
    total, step, curve = args.epochs * per_epoch, 0, []
    for _ in range(args.epochs):
        order = rows[torch.randperm(len(rows), generator=generator)]
        model.train()
        for b in range(per_epoch):
            batch = order[b * args.batch : (b + 1) * args.batch]
            scale = (
                min(1.0, (step + 1) / args.lr_warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
            )
            for group in optimizer.param_groups:
                group["lr"] = args.lr * scale
            image_emb, text_emb, logit_scale = model(pixels[batch], tokens[batch])
            loss = symmetric_infonce(image_emb, text_emb, logit_scale)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
        if test is not None:
            model.eval()
            curve.append(round(evaluate_models({"m": loaded}, test)["m"]["rsum"], 1))
    model.eval()
    return curve


def teacher_cosine(loaded, pixels, tokens) -> np.ndarray:
    cosines = []
    for start in range(0, len(pixels), 256):
        image_emb, text_emb, _ = encode_pairs(
            loaded, pixels[start : start + 256], tokens[start : start + 256]
        )
        cosines.append((image_emb * text_emb).sum(dim=1).numpy())
    return np.concatenate(cosines)


def gate(cosine: np.ndarray, truth: dict, keys: list[str], fractions) -> dict:
    from sklearn.metrics import roc_auc_score

    position = {k: i for i, k in enumerate(truth["key"])}
    rows = np.array([position[k] for k in keys])
    kind = np.asarray(truth["kind"], dtype=object)[rows]
    noise_type = np.asarray(truth["noise_type"], dtype=object)[rows]
    clean = kind == "clean"
    auroc = {}
    for name in ["all_mismatched", *sorted(set(noise_type[~clean]))]:
        other = kind == "mismatched" if name == "all_mismatched" else noise_type == name
        keep = clean | other
        auroc[name] = round(float(roc_auc_score(clean[keep], cosine[keep])), 3)
    order = np.argsort(-cosine, kind="stable")
    precision = {
        f: round(float(clean[order[: round(f * len(order))]].mean()), 3) for f in fractions
    }
    return {
        "auroc": auroc,
        "kept_precision": precision,
        "clean_share": round(float(clean.mean()), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus", required=True, help="a web corpus (make-corpus --noise-model web)"
    )
    parser.add_argument("--teacher", default="data/teacher/model.pt", help="the starting weights")
    parser.add_argument("--teacher-corpus", default=None, help="train the teacher here first")
    parser.add_argument("--teacher-out", default="/tmp/screen-teacher.pt")
    parser.add_argument("--teacher-epochs", type=int, default=10)
    parser.add_argument("--model", default="ncl-tiny")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-warmup", type=int, default=20, help="linear warm-up steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    started = time.perf_counter()
    teacher = args.teacher
    if args.teacher_corpus:
        loaded = load_clip(ModelSpec(args.model, None, "fp32", seed=args.seed))
        pixels, tokens, _ = decode(args.teacher_corpus, loaded)
        settings = argparse.Namespace(
            **{**vars(args), "epochs": args.teacher_epochs, "lr_warmup": 100}
        )
        train(loaded, pixels, tokens, torch.arange(len(pixels)), settings, seed=args.seed)
        torch.save(loaded.model.state_dict(), args.teacher_out)
        teacher = args.teacher_out
        emit("screen_teacher_trained", corpus=args.teacher_corpus, epochs=args.teacher_epochs)

    base = load_clip(ModelSpec(args.model, teacher, "fp32"))
    pixels, tokens, keys = decode(args.corpus, base)
    truth = pq.read_table(f"{args.corpus}/ground_truth.parquet").to_pydict()
    test_shards = sorted(glob.glob(f"{args.corpus}/test/[0-9]*.tar"))
    test = load_eval_set(test_shards, base.preprocess, base.tokenizer)
    cosine = teacher_cosine(base, pixels, tokens)
    emit(
        "screen_teacher",
        test_rsum=round(evaluate_models({"t": base}, test)["t"]["rsum"], 1),
        **gate(cosine, truth, keys, args.fractions),
    )
    kinds = dict(zip(truth["key"], truth["kind"], strict=True))
    clean = torch.tensor([kinds[k] == "clean" for k in keys])
    order = torch.from_numpy(np.argsort(-cosine, kind="stable").copy())
    runs = {"oracle": torch.nonzero(clean).squeeze(1), "vanilla": torch.arange(len(keys))}
    runs |= {f"filter_{f}": order[: round(f * len(keys))] for f in args.fractions}
    final = {}
    for name, rows in runs.items():
        loaded = load_clip(ModelSpec(args.model, teacher, "fp32"))
        curve = train(loaded, pixels, tokens, rows, args, test, seed=args.seed)
        final[name] = curve[-1]
        emit(
            "screen_run",
            run=name,
            pairs=len(rows),
            precision=round(float(clean[rows].float().mean()), 3),
            rsum_per_epoch=curve,
        )
    best_filter = max(v for k, v in final.items() if k.startswith("filter_"))
    emit(
        "screen_summary",
        corpus=args.corpus,
        teacher=teacher,
        epochs=args.epochs,
        lr=args.lr,
        oracle_over_best_filter=round(final["oracle"] / best_filter, 3),
        oracle_over_vanilla=round(final["oracle"] / final["vanilla"], 3),
        note="best filter picked on the test split here (a screen, not a claim)",
        seconds=round(time.perf_counter() - started, 1),
    )


if __name__ == "__main__":
    main()
