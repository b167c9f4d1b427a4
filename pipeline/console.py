"""What reaches the terminal: the one place that configures logging for `pipeline`.

Convention:
- Every module logs through its own `logger = logging.getLogger(__name__)` (so every record is
  under the `pipeline` logger) and never prints, never calls `logging.basicConfig`, never
  touches the root logger's level or handlers. Importing `pipeline` configures nothing.
- Entry points decide where records go: the CLI calls `setup_console` once; `pipeline.run_job`
  calls `ensure_console`, which does the same only when nothing has configured logging yet (a
  script or notebook sees the progress; an application with its own logging set-up keeps it).
- Ray worker processes (actors, tasks, Ray Train loops) get `setup_worker_logging` through
  Ray's `worker_process_setup_hook` (set by `pipeline.runtime.init_ray`); worker code itself
  configures nothing. Per-item results come back to the driver as return values and the driver
  logs them; workers log only what cannot wait (training progress), which Ray forwards from the
  worker's stdout/stderr to the driver.

Format: INFO is the bare message (the run's summaries are tables meant to be read as they are),
DEBUG, WARNING and above carry the level and the logger's name. INFO and DEBUG go to stdout,
WARNING and above to stderr.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = [
    "ConsoleFormatter",
    "ConsoleHandler",
    "ensure_console",
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
# <output>/logs/ (pipeline.run_errors); Ray Data also keeps them in its own log files.
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
