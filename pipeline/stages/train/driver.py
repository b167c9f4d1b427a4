"""`run_training`: a round's training workers (whether to run it at all is the run state's
decision: `pipeline.run.state`).

One worker runs `train_loop` in one Ray task: no process group to set up, so Ray Train's
controller and worker-group start-up would buy nothing; a failed task is retried
`train.max_failures` times (a lost node, a killed worker) and resumes from `resume.pt`.
Several workers run it on Ray Train (`TorchTrainer`, DDP) with a rendezvous bound to rank 0's
node address (`pipeline.runtime.rendezvous`); Ray Train restarts a failed worker group the
same number of times. Either way the loop reads the same spec, writes the same checkpoints and
summary, and reports progress to the same board.
"""

from __future__ import annotations

import logging
import pickle
import threading
from typing import TYPE_CHECKING

from pipeline.config import JobConfig
from pipeline.errors import root_cause
from pipeline.io.layout import RunLayout
from pipeline.io.tables import read_json, remove_path
from pipeline.runtime.preflight import Request, more_cpus, resources_of
from pipeline.stages.train.data import (
    READER_TASK_OPTIONS,
    reader_tasks_per_view,
    steps_per_epoch,
)
from pipeline.stages.train.loop import NOT_RETRIED, epoch_line, train_loop
from pipeline.stages.train.spec import VIEW_NAMES, TrainSpec

if TYPE_CHECKING:
    from pipeline.runtime.progress import Progress

__all__ = ["ray_requests", "run_training", "train_loop_config", "worker_options"]

logger = logging.getLogger(__name__)


def worker_options(use_gpu: bool) -> dict[str, float]:
    """Ray options of one training worker, a Ray task or a Ray Train worker alike: a CPU for
    its loop, and a GPU on a GPU cluster."""
    return {"num_cpus": 1, **({"num_gpus": 1} if use_gpu else {})}


def ray_requests(job: JobConfig, cluster_gpus: float) -> list[Request]:
    """What training asks of Ray: `train.workers` workers at once, and beside them their
    readers. Each worker needs one reader CPU of its own, or it can wait forever: a reader
    waiting for a CPU held by another worker's reader, blocked on its worker stuck in a DDP
    all-reduce, never finishes. On GPUs each worker would use `READER_CPUS_PER_GPU` of them;
    fewer only slow it down. On CPU the readers share the node's cores with the trainer."""
    use_gpu, workers = cluster_gpus > 0, job.train.workers
    reader_cpus = resources_of(READER_TASK_OPTIONS)["CPU"]
    wanted = len(VIEW_NAMES) * reader_tasks_per_view(len(VIEW_NAMES)) if use_gpu else 0
    return [
        Request(
            "training worker",
            "train.workers",
            resources_of(worker_options(use_gpu)),
            count=workers,
            beside_cpus=int(workers * reader_cpus),
            wanted_cpus=int(workers * wanted * reader_cpus),
            beside="the Ray Data tasks reading their data",
            fix=f"lower train.workers (to {max(1, workers // 2)}?) or {more_cpus(job)}",
        )
    ]


def train_loop_config(spec: TrainSpec, board, ray_train: bool) -> dict:
    """`train_loop`'s config, with the spec as bytes: Ray Train's controller unpickles this
    config too, and the spec's classes would make it import the training code and open_clip
    (seconds of CPU per round in a process that only supervises the workers)."""
    return {"spec": pickle.dumps(spec), "progress": board, "ray_train": ray_train}


def _train_storage(path: str):
    """(storage path, pyarrow filesystem or None) for Ray Train. A URL goes through the same
    fsspec filesystem as every other file of the run (s3fs on S3), so Ray Train needs no
    credentials or endpoint of its own."""
    if "://" not in path:
        import os

        return os.path.abspath(path), None
    import fsspec
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, fs_path = fsspec.core.url_to_fs(path)
    return fs_path, PyFileSystem(FSSpecHandler(fs))


class _EpochBars:
    """The driver's progress bar of the epoch the workers are in (pipeline.runtime.progress), from
    the counts rank 0 leaves on the progress board; the workers' finished epochs are logged
    (and tracked) here."""

    def __init__(self) -> None:
        self.current: Progress | None = None
        self.finished: set[str] = set()

    def counts(self, counts: dict) -> None:
        from pipeline.runtime.progress import Progress

        for name, (done, total, note) in counts.items():
            if name in self.finished:
                continue
            if self.current is None or self.current.what != name:
                self.close()
                self.current = Progress(
                    name, total, "steps", log=logger, closing_level=logging.DEBUG
                )
            self.current.update(done, total, note)

    def message(self, message: dict) -> None:
        """A view's finished epoch: its console line, and the same numbers to the tracker."""
        from pipeline.runtime.tracking import track_epoch

        self.close()  # a view's epoch line comes after its last step
        logger.info(epoch_line(message))
        track_epoch(message)

    def close(self) -> None:
        if self.current is not None:
            self.finished.add(self.current.what)
            self.current.close()
            self.current = None


def _recorded_error(record: dict) -> Exception:
    """The worker's error (`train_loop`'s record) raised again on the driver, its worker-side
    traceback in the message after the first line (the run's error log shows it)."""
    kind = {cls.__name__: cls for cls in NOT_RETRIED}.get(record["type"], RuntimeError)
    return kind(
        f"{record['message']}\n\nraised on a training worker (not retried):\n{record['traceback']}"
    )


def _fit_off_the_main_thread(trainer) -> None:
    """`trainer.fit()` in a thread of its own, the main thread waiting on it interruptibly.

    Ray Train registers a SIGINT handler of its own only when `fit` runs in the main thread (it
    does not when Tune drives it from another): that handler aborts its controller and exits
    with status 1, and is never removed. Off the main thread the run's own handlers
    (`pipeline.run.interrupts`) keep Ctrl-C and SIGTERM, and `ray.shutdown` stops the fit.
    """
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)  # a signal's handler runs in the main thread between these waits
    if "error" in outcome:
        raise outcome["error"]


def run_training(spec: TrainSpec) -> dict:
    """Train the views of `spec`; a `resume.pt` left by an interrupted run of the same round
    is resumed (the driver deletes the round's checkpoints when its key changed).

    Returns:
        The round's train summary (per view: epochs, steps, loss/rSum history, kept epoch).
    """
    import ray

    layout = RunLayout(spec.output)
    if steps_per_epoch(spec, spec.train.workers) == 0:
        from pipeline.config import JobConfigError

        usable = sum(spec.shard_sizes.values())
        raise JobConfigError(
            f"train.batch_size={spec.train.batch_size} x train.workers={spec.train.workers} is "
            f"more than the {usable} usable samples can fill once; lower train.batch_size"
        )
    logger.info(
        f"train: round {spec.round_index} ({spec.round_kind}), views "
        f"{', '.join(v.name for v in spec.views)}, {spec.train.workers} worker(s), "
        f"{'GPU' if spec.use_gpu else 'CPU'}, up to {spec.max_epochs} epochs"
    )
    from pipeline.runtime.progress import ProgressBoard, follow_board

    # An earlier attempt's error file is stale once the round runs again.
    remove_path(layout.train_error(spec.round_index))
    board = ProgressBoard.start()
    bars = _EpochBars()
    try:
        with follow_board(board, bars.counts, bars.message):
            if spec.train.workers == 1:
                _run_one_worker(spec, board)
            else:
                _run_on_ray_train(spec, board)
    finally:
        bars.close()
        ray.kill(board)
    error = read_json(layout.train_error(spec.round_index))
    if error is not None:  # recorded by a worker; the retried worker(s) ended at once
        raise _recorded_error(error)
    summary = read_json(layout.train_summary(spec.round_index))
    if summary is None:
        raise RuntimeError(f"training of round {spec.round_index} ended without its summary")
    return summary


def train_worker(config: dict) -> None:
    """The single training worker of a round, as a Ray task (see the module docstring).

    An error a retry would only repeat (`NOT_RETRIED`) is recorded by `train_loop` and ends
    the task normally: the driver raises the record, and Ray neither retries the task nor
    reports the failure on the terminal."""
    try:
        train_loop(config)
    except Exception as exc:
        if not isinstance(root_cause(exc), NOT_RETRIED):
            raise


def _run_one_worker(spec: TrainSpec, board) -> None:
    import ray

    task = ray.remote(train_worker).options(
        **worker_options(spec.use_gpu),
        max_retries=spec.train.max_failures,
        retry_exceptions=True,
    )
    ray.get(task.remote(train_loop_config(spec, board, ray_train=False)))


def _run_on_ray_train(spec: TrainSpec, board) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.runtime.rendezvous import LoopbackTorchConfig

    layout = RunLayout(spec.output)
    storage, filesystem = _train_storage(f"{layout.round_dir(spec.round_index)}/ray_train")
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=train_loop_config(spec, board, ray_train=True),
        torch_config=LoopbackTorchConfig(),
        scaling_config=ScalingConfig(
            num_workers=spec.train.workers,
            use_gpu=spec.use_gpu,
            resources_per_worker=resources_of(worker_options(spec.use_gpu)),
        ),
        # A failed worker group (a node lost, a worker killed) is restarted by Ray Train and
        # train_loop resumes from resume.pt: the same weights as an undisturbed run.
        run_config=RunConfig(
            storage_path=storage,
            storage_filesystem=filesystem,
            name="train",
            failure_config=FailureConfig(max_failures=spec.train.max_failures),
        ),
    )
    _fit_off_the_main_thread(trainer)
