"""Resume checkpoints in time as well as in steps (train.checkpoint_every_s): when rank 0
saves, and that the cadence is a resource, not part of any stage's key."""

from __future__ import annotations

from pipeline.config import JobConfig, TrainConfig
from pipeline.run.state import stage_config
from pipeline.stages.train.loop import checkpoint_due


def _job(**train) -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "unit",
            "input": {"shards": "/data/{00000..00003}.tar"},
            "output": "/tmp/out",
            "model": {"name": "ncl-tiny"},
            "embed": {"decode": "cpu"},  # as a run resolves auto
            "train": {"rounds": 1, **train},
        }
    )


def test_steps_time_both_and_neither():
    steps = TrainConfig(checkpoint_every_steps=200)
    assert checkpoint_due(steps, 200, 0.0) and checkpoint_due(steps, 400, 0.0)
    assert not checkpoint_due(steps, 199, 10_000.0)  # time is off by default
    timed = TrainConfig(checkpoint_every_steps=0, checkpoint_every_s=600)
    assert not checkpoint_due(timed, 200, 599.9)
    assert checkpoint_due(timed, 7, 600.0)
    both = TrainConfig(checkpoint_every_steps=50, checkpoint_every_s=600)
    assert checkpoint_due(both, 50, 1.0) and checkpoint_due(both, 51, 601.0)
    assert not checkpoint_due(both, 51, 1.0)
    never = TrainConfig(checkpoint_every_steps=0, checkpoint_every_s=0)
    assert not any(checkpoint_due(never, n, 1e9) for n in (1, 200, 10_000))


def test_the_cadence_changes_no_stage_key():
    plain = _job()
    timed = _job(checkpoint_every_s=600, checkpoint_every_steps=0)
    for stage in ("embed", "warmup", "labels", "train"):
        assert stage_config(plain, stage) == stage_config(timed, stage)
