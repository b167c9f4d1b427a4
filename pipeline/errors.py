"""The exceptions a user reads, the exit code of each, and `root_cause` (the innermost error
of Ray's wrapper chain).

Every error whose message lets the user fix it derives from `UserError`; the CLI prints it as
one line. `pipeline.run.failures.explain_failure` turns a failed stage into a `RunFailedError`.
`EXIT_CODES` is the one table of the CLI's exit statuses (what `--help` and docs/failures.md
show); `exit_code` maps an exception onto it: 0 ok, 1 the run failed, 2 a usage or
configuration error (nothing ran), 3 stopped by `input.max_failed_shards`, 128 + the signal
when interrupted (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import enum
import signal

__all__ = [
    "EXIT_CODES",
    "ExitCode",
    "RunFailedError",
    "RunInterrupted",
    "ShardFailuresError",
    "UserError",
    "exit_code",
    "inner_exception",
    "root_cause",
]


class ExitCode(enum.IntEnum):
    """The CLI's exit statuses (an interrupted run exits with 128 + the signal)."""

    OK = 0
    RUN_FAILED = 1
    USAGE = 2
    SHARDS_STOPPED = 3
    INTERRUPTED = 128 + signal.SIGINT  # 130; SIGTERM gives 143


EXIT_CODES: dict[int, str] = {
    ExitCode.OK: "the command finished",
    ExitCode.RUN_FAILED: "the run failed (a stage, an export, a followed job); rerun to resume",
    ExitCode.USAGE: "usage or configuration error (option, job key, path, output); nothing ran",
    ExitCode.SHARDS_STOPPED: "stopped: more shards failed to read than input.max_failed_shards "
    "allows",
    ExitCode.INTERRUPTED: "interrupted by Ctrl-C (SIGINT); 143 for SIGTERM",
}


class UserError(Exception):
    """An error its message lets the user fix (a bad job key, a missing shard or weights file,
    a conflicting run directory): the CLI prints it as one `error:` line, without a traceback,
    and exits with `exit_code(error)` (2 unless a subclass is in `_EXIT_BY_ERROR`). Every such
    error derives from it, so the CLI catches them without importing the modules that raise
    them (torch and open_clip for a model error)."""


class RunFailedError(UserError, RuntimeError):
    """A stage of the run failed; the message is one paragraph meant for the user as is."""

    def __init__(self, message: str, log_path: str | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path


class ShardFailuresError(UserError, RuntimeError):
    """More shards failed to read than `input.max_failed_shards` allows."""


class RunInterrupted(KeyboardInterrupt):  # noqa: N818 (a KeyboardInterrupt, not an error)
    """SIGINT or SIGTERM stopped the run (pipeline.run.interrupts). A KeyboardInterrupt, so that
    no stage's `except Exception` handles it as a failure, and so that Ray's `get`, which runs
    signal handlers while it blocks, returns at once (it does so only for a KeyboardInterrupt;
    any other exception from a handler waited for the task to end). The CLI prints the message
    and exits with `exit_code` (128 + the signal: 130 Ctrl-C, 143 SIGTERM)."""

    def __init__(self, signum: int, stage: str = "") -> None:
        self.signum = signum
        self.stage = stage
        where = f" in {stage}" if stage else ""
        super().__init__(
            f"interrupted{where}; finished stages are kept; rerun the same command to resume"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# Most specific first: the first class an error is an instance of gives its exit code.
_EXIT_BY_ERROR: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (ShardFailuresError, ExitCode.SHARDS_STOPPED),
    (RunFailedError, ExitCode.RUN_FAILED),
    (UserError, ExitCode.USAGE),
    (KeyboardInterrupt, ExitCode.INTERRUPTED),
)


def exit_code(exc: BaseException) -> int:
    """The CLI's exit status for `exc` (`EXIT_CODES`): an unexpected error (a bug, which
    keeps its traceback) exits 1 like a failed run."""
    if isinstance(exc, RunInterrupted):
        return exc.exit_code
    for kind, code in _EXIT_BY_ERROR:
        if isinstance(exc, kind):
            return int(code)
    return int(ExitCode.RUN_FAILED)


def inner_exception(exc: BaseException) -> BaseException | None:
    """The exception `exc` wraps, if any (Ray's wrappers first, then Python's chain)."""
    for attribute in ("cause", "controller_failure"):
        wrapped = getattr(exc, attribute, None)
        if isinstance(wrapped, BaseException):
            return wrapped
    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return failures[min(failures)]
    return exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of `exc`'s wrapper and cause chain."""
    seen = {id(exc)}
    while (inner := inner_exception(exc)) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc
