"""Training stage: two models (views A and B) trained in lockstep on Ray Train, data streamed by
Ray Data (docs/architecture.md §4.9).

Contract: `run_training(spec)` trains both views of one `TrainSpec` (the warm-up,
`round_kind="warmup"`, or one co-teaching round, `round_kind="labels"`, where each view joins
its peer's label table by key) with their own seeds, data order and optimizers; the order is a
pure function of (seed, view, epoch), so a resumed run sees the batches the killed one would
have. It writes `rounds/<r>/checkpoints/<VIEW>/resume.pt` atomically during the run, `model.pt`
at the end and `train_summary.json` last, then removes `resume.pt` (a finished round is not
resumed). Whether a round runs at all is the run state's decision (`pipeline.run.state`).
"""

from pipeline.stages.train.data import epoch_shard_order, read_training_batches
from pipeline.stages.train.driver import run_training
from pipeline.stages.train.spec import TrainSpec, ViewSpec

__all__ = ["TrainSpec", "ViewSpec", "epoch_shard_order", "read_training_batches", "run_training"]
