"""Screen for the method issue's item 3: would GSC-style structure consistency add to the
labels we publish? Offline, exact numpy, on the web benchmark's warmed embeddings (no training).

Per seed and view it scores every training pair of a `benchmarks/quality.py --corpus web` work
directory's round-1 embeddings (the two warmed models) by
- cosine: u_i . v_i (what a CLIP-score filter ranks by);
- gsc: y_IM, GSC's intra-modal structure consistency as docs/methods.md's review adapts it:
  the Pearson correlation of (u_i . u_r) and (v_i . v_r) over R_i, the union of the k nearest
  images of u_i and the k nearest texts of v_i (i left out);
- published: the round-1 label table's `soft_label` of the run's method, and its `assign`
  column where the table has one;
- min(rank(published), rank(gsc)): GSC's combination rule (the target is the min of its two
  scores) applied to our labels, on ranks since the scales differ;
- published_round2 and ensemble_rounds_1_2: the next round's table (labels of the models after
  one more round of training) and the mean of the two rounds' labels, a two-point version of
  GSC's temporal ensembling;
and prints AUROC of clean pairs against every mismatch and per noise type (the web benchmark's
`per_noise_type_auroc`), one JSON line per seed and view, then the medians.

    python benchmarks/gsc_screen.py --workdir /tmp/web-bench --k 20
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from quality_web import per_noise_type_auroc


def gsc_scores(u: np.ndarray, v: np.ndarray, k: int) -> np.ndarray:
    """(N,) Pearson of u_i.u_R and v_i.v_R over R_i = top-k images of u_i | top-k texts of v_i."""
    uu, vv = u @ u.T, v @ v.T  # (N, N)
    np.fill_diagonal(uu, -np.inf)
    np.fill_diagonal(vv, -np.inf)
    near_u = np.argpartition(-uu, k, axis=1)[:, :k]
    near_v = np.argpartition(-vv, k, axis=1)[:, :k]
    out = np.empty(len(u))
    for i in range(len(u)):
        ref = np.union1d(near_u[i], near_v[i])
        a, b = uu[i, ref], vv[i, ref]
        out[i] = np.corrcoef(a, b)[0, 1]
    return out


def ranks(x: np.ndarray) -> np.ndarray:
    return x.argsort(kind="stable").argsort() / max(len(x) - 1, 1)


def screen(seed_dir: Path, view: str, k: int) -> dict:
    truth = pq.read_table(seed_dir / "corpus" / "ground_truth.parquet").to_pandas()
    truth = truth.set_index("key")
    emb = pq.read_table(seed_dir / "vanilla/rounds/1/embeddings")
    u = np.stack(emb.column(f"image_embedding_{view}").to_numpy(zero_copy_only=False))
    v = np.stack(emb.column(f"text_embedding_{view}").to_numpy(zero_copy_only=False))
    u = u.astype(np.float64) / np.linalg.norm(u, axis=1, keepdims=True)
    v = v.astype(np.float64) / np.linalg.norm(v, axis=1, keepdims=True)
    keys = emb.column("key").to_pylist()
    labels = pq.read_table(seed_dir / f"vanilla/rounds/1/labels_{view}").to_pandas()
    labels = labels.set_index("key").reindex(keys)
    scores = {"cosine": np.einsum("nd,nd->n", u, v), "gsc": gsc_scores(u, v, k)}
    scores["published"] = labels["soft_label"].to_numpy(dtype=float)
    if "assign" in labels and labels["assign"].notna().all():
        scores["assign"] = labels["assign"].to_numpy(dtype=float)
    later = seed_dir / f"vanilla/rounds/2/labels_{view}"
    if later.exists():  # temporal ensembling across rounds: the mean with the next round's
        after = pq.read_table(later).to_pandas().set_index("key").reindex(keys)
        scores["published_round2"] = after["soft_label"].to_numpy(dtype=float)
        scores["ensemble_rounds_1_2"] = (scores["published"] + scores["published_round2"]) / 2
    for name in [n for n in ("published", "assign") if n in scores]:
        scores[f"min_{name}_gsc"] = np.minimum(ranks(scores[name]), ranks(scores["gsc"]))
    rows = truth.reindex(keys)
    kind, noise = rows["kind"].to_numpy(), rows["noise_type"].to_numpy()
    out = {"seed_dir": str(seed_dir), "view": view, "k": k, "pairs": len(keys)}
    for name, score in scores.items():
        for kind_name, value in per_noise_type_auroc(score, noise, kind).items():
            out[f"{name}.{kind_name}"] = None if value is None else round(value, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="/tmp/web-bench")
    parser.add_argument("--k", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for seed_dir in sorted(Path(args.workdir).glob("web_seed*")):
        for view in ("a", "b"):
            rows.append(screen(seed_dir, view, args.k))
            print(json.dumps(rows[-1]), flush=True)
    names = [n for n in rows[0] if "." in n]
    medians = {
        n: round(statistics.median(r[n] for r in rows if r.get(n) is not None), 4) for n in names
    }
    print(json.dumps({"figure": "gsc_screen_medians", "k": args.k, **medians}), flush=True)


if __name__ == "__main__":
    main()
