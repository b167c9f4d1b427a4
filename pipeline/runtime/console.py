"""What reaches the terminal: the one place that configures logging for `pipeline`
(docs/architecture.md §5 has the whole convention).

Contract:
- Library modules log through `logging.getLogger(__name__)`, never print and configure nothing;
  importing `pipeline` configures nothing.
- `setup_console` (the CLI, once) and `ensure_console` (`run_job`, only when nothing configured
  logging yet) send `pipeline` records to the terminal: INFO bare to stdout, DEBUG with level and
  name to stdout, WARNING and above with level and name to stderr.
- `setup_worker_logging` runs in every Ray worker process (Ray's `worker_process_setup_hook`).
- `ray_init_options` quiets Ray with its own settings (`log_to_driver=False`, log levels) when
  the console was set up here; an application with its own logging keeps Ray's defaults.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = [
    "QUIET_RAY_ENV",
    "ConsoleFormatter",
    "ConsoleHandler",
    "ensure_console",
    "live_task",
    "ray_init_options",
    "setup_console",
    "setup_worker_logging",
]

LOGGER_NAME = "pipeline"

# Ray's loggers that print a failed task's or training worker's traceback where it happens
# (in the worker, forwarded to the driver's terminal, or on the driver). The exception still
# reaches `run_job`, which reports it as one paragraph and writes the whole chain to
# <output>/logs/ (pipeline.run.failures); Ray Data also keeps them in its own log files.
_FAILURE_LOGGERS = (
    "ray.data._internal.execution.streaming_executor_state",  # "An exception was raised ..."
    "ray.data.exceptions",  # "Full stack trace:"
    "ray.train.v2._internal.util",  # "Error in training function:"
    "ray.train.v2._internal.execution.failure_handling.default",  # "[FailurePolicy] RAISE"
)


class _DropFailureReports(logging.Filter):
    """Drops a failure logger's records. A filter, not a level: Ray Train's own logging set-up
    (`dictConfig`) resets the levels of its loggers in its worker processes, not their filters."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL


def _quiet_failure_loggers() -> None:
    for name in _FAILURE_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropFailureReports) for f in target.filters):
            target.addFilter(_DropFailureReports())


class ConsoleFormatter(logging.Formatter):
    """INFO as the bare message; other levels as `LEVEL logger.name: message`."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno != logging.INFO:  # (a table's indentation means nothing here)
            message = f"{record.levelname} {record.name}: {message.lstrip()}"
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return message


class ConsoleHandler(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr.

    The streams are looked up on every record, not kept from when the handler was made, so
    output follows `sys.stdout`/`sys.stderr` wherever they are redirected (pytest's capsys,
    click's CliRunner, `contextlib.redirect_stdout`).
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(text + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _attach(level: int) -> logging.Logger:
    target = logging.getLogger(LOGGER_NAME)
    for handler in list(target.handlers):
        if isinstance(handler, ConsoleHandler):
            target.removeHandler(handler)  # calling twice replaces, never duplicates
    handler = ConsoleHandler()
    handler.setFormatter(ConsoleFormatter())
    target.addHandler(handler)
    target.setLevel(level)
    # The console shows each record once: a handler on the root logger (open_clip calls
    # logging.basicConfig implicitly through `logging.info`) must not repeat it.
    target.propagate = False
    return target


def setup_console(verbose: bool = False) -> None:
    """Show the pipeline's records on the terminal (INFO, or DEBUG when `verbose`).

    Attaches one `ConsoleHandler` to the `pipeline` logger; other loggers, the root logger
    included, are left as they are, except Ray's loggers that print a failure's traceback
    (`_FAILURE_LOGGERS`: the run reports failures as one paragraph itself). Called by the CLI
    entry points.
    """
    _attach(logging.DEBUG if verbose else logging.INFO)
    _quiet_failure_loggers()
    _STATE["owned"] = True
    for key, value in QUIET_RAY_ENV.items():
        os.environ.setdefault(key, value)  # read when Ray (Data) starts; a user's choice stands
    # Ray Data reads its level when imported: if that was before this call, set it here too.
    logging.getLogger("ray.data").setLevel(os.environ["RAY_DATA_LOG_LEVEL"].upper())
    if _STATE["live"] is None and _is_terminal() and os.environ.get("NCL_PROGRESS") != "lines":
        _STATE["live"] = _LiveBars()


def _is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def ensure_console() -> None:
    """`setup_console()` unless logging is already configured (like `logging.basicConfig`).

    "Configured" means the `pipeline` logger or the root logger has a handler, or the
    `pipeline` logger has a level set: then the application's choice stands.
    """
    ours = logging.getLogger(LOGGER_NAME)
    if ours.handlers or ours.level != logging.NOTSET or logging.getLogger().handlers:
        return
    setup_console()


def setup_worker_logging() -> None:
    """Ray `worker_process_setup_hook`: the console set-up of every worker process.

    What worker code logs under `pipeline` goes to the worker's stdout/stderr at INFO: Ray's
    worker log files, and the driver's terminal when the driver forwards worker output (an
    application's choice; `ray_init_options`). The root logger is not touched.
    """
    _attach(logging.INFO)
    _quiet_failure_loggers()


# ------------------------------------------------------------------------------------------
# Ray's own output on the driver's terminal

# Ray's own settings for a quiet terminal, read from the environment when Ray (Data) starts:
# Ray Data's per-dataset narration and its "progress bars disabled" notice (we show our own
# progress) stay in its log file; the autoscaler's "Tip: use `ray status`" lines are not made.
QUIET_RAY_ENV = {"RAY_DATA_LOG_LEVEL": "ERROR", "RAY_SCHEDULER_EVENTS": "0"}

_STATE: dict = {"owned": False, "live": None}


def ray_init_options() -> dict:
    """`ray.init`'s output settings: quiet when the console is ours (`setup_console`), Ray's
    defaults for an application that set up logging itself.

    Quiet: worker output stays in Ray's log files (`log_to_driver=False`; workers report through
    return values, exceptions and the progress board) and the driver's `ray` loggers show
    errors only (Ray's start-up notices, e.g. that a local Ray uses token authentication).
    """
    if not _STATE["owned"]:
        return {"log_to_driver": True, "logging_level": logging.WARNING}
    return {"log_to_driver": False, "logging_level": logging.ERROR}


# ------------------------------------------------------------------------------------------
# Live progress bars on a terminal


class _LiveBars:
    """One rich display for every bar open at a time; it goes away when the last one closes,
    so log lines between the stages print as usual."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("  {task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[note]}"),
            transient=True,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self.open = 0
        self.lock = threading.Lock()

    def add(self, what: str, total: float | None, unit: str) -> int:
        with self.lock:
            if self.open == 0:
                self.progress.start()
            self.open += 1
            return self.progress.add_task(what, total=total, counts="", note="")

    def remove(self, task: int) -> None:
        with self.lock:
            self.progress.remove_task(task)
            self.open -= 1
            if self.open == 0:
                self.progress.stop()


class _LiveTask:
    def __init__(self, bars: _LiveBars, what: str, total: float | None, unit: str) -> None:
        self.bars, self.unit = bars, unit
        self.task = bars.add(what, total, unit)

    def update(self, done: float, total: float | None, note: str) -> None:
        counts = f"{done:,.0f}/{total:,.0f} {self.unit}" if total else f"{done:,.0f} {self.unit}"
        self.bars.progress.update(self.task, completed=done, total=total, counts=counts, note=note)

    def close(self) -> None:
        self.bars.remove(self.task)


def live_task(what: str, total: float | None, unit: str) -> _LiveTask | None:
    """A live bar when the console owns a terminal (see `setup_console`), else None: the
    caller (`pipeline.runtime.progress.Progress`) then logs its progress as lines."""
    bars = _STATE["live"]
    if bars is None:
        return None
    return _LiveTask(bars, what, total, unit)
