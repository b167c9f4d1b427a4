"""Progress lines (pipeline.runtime.progress) and the console's filter of Ray's noise."""

from __future__ import annotations

import logging

from pipeline.runtime.console import _FilteredForwarding, is_ray_noise
from pipeline.runtime.progress import Progress, format_seconds


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


def test_ray_noise_is_dropped_and_everything_else_forwarded():
    shown = []
    forward = _FilteredForwarding(shown.append)
    core = (
        "[2026-12-01 03:57:35,657 E 7164 7164] core_worker.cc:2465: Actor with class name: 'X' "
        "has constructor arguments in the object store and max_restarts > 0. If ..."
    )
    forward({"pid": 1, "lines": [core, "Requesting resources: {'CPU': 1} * 1", "real warning"]})
    forward({"pid": 2, "actor_name": "PlacementGroupCleaner", "lines": ["Traceback (most"]})
    forward({"pid": 3, "lines": ["Progress bars disabled. To enable, set ..."]})
    cleaner = ["Failed to register placement group with cleaner: ...", "\tpid: 6"]
    forward({"pid": 4, "lines": cleaner})
    forward({"pid": 5, "lines": ["Reporting training result 1: TrainingReport(checkpoint=None)"]})
    assert shown == [{"pid": 1, "lines": ["real warning"]}]
    assert is_ray_noise("Tip: use `ray status` to view detailed cluster status. To disable")
    assert not is_ray_noise("WARNING pipeline.run.runner: 1 shard(s) could not be read")
