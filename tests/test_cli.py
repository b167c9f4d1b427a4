"""The command line's conventions: exit statuses from one table (documented where users read
them), `--version`, fixed-set options as choices in `--help`, and what `validate` says about
the model's weights: cached (a local checkpoint) or to be downloaded (a tag that is not in the
job's empty `model.cache_dir`), without any network access.

Exit 3 end to end: tests/test_broken_shards.py runs a job through the CLI; exit 2 of a real
process: tests/test_config.py; 130 and 143: tests/test_interrupts.py."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import get_args

import pytest
from cli_job import invoke_cli

from pipeline.cli import ExportFormat, LabelView, NoiseModel
from pipeline.errors import (
    EXIT_CODES,
    ExitCode,
    RunFailedError,
    RunInterrupted,
    ShardFailuresError,
    exit_code,
)

ROOT = Path(__file__).resolve().parents[1]


def test_each_outcome_has_its_exit_status():
    from pipeline.config import JobConfigError
    from pipeline.io.shard_patterns import ShardPatternError
    from pipeline.run.runner import RunConflictError
    from pipeline.stages.export.tasks import ExportError

    cases = [
        (JobConfigError("unknown key 'embed.batchsize'"), 2),
        (ShardPatternError("no shard matches"), 2),
        (RunConflictError("the output holds another job"), 2),
        (RunFailedError("the warm-up failed"), 1),
        (ExportError("a kept key is not in its tar"), 1),
        (ShardFailuresError("3 of 10 shards could not be read"), 3),
        (RunInterrupted(signal.SIGINT), 130),
        (RunInterrupted(signal.SIGTERM), 143),
        (KeyboardInterrupt(), 130),
        (ZeroDivisionError(), 1),  # a bug: its traceback, and the run did not finish
    ]
    assert [exit_code(error) for error, _ in cases] == [code for _, code in cases]
    assert set(EXIT_CODES) == set(ExitCode)


def test_exit_statuses_are_documented_where_users_read_them():
    code, shown = invoke_cli("--help")
    assert code == 0
    failures = (ROOT / "docs" / "failures.md").read_text()
    table = failures.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    for status in EXIT_CODES:
        assert re.search(rf"^\s*{status}\s", shown, re.M), status
        assert re.search(rf"^\| {status} \|", table, re.M), status
    # Every status in the "what happens when" table is one of them.
    cases = failures.split("| when | what the run does | exit |", 1)[1].split("\n\n", 1)[0]
    shown_codes = {int(c) for row in cases.splitlines() for c in re.findall(r"\d+", row[-12:])}
    assert shown_codes <= {*EXIT_CODES, 143}, shown_codes
    assert {1, 2, 3, 130, 143} <= shown_codes


def test_version_is_the_installed_package_s():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ncl-pipeline {version('ncl-pipeline')}\n"


def test_fixed_set_options_are_choices():
    from pipeline.data.synthetic import NOISE_MODELS
    from pipeline.stages.export.driver import FORMATS

    assert get_args(ExportFormat) == FORMATS and get_args(NoiseModel) == NOISE_MODELS
    assert get_args(LabelView) == ("a", "b")
    for command, listed in (("export", "wds|uid|keys"), ("make-corpus", "ncr|web|teacher")):
        code, shown = invoke_cli(command, "--help")
        assert code == 0 and listed in shown, shown
    code, shown = invoke_cli("inspect", "--help")
    assert "<a|b>" in shown and "model A's embeddings" in " ".join(shown.split())
    code, shown = invoke_cli("export", "run", "--out", "x", "--format", "parquet")
    assert code == 2 and "'parquet' is not one of" in " ".join(shown.replace("│", " ").split())


@pytest.fixture()
def shards(tmp_path) -> str:
    (tmp_path / "data").mkdir()
    for name in ("00000.tar", "00001.tar"):
        (tmp_path / "data" / name).write_bytes(b"")  # validate lists shards, it does not read
    return f"{tmp_path}/data/{{00000..00001}}.tar"


def _validate(tmp_path: Path, shards: str, model: str):
    job = tmp_path / "job.yaml"
    job.write_text(f'name: t\ninput: {{shards: "{shards}"}}\noutput: {tmp_path}/run\n{model}\n')
    return invoke_cli("validate", str(job))


def test_validate_says_a_local_checkpoint_is_cached(tmp_path, shards):
    checkpoint = tmp_path / "teacher.pt"
    checkpoint.write_bytes(b"")  # the preflight checks the file is there; a run reads it
    code, shown = _validate(
        tmp_path, shards, f"model: {{name: ncl-tiny, pretrained: {checkpoint}}}"
    )
    assert code == 0, shown
    assert "ok: 2 input shards found" in shown
    assert f"ok: model ncl-tiny: weights cached (local checkpoint {checkpoint})" in shown
    assert "is available" not in shown


def test_validate_says_a_tag_not_in_the_cache_dir_will_be_downloaded(
    tmp_path, shards, hub_endpoint
):
    hub_endpoint(True)
    cache = tmp_path / "weights"
    model = f"model: {{name: ViT-B-32, pretrained: laion2b_s34b_b79k, cache_dir: {cache}}}"
    code, shown = _validate(tmp_path, shards, model)
    assert code == 0, shown
    line = next(x for x in shown.splitlines() if x.startswith("ok: model"))
    assert line.startswith("ok: model ViT-B-32: weights will be downloaded at run time (hf-hub ")
    assert line.endswith(f" into {cache})") and not cache.exists()


@pytest.mark.parametrize("command", ["validate", "run"])
def test_weights_neither_cached_nor_reachable_stop_in_seconds(
    tmp_path, shards, hub_endpoint, command
):
    """With HF_HUB_OFFLINE unset and the hub unreachable, validate and run each say so in one
    sentence (the repo, the cache, how to pre-fetch) and exit 2 within seconds, before Ray."""
    import time

    endpoint = hub_endpoint(False)
    cache = tmp_path / "weights"
    job = tmp_path / "job.yaml"
    job.write_text(
        f'name: t\ninput: {{shards: "{shards}"}}\noutput: {tmp_path}/run\n'
        f"model: {{name: ViT-B-32, pretrained: laion2b_s34b_b79k, cache_dir: {cache}}}\n"
    )
    started = time.monotonic()
    code, shown = invoke_cli(command, str(job))
    assert time.monotonic() - started < 10, shown
    assert code == 2, shown
    error = next(line for line in shown.splitlines() if "cannot be reached" in line)
    assert "laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in error and str(cache) in error
    assert endpoint in error and "pre-fetch" in error and "model.pretrained" in error
    # before Ray: the run's first line after Ray starts ("ncl-pipeline: job ...") never came
    assert "Traceback" not in shown and "ncl-pipeline: job" not in shown
    assert not (tmp_path / "run").exists()


def test_a_folder_as_input_shards_names_its_tars_and_the_pattern(tmp_path, shards):
    folder = shards.rsplit("/", 1)[0]
    code, shown = _validate(tmp_path, folder, "model: {name: ncl-tiny}")
    assert code == 2, shown
    assert "is a folder, not a shard: it holds 2 tars (00000.tar, 00001.tar)" in shown
    assert f"'{folder}/{{00000..00001}}.tar'" in shown
