"""`run_training`: one Ray Train `TorchTrainer` for a round (skipped when complete)."""

from __future__ import annotations

import logging

from pipeline.io.layout import RunLayout
from pipeline.io.tables import read_json
from pipeline.stages.train.data import steps_per_epoch
from pipeline.stages.train.loop import train_loop
from pipeline.stages.train.spec import TrainSpec

__all__ = ["run_training"]

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# Driver side


def _torch_config():
    """Ray Train's torch backend, without a process group when there is a single worker.

    A process group is only needed to synchronise several workers, and torch's TCPStore binds
    all interfaces (`::`) whatever MASTER_ADDR says: a local, single-worker run must not open a
    port beyond loopback (`tests/test_embed_pass.py` checks what Ray processes listen on).
    """
    from ray.train.torch.config import TorchConfig, _TorchBackend

    class _Backend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            if len(worker_group) > 1:
                super().on_start(worker_group, backend_config)

    class _Config(TorchConfig):
        @property
        def backend_cls(self):
            return _Backend

    return _Config()


class _EpochBars:
    """The driver's progress bar of the epoch the workers are in (pipeline.progress), from the
    counts rank 0 leaves on the progress board; the workers' epoch lines are logged here."""

    def __init__(self) -> None:
        self.current = None
        self.finished: set[str] = set()

    def counts(self, counts: dict) -> None:
        from pipeline.progress import Progress

        for name, (done, total, note) in counts.items():
            if name in self.finished:
                continue
            if self.current is None or self.current.what != name:
                self.close()
                self.current = Progress(
                    name, total, "steps", log=logger, closing_level=logging.DEBUG
                )
            self.current.update(done, total, note)

    def message(self, text: str) -> None:
        self.close()  # a view's epoch line comes after its last step
        logger.info(text)

    def close(self) -> None:
        if self.current is not None:
            self.finished.add(self.current.what)
            self.current.close()
            self.current = None


def run_training(spec: TrainSpec) -> dict:
    """Train the views of `spec` on Ray Train (skipped when the round's training is complete).

    Returns:
        The round's train summary (per view: epochs, steps, loss/rSum history, kept epoch).
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    layout = RunLayout(spec.output)
    done = read_json(layout.train_summary(spec.round_index))
    if done is not None:
        logger.info(f"train: round {spec.round_index} already complete, skipped")
        return done
    if steps_per_epoch(spec, spec.train.workers) == 0:
        from pipeline.config import JobConfigError

        usable = sum(spec.shard_sizes.values())
        raise JobConfigError(
            f"train.batch_size={spec.train.batch_size} x train.workers={spec.train.workers} is "
            f"more than the {usable} usable samples can fill once; lower train.batch_size"
        )
    storage = f"{layout.round_dir(spec.round_index)}/ray_train"
    if "://" not in storage:
        import os

        storage = os.path.abspath(storage)
    logger.info(
        f"train: round {spec.round_index} ({spec.mode}), views "
        f"{', '.join(v.name for v in spec.views)}, {spec.train.workers} worker(s), "
        f"{'GPU' if spec.use_gpu else 'CPU'}, up to {spec.max_epochs} epochs"
    )
    from pipeline.progress import ProgressBoard, follow_board

    board = ProgressBoard.start()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"spec": spec, "progress": board},
        torch_config=_torch_config(),
        scaling_config=ScalingConfig(num_workers=spec.train.workers, use_gpu=spec.use_gpu),
        run_config=RunConfig(
            storage_path=storage, name="train", failure_config=FailureConfig(max_failures=0)
        ),
    )
    bars = _EpochBars()
    try:
        with follow_board(board, bars.counts, bars.message):
            trainer.fit()
    finally:
        bars.close()
        ray.kill(board)
    summary = read_json(layout.train_summary(spec.round_index))
    if summary is None:
        raise RuntimeError(f"training of round {spec.round_index} ended without its summary")
    return summary
