"""Failures a user reads: one plain paragraph on the console, the traceback in the run directory.

A failure inside a Ray task, actor or Ray Train worker reaches the driver wrapped in Ray's own
errors (`RayTaskError`, `WorkerGroupError`, ...), whose text is pages of Ray internals.
`explain_failure` writes the whole chain to `<output>/logs/error-<time>.log` and returns a
`RunFailedError` whose message names the stage, the underlying error (which names the shard or
sample where the reader knows it) and what to do, and the log's path.
"""

from __future__ import annotations

import datetime as _dt
import logging
import traceback

from pipeline.errors import RunFailedError, inner_exception, root_cause

__all__ = ["explain_failure"]

logger = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _advice(root: BaseException) -> str:
    from pipeline.io.admitted import ShardChangedError
    from pipeline.io.shards import ShardReadError

    if isinstance(root, ShardChangedError):
        return (
            "A shard changed while the run used it: leave the input unchanged during a run, "
            "then rerun (the changed shard is read again)."
        )
    if isinstance(root, ShardReadError | OSError):
        return (
            "Check that the shard named above is readable from every node (or remove it from "
            "input.shards), then rerun."
        )
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


def explain_failure(exc: BaseException, stage: str, output: str) -> RunFailedError:
    """The one-paragraph error for a failure of `stage`; the traceback goes to a log file."""
    root = root_cause(exc)
    log_path = _write_log(exc, stage, output)
    where = f" The full traceback is in {log_path}." if log_path else ""
    message = (
        f"{stage} failed: {_first_line(root)}. {_advice(root)} Finished stages are kept and "
        f"reused when the job is run again (`ncl-pipeline status` shows them).{where}"
    )
    return RunFailedError(message, log_path)
