"""What a run shows on the terminal, for tests whose fixtures outlive `capsys`/`caplog`."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
from collections.abc import Iterator

from pipeline.runtime.console import ConsoleFormatter, ConsoleHandler


@contextlib.contextmanager
def console_output() -> Iterator[list[str]]:
    """Collects the lines the console shows on stdout while the block runs (filled on exit).

    The `pipeline` logger gets the CLI's console handler at INFO (removed afterwards) and stdout
    is redirected, so the lines are the records as `pipeline.runtime.console` formats them, plus
    anything still printed on the driver.
    """
    logger = logging.getLogger("pipeline")
    handler = ConsoleHandler()
    handler.setFormatter(ConsoleFormatter())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = io.StringIO()
    lines: list[str] = []
    try:
        with contextlib.redirect_stdout(out):
            yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        lines.extend(out.getvalue().splitlines())


def printed_before_timeout(exc: subprocess.TimeoutExpired, tail: int = 3000) -> str:
    """The last `tail` characters of a timed-out child's stdout and of its stderr. What
    `subprocess.run` collected before the timeout is bytes even with `text=True`."""
    parts = (exc.stdout or b"", exc.stderr or b"")
    return "\n".join(
        (p.decode(errors="replace") if isinstance(p, bytes) else p)[-tail:] for p in parts
    )
