"""SIGINT (Ctrl-C) and SIGTERM (what schedulers send) during a run: stop within seconds.

`catch_interrupts` installs handlers for the duration of `run_job` (in the main thread only;
elsewhere it does nothing). The first signal raises `RunInterrupted` in the main thread, wherever
it waits: Ray's `get` runs the handler while it blocks and, the exception being a
KeyboardInterrupt, raises a KeyboardInterrupt of its own at once. `run_job` then stops Ray,
releases the output's lease and raises `RunInterrupted` naming the stage (also for a signal some
library swallowed, once the stages return), and the CLI exits with 128 + the signal. A second
signal while that clean-up runs exits at once (`os._exit`).

`ray.init` installs handlers of its own, so the runner installs these again once Ray has
started. Ray Train would replace the SIGINT handler on every `fit()` run in the main thread;
the trainer runs `fit` in a thread of its own (`pipeline.stages.train.driver`), so an interrupt
in training stops the controller and its workers through `ray.shutdown` like any other stage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pipeline.errors import RunInterrupted

__all__ = ["Interrupts", "catch_interrupts"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """The handlers of one run, and the signal that stopped it (None while none did)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}  # what signal.getsignal returned

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            sys.stderr.write(f"\ninterrupted again: exiting now (exit {128 + signum})\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        raise RunInterrupted(signum)

    def install(self) -> None:
        """(Re)install the handlers: `ray.init` may install handlers of its own."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


@contextlib.contextmanager
def catch_interrupts() -> Iterator[Interrupts]:
    """Handle SIGINT and SIGTERM as `RunInterrupted` while the block runs."""
    interrupts = Interrupts()
    interrupts.install()
    try:
        yield interrupts
    finally:
        interrupts.restore()
