"""`TrainSpec` and `ViewSpec`: one training run of the two views, as plain data for Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import TrainConfig
from pipeline.io.shards import DecodeOptions
from pipeline.models import ModelSpec

__all__ = ["VIEW_NAMES", "TrainSpec", "ViewSpec"]

VIEW_NAMES = ("A", "B")  # the two co-taught models a pipeline run trains side by side


@dataclass(frozen=True)
class ViewSpec:
    """One of the two co-taught models."""

    name: str  # "A" or "B"
    init: ModelSpec  # weights to start from (tag, checkpoint path, or random init by seed)
    seed: int  # data order (and random init) seed
    labels_dir: str | None = None  # label table to join by key; None = every pair weight 1
    label_column: str = "soft_label"
    target: str = "weights"  # how label rows become training targets (core.coteach)
    weight_cut: float = 0.0  # labels at or below it train with weight 0 (the method's cut)
    proxies_dir: str | None = None  # SPS proxy pairs (key -> proxy caption, y_p)


@dataclass(frozen=True)
class TrainSpec:
    """One training run (the warm-up, or one co-teaching round) of the two views.

    The optimisation, warm-up and co-teaching settings are the job's validated `train` section
    itself (defaults and checks live in `pipeline.config` only); the rest says what to train
    on and where this run sits among the rounds.
    """

    output: str
    round_index: int
    views: tuple[ViewSpec, ...]
    shards: tuple[str, ...]
    shard_sizes: dict[str, int]  # usable samples per shard (from the embed pass): steps/epoch
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: str = "fp32"  # the job's model.precision
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    val_shards: tuple[str, ...] = ()  # select the warm-up length and kept epoch (not reported)
    test_shards: tuple[str, ...] = ()  # the reported retrieval of the final models only
    # which training this is: "warmup" (every pair, or the warm-up selection) | "labels"
    # (co-teaching on joined label tables); not the job's train.mode, which picks the labels
    round_kind: str = "warmup"
    max_epochs: int = 1  # train.warmup_epochs or train.epochs_per_round
    use_gpu: bool = False
    # (co-teaching epochs before this round, all co-teaching epochs): the subset schedule and
    # one LR curve over every round; (0, 0) = this run alone.
    coteach_epochs: tuple[int, int] = (0, 0)
    fail_after_steps: int | None = None  # fault injection for the resume test only
    # The run-state key this training is computed under, recorded in train_summary.json
    # (`pipeline.io.layout.RUN_STATE_FIELD`); None outside a run.
    run_state: dict | None = None
