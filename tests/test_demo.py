"""The quick demo (`make demo`: jobs/demo.yaml) end to end through the CLI, on a freshly
generated corpus with the Makefile's arguments; its console is what a first user reads."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from log_capture import printed_before_timeout

from pipeline.clients.read import labels_folder
from pipeline.data.synthetic import QUICK_DEMO, make_corpus

# The demo takes 3-4.5 min on an idle 2-core machine; on a busy one it took over 10 (two
# suites side by side: 600 s, the suite's per-test limit, cut it off with no output). The job's
# own limit comes first, and a job cut off by it shows how far it got.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.own_ray, pytest.mark.timeout(1000)]
ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 900


def test_demo_job_runs_from_the_cli(tmp_path):
    corpus = make_corpus(tmp_path / "demo", **QUICK_DEMO)
    out = tmp_path / "run"
    overrides = [
        "--set",
        f"input.shards={tmp_path}/demo/{{00000..00003}}.tar",
        "--set",
        f"output={out}",
        "--set",
        f"eval.ground_truth={corpus.ground_truth}",
        "--set",
        f"eval.test_shards={corpus.test_shards[0]}",
        "--set",
        f"eval.val_shards={corpus.val_shards[0]}",
    ]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pipeline", "run", "jobs/demo.yaml", *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        printed = printed_before_timeout(exc)
        pytest.fail(f"the demo job ran past {JOB_TIMEOUT_S} s; it had printed:\n{printed}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "summary" in result.stdout and "quarantined:" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    embed = metrics["rounds"]["0"]["embed"]
    assert embed["embedded"] + embed["quarantined"] == 2000
    assert embed["quarantined"] == corpus.corrupt
    assert len(list((out / "rounds" / "0" / "embeddings").glob("*.parquet"))) == 4
    warmup = metrics["rounds"]["0"]["train"]
    # The warm-up is selected on the validation split; the test split is only reported.
    assert all(
        e["val_rsum"] is not None for info in warmup["views"].values() for e in info["history"]
    )
    assert set(metrics["rounds"]["0"]["retrieval"]) == {"A", "B", "A+B"}
    assert "retrieval on the test split" in result.stdout
    assert (out / "report" / "index.html").exists()
    assert len(list(Path(labels_folder(out)[1]).glob("*.parquet"))) == 4
    assert metrics["labels"]["round"] == 3 and metrics["labels"]["samples"] == 2000 - corpus.corrupt
    # What the demo is for: co-teaching improves the labels and the retrieval, round by round.
    rows = metrics["coteaching"]
    assert [row["models"] for row in rows] == [0, 1, 2]
    first, last = rows[0], rows[-1]
    assert last["auroc_combined"] > max(first["auroc_a"], first["auroc_b"]), rows
    assert last["rsum_A+B"] > first["rsum_A+B"], rows
    assert "co-teaching (coteach, labels rcr)" in result.stdout
    # A short console: progress and summaries, none of Ray's internals, each line once.
    console = result.stdout + result.stderr
    for noise in (
        "core_worker.cc",
        "PlacementGroupCleaner",
        "Progress bars disabled",
        "Tip: use `ray status`",
        "Token authentication is enabled",
        "training worker group",
        "Traceback",
        "Loading faiss",
        "ModuleNotFoundError",
    ):
        assert noise not in console, noise
    assert "embed round 0: 4 shards in" in result.stdout  # the closing progress line
    assert "warm-up epoch 1/" in result.stdout or " A epoch 1/" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    repeated = {line for line in lines if lines.count(line) > 1 and not set(line) <= {"-", " "}}
    assert not repeated, repeated
    # Progress lines are paced by time (more of them on a loaded machine); the rest is fixed.
    settled = [line for line in lines if not re.search(r"\(\d+%\)", line)]
    assert len(settled) < 100, "\n".join(settled)
