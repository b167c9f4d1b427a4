"""Job config: validation messages, overrides, the committed JSON schema, shipped jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.config import JobConfigError, load_job, parse_overrides
from pipeline.schemas import generated_schemas, render

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = """
name: t
input: {shards: "data/x/{00000..00001}.tar"}
output: runs/t
model: {name: ncl-tiny, pretrained: null}
"""


def _job(tmp_path: Path, text: str = MINIMAL) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_minimal_job_gets_defaults_and_is_frozen(tmp_path):
    job = load_job(_job(tmp_path))
    assert job.embed.batch_size == 256 and job.labels.method == "rcr" and job.ray.address is None
    with pytest.raises(ValidationError):
        job.embed.batch_size = 3  # frozen


def test_overrides_are_typed_and_nested(tmp_path):
    job = load_job(
        _job(tmp_path),
        [
            "labels.method=rcr",
            "train.rounds=0",
            "embed.concurrency=3",
            "input.shards=[a.tar, b.tar]",
            "eval.ground_truth=null",
        ],
    )
    assert job.labels.method == "rcr" and job.train.rounds == 0 and job.embed.concurrency == 3
    assert job.input.shards == ["a.tar", "b.tar"] and job.eval.ground_truth is None
    assert parse_overrides(["a.b.c=1", "a.b.d=x"]) == {"a": {"b": {"c": 1, "d": "x"}}}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["embed.batchsize=3"],
            ["unknown key 'embed.batchsize'", "did you mean 'embed.batch_size'"],
        ),
        (["labels.method=foo"], ["'labels.method'", '"foo"', "'bicro'", "--set labels.method="]),
        (["train.rounds=-1"], ["'train.rounds'", "-1", "greater than or equal to 0"]),
        (["model.precision=fp8"], ["'model.precision'", '"fp8"']),
        (["embed.concurrency=0"], ["'embed.concurrency'", ">= 1 or 'auto'"]),
        (["trainn.rounds=1"], ["unknown key 'trainn'", "did you mean 'train'"]),
    ],
)
def test_errors_name_key_value_and_fix(tmp_path, overrides, expected):
    with pytest.raises(JobConfigError) as info:
        load_job(_job(tmp_path), overrides)
    message = str(info.value)
    assert str(tmp_path / "job.yaml") in message
    for fragment in expected:
        assert fragment in message, message


def test_the_filter_scores_with_the_starting_model_when_it_is_pretrained(tmp_path):
    """DataComp's filter scores once with an off-the-shelf CLIP: a job that starts from
    pretrained weights filters with them; a random-init job with its warmed models."""
    path = _job(tmp_path)
    assert load_job(path).filter_scorer() == "warmed"
    assert load_job(path, ["model.pretrained=/w/teacher.pt"]).filter_scorer() == "initial"
    chosen = load_job(path, ["model.pretrained=/w/t.pt", "train.filter_scorer=warmed"])
    assert chosen.filter_scorer() == "warmed"
    with pytest.raises(JobConfigError, match="filter_scorer"):
        load_job(path, ["train.filter_scorer=teacher"])


def test_missing_key_and_bad_files(tmp_path):
    with pytest.raises(JobConfigError, match="missing required key 'output'"):
        load_job(_job(tmp_path, MINIMAL.replace("output: runs/t\n", "")))
    with pytest.raises(JobConfigError, match="does not exist"):
        load_job(tmp_path / "nope.yaml")
    with pytest.raises(JobConfigError, match="not valid YAML"):
        load_job(_job(tmp_path, "name: [unclosed"))
    with pytest.raises(JobConfigError, match="not of the form"):
        load_job(_job(tmp_path), ["train.rounds"])


def test_yaml_is_loaded_safely(tmp_path):
    evil = MINIMAL + "seed: !!python/object/apply:os.system ['true']\n"
    with pytest.raises(JobConfigError, match="not valid YAML"):
        load_job(_job(tmp_path, evil))


def test_committed_schemas_are_current():
    for name, document in generated_schemas().items():
        committed = (ROOT / "schemas" / name).read_text()
        assert committed == render(document), (
            f"schemas/{name} is stale: run `make schemas` (ncl-pipeline schemas) and commit it"
        )
    schema = json.loads((ROOT / "schemas" / "job.schema.json").read_text())
    assert {"name", "input", "output", "model"} <= set(schema["required"])


@pytest.mark.parametrize("name", ["demo", "demo-full", "demo-web", "teacher", "cc3m"])
def test_shipped_jobs_validate(name):
    job = load_job(ROOT / "jobs" / f"{name}.yaml")
    assert job.name == name


def test_cc3m_job_is_the_real_gpu_setting():
    job = load_job(ROOT / "jobs" / "cc3m.yaml")
    assert (job.model.name, job.model.pretrained, job.model.precision) == (
        "ViT-B-32",
        "laion2b_s34b_b79k",
        "bf16",
    )
    assert job.embed.gpus_per_worker == 1
    assert job.input.shards == "/data/cc3m/{00000..00331}.tar"


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_validate_reports_errors_without_traceback(tmp_path):
    bad = _cli("validate", str(_job(tmp_path)), "--config-only", "--set", "embed.batchsize=2")
    assert bad.returncode == 2
    assert "unknown key 'embed.batchsize'" in bad.stderr and "Traceback" not in bad.stderr
    good = _cli("validate", str(_job(tmp_path)), "--config-only")
    assert good.returncode == 0 and "ok: job 't'" in good.stdout


def test_every_error_the_cli_explains_is_a_user_error():
    from pipeline.clients.read import LabelTableError
    from pipeline.errors import RunFailedError, ShardFailuresError, UserError
    from pipeline.io.shards import ShardPatternError
    from pipeline.models import ModelLoadError
    from pipeline.run.runner import RunConflictError
    from pipeline.run.status import RunStatusError
    from pipeline.run.submit import SubmitError
    from pipeline.stages.export.driver import ExportConflictError
    from pipeline.stages.export.tasks import ExportError

    for error in (
        JobConfigError,
        ExportConflictError,
        ExportError,
        ShardPatternError,
        LabelTableError,
        ModelLoadError,
        RunConflictError,
        RunFailedError,
        RunStatusError,
        ShardFailuresError,
        SubmitError,
    ):
        assert issubclass(error, UserError), error


def test_cli_validate_and_run_fail_fast_on_missing_shards(tmp_path):
    for command in ("validate", "run"):
        result = _cli(command, "jobs/cc3m.yaml")
        assert result.returncode == 2, result.stderr
        assert "/data/cc3m/{00000..00331}.tar" in result.stderr
        assert "Traceback" not in result.stderr
