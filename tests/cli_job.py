"""The CLI in a subprocess (`python -m pipeline.cli`) or in this process, for the tests of
what a user sees when a run is interrupted, refused or finds a damaged run directory (their
corpus and job: tests/shared_run.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI to its end; stdout and stderr together in `.stdout`."""
    return subprocess.run(
        cli(*args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def start_cli(log: Path, *args: str) -> subprocess.Popen:
    """The CLI in the background, its console (stdout and stderr) into `log`."""
    return subprocess.Popen(
        cli(*args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def poll_until(proc: subprocess.Popen, found, what: str, console, timeout: float, every: float):
    """`found()`'s first truthy result, asked every `every` s; AssertionError with the end of
    `console()` (the process's output) when the process ends or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not (result := found()):
        if proc.poll() is not None:
            raise AssertionError(f"ended before {what}:\n{console()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout}s:\n{console()}")
        time.sleep(every)
    return result


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = 240) -> None:
    """Block until `text` appears in the console `log`; fail if the process ends first."""

    def tail() -> str:
        return log.read_text(errors="replace")[-3000:]

    def printed() -> bool:
        return text in log.read_text(errors="replace")

    poll_until(proc, printed, repr(text), tail, timeout, every=0.1)


def invoke_cli(*args: str) -> tuple[int, str]:
    """The CLI in this process (typer's CliRunner): (exit status, stdout and stderr, without
    colour codes). The console set-up the CLI does on the `pipeline` logger is undone after,
    so the records of later tests reach pytest's capture as before."""
    import logging
    import re

    from typer.testing import CliRunner

    from pipeline.cli import app

    logger = logging.getLogger("pipeline")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    return result.exit_code, re.sub(r"\x1b\[[0-9;]*m", "", result.output)
