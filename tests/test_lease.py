"""One writer per output (pipeline.run.lease): a live lease refuses a second run in seconds,
a stale one is taken over, `status` shows a leased run as running (issue 37 item 1)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
from cli_job import run_cli
from shared_run import write_corpus, write_job

from pipeline.io.layout import RunLayout
from pipeline.run.lease import (
    STALE_AFTER_S,
    OutputInUseError,
    acquire_lease,
    read_holder,
)


def _plant(output, pid: int, heartbeat: float, host: str | None = None) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "_lease.json").write_text(
        json.dumps(
            {
                "host": host or socket.gethostname(),
                "pid": pid,
                "started_at": "2030-01-01T00:00:00+00:00",
                "heartbeat": heartbeat,
                "token": "other",
                "job_name": "shared",
            }
        )
    )


def test_a_second_lease_is_refused_naming_the_holder(tmp_path):
    layout = RunLayout(str(tmp_path / "run"))
    with acquire_lease(layout, "first") as lease:
        assert read_holder(layout).token == lease.holder.token
        with pytest.raises(OutputInUseError) as refused:
            acquire_lease(layout, "second")
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and socket.gethostname() in message
        assert "started 20" in message and "--set output=" in message
    assert not os.path.exists(layout.lease)  # released on exit
    acquire_lease(layout, "third").release()


def test_a_stale_or_orphaned_lease_is_taken_over(tmp_path, caplog):
    layout = RunLayout(str(tmp_path / "run"))
    _plant(tmp_path / "run", os.getpid(), time.time() - STALE_AFTER_S - 5)  # no heartbeat
    with caplog.at_level("WARNING", logger="pipeline"), acquire_lease(layout) as lease:
        assert read_holder(layout).token == lease.holder.token
    assert "taking over the lease" in caplog.text and "stopped heartbeating" in caplog.text
    dead = subprocess.Popen(["true"])
    dead.wait()
    _plant(tmp_path / "run", dead.pid, time.time())  # fresh heartbeat, process gone
    with acquire_lease(layout):
        pass
    assert "its process is gone" in caplog.text


def test_the_cli_refuses_an_output_in_use_in_seconds(tmp_path):
    """A live holder (this test process, heartbeat now): the run stops before Ray starts."""
    corpus = write_corpus(tmp_path / "corpus")
    output = tmp_path / "run"
    _plant(output, os.getpid(), time.time() + 60)  # stays fresh for the whole test
    started = time.monotonic()
    result = run_cli("run", str(write_job(corpus, output)), timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stdout
    error = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "is in use by another run" in error[0], result.stdout
    assert f"pid {os.getpid()}" in error[0] and "ncl-pipeline status" in error[0]
    assert "Traceback" not in result.stdout
    assert took < 30, took  # no Ray start, no stage
    assert read_holder(RunLayout(str(output))).token == "other"  # the holder's lease is kept
    status = run_cli("status", str(output), timeout=120)
    assert status.returncode == 0, status.stdout
    assert "starting, no stage has run yet" in status.stdout
    assert f"running now: job 'shared', host {socket.gethostname()}" in status.stdout
