"""A damaged manifest.json is never fatal (issue 37 item 3): `run` warns once, keeps the file
aside, rebuilds the run state (embeddings reused by their footers) and finishes; `status`
warns and reads what it can, changing nothing."""

from __future__ import annotations

import json

import pytest
from cli_job import run_cli, write_corpus, write_job

from pipeline.io.layout import RunLayout
from pipeline.run.manifest import read_manifest

NO_WARMUP = ("--set", "train.warmup_epochs=0")  # embed, keys, labels, publish: ~40 s


def test_read_manifest_keeps_a_damaged_file_aside_only_when_asked(tmp_path, caplog):
    layout = RunLayout(str(tmp_path))
    assert read_manifest(layout, keep_aside=True) is None  # no manifest: a new run directory
    (tmp_path / "manifest.json").write_text('{"job_name": "x", "stages": {"round0/em')
    with caplog.at_level("WARNING", logger="pipeline"):
        assert read_manifest(layout, keep_aside=False) == {}
        assert (tmp_path / "manifest.json").exists()
        assert read_manifest(layout, keep_aside=True) == {}
    assert not (tmp_path / "manifest.json").exists()
    assert len(list(tmp_path.glob("manifest.json.damaged-*"))) == 1
    assert caplog.text.count("is damaged (not valid JSON") == 2
    for garbage in (b"\xff\xfe\x00garbage", b"[1, 2]", b'{"stages": [1]}'):
        (tmp_path / "manifest.json").write_bytes(garbage)
        assert read_manifest(layout, keep_aside=False) == {}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.own_ray
@pytest.mark.timeout(600)
def test_run_and_status_survive_a_truncated_or_garbage_manifest(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    output = tmp_path / "run"
    job = write_job(corpus, output)
    first = run_cli("run", str(job), *NO_WARMUP)
    assert first.returncode == 0, first.stdout[-3000:]
    manifest = output / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])  # cut in half, as by a full disk

    status = run_cli("status", str(output))
    assert status.returncode == 0, status.stdout
    assert "Traceback" not in status.stdout
    assert status.stdout.count("is damaged (not valid JSON") == 1
    assert "manifest.json is damaged; the stage records are lost" in status.stdout
    assert manifest.read_text() == text[: len(text) // 2]  # read-only

    rerun = run_cli("run", str(job), *NO_WARMUP)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "Traceback" not in rerun.stdout
    assert rerun.stdout.count("is damaged (not valid JSON") == 1
    assert "kept aside as" in rerun.stdout
    assert "round0/embed: reused" in rerun.stdout  # rebuilt from the tables' footers
    kept = list(output.glob("manifest.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_text() == text[: len(text) // 2]
    stages = json.loads(manifest.read_text())["stages"]
    assert all(record["status"] == "done" for record in stages.values())

    manifest.write_bytes(b"\x00\xff garbage \x13" * 50)
    status = run_cli("status", str(output), "--job", str(job), *NO_WARMUP)
    assert status.returncode == 0, status.stdout
    assert "Traceback" not in status.stdout and "is damaged (not UTF-8" in status.stdout
    assert "round0/embed      reused" in status.stdout
