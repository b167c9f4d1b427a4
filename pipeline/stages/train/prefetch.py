"""Each view's batches epoch after epoch, the next epoch's pipeline started before this one ends.

An epoch's first batch waits for its data pipeline to start: Ray Data plans and launches the
readers, the first shard is read, decoded and tokenized. The training worker would idle that
long at every epoch boundary. `EpochData` starts the next epoch's pipeline on a thread when
the steps left in this epoch take about as long as the last start-up did (`start_due`), so its
first batch is ready when this epoch ends. The batches and their order are the same either
way (a pure function of seed, view and epoch: `pipeline.stages.train.data`); only when they
are fetched changes. A pipeline started for an epoch that never runs (the warm-up stopped) is
closed, which ends its readers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from pipeline.stages.train.data import epoch_batches
from pipeline.stages.train.spec import TrainSpec, ViewSpec

__all__ = ["EarlyStart", "EpochData", "start_due"]

# The next epoch starts this many of its measured start-ups before the current epoch ends: its
# readers then compete with the last steps for the CPUs, so a start-up takes longer than alone.
START_MARGIN = 2.0
# ... but never earlier than this share of the epoch before its end: two epochs' readers would
# then wait for the same reader CPUs, and the current epoch's last shards come first.
MAX_EARLY_SHARE = 0.25


def start_due(steps_left: int, steps: int, step_s: float, start_s: float | None) -> bool:
    """Whether the next epoch's pipeline starts now: `steps_left` of `steps` steps, taking
    `step_s` seconds each so far, last as long as `START_MARGIN` start-ups of `start_s` seconds
    (None: none measured yet, wait for it)."""
    if start_s is None or steps_left > MAX_EARLY_SHARE * steps:
        return False
    return steps_left * step_s <= START_MARGIN * start_s


class EarlyStart:
    """The batches of `make()`, the first one fetched at once on a thread; iterating joins the
    thread and yields it, then the rest in the caller's thread. An error while starting is
    raised on iteration, as it would have been without the thread."""

    def __init__(self, make: Callable[[], Iterable]):
        self._started = time.perf_counter()
        self.start_s: float | None = None  # seconds to the first batch, once it came
        self._iterator: Iterator | None = None
        self._first: list = []  # the first batch (empty: none, or not yet)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._fetch_first, args=(make,), name="epoch-data-start", daemon=True
        )
        self._thread.start()

    def _fetch_first(self, make: Callable[[], Iterable]) -> None:
        try:
            self._iterator = iter(make())
            self._first.append(next(self._iterator))
        except StopIteration:
            pass
        except BaseException as exc:  # raised again in the consuming thread
            self._error = exc
        self.start_s = time.perf_counter() - self._started

    def __iter__(self) -> Iterator:
        self._thread.join()
        if self._error is not None:
            raise self._error
        yield from self._first
        self._first = []
        if self._iterator is not None:
            yield from self._iterator

    def close(self) -> None:
        """Stop the pipeline (Ray Data shuts its executor down when its iterator closes)."""
        self._thread.join()
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()
        self._iterator, self._first = None, []


class EpochData:
    """The batches of each view and epoch on one rank, started early (see the module
    docstring); `close` ends every pipeline still open."""

    def __init__(self, spec: TrainSpec, rank: int, world: int):
        self.spec, self.rank, self.world = spec, rank, world
        self._early: dict[tuple[str, int], EarlyStart] = {}
        self._current: list[EarlyStart] = []

    def _start(self, view: ViewSpec, epoch: int) -> EarlyStart:
        spec, rank, world = self.spec, self.rank, self.world
        return EarlyStart(lambda: epoch_batches(spec, view, epoch, rank, world))

    def batches(self, views: list[ViewSpec], epoch: int) -> list[EarlyStart]:
        """Per view, the epoch's batches: started early, or now. The previous epoch's
        pipelines, and those started for a view not in `views`, are closed."""
        current = [self._early.pop((view.name, epoch), None) for view in views]
        self.close()
        self._current = [
            early or self._start(view, epoch) for early, view in zip(current, views, strict=True)
        ]
        return self._current

    def start_s(self) -> float | None:
        """The current epoch's start-up: the slowest view's seconds to its first batch."""
        measured = [e.start_s for e in self._current if e.start_s is not None]
        return max(measured) if measured else None

    def start_next(self, views: list[ViewSpec], epoch: int) -> None:
        """Start `epoch`'s pipelines now (no epoch past the round's last)."""
        if epoch >= self.spec.max_epochs:
            return
        for view in views:
            if (view.name, epoch) not in self._early:
                self._early[(view.name, epoch)] = self._start(view, epoch)

    def close(self) -> None:
        """Close every pipeline: the current epoch's and those started early."""
        for early in [*self._current, *self._early.values()]:
            early.close()
        self._current, self._early = [], {}
