"""A damaged manifest.json is never fatal (issue 37 item 3): `run` warns once, keeps the file
aside, rebuilds the run state from what the outputs record (embeddings by their footers, every
other stage by the key in its summary) and reuses every finished stage whose key is current;
`status` warns and reads the same, changing nothing."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from cli_job import run_cli
from shared_run import copy_run, write_job

from pipeline.config import load_job
from pipeline.io.layout import RunLayout
from pipeline.run.graph import stage_graph
from pipeline.run.manifest import REBUILT, read_manifest

ONE_ROUND = ("--set", "train.rounds=1", "--set", "train.epochs_per_round=1")


def _published(output) -> dict:
    """{file: rows} of the published generation (`labels/_CURRENT`)."""
    folder = output / "labels" / (output / "labels" / "_CURRENT").read_text().strip()
    return {p.name: pq.read_table(p).to_pylist() for p in sorted(folder.glob("*.parquet"))}


def test_read_manifest_keeps_a_damaged_file_aside_only_when_asked(tmp_path, caplog):
    layout = RunLayout(str(tmp_path))
    assert read_manifest(layout, keep_aside=True) is None  # no manifest: a new run directory
    (tmp_path / "manifest.json").write_text('{"job_name": "x", "stages": {"round0/em')
    rebuilt = {"stages": {}, REBUILT: "not valid JSON (Unterminated string starting at at line 1)"}
    with caplog.at_level("WARNING", logger="pipeline"):
        assert read_manifest(layout, keep_aside=False) == rebuilt
        assert (tmp_path / "manifest.json").exists()
        assert read_manifest(layout, keep_aside=True) == rebuilt
    assert not (tmp_path / "manifest.json").exists()
    assert len(list(tmp_path.glob("manifest.json.damaged-*"))) == 1
    assert caplog.text.count("is damaged (not valid JSON") == 2
    for garbage in (b"\xff\xfe\x00garbage", b"[1, 2]", b'{"stages": [1]}'):
        (tmp_path / "manifest.json").write_bytes(garbage)
        assert read_manifest(layout, keep_aside=False)["stages"] == {}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.own_ray
@pytest.mark.timeout(900)
def test_a_truncated_or_garbage_manifest_is_rebuilt_and_every_finished_stage_reused(
    cli_reference, tmp_path
):
    """One real run (the shared reference run and a co-teaching round more), then its manifest
    cut to a third (as by a full disk) and later garbage: `status` (with and without the job)
    and `run` each warn once and read the stage records rebuilt from the outputs; `status`
    changes nothing, `run` keeps the damaged file aside."""
    corpus = cli_reference["corpus"]
    output = copy_run(cli_reference["out"], tmp_path / "run")
    job = write_job(corpus, output)
    # Every stage of the job with ONE_ROUND: each kind of stage summary.
    every_stage = [n.name for n in stage_graph(load_job(job, list(ONE_ROUND[1::2])))]
    first = run_cli("run", str(job), *ONE_ROUND, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:]
    labels = _published(output)
    manifest = output / "manifest.json"
    text = manifest.read_text()
    cut = text[: len(text) // 3]
    manifest.write_text(cut)

    status = run_cli("status", str(output))
    assert status.returncode == 0 and "Traceback" not in status.stdout, status.stdout
    assert status.stdout.count("is damaged (not valid JSON") == 1
    assert "manifest.json is damaged; the stage records are rebuilt" in status.stdout
    status = run_cli("status", str(output), "--job", str(job), *ONE_ROUND)
    assert status.returncode == 0 and "Traceback" not in status.stdout, status.stdout
    assert "8 stage summaries hold their keys" in status.stdout
    assert all(f"{stage:<17} reused" in status.stdout for stage in every_stage), status.stdout
    assert manifest.read_text() == cut  # status is read-only

    rerun = run_cli("run", str(job), *ONE_ROUND, timeout=600)
    assert rerun.returncode == 0 and "Traceback" not in rerun.stdout, rerun.stdout[-3000:]
    assert rerun.stdout.count("is damaged (not valid JSON") == 1
    assert "kept aside as" in rerun.stdout
    kept = list(output.glob("manifest.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_text() == cut
    missing = [stage for stage in every_stage if f"{stage}: reused" not in rerun.stdout]
    assert not missing and "recomputed because" not in rerun.stdout, rerun.stdout[-3000:]
    assert _published(output) == labels
    stages = json.loads(manifest.read_text())["stages"]
    assert sorted(stages) == sorted(every_stage)
    assert all(record["status"] == "done" for record in stages.values())

    # Garbage instead of JSON; then a changed config still recomputes what it changes, from
    # the records the outputs hold (the co-teaching round trains longer; the warm-up does not).
    manifest.write_bytes(b"\x00\xff garbage")
    status = run_cli("status", str(output), "--job", str(job), *ONE_ROUND)
    assert status.returncode == 0, status.stdout
    assert "Traceback" not in status.stdout and "is damaged (not UTF-8" in status.stdout
    assert "round0/embed      reused" in status.stdout
    longer = ("--set", "train.rounds=1", "--set", "train.epochs_per_round=2")
    changed = run_cli("run", str(job), *longer, timeout=600)
    assert changed.returncode == 0 and "Traceback" not in changed.stdout, changed.stdout[-3000:]
    assert "round1/train: recomputed because train.epochs_per_round changed" in changed.stdout
    for stage in every_stage[:6]:
        assert f"{stage}: reused" in changed.stdout, changed.stdout[-3000:]
    for stage in every_stage[7:]:
        assert f"{stage}: recomputed because" in changed.stdout, changed.stdout[-3000:]
