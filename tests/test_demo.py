"""The demo job end to end through the CLI, on a freshly generated demo-sized corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data.synthetic import make_corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def test_demo_job_runs_from_the_cli(tmp_path):
    corpus = make_corpus(
        tmp_path / "demo",
        samples=4000,
        seed=0,
        samples_per_shard=500,
        test_samples=500,
        val_samples=500,
        corrupt=0.005,
    )
    out = tmp_path / "run"
    overrides = [
        "--set",
        f"input.shards={tmp_path}/demo/{{00000..00007}}.tar",
        "--set",
        f"output={out}",
        "--set",
        f"eval.ground_truth={corpus.ground_truth}",
        "--set",
        f"eval.test_shards={corpus.test_shards[0]}",
        "--set",
        f"eval.val_shards={corpus.val_shards[0]}",
        "--set",
        "train.warmup_epochs=2",  # the full demo trains longer; CI checks the wiring
        "--set",
        "train.rounds=1",
        "--set",
        "train.epochs_per_round=1",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "jobs/demo.yaml", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "summary" in result.stdout and "quarantined:" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    embed = metrics["rounds"]["0"]["embed"]
    assert embed["embedded"] + embed["quarantined"] == 4000
    assert embed["quarantined"] == corpus.corrupt
    assert len(list((out / "rounds" / "0" / "embeddings").glob("*.parquet"))) == 8
    warmup = metrics["rounds"]["0"]["train"]
    assert {v: len(info["history"]) for v, info in warmup["views"].items()} == {"A": 2, "B": 2}
    # The warm-up is selected on the validation split; the test split is only reported.
    assert all(
        e["val_rsum"] is not None for info in warmup["views"].values() for e in info["history"]
    )
    assert set(metrics["rounds"]["0"]["retrieval"]) == {"A", "B", "A+B"}
    assert "retrieval on the test split" in result.stdout
    assert (out / "report" / "index.html").exists()
    assert len(list((out / "labels").glob("*.parquet"))) == 8
    for view in ("a", "b"):  # round 1 labels (warmed models) train round 1; round 2 publishes
        quality = metrics["rounds"]["1"][f"labels_{view}"]["quality"]
        assert quality and "cosine" in json.dumps(quality) and "bicro" in json.dumps(quality)
    assert set(metrics["rounds"]["1"]["retrieval"]) == {"A", "B", "A+B"}
    assert metrics["labels"]["round"] == 2 and metrics["labels"]["samples"] == 4000 - corpus.corrupt
    assert metrics["labels"]["quality"]["combined"]["auroc"] is not None
    assert [row["models"] for row in metrics["coteaching"]] == [0, 1]
    assert "co-teaching (coteach, labels bicro)" in result.stdout
