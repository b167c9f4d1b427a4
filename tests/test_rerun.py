"""Reruns into an existing run directory (issue 11): one run state decides, per stage, what is
reused and what is recomputed, and a changed configuration never publishes stale labels.

One first run (module fixture: the session's shared warmed run, labelled and published) is
copied for each rerun case; the reruns are real runs on the session's local Ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from log_capture import console_output
from shared_run import PAIRS_PER_SHARD, SHARDS, copy_run, load, shard_pattern, write_job

from pipeline.clients.read import labels_folder
from pipeline.run.runner import RunConflictError, run_job
from pipeline.run.status import predict_rerun

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def corpus(warmed_run) -> Path:
    return warmed_run["corpus"]


def _job(corpus: Path, out: Path, overrides=(), shards: int = SHARDS):
    return load(corpus, out, f"input.shards={shard_pattern(corpus, shards)}", *overrides)


def _run(job) -> tuple[dict, dict[str, str]]:
    """Run `job`; returns its metrics and {stage: what the run state said about it}, after
    checking that `ncl-pipeline status` predicted exactly that."""
    rerun = (Path(job.output) / "manifest.json").exists()
    predicted = predict_rerun(job.output, job).decisions if rerun else None
    with console_output() as lines:
        metrics = run_job(job)
    said = {}
    for line in lines:
        found = re.search(r"(round\d/\w+|publish): (reused|recomputed because .*)$", line)
        if found:  # an embed pass also says how many shards it reused
            said[found.group(1)] = re.sub(r"; \d+ of \d+ shards reused$", "", found.group(2))
    if predicted is not None:
        assert {stage: d.describe() for stage, d in predicted.items()} == said
    return metrics, said


@pytest.fixture(scope="module")
def first(warmed_run, corpus, tmp_path_factory) -> Path:
    """The shared warmed run, labelled and published by the shared job (its embed pass and
    warm-up reused)."""
    out = copy_run(warmed_run["out"], tmp_path_factory.mktemp("first") / "run")
    _run(_job(corpus, out))
    return out


def _copy(first: Path, tmp_path: Path) -> Path:
    return copy_run(first, tmp_path / "run")


def _labels(out: Path) -> dict[str, list]:
    table = pq.read_table(labels_folder(out)[1]).sort_by("key")
    return {name: table.column(name).to_pylist() for name in ("key", "soft_label")}


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("*.parquet"))}


# train.rounds 0 keeps the test short: the warm-up is the one training; the co-teaching rounds'
# keys and inputs are checked by tests/test_run_state.py.
ALL = (
    "round0/embed",
    "round0/keys",
    "round0/warmup",
    "round1/embed",
    "round1/labels_a",
    "round1/labels_b",
    "publish",
)


def test_unchanged_rerun_reuses_every_stage(first, corpus, tmp_path):
    out = _copy(first, tmp_path)
    before = {r: _mtimes(out / "rounds" / r / "embeddings") for r in ("0", "1")}
    metrics, said = _run(_job(corpus, out))
    assert said == dict.fromkeys(ALL, "reused")
    assert {r: _mtimes(out / "rounds" / r / "embeddings") for r in before} == before
    assert _labels(out) == _labels(first)
    # The reused stages' summaries fill metrics.json as a fresh run would.
    assert metrics["rounds"]["0"]["train"]["views"]["A"]["history"]
    assert metrics["labels"]["samples"] == PAIRS_PER_SHARD * SHARDS
    manifest = json.loads((out / "manifest.json").read_text())
    assert {manifest["stages"][s]["status"] for s in ALL} == {"done"}
    # embed.decode auto is recorded and keyed as it ran (PIL on a Ray without GPUs), so the
    # same job on GPU workers (device decode: other pixels) embeds again.
    assert manifest["job"]["embed"]["decode"] == "cpu"
    assert manifest["stages"]["round0/embed"]["config"]["embed.decode"] == "cpu"
    on_gpus = predict_rerun(str(out), _job(corpus, out, ["embed.decode=device"])).decisions
    assert "embed.decode changed" in on_gpus["round0/embed"].describe()


def test_changed_learning_rate_retrains_and_republishes(first, corpus, tmp_path):
    out = _copy(first, tmp_path)
    round0 = _mtimes(out / "rounds" / "0" / "embeddings")
    _, said = _run(_job(corpus, out, ["train.lr=5.0e-4"]))
    assert said["round0/embed"] == said["round0/keys"] == "reused"
    assert said["round0/warmup"] == "recomputed because train.lr changed"
    assert said["round1/embed"].startswith("recomputed because its input round0/warmup")
    for stage in ALL[4:]:
        assert said[stage].startswith("recomputed because"), stage
    assert _mtimes(out / "rounds" / "0" / "embeddings") == round0
    # The published labels come from the retrained models.
    assert _labels(out)["key"] == _labels(first)["key"]
    assert _labels(out)["soft_label"] != _labels(first)["soft_label"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"]["round0/warmup"]["config"]["train.lr"] == 5.0e-4


def test_changed_label_method_keeps_the_warm_up(first, corpus, tmp_path):
    out = _copy(first, tmp_path)
    warm = (out / "rounds" / "0" / "checkpoints" / "A" / "model.pt").stat().st_mtime_ns
    _, said = _run(_job(corpus, out, ["labels.method=rcr"]))
    for stage in ("round0/embed", "round0/keys", "round0/warmup", "round1/embed"):
        assert said[stage] == "reused", stage
    changed = "recomputed because labels.method, labels.bicro, labels.rcr changed"
    assert said["round1/labels_a"] == said["round1/labels_b"] == changed
    assert said["publish"] == (
        "recomputed because its input round1/labels_a was recomputed; "
        "its input round1/labels_b was recomputed"
    )
    assert (out / "rounds" / "0" / "checkpoints" / "A" / "model.pt").stat().st_mtime_ns == warm
    table = pq.read_table(labels_folder(out)[1])
    assert (
        table.column("rcr").null_count == 0
        and table.column("bicro").null_count == PAIRS_PER_SHARD * SHARDS
    )


def test_an_added_shard_is_embedded_alone_then_everything_global_recomputed(
    first, corpus, tmp_path
):
    out = _copy(first, tmp_path)
    round0 = _mtimes(out / "rounds" / "0" / "embeddings")
    metrics, said = _run(_job(corpus, out, shards=SHARDS + 1))
    assert said["round0/embed"] == (
        "recomputed because input shards changed (no embeddings yet: 00003)"
    )
    assert metrics["rounds"]["0"]["embed"]["embedded"] == PAIRS_PER_SHARD  # the new shard only
    after = _mtimes(out / "rounds" / "0" / "embeddings")
    assert {k: v for k, v in after.items() if k != "00003.parquet"} == round0
    assert said["round0/keys"] == (
        "recomputed because its input round0/embed was recomputed; input shards changed"
    )
    assert "input shards changed" in said["round0/warmup"]
    for stage in ALL[1:]:
        assert said[stage].startswith("recomputed because"), stage
    assert len(_labels(out)["key"]) == PAIRS_PER_SHARD * (SHARDS + 1)


def test_another_job_name_is_refused(first, corpus, tmp_path):
    out = _copy(first, tmp_path)
    with pytest.raises(RunConflictError, match="holds the results of job 'shared'"):
        run_job(_job(corpus, out, ["name=other"]))


def test_status_shows_stages_times_and_what_a_rerun_would_do(first, corpus, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    out = _copy(first, tmp_path)
    cli = CliRunner()
    shown = cli.invoke(app, ["status", str(out)])
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[0]: line for line in shown.output.splitlines()[2:] if "/" in line}
    assert set(ALL) - {"publish"} <= set(rows)
    for stage in ALL[:-1]:
        assert re.search(rf"{stage}\s+done\s+20\d\d-.*\d+\.\ds\s+reused$", rows[stage])
    assert "quarantine: " in shown.output
    job_file = write_job(corpus, out, name="changed.yaml")
    asked = cli.invoke(
        app, ["status", str(out), "--job", str(job_file), "--set", "train.lr=5.0e-4"]
    )
    assert asked.exit_code == 0, asked.output
    after = asked.output.split("would:")[1]
    assert re.search(r"round0/embed\s+reused", after)
    assert re.search(r"round0/warmup\s+recomputed because train.lr changed", after)
    # A deleted checkpoint: that stage is stale, and what reads it would be recomputed.
    (out / "rounds" / "0" / "checkpoints" / "A" / "model.pt").unlink()
    stale = cli.invoke(app, ["status", str(out)]).output
    assert re.search(r"round0/warmup\s+stale .* recomputed because its outputs are missing", stale)
    assert re.search(
        r"round1/embed\s+stale .* recomputed because its input round0/warmup was recomputed", stale
    )
    missing = cli.invoke(app, ["status", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "not a run directory" in missing.output
