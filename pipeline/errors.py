"""The exceptions a user reads, and `root_cause` (the innermost error of Ray's wrapper chain).

Every error whose message lets the user fix it derives from `UserError`; the CLI prints it as
one line. `pipeline.run.failures.explain_failure` turns a failed stage into a `RunFailedError`.
"""

from __future__ import annotations

__all__ = [
    "RunFailedError",
    "RunInterrupted",
    "ShardFailuresError",
    "UserError",
    "inner_exception",
    "root_cause",
]


class UserError(Exception):
    """An error its message lets the user fix (a bad job key, a missing shard or weights file,
    a conflicting run directory): the CLI prints it as one `error:` line and exits with status
    2, without a traceback. Every such error derives from it, so the CLI catches them without
    importing the modules that raise them (torch and open_clip for a model error)."""


class RunFailedError(UserError, RuntimeError):
    """A stage of the run failed; the message is one paragraph meant for the user as is."""

    def __init__(self, message: str, log_path: str | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path


class ShardFailuresError(UserError, RuntimeError):
    """More shards failed to read than `input.max_failed_shards` allows."""


class RunInterrupted(BaseException):  # noqa: N818 (like KeyboardInterrupt, not an error)
    """SIGINT or SIGTERM stopped the run (pipeline.run.interrupts). A BaseException, like
    KeyboardInterrupt, so that no stage's `except Exception` handles it as a failure. The CLI
    prints the message and exits with `exit_code` (128 + the signal: 130 Ctrl-C, 143 SIGTERM)."""

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
