"""Failures a user reads: one plain paragraph on the console, the traceback in the run directory.

A failure inside a Ray task, actor or Ray Train worker reaches the driver wrapped in Ray's own
errors (`RayTaskError`, `WorkerGroupError`, ...), whose text is pages of Ray internals.
`explain_failure` writes the whole chain to `<output>/logs/error-<time>.log` and returns a
`RunFailedError` whose message names the stage, the underlying error (which names the shard or
sample where the reader knows it) and what to do, and the log's path.
"""

from __future__ import annotations

import datetime as _dt
import errno
import logging
import os
import traceback
from collections.abc import Callable
from typing import TypeGuard

from pipeline.errors import RunFailedError, inner_exception, root_cause

__all__ = ["explain_failure"]

logger = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


# Errors of writing the output: what the user reads first, and what to do about it.
_OUTPUT_ERRORS = {
    errno.ENOSPC: ("the output's filesystem is full", "Free space there"),
    errno.EDQUOT: ("the disk quota of the output is exceeded", "Free space or raise the quota"),
    errno.EACCES: ("permission denied on the output", "Make it writable"),
    errno.EPERM: ("permission denied on the output", "Make it writable"),
    errno.EROFS: ("the output's filesystem is read-only", "Make it writable"),
}


def _under(path: str, output: str) -> bool:
    if "://" in output or "://" in path:
        return path.startswith(output.rstrip("/") + "/") or path == output
    path, output = os.path.abspath(path), os.path.abspath(output)
    return path == output or path.startswith(output.rstrip("/") + "/")


def _output_fault(root: BaseException, output: str) -> TypeGuard[OSError]:
    """An error writing the output: a full disk or quota (whatever the path: a write that
    fills the disk often has none), or no permission on a path inside the output."""
    if not isinstance(root, OSError) or root.errno not in _OUTPUT_ERRORS:
        return False
    if root.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return root.filename is None or _under(str(root.filename), output)


def _output_message(root: OSError, stage: str, output: str, space_note: str) -> str:
    assert root.errno is not None  # _output_fault found it in _OUTPUT_ERRORS
    what, fix = _OUTPUT_ERRORS[root.errno]
    path = root.filename or output
    note = f" {space_note}" if space_note and root.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return (
        f"{stage} failed: {what} ({_first_line(root)}); it was writing its outputs to "
        f"{path}.{note} {fix} (or set output to another place), then rerun the same command: "
        "finished stages are kept and the run resumes."
    )


def _advice(root: BaseException, output: str = "") -> str:
    from pipeline.io.admitted import ShardChangedError
    from pipeline.io.shards import ShardReadError

    if isinstance(root, ShardChangedError):
        return (
            "A shard changed while the run used it: leave the input unchanged during a run, "
            "then rerun (the changed shard is embedded again)."
        )
    if isinstance(root, ShardReadError):
        return (
            "Check that the shard named above is readable from every node (or remove it from "
            "input.shards), then rerun."
        )
    if isinstance(root, OSError):
        path = str(root.filename) if root.filename is not None else ""
        if path and output and _under(path, output):
            return (
                f"{path} is a file of the run directory: if another run wrote to this output at "
                "the same time or it was changed by hand, rerun the same command alone."
            )
        if path:
            return (
                f"Check that {path} is readable from every node (if it is an input shard, fix "
                "it or remove it from input.shards), then rerun."
            )
        return "Check the nodes' disks and network, then rerun."
    if isinstance(root, MemoryError) or "OutOfMemory" in type(root).__name__:
        return (
            "A worker ran out of memory: lower train.batch_size or embed.batch_size, or give "
            "the workers more memory, then rerun."
        )
    return "Fix the cause above if it is in the job or the data, then rerun."


def _write_log(exc: BaseException, stage: str, output: str) -> str | None:
    import fsspec

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = f"{output}/logs/error-{stamp}.log"
    lines = [f"stage: {stage}\n", "\n"]
    lines += traceback.format_exception(type(exc), exc, exc.__traceback__)
    chained, seen = exc, {id(exc)}
    while (inner := inner_exception(chained)) is not None and id(inner) not in seen:
        seen.add(id(inner))
        chained = inner
        lines += ["\nwrapped:\n"] + traceback.format_exception(type(inner), inner, None)
    try:
        fs, _, _ = fsspec.get_fs_token_paths(path)
        fs.makedirs(f"{output}/logs", exist_ok=True)
        with fs.open(path, "w") as handle:
            handle.write("".join(lines))
    except OSError as error:
        logger.debug(f"could not write {path}: {error}")
        return None
    return path


def explain_failure(
    exc: BaseException,
    stage: str,
    output: str,
    space_note: Callable[[], str] | None = None,
) -> RunFailedError:
    """The one-paragraph error for a failure of `stage`; the traceback goes to a log file.

    Args:
        space_note: called only for a full disk or quota: a sentence on how much space the
            stages still to run need (`pipeline.run.space.remaining_space_note`).
    """
    root = root_cause(exc)
    log_path = _write_log(exc, stage, output)
    where = f" The full traceback is in {log_path}." if log_path else ""
    if _output_fault(root, output):
        note = ""
        if space_note is not None and root.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                note = space_note()
            except Exception as error:  # an estimate must not hide the real error
                logger.debug(f"no space estimate: {error}")
        message = _output_message(root, stage, output, note) + where
        return RunFailedError(message, log_path)
    message = (
        f"{stage} failed: {_first_line(root)}. {_advice(root, output)} Finished stages are kept "
        f"and reused when the job is run again (`ncl-pipeline status` shows them).{where}"
    )
    return RunFailedError(message, log_path)
