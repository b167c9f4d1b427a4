"""Progress lines (pipeline.runtime.progress) and a quiet console: the pipeline's lines, none of
Ray's (pipeline.runtime.console)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime.progress import Progress, format_seconds

REPO = Path(__file__).resolve().parents[1]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_logs_counts_rate_and_time_left_every_few_percent(caplog):
    clock = _Clock()
    log = logging.getLogger("pipeline.stages.example")
    progress = Progress("embed round 0", 100, "pairs", log=log, clock=clock)
    with caplog.at_level(logging.INFO, logger="pipeline"), progress:
        for _ in range(100):
            clock.now += 1.0
            progress.advance(1)
    lines = [r.getMessage() for r in caplog.records]
    # one line per 10% (at most one per 5 s), then the closing line; never the same line twice
    assert lines[0] == "  embed round 0: 10/100 pairs (10%), 1.0 pairs/s, 1m30s left"
    assert len(lines) == 10 and len(set(lines)) == 10
    assert lines[-1] == "  embed round 0: 100 pairs in 1m40s (1.0 pairs/s)"
    assert format_seconds(3725) == "1h02m"


# A driver with the CLI's console, a local Ray, and what made Ray print on the terminal before
# its own settings were used (pipeline.runtime.console): a worker's print and log lines, Ray
# Data (imported before the console is set up) with its progress bars off, Ray's start-up
# notices (token authentication of a local Ray).
_QUIET_SCRIPT = """
import logging, sys
import ray, ray.data
from pipeline.runtime.console import setup_console
from pipeline.runtime.ray import init_ray

setup_console()
init_ray(None, num_cpus=1)


@ray.remote
def chatty():
    print("worker stdout line")
    print("worker stderr line", file=sys.stderr)
    logging.getLogger("pipeline.stages.example").warning("worker warning line")


ray.get(chatty.remote())
ray.data.DataContext.get_current().enable_progress_bars = False
assert len(ray.data.range(8).map_batches(lambda b: b).take_all()) == 8
logging.getLogger("pipeline.runtime.example").info("driver info line")
logging.getLogger("pipeline.runtime.example").warning("driver warning line")
print(ray._private.worker._global_node.get_logs_dir_path())
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.own_ray
def test_the_console_shows_the_pipeline_and_none_of_rays_output(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _QUIET_SCRIPT],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    *shown, logs = result.stdout.strip().splitlines()
    assert shown == ["driver info line"], result.stdout
    assert result.stderr.strip() == "WARNING pipeline.runtime.example: driver warning line"
    # The worker did print: its lines are in Ray's log files, not on the terminal.
    worker_output = "".join(p.read_text(errors="replace") for p in Path(logs).glob("worker-*"))
    for line in ("worker stdout line", "worker stderr line", "worker warning line"):
        assert line in worker_output, line
