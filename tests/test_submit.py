"""`ncl-pipeline submit` against a real `ray start --head` on loopback (Ray Jobs API)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from pipeline.clients.read import labels_folder
from pipeline.data.synthetic import make_corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.own_ray]
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports on loopback. The sockets stay bound until all are chosen: one
    closed before the next bind can be handed out again, and Ray refuses a head whose
    components share a port."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@pytest.fixture(scope="module")
def head():
    """A separate Ray head (its own temp dir, so teardown kills only its processes)."""
    # A short path of its own, not pytest's: Ray's socket paths under it must fit AF_UNIX's
    # 107 bytes, which .../session_<date>_<pid>/sockets/plasma_store under a deeper pytest
    # temp dir (a long --basetemp, pytest-xdist's .../popen-gw1/rayhead0/) exceeds.
    temp_dir = Path(tempfile.mkdtemp(prefix="ncl-head-"))
    # Fixed default ports (agent 52365, metrics, runtime env) would clash with the session's
    # local Ray: give this head its own.
    gcs_port, dash_port, agent_http, agent_grpc, metrics, runtime_env = _free_ports(6)
    # As on a real cluster node, the project's console script is on the head's PATH.
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # Output to a file, not a pipe: the head's daemons outlive `ray start`, and writing to a
    # closed pipe kills them (the job agent then never comes up).
    log = temp_dir / "ray-start.log"
    try:
        with log.open("w") as out:
            started = subprocess.run(
                [
                    str(BIN / "ray"),
                    "start",
                    "--head",
                    f"--port={gcs_port}",
                    "--num-cpus=2",
                    "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dash_port}",
                    f"--temp-dir={temp_dir}",
                    f"--dashboard-agent-listen-port={agent_http}",
                    f"--dashboard-agent-grpc-port={agent_grpc}",
                    f"--metrics-export-port={metrics}",
                    f"--runtime-env-agent-port={runtime_env}",
                    "--disable-usage-stats",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=180,
            )
        assert started.returncode == 0, log.read_text()[-3000:]
        yield f"http://127.0.0.1:{dash_port}"
    finally:
        # Also after a failed `ray start`: the daemons it did start (GCS, agents) stay up.
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(temp_dir) in part for part in (proc.info["cmdline"] or [])):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [str(BIN / "ncl-pipeline"), "submit", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_submit_runs_the_demo_job_on_the_cluster(head, tmp_path):
    corpus = make_corpus(
        tmp_path / "corpus", samples=60, samples_per_shard=30, test_samples=10, seed=2
    )
    out = tmp_path / "run"
    args = [
        "jobs/demo.yaml",
        "--address",
        head,
        "--follow",
        "--set",
        f"input.shards={tmp_path}/corpus/{{00000..00001}}.tar",
        "--set",
        f"output={out}",
        "--set",
        "embed.batch_size=16",
        "--set",
        "eval.ground_truth=null",
        "--set",
        "eval.test_shards=null",
        "--set",
        "eval.val_shards=null",
        "--set",
        "train.warmup_epochs=0",
        "--set",
        "train.rounds=0",  # the submission is under test here; co-teaching has its own tests
    ]
    result = _submit(args, {"RAY_AUTH_MODE": "token"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SUCCEEDED" in result.stdout
    assert sorted(p.name for p in (out / "rounds" / "0" / "embeddings").glob("*.parquet")) == [
        "00000.parquet",
        "00001.parquet",
    ]
    assert len(corpus.shards) == 2
    assert sorted(p.name for p in Path(labels_folder(out)[1]).glob("*.parquet")) == [
        "00000.parquet",
        "00001.parquet",
    ]


def test_submit_explains_a_missing_token(head, tmp_path):
    env = {"RAY_AUTH_MODE": "", "RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}
    result = _submit(["jobs/demo.yaml", "--address", head], env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "token" in result.stderr and "Traceback" not in result.stderr


def test_submit_rejects_an_invalid_job_before_contacting_the_cluster(tmp_path):
    result = _submit(
        ["jobs/demo.yaml", "--address", "http://127.0.0.1:9", "--set", "labels.method=x"], {}
    )
    assert result.returncode == 2 and "labels.method" in result.stderr
