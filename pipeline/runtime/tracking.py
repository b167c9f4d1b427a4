"""Experiment tracking (`train.report_to`): the numbers the console shows, also sent to
TensorBoard or Weights & Biases, from the driver only.

Contract:
- `open_tracking(kind, log_dir, run_name, config)` is a context manager around a run
  (`job_tracking` in `pipeline.run.runner.run_job`): it opens the tracker, makes it the active
  one and closes it. `kind="none"` opens nothing. TensorBoard writes to `<output>/tensorboard`
  (`tensorboard/<job name>` in the working directory when the output is a URL).
- A tracker whose package is missing fails at once, before Ray starts, with a
  `TrackingUnavailableError` naming the package to install.
- `track_epoch(message)` and `track_coteaching(rows)` write to the active tracker (nothing
  without one). Workers never hold a tracker: a finished epoch reaches the driver through the
  progress board (`pipeline.stages.train.loop.epoch_line` formats the same message for the
  console), the label AUROC and held-out rSum per round through the co-teaching table.
- `EPOCH_SCALARS` and `COTEACHING_SCALARS` are the one list of what is logged and under which
  tag (docs/tracking.md shows them). Tracking never changes results, so `train.report_to` is
  not in any stage key.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.errors import UserError

__all__ = [
    "COTEACHING_SCALARS",
    "EPOCH_SCALARS",
    "TRACKERS",
    "TrackingUnavailableError",
    "epoch_scalars",
    "job_tracking",
    "open_tracking",
    "track_coteaching",
    "track_epoch",
]

logger = logging.getLogger(__name__)

# An epoch message's field -> the tag's metric name; tag `round{r}/{metric}/{view}`, step: the
# epoch counted from 1 (as the console counts).
EPOCH_SCALARS = {
    "loss": "mean_infonce",
    "objective": "objective",
    "mean_weight": "pair_weight_mean",
    "val_rsum": "val_rsum",
}
WEIGHT_QUANTILE_TAG = "pair_weight_{name}"  # p10, p50, p90 of the epoch's pair weights
# A co-teaching table column -> its tag; step: the row's labels round (AUROC) or model
# generation (rSum), as in the console's co-teaching table.
COTEACHING_SCALARS = {
    "auroc_a": ("labels/auroc_a", "labels_round"),
    "auroc_b": ("labels/auroc_b", "labels_round"),
    "auroc_combined": ("labels/auroc_published", "labels_round"),
    "rsum_A": ("heldout/rsum_A", "models"),
    "rsum_B": ("heldout/rsum_B", "models"),
    "rsum_A+B": ("heldout/rsum_A+B", "models"),
    "val_rsum_A": ("val/rsum_A", "models"),
    "val_rsum_B": ("val/rsum_B", "models"),
    "kept_fraction": ("labels/kept_fraction", "labels_round"),
    "views_spearman": ("labels/views_spearman", "labels_round"),
    "views_subset_agreement": ("labels/views_subset_agreement", "labels_round"),
    "change_spearman": ("labels/change_spearman", "labels_round"),
    "changed_subset_share": ("labels/changed_subset_share", "labels_round"),
    "noise_a": ("labels/noise_rate_a", "labels_round"),
    "noise_b": ("labels/noise_rate_b", "labels_round"),
}


class TrackingUnavailableError(UserError, ImportError):
    """`train.report_to` names a tracker whose package is not installed."""


def _require(module: str, kind: str, package: str, install: str):
    """`module`, imported; one sentence naming what to install when it is not there."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackingUnavailableError(
            f"train.report_to={kind} needs the {package} package, which is not installed: "
            f"{install}, or set train.report_to=none"
        ) from exc


class _TensorBoard:
    def __init__(self, log_dir: str, run_name: str, config: Mapping[str, Any]) -> None:
        install = "pip install 'ncl-pipeline[tracking]' (or tensorboard)"
        tensorboard = _require("torch.utils.tensorboard", "tensorboard", "tensorboard", install)
        self.writer = tensorboard.SummaryWriter(log_dir=log_dir)
        self.writer.add_text("job", f"```\n{_yaml(config)}\n```")
        self.where = log_dir

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, log_dir: str, run_name: str, config: Mapping[str, Any]) -> None:
        wandb = _require("wandb", "wandb", "wandb", "pip install wandb (and wandb login)")
        self.run = wandb.init(project="ncl-pipeline", name=run_name, config=dict(config))
        self.where = f"W&B run {self.run.name}"

    def scalar(self, tag: str, value: float, step: int) -> None:
        # W&B's own step must only grow; each tag's step is logged beside it instead.
        self.run.log({tag: value, f"{tag}/step": step})

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, type[_TensorBoard] | type[_WandB]] = {
    "tensorboard": _TensorBoard,
    "wandb": _WandB,
}
_active: list[_TensorBoard | _WandB] = []  # the open tracker of the running job (at most one)


def _yaml(config: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(config), sort_keys=False)


@contextlib.contextmanager
def open_tracking(
    kind: str, log_dir: str, run_name: str, config: Mapping[str, Any]
) -> Iterator[None]:
    """The tracker of one run, active while the body runs (nothing for `kind="none"`)."""
    if kind == "none":
        yield
        return
    tracker = TRACKERS[kind](log_dir, run_name, config)
    logger.info(f"tracking: {kind} -> {tracker.where}")
    _active.append(tracker)
    try:
        yield
    finally:
        _active.remove(tracker)
        tracker.close()


def job_tracking(job, output: str):
    """`open_tracking` for a job (`train.report_to`) whose run directory is `output`."""
    local = "://" not in output
    log_dir = f"{output}/tensorboard" if local else f"tensorboard/{job.name}"
    return open_tracking(job.train.report_to, log_dir, job.name, job.model_dump(mode="json"))


def _scalar(tag: str, value, step: int) -> None:
    if value is None or not _active:
        return
    _active[-1].scalar(tag, float(value), step)


def epoch_scalars(message: Mapping[str, Any]) -> dict[str, float]:
    """Tag -> value of a finished epoch's message (`pipeline.stages.train.loop`)."""
    prefix, view = f"round{message['round']}", message["view"]
    out = {
        f"{prefix}/{metric}/{view}": message[field]
        for field, metric in EPOCH_SCALARS.items()
        if message.get(field) is not None
    }
    for name, value in (message.get("weight_quantiles") or {}).items():
        if value is not None:
            out[f"{prefix}/{WEIGHT_QUANTILE_TAG.format(name=name)}/{view}"] = value
    return out


def track_epoch(message: Mapping[str, Any]) -> None:
    """A finished epoch's numbers (step: the epoch counted from 1)."""
    for tag, value in epoch_scalars(message).items():
        _scalar(tag, value, message["epoch"] + 1)


def track_coteaching(rows: list[Mapping[str, Any]]) -> None:
    """The co-teaching table (`pipeline.run.summary.coteaching_table`): per labels round its
    label-free diagnostics and, with ground truth, AUROC per view; per model generation its
    validation and held-out rSum."""
    for row in rows:
        for column, (tag, step) in COTEACHING_SCALARS.items():
            _scalar(tag, row.get(column), int(row[step]))
