"""Co-teaching: which pairs train, with which weight, at which point of the schedule (pure numpy).

Contract (docs/methods.md §10):
- `coteach_phase(...)`: the subsets that take part in co-teaching epoch e (0-based over all
  rounds' epochs, E in total). A subset joins at epoch ⌊start·E⌋, so "half the epochs" means
  the same thing for 1 round of 4 epochs and 4 rounds of 1 (§10.4).
- `training_targets(target, phase, subset, soft_label, proxy_label)`: per-row training targets
  from a label table: the weight of the pair's positive InfoNCE term (or its soft margin), the
  SPS reliable flag (L_cro/L_met rows) and whether the caption is replaced by the SPS proxy
  caption. A weight of 0 keeps the pair in the batch as a negative only (§10.5).
- Each label method names its target (`bicro`, `sps`, `weights`, `rematch`) in
  `pipeline.core.labels.LABEL_METHODS`; what each gives the trainee is the table of §10.3.
  `proxy_image_weights` weighs the added text-direction rows (SPS, assign's rematches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.core.partition.decisions import CLEAN, NOISY, QUASI_CLEAN

__all__ = [
    "PROXY_TARGETS",
    "TRAINING_TARGETS",
    "Phase",
    "TrainingTargets",
    "coteach_phase",
    "proxy_image_weights",
    "training_targets",
]

TRAINING_TARGETS = ("bicro", "sps", "weights", "rematch")
PROXY_TARGETS = ("sps", "rematch")  # the targets that train the proxies table's pairs


@dataclass(frozen=True)
class Phase:
    """Which label subsets take part in an epoch."""

    noisy: bool  # BiCro's noisy subset, SPS's proxy pairs
    quasi_clean: bool  # SPS's quasi-clean subset


def _joined(epoch: int, total_epochs: int, start: float) -> bool:
    # 1e-9: 0.375 * 8 = 3.0000000000000004 must still join at epoch 3.
    return epoch >= math.floor(start * total_epochs + 1e-9)


def coteach_phase(
    epoch: int,
    total_epochs: int,
    *,
    bicro_noisy_start: float = 0.5,
    sps_quasi_start: float = 0.25,
    sps_noisy_start: float = 0.375,
    target: str = "bicro",
) -> Phase:
    """The subsets of co-teaching epoch `epoch` (0-based) out of `total_epochs`.

    Raises:
        ValueError: an epoch outside [0, total_epochs) or an unknown target.
    """
    if target not in TRAINING_TARGETS:
        raise ValueError(f"target must be one of {TRAINING_TARGETS}, got {target!r}")
    if not 0 <= epoch < total_epochs:
        raise ValueError(f"epoch {epoch} is outside the {total_epochs} co-teaching epochs")
    if target == "sps":
        return Phase(
            noisy=_joined(epoch, total_epochs, sps_noisy_start),
            quasi_clean=_joined(epoch, total_epochs, sps_quasi_start),
        )
    noisy = _joined(epoch, total_epochs, bicro_noisy_start) if target == "bicro" else True
    return Phase(noisy=noisy, quasi_clean=True)


@dataclass(frozen=True)
class TrainingTargets:
    weight: np.ndarray  # (N,) float32 in [0, 1]: weight of the pair's positive term
    reliable: np.ndarray  # (N,) bool: SPS reliable rows (L_cro / L_met)
    use_proxy: np.ndarray  # (N,) bool: train the image with the SPS proxy caption
    # (N,) float32 in [0, 1]: weight of an added row, the image with its proxy caption (0: none;
    # rematch: the row is added, the pair's own row stays)
    proxy_row: np.ndarray


def training_targets(
    target: str,
    phase: Phase,
    subset: np.ndarray,
    soft_label: np.ndarray,
    proxy_label: np.ndarray | None = None,
    *,
    weight_cut: float = 0.0,
) -> TrainingTargets:
    """Training targets of N label-table rows.

    Args:
        target: one of TRAINING_TARGETS (the label method's `training_target`).
        phase: from `coteach_phase`.
        subset: (N,) int codes CLEAN / QUASI_CLEAN / NOISY (pipeline.core.partition.decisions).
        soft_label: (N,) float labels in [0, 1]; NaN counts as 0.
        proxy_label: (N,) y_p of the image's proxy caption (NaN/absent = no proxy); sps and
            rematch only.
        weight_cut: labels at or below it train with weight 0 (BiCro*'s theta, applied here
            when the published label is left uncut).

    Returns:
        TrainingTargets with float32 weights clipped to [0, 1].
    """
    if target not in TRAINING_TARGETS:
        raise ValueError(f"target must be one of {TRAINING_TARGETS}, got {target!r}")
    subset = np.asarray(subset)
    label = np.clip(np.nan_to_num(np.asarray(soft_label, dtype=np.float32), nan=0.0), 0.0, 1.0)
    n = label.shape[0]
    if subset.shape != (n,):
        raise ValueError(f"subset must have shape ({n},); got {subset.shape}")
    reliable = np.zeros(n, dtype=bool)
    use_proxy = np.zeros(n, dtype=bool)
    proxy_row = np.zeros(n, dtype=np.float32)
    y_p = None
    if proxy_label is not None and target in PROXY_TARGETS and phase.noisy:
        y_p = np.clip(np.nan_to_num(np.asarray(proxy_label, np.float32), nan=0.0), 0.0, 1.0)
    weight = np.where(label > weight_cut, label, 0.0).astype(np.float32) if weight_cut else label
    if target == "bicro" and not phase.noisy:
        weight[subset == NOISY] = 0.0
    elif target == "sps":
        reliable = subset == CLEAN
        weight = np.where(reliable, 1.0, 0.0).astype(np.float32)
        if phase.quasi_clean:
            quasi = subset == QUASI_CLEAN
            weight[quasi] = label[quasi]
        if y_p is not None:
            use_proxy = (subset == NOISY) & (y_p > 0)
            weight[use_proxy] = y_p[use_proxy]
    elif target == "rematch" and y_p is not None:
        proxy_row = np.where((subset == NOISY) & (y_p > 0), y_p, 0.0).astype(np.float32)
    return TrainingTargets(
        weight=weight.astype(np.float32),
        reliable=reliable,
        use_proxy=use_proxy,
        proxy_row=proxy_row,
    )


def proxy_image_weights(target: str, phase: Phase, proxy_label_txt: np.ndarray) -> np.ndarray:
    """Weights of the text-direction proxy pairs (proxy image Ï, noisy caption T_n): SPS's, and
    assign's rematched image (target rematch).

    These are extra training rows, one per noisy pair with y_p^t > 0 (docs/methods.md §10.3):
    weight y_p^t from the noisy phase on, 0 (not trained) before it and for other targets.

    Args:
        target: one of TRAINING_TARGETS.
        phase: from `coteach_phase`.
        proxy_label_txt: (M,) y_p^t; NaN counts as 0.

    Returns:
        (M,) float32 in [0, 1].
    """
    y_p = np.clip(np.nan_to_num(np.asarray(proxy_label_txt, np.float32), nan=0.0), 0.0, 1.0)
    if target not in PROXY_TARGETS or not phase.noisy:
        return np.zeros_like(y_p)
    return y_p
