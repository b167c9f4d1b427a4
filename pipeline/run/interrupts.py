"""SIGINT (Ctrl-C) and SIGTERM (what schedulers send) during a run: stop within seconds.

`catch_interrupts` installs handlers for the duration of `run_job` (in the main thread only;
elsewhere it does nothing). The first signal raises `RunInterrupted` in the main thread, wherever
it waits (Ray's `get` checks for signals while it blocks); `run_job` then stops Ray, releases the
output's lease and re-raises it naming the stage, and the CLI exits with 128 + the signal. A
second signal while that clean-up runs exits at once (`os._exit`).

Ray Train replaces the process's SIGINT handler on every `fit()` and never restores it; its
handler asks the training controller to abort and then `sys.exit`s, which ended a run
interrupted in training with status 1 and no message (issue 37). While the handlers here are
installed, that registration is a no-op (`_keep_ray_train_off_sigint`), and an interrupt in
training stops the controller and its workers through `ray.shutdown` like any other stage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.errors import RunInterrupted

__all__ = ["Interrupts", "catch_interrupts"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


_NO_REGISTRATION = "_ncl_pipeline_no_sigint_handler"


def _keep_ray_train_off_sigint() -> Callable[[], None]:
    """Make Ray Train's SIGINT handler registration a no-op; returns what undoes it."""
    try:
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    except ImportError:  # another Ray version: nothing to keep off
        return lambda: None
    original = DataParallelTrainer.__dict__.get("_register_sigint_handler")
    if original is None or getattr(original, _NO_REGISTRATION, False):
        return lambda: None

    def no_registration(self, controller) -> None:
        return None

    setattr(no_registration, _NO_REGISTRATION, True)
    DataParallelTrainer._register_sigint_handler = no_registration

    def undo() -> None:
        DataParallelTrainer._register_sigint_handler = original

    return undo


class Interrupts:
    """The handlers of one run, and the signal that stopped it (None while none did)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}  # what signal.getsignal returned
        self._undo: list[Callable[[], None]] = []

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            sys.stderr.write(f"\ninterrupted again: exiting now (exit {128 + signum})\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        raise RunInterrupted(signum)

    def install(self, *, ray_started: bool = False) -> None:
        """(Re)install the handlers: `ray.init` may install handlers of its own. Once Ray has
        started (`ray_started`), Ray Train's own SIGINT handler is kept off too."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        if ray_started and not self._undo:
            self._undo.append(_keep_ray_train_off_sigint())

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        while self._undo:
            self._undo.pop()()


@contextlib.contextmanager
def catch_interrupts() -> Iterator[Interrupts]:
    """Handle SIGINT and SIGTERM as `RunInterrupted` while the block runs."""
    interrupts = Interrupts()
    interrupts.install()
    try:
        yield interrupts
    finally:
        interrupts.restore()
