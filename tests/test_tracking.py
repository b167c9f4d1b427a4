"""`train.report_to`: what the driver sends to TensorBoard (read back from the event files),
the sentence for a tracker that is not installed, the console's epoch line, and that tracking
is no part of any stage key. A real run's events: tests/test_coteach_rounds.py."""

from __future__ import annotations

import sys

import pytest

from pipeline.config import JobConfig
from pipeline.run.state import stage_config
from pipeline.runtime.tracking import (
    TrackingUnavailableError,
    open_tracking,
    track_coteaching,
    track_epoch,
)
from pipeline.stages.train.loop import epoch_line


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of the TensorBoard event files under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _message(**changes) -> dict:
    message = {
        "round": 1,
        "round_kind": "labels",
        "view": "A",
        "epoch": 0,
        "max_epochs": 2,
        "loss": 5.187,
        "objective": 2.125,
        "objective_name": "weighted InfoNCE",
        "val_rsum": None,
        "seconds": 1.0,
        "samples_per_s": 900.0,
        "pairs": 256,
        "mean_weight": 0.625,
        "weight_quantiles": {"p10": 0.25, "p50": 0.75, "p90": 1.0},
        "reliable_pairs": 0,
        "proxy_pairs": 0,
        "stop": "",
    }
    return {**message, **changes}


def test_the_epoch_line_counts_from_one_and_names_each_loss():
    line = epoch_line(_message(epoch=1, val_rsum=123.45))
    assert line.startswith("  round 1 A epoch 2/2: mean InfoNCE 5.187 (all pairs, unweighted)")
    assert "objective weighted InfoNCE 2.125" in line and "mean pair weight 0.62" in line
    assert "validation rSum 123.5" in line
    # A warm-up on plain InfoNCE minimises the same number it shows: shown once.
    warm = epoch_line(_message(round_kind="warmup", objective_name="InfoNCE", stop="patience"))
    assert "objective" not in warm and "pair weight" not in warm and warm.endswith("stop: patience")


def test_tensorboard_holds_the_numbers_the_console_shows(tmp_path):
    rows = [
        {"models": 0, "labels_round": 1, "auroc_a": 0.75, "auroc_b": 0.5, "rsum_A": 100.0},
        {"models": 1, "labels_round": 2, "auroc_a": 0.875, "auroc_combined": 0.9, "rsum_A": None},
    ]
    with open_tracking("tensorboard", str(tmp_path), "unit", {"name": "unit"}):
        track_epoch(_message())
        track_epoch(_message(epoch=1, loss=4.5, val_rsum=150.0))
        track_coteaching(rows)
    track_epoch(_message(view="B"))  # after the run: no tracker, nothing written
    scalars = read_scalars(tmp_path)
    assert scalars["round1/mean_infonce/A"] == [(1, pytest.approx(5.187)), (2, 4.5)]
    assert scalars["round1/objective/A"] == [(1, 2.125), (2, 2.125)]
    assert scalars["round1/pair_weight_mean/A"][0] == (1, 0.625)
    assert scalars["round1/pair_weight_p50/A"][0] == (1, 0.75)
    assert scalars["round1/val_rsum/A"] == [(2, 150.0)]  # no rSum, no point
    assert scalars["labels/auroc_a"] == [(1, 0.75), (2, 0.875)]
    assert scalars["labels/auroc_published"] == [(2, pytest.approx(0.9))]
    assert scalars["heldout/rsum_A"] == [(0, 100.0)]
    assert not any(tag.endswith("/B") for tag in scalars)


def test_a_tracker_that_is_not_installed_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does when it is absent
    with pytest.raises(TrackingUnavailableError, match=r"needs the wandb package.*pip install"):
        open_tracking("wandb", str(tmp_path), "unit", {}).__enter__()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TrackingUnavailableError, match=r"ncl-pipeline\[tracking\]"):
        open_tracking("tensorboard", str(tmp_path), "unit", {}).__enter__()


def test_report_to_is_no_part_of_any_stage_key():
    base = {
        "name": "unit",
        "input": {"shards": "/data/0.tar"},
        "output": "/tmp/out",
        "model": {"name": "ncl-tiny"},
        "embed": {"decode": "cpu"},  # as a run resolves auto
    }
    plain = JobConfig.model_validate(base)
    tracked = JobConfig.model_validate({**base, "train": {"report_to": "tensorboard"}})
    for kind in ("embed", "keys", "warmup", "labels", "train", "publish"):
        assert stage_config(plain, kind) == stage_config(tracked, kind), kind
