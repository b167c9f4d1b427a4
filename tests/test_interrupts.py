"""Ctrl-C and SIGTERM during `ncl-pipeline run` (issue 37 item 2): the run stops within
seconds with one sentence and exit 128 + the signal, keeps its finished stages, leaves no
lease, and a rerun of the same command finishes (taking over a stale lease, item 1)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from cli_job import run_cli, start_cli, wait_for_line
from shared_run import SHARDS, write_corpus, write_job

from pipeline.clients.read import labels_folder
from pipeline.errors import RunInterrupted
from pipeline.run.interrupts import Interrupts, catch_interrupts


def cli_run(test):
    """The marks of a test that runs the CLI (its own Ray in a subprocess)."""
    for mark in (pytest.mark.ray, pytest.mark.slow, pytest.mark.own_ray, pytest.mark.timeout(600)):
        test = mark(test)
    return test


SENTENCE = "; finished stages are kept; rerun the same command to resume"


def _stop(proc, signum: int, log, within: float = 60) -> tuple[int, float, str]:
    children = psutil.Process(proc.pid).children(recursive=True)  # Ray's processes
    started = time.monotonic()
    proc.send_signal(signum)
    code = proc.wait(timeout=within)
    took = time.monotonic() - started
    gone = psutil.wait_procs(children, timeout=30)[1]
    assert not gone, f"left running: {[p.name() for p in gone]}"
    return code, took, log.read_text(errors="replace")


def test_a_second_signal_exits_at_once(monkeypatch):
    def _exit(code):
        raise SystemExit(f"os._exit({code})")

    monkeypatch.setattr(os, "_exit", _exit)
    interrupts = Interrupts()
    with pytest.raises(RunInterrupted) as first:
        interrupts._handle(signal.SIGINT, None)
    assert first.value.exit_code == 130 and interrupts.signum == signal.SIGINT
    with pytest.raises(SystemExit, match=r"os\._exit\(143\)"):
        interrupts._handle(signal.SIGTERM, None)


@pytest.mark.ray
def test_a_signal_stops_a_driver_waiting_in_ray_get_at_once(local_ray):
    """The driver waits for a one-worker training round in one `ray.get`. Ray runs the handler
    while it blocks and returns at once only for a KeyboardInterrupt (`RunInterrupted` is one):
    another exception from the handler waited for the task to end, or was lost."""
    import ray

    @ray.remote(num_cpus=0)
    def slow() -> None:
        time.sleep(20)

    ref = slow.remote()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with catch_interrupts() as interrupts:
            started = time.monotonic()
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                ray.get(ref)
            took = time.monotonic() - started
    finally:
        ray.cancel(ref, force=True)
    assert took < 10, took
    assert interrupts.signum == signal.SIGINT


@cli_run
def test_sigterm_in_the_embed_pass_then_ctrl_c_in_the_warm_up_and_a_rerun_finishes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    output = tmp_path / "run"
    job = write_job(corpus, output)
    log = tmp_path / "sigterm.log"
    proc = start_cli(log, "run", str(job))
    wait_for_line(proc, log, "round0/embed: recomputed")
    code, took, console = _stop(proc, signal.SIGTERM, log)
    assert code == 143, console[-3000:]
    assert took < 30, took
    assert f"interrupted in the embed pass (round 0){SENTENCE}" in console
    assert not (output / "_lease.json").exists()

    log = tmp_path / "sigint.log"
    proc = start_cli(log, "run", str(job))
    wait_for_line(proc, log, "train: round 0 (warmup)")
    time.sleep(2)  # into the training loop
    code, took, console = _stop(proc, signal.SIGINT, log)
    assert code == 130, console[-3000:]
    assert took < 30, took
    assert f"interrupted in the warm-up (round 0 training){SENTENCE}" in console
    assert "Traceback" not in console and "Aborted" not in console
    assert not (output / "_lease.json").exists()
    stages = json.loads((output / "manifest.json").read_text())["stages"]
    assert stages["round0/embed"]["status"] == "done"
    assert stages["round0/warmup"]["status"] == "running"
    status = run_cli("status", str(output))
    assert "pending (interrupted)" in status.stdout and "running now" not in status.stdout

    # A stale lease (a holder that stopped heartbeating a minute ago) does not block the rerun.
    (output / "_lease.json").write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": "2030-01-01T00:00:00+00:00",
                "heartbeat": time.time() - 60,
                "token": "stale",
            }
        )
    )
    rerun = run_cli("run", str(job))
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "taking over the lease" in rerun.stdout and "stopped heartbeating" in rerun.stdout
    assert "round0/embed: reused" in rerun.stdout
    assert len(list(Path(labels_folder(output)[1]).glob("*.parquet"))) == SHARDS
    assert not (output / "_lease.json").exists()


@cli_run
def test_a_live_run_is_shown_running_refuses_a_second_and_stops_in_a_label_pass(tmp_path):
    """Two real runs into one output: while the first embeds, `status` shows it running and a
    second run is refused in seconds naming it; Ctrl-C in its label pass exits 130."""
    corpus = write_corpus(tmp_path / "corpus")
    output = tmp_path / "run"
    job = write_job(corpus, output, "train.warmup_epochs=0")
    log = tmp_path / "first.log"
    proc = start_cli(log, "run", str(job))
    try:
        wait_for_line(proc, log, "round0/embed: recomputed")
        status = run_cli("status", str(output), timeout=120)
        assert f"running now: job 'shared', host {socket.gethostname()}" in status.stdout
        assert f"pid {proc.pid}" in status.stdout, status.stdout
        started = time.monotonic()
        second = run_cli("run", str(job), timeout=120)
        assert second.returncode == 2, second.stdout
        assert "is in use by another run" in second.stdout and f"pid {proc.pid}" in second.stdout
        assert time.monotonic() - started < 30
        wait_for_line(proc, log, "round1/labels_a: recomputed", timeout=300)
    except BaseException:
        proc.kill()
        raise
    code, took, console = _stop(proc, signal.SIGINT, log)
    assert code == 130, console[-3000:]
    assert took < 30, took
    assert f"interrupted in the label passes of round 1{SENTENCE}" in console, console[-2000:]
    assert "Traceback" not in console
    assert not (output / "_lease.json").exists()
