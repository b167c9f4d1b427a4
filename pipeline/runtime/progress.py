"""Progress of the long stages: counts, rate and time left, shown by the driver only.

Contract:
- `Progress(what, total, unit)` lives on the driver. A stage advances it as results reach the
  driver: per-shard summary rows (embed), finished futures (`as_completed`: label, publish and
  export tasks), or counts a Ray Train worker sends to a `ProgressBoard` actor that the driver
  polls (`follow_board`). Workers never print their progress.
- What the terminal shows is `pipeline.runtime.console`'s choice: a live bar with rate and time left
  when stdout is a terminal (`console.live_task`), otherwise one log line per `step` percent;
  either way one closing line with the count, the time taken and the rate. Progress lines go
  through the stage's logger like every other record, so they reach log files and tests too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Progress", "ProgressBoard", "as_completed", "follow_board", "format_seconds"]

logger = logging.getLogger(__name__)


def format_seconds(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _count(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


class Progress:
    """Counts of one long step on the driver; see the module docstring.

    Args:
        what: the step, e.g. "embed round 0" (the line's prefix).
        total: how many `unit`s make the step (None: unknown, no time left shown).
        unit: e.g. "shards", "pairs", "steps".
        log: the stage's logger (records stay under the stage's name).
        step: percent between two lines when the output is not a terminal...
        min_interval: ...and at least this many seconds (a short step shows its closing
            line only).
        closing_level: of the closing line (DEBUG when the caller logs its own summary).
    """

    def __init__(
        self,
        what: str,
        total: float | None,
        unit: str,
        *,
        log: logging.Logger | None = None,
        step: float = 10.0,
        min_interval: float = 5.0,
        closing_level: int = logging.INFO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from pipeline.runtime.console import live_task

        self.what, self.total, self.unit = what, total, unit
        self.log = log or logger
        self.step, self.min_interval = step, min_interval
        self.closing_level = closing_level
        self._shown_at = 0.0
        self.clock = clock
        self.started = clock()
        self.done = 0.0
        self.note = ""
        self.closed = False
        self._shown_bucket = 0
        self._live = live_task(what, total, unit)

    # -- numbers
    def elapsed(self) -> float:
        return max(self.clock() - self.started, 1e-9)

    def rate(self) -> float:
        return self.done / self.elapsed()

    def seconds_left(self) -> float | None:
        if not self.total or self.done <= 0:
            return None
        return max(self.total - self.done, 0.0) / self.rate()

    def line(self) -> str:
        """`  what: 300/2,000 pairs (15%), 52 pairs/s, 33s left; note`."""
        parts = [f"  {self.what}: {_count(self.done)}"]
        if self.total:
            parts.append(f"/{_count(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)")
        else:
            parts.append(f" {self.unit}")
        text = "".join(parts) + f", {self.rate():.1f} {self.unit}/s"
        left = self.seconds_left()
        if left is not None:
            text += f", {format_seconds(left)} left"
        return text + (f"; {self.note}" if self.note else "")

    # -- updates
    def update(self, done: float, total: float | None = None, note: str | None = None) -> None:
        if self.closed:
            return
        self.done = float(done)
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        if self._live is not None:
            self._live.update(self.done, self.total, self.note)
            return
        if not self.total or self.done >= self.total:
            return  # the closing line says it
        bucket = int(100 * self.done / self.total // self.step)
        if bucket > self._shown_bucket and self.elapsed() - self._shown_at >= self.min_interval:
            self._shown_bucket, self._shown_at = bucket, self.elapsed()
            self.log.info(self.line())

    def advance(self, amount: float = 1, note: str | None = None) -> None:
        self.update(self.done + amount, note=note)

    def close(self, note: str | None = None) -> None:
        """The closing line: `  what: 2,000 pairs in 38s (52 pairs/s); note`."""
        if self.closed:
            return
        self.closed = True
        if note is not None:
            self.note = note
        if self._live is not None:
            self._live.close()
        elapsed = self.elapsed()
        self.log.log(
            self.closing_level,
            f"  {self.what}: {_count(self.done)} {self.unit} in {format_seconds(elapsed)} "
            f"({self.done / elapsed:.1f} {self.unit}/s)" + (f"; {self.note}" if self.note else ""),
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._live is not None:  # a failure: no closing line, just take the bar away
            self.closed = True
            self._live.close()


def as_completed(refs: Iterable[Any], *, poll_seconds: float = 1.0) -> Iterator[tuple[int, Any]]:
    """(index, result) of Ray futures in the order they finish (the driver waits, not the
    workers). A failed task raises here, as `ray.get` would."""
    import ray

    pending = {ref: index for index, ref in enumerate(refs)}
    while pending:
        # Everything finished within the poll, not one ref per call: a call costs O(pending),
        # so one per result made a pass over thousands of shards O(shards^2) on the driver.
        done, _ = ray.wait(
            list(pending), num_returns=len(pending), timeout=poll_seconds, fetch_local=False
        )
        for ref in done:
            yield pending.pop(ref), ray.get(ref)


class ProgressBoard:
    """A Ray actor (created with `ProgressBoard.start()`) where workers leave their counts
    and their finished epochs; the driver reads them with `follow_board`.

    Workers call `board.report.remote(name, done, total, note)` and
    `board.message.remote(message)` (any picklable value, e.g. an epoch's numbers) without
    waiting for an answer.
    """

    def __init__(self) -> None:
        self.counts: dict[str, tuple[float, float | None, str]] = {}
        self.messages: list[Any] = []

    def report(self, name: str, done: float, total: float | None, note: str = "") -> None:
        self.counts[name] = (done, total, note)

    def message(self, message: Any) -> None:
        self.messages.append(message)

    def drain(self) -> tuple[dict[str, tuple[float, float | None, str]], list[Any]]:
        messages, self.messages = self.messages, []
        return dict(self.counts), messages

    @staticmethod
    def start():
        """The actor: no CPU reserved (it only holds a few numbers)."""
        import ray

        return ray.remote(num_cpus=0, max_restarts=0)(ProgressBoard).remote()


class _Follower:
    """The driver's polling thread of `follow_board`."""

    def __init__(self, board, on_counts, on_message, interval: float) -> None:
        self.board, self.on_counts, self.on_message = board, on_counts, on_message
        self.interval = interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ncl-progress", daemon=True)

    def poll(self) -> None:
        import ray

        counts, messages = ray.get(self.board.drain.remote(), timeout=30)
        for message in messages:
            self.on_message(message)
        self.on_counts(counts)

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - progress must never fail a run
                logger.debug(f"progress board not readable: {exc}")

    def __enter__(self) -> _Follower:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        try:
            self.poll()  # the last lines the workers left
        except Exception as exc:  # noqa: BLE001
            logger.debug(f"progress board not readable: {exc}")


def follow_board(
    board,
    on_counts: Callable[[dict[str, tuple[float, float | None, str]]], None],
    on_message: Callable[[Any], None],
    interval: float = 1.0,
) -> _Follower:
    """Context manager: poll `board` on a driver thread while the body (e.g. `trainer.fit()`)
    runs; each message is handed over once, in order; the last poll runs on exit."""
    return _Follower(board, on_counts, on_message, interval)
