"""Training schedules, pure: learning rate and the adaptive warm-up (docs/methods.md §10.2).

Contract:
- `cosine_lr` is linear warm-up to `base_lr` over `warmup_steps`, then cosine decay to
  `min_ratio * base_lr` at `total_steps` (CLIP fine-tuning practice: NPC/RCR).
- `WarmupState` + `update_warmup` decide, epoch by epoch, (a) whether small-loss selection is
  on and (b) whether warm-up stops. Selection waits until the model has left the chance
  plateau: selecting the lowest-loss pairs of a model that has learned nothing stops learning
  altogether (docs/methods.md §10.2 has the evidence). Warm-up
  stops when held-out rSum has not improved for `patience` epochs after leaving the plateau,
  or at `max_epochs`. The state is a plain dict so it can be checkpointed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["cosine_lr", "chance_loss", "WarmupState", "update_warmup"]


def cosine_lr(
    step: int, total_steps: int, warmup_steps: int, base_lr: float, min_ratio: float = 0.0
) -> float:
    """Learning rate at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def chance_loss(batch_size: int) -> float:
    """Mean per-direction InfoNCE of a model that has learned nothing: ln b."""
    return math.log(batch_size)


@dataclass
class WarmupState:
    epochs_done: int = 0
    left_plateau: bool = False  # once True stays True
    best_rsum: float | None = None
    best_epoch: int | None = None
    epochs_since_best: int = 0
    stopped: bool = False
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def update_warmup(
    state: WarmupState,
    *,
    epoch_loss: float,
    batch_size: int,
    rsum: float | None,
    max_epochs: int,
    plateau_fraction: float = 0.9,
    patience: int = 2,
    min_epochs: int = 1,
) -> WarmupState:
    """Fold one finished epoch into the warm-up decision.

    Args:
        state: the state before the epoch.
        epoch_loss: mean per-direction InfoNCE over the epoch (plain, unselected).
        batch_size: b, which sets the chance level ln b.
        rsum: retrieval rSum on the validation split after the epoch, or None without one.
        max_epochs: hard cap on warm-up epochs.
        plateau_fraction: the model has left the plateau once epoch_loss < fraction * ln b.
        patience: epochs without an rSum improvement (after the plateau) before stopping.
        min_epochs: never stop before this many epochs.

    Returns:
        The new state; `stopped` tells the caller to end warm-up, `best_epoch` which epoch's
        weights to keep (None: keep the last).
    """
    new = WarmupState(**state.to_dict())
    new.epochs_done += 1
    if not new.left_plateau and epoch_loss < plateau_fraction * chance_loss(batch_size):
        new.left_plateau = True
    if rsum is not None and new.left_plateau:
        if new.best_rsum is None or rsum > new.best_rsum:
            new.best_rsum, new.best_epoch, new.epochs_since_best = rsum, new.epochs_done, 0
        else:
            new.epochs_since_best += 1
    if new.epochs_done >= max_epochs:
        new.stopped, new.reason = True, f"reached the maximum of {max_epochs} epochs"
    elif (
        new.epochs_done >= min_epochs
        and new.best_rsum is not None
        and new.epochs_since_best >= patience
    ):
        new.stopped = True
        new.reason = f"held-out rSum did not improve for {patience} epochs"
    return new
