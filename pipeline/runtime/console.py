"""What reaches the terminal: the one place that configures logging for `pipeline`.

Convention:
- Every module logs through its own `logger = logging.getLogger(__name__)` (so every record is
  under the `pipeline` logger) and never prints, never calls `logging.basicConfig`, never
  touches the root logger's level or handlers. Importing `pipeline` configures nothing.
- Entry points decide where records go: the CLI calls `setup_console` once; `pipeline.run_job`
  calls `ensure_console`, which does the same only when nothing has configured logging yet (a
  script or notebook sees the progress; an application with its own logging set-up keeps it).
- Ray worker processes (actors, tasks, Ray Train loops) get `setup_worker_logging` through
  Ray's `worker_process_setup_hook` (set by `pipeline.runtime.ray.init_ray`); worker code itself
  configures nothing. Per-item results come back to the driver as return values and the driver
  logs them; workers log only what cannot wait (training progress), which Ray forwards from the
  worker's stdout/stderr to the driver.

Ray's own output: after `init_ray` starts or joins Ray, `quiet_ray` (only when the console was
set up here) drops what says nothing to a user from the terminal: Ray's forwarded worker lines
and its driver-side log lines matching `RAY_NOISE` (actor restart caveats of Ray's C++ core,
Ray Train's start-up narration, its placement-group cleaner's failures to reach a dashboard
we do not run, Ray Data's "progress bars disabled", the autoscaler's tip). They stay in Ray's
log files (/tmp/ray/session_*/logs). Ray's duplicate-line folding stays on, so a line repeated
by several workers is shown once.

Progress (`pipeline.runtime.progress`): on a terminal, `live_task` draws a bar per long step (rich),
printed over by the log lines; elsewhere progress arrives as ordinary log lines.

Format: INFO is the bare message (the run's summaries are tables meant to be read as they are),
DEBUG, WARNING and above carry the level and the logger's name. INFO and DEBUG go to stdout,
WARNING and above to stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading

__all__ = [
    "RAY_NOISE",
    "ConsoleFormatter",
    "ConsoleHandler",
    "ensure_console",
    "filter_stderr",
    "is_ray_noise",
    "live_task",
    "quiet_ray",
    "setup_console",
    "setup_worker_logging",
]

LOGGER_NAME = "pipeline"

# Third-party loggers that are noisy at their default level in our worker processes.
# Ray Train's placement-group cleaner asks the State API, served by the dashboard, once a second
# whether the controller is alive; the embedded Ray runs without a dashboard, so every ask fails
# with a warning. The cleaner only matters when a controller dies ungracefully.
_QUIET_WORKER_LOGGERS = {
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": logging.ERROR,
}

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
    # Ray Data reads this when it is imported: its per-dataset INFO narration stays in its log.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
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

    What worker code logs under `pipeline` goes to the worker's stdout/stderr at INFO, which
    Ray forwards to the driver's terminal prefixed with the worker's name; a few noisy
    third-party loggers are turned down. The root logger is not touched.
    """
    _attach(logging.INFO)
    for name, level in _QUIET_WORKER_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    _quiet_failure_loggers()
    # Ray Data sets up its own logger when it is imported (after this hook), from this variable:
    # the Ray Train loop builds a dataset per view and epoch, each announced at INFO.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")


# ------------------------------------------------------------------------------------------
# Ray's own output on the driver's terminal

# Lines of Ray's that say nothing a user can act on (each stays in Ray's log files). Matched
# against a forwarded worker line, a Ray logger's record on the driver, or a line Ray's C++
# core writes to the driver's stderr.
RAY_NOISE = tuple(
    re.compile(pattern)
    for pattern in (
        # Ray Data / Ray Train create actors whose arguments live in the object store.
        r"core_worker\.cc.*constructor arguments in the object store and max_restarts",
        r"Progress bars (for operators )?disabled",  # we show our own progress
        r"Tip: use `ray status` to view detailed cluster status",
        r"Token authentication is enabled for this Ray cluster",  # a local, loopback-only Ray
        # Ray Train's start-up narration (the run logs its own "train: round ..." line).
        r"^Requesting resources: ",
        r"^Attempting to start training worker group",
        r"^Started training worker group of size",
        r"^- \(ip=[^)]*\) world_rank=",
        r"^Reporting training result \d+: TrainingReport\(",
        # Ray Data's per-dataset narration (INFO; RAY_DATA_LOG_LEVEL covers workers).
        r"(Starting execution of|Execution plan of|execution finished in) .*Dataset|"
        r"Dataset .* execution finished in",
        r"Registered dataset logger for dataset",
        # Ray Data hands Arrow-backed (read-only) arrays to torch; nothing writes to them.
        r"The given NumPy array is not writable, and PyTorch does not support",
        r"^\s*result = torch\.as_tensor\(ndarray, dtype=dtype, device=device\)",
    )
)
# Actors whose whole output is Ray's internal business: Ray Train's placement-group cleaner
# asks the State API (a dashboard we do not run) and, with several Ray instances on one
# machine, prints a ConnectionError traceback that is not a failure of the run.
_NOISY_ACTORS = ("PlacementGroupCleaner",)
# ...and a batch of another process's lines about that cleaner (its death, its traceback).
_NOISY_BATCH = re.compile(r"placement group with cleaner|PlacementGroupCleaner")

_STATE: dict = {"owned": False, "live": None, "stderr": None}


def is_ray_noise(line: str) -> bool:
    return any(pattern.search(line) for pattern in RAY_NOISE)


class _RayNoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not is_ray_noise(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is shown as is
            return True


class _FilteredForwarding:
    """Wraps Ray's handler that prints forwarded worker lines on the driver."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __call__(self, data: dict) -> None:
        if any(name in (data.get("actor_name") or "") for name in _NOISY_ACTORS):
            return
        if any(_NOISY_BATCH.search(line) for line in data.get("lines", [])):
            return
        lines = [line for line in data.get("lines", []) if not is_ray_noise(line)]
        if lines:
            self.handle({**data, "lines": lines})


class _StderrLineFilter:
    """The driver's file descriptor 2 through a pipe: Ray's C++ core logs there directly (not
    through Python), so its noise can only be dropped line by line; the rest passes on."""

    def __init__(self) -> None:
        import atexit

        sys.stderr.flush()
        self.original = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read,), daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def _pump(self, read: int) -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in iter(pipe.readline, b""):
                if not is_ray_noise(line.decode("utf-8", "replace")):
                    os.write(self.original, line)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self.original, 2)  # the pipe's last writer closes: the pump drains and ends
        self.thread.join(timeout=2)


def quiet_ray() -> None:
    """Drop `RAY_NOISE` from the terminal; called by `pipeline.runtime.ray.init_ray` once Ray is
    up. Does nothing unless `setup_console` configured the terminal (an application that set
    up logging itself keeps Ray's output as Ray prints it). Safe to call again."""
    if not _STATE["owned"]:
        return
    try:
        import ray.data  # noqa: F401 - Ray Data sets up its loggers when imported
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # pragma: no cover - another Ray layout: nothing filtered
        return
    with dispatcher._lock:
        handlers = list(dispatcher.handlers)
    for name, handle in handlers:
        if name == "ray_print_logs" and not isinstance(handle, _FilteredForwarding):
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, _FilteredForwarding(handle))
    for name in ["ray", *logging.root.manager.loggerDict]:
        if not name.startswith("ray"):
            continue
        for handler in getattr(logging.getLogger(name), "handlers", []):
            if type(handler) is logging.StreamHandler and not any(
                isinstance(f, _RayNoiseFilter) for f in handler.filters
            ):
                handler.addFilter(_RayNoiseFilter())
    filter_stderr()


def filter_stderr() -> None:
    """Route file descriptor 2 through the noise filter; called before `ray.init` too, which
    prints some of its notices while it starts. Does nothing unless the console is ours."""
    if _STATE["owned"] and _STATE["stderr"] is None:
        _STATE["stderr"] = _StderrLineFilter()


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
