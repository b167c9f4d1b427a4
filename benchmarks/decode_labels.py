"""The demo's labels with either embed decode (issue 35): `embed.decode: cpu` (PIL) vs `device`
(torchvision's batched decode_jpeg, run on CPU here), the same job otherwise (jobs/demo.yaml on
the Makefile's quick corpus). Prints one JSON line per run (published AUROC, held-out rSum) and
one comparing the two tables pair by pair.

    python benchmarks/decode_labels.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from pipeline.clients.read import read_labels
from pipeline.data.synthetic import QUICK_DEMO, make_corpus

ROOT = Path(__file__).resolve().parents[1]


def run_demo(corpus, data: Path, out: Path, decode: str) -> dict:
    overrides = {
        "input.shards": f"{data}/{{00000..00003}}.tar",
        "output": str(out),
        "eval.ground_truth": str(corpus.ground_truth),
        "eval.val_shards": str(corpus.val_shards[0]),
        "eval.test_shards": str(corpus.test_shards[0]),
        "embed.decode": decode,
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "pipeline", "run", "jobs/demo.yaml", *sets]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    metrics = json.loads((out / "metrics.json").read_text())
    last = metrics["coteaching"][-1]
    return {"auroc": last["auroc_combined"], "rsum_A+B": last["rsum_A+B"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="decode-labels-"))
    data = root / "demo-quick"
    corpus = make_corpus(data, **QUICK_DEMO)
    tables = {}
    for decode in ("cpu", "device"):
        figures = run_demo(corpus, data, root / decode, decode)
        print(json.dumps({"figure": "demo_labels", "decode": decode, **figures}), flush=True)
        tables[decode] = read_labels(str(root / decode)).to_table().sort_by("key")
    cpu, device = tables["cpu"], tables["device"]
    assert cpu.column("key").equals(device.column("key")), "the runs labelled other pairs"
    delta = np.abs(cpu["soft_label"].to_numpy() - device["soft_label"].to_numpy())
    same_subset = np.mean(
        np.asarray(cpu["subset"].to_pylist()) == np.asarray(device["subset"].to_pylist())
    )
    compared = {
        "pairs": cpu.num_rows,
        "soft_label_max_abs_diff": float(delta.max()),
        "soft_label_mean_abs_diff": float(delta.mean()),
        "same_subset": float(same_subset),
    }
    print(json.dumps({"figure": "decode_label_agreement", **compared}), flush=True)


if __name__ == "__main__":
    main()
