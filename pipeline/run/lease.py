"""One writer per output: the lease a run holds on its run directory (`<output>/_lease.json`).

`run_job` takes the lease before any stage and releases it on exit. The lease records the
holder (host, pid, start time, job name) and a heartbeat that a daemon thread renews every
`HEARTBEAT_S` seconds. A second run into the same output refuses in seconds
(`OutputInUseError`, naming the holder); a lease is taken over, with a warning, when its
heartbeat is older than `STALE_AFTER_S` (the holder stopped: killed, its machine lost) or when
its holder was a process of this machine that no longer exists (a killed driver rerun at once).

Local paths are created with O_EXCL, so two runs starting together cannot both take a fresh
lease. On an fsspec URL (object storage) the lease is best effort: written, then read back to
check that it is ours; two runs starting within the same second may both pass.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace

from pipeline.errors import UserError
from pipeline.io.layout import RunLayout
from pipeline.io.tables import open_atomic

__all__ = [
    "HEARTBEAT_S",
    "STALE_AFTER_S",
    "Lease",
    "LeaseHolder",
    "OutputInUseError",
    "acquire_lease",
    "read_holder",
]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # how often the holder renews its heartbeat
STALE_AFTER_S = 3 * HEARTBEAT_S  # a heartbeat older than this: the holder is gone


class OutputInUseError(UserError, RuntimeError):
    """Another live run holds the output's lease; the message names it and what to do."""


@dataclass(frozen=True)
class LeaseHolder:
    """What a lease file says about the run holding it."""

    host: str
    pid: int
    started_at: str  # ISO time, UTC
    heartbeat: float  # Unix time of the last renewal
    token: str  # this lease's identity (a run re-reading its lease checks it is still its own)
    job_name: str = ""

    def age(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat."""
        return max(0.0, (time.time() if now is None else now) - self.heartbeat)

    def gone(self) -> bool:
        """Whether this machine can tell that the holder no longer runs (its own process)."""
        if self.host != socket.gethostname():
            return False
        import psutil

        return not psutil.pid_exists(self.pid)

    def live(self, now: float | None = None) -> bool:
        return self.age(now) <= STALE_AFTER_S and not self.gone()

    def describe(self) -> str:
        job = f"job '{self.job_name}', " if self.job_name else ""
        return (
            f"{job}host {self.host}, pid {self.pid}, started {self.started_at}, "
            f"last heartbeat {self.age():.0f} s ago"
        )


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def read_holder(layout: RunLayout) -> LeaseHolder | None:
    """The lease of a run directory, None without one (or an unreadable one: a lease being
    written, or garbage, is not a live holder)."""
    fs, path = _fs(layout.lease)
    try:
        with fs.open(path, "r") as handle:
            payload = json.load(handle)
        return LeaseHolder(
            host=str(payload["host"]),
            pid=int(payload["pid"]),
            started_at=str(payload["started_at"]),
            heartbeat=float(payload["heartbeat"]),
            token=str(payload["token"]),
            job_name=str(payload.get("job_name") or ""),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _payload(holder: LeaseHolder) -> str:
    return json.dumps(
        {
            "host": holder.host,
            "pid": holder.pid,
            "started_at": holder.started_at,
            "heartbeat": holder.heartbeat,
            "heartbeat_at": _dt.datetime.fromtimestamp(
                holder.heartbeat, _dt.timezone.utc
            ).isoformat(timespec="seconds"),
            "token": holder.token,
            "job_name": holder.job_name,
        },
        indent=2,
    )


def _create_exclusive(path: str, text: str) -> bool:
    """Create a local file that must not exist; False when it does."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return True


def _replace(path: str, text: str) -> None:
    """Write the lease file whole: locally through the one atomic writer; on an object store
    with one PUT, already whole (a renamed copy would cost a copy and a delete per renewal)."""
    if "://" not in path:
        with open_atomic(path, "w") as handle:
            handle.write(text)
        return
    fs, fs_path = _fs(path)
    fs.makedirs(fs_path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(fs_path, "w") as handle:
        handle.write(text)


class Lease:
    """A held lease: renewed by a daemon thread until `release`."""

    def __init__(self, layout: RunLayout, holder: LeaseHolder) -> None:
        self.layout = layout
        self.holder = holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ncl-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            current = read_holder(self.layout)
            if current is not None and current.token != self.holder.token:
                logger.warning(
                    f"another run took over the lease on {self.layout.output} ({current.describe()}"
                    "): this run's heartbeat had stopped for too long; its outputs may now mix "
                    "with that run's."
                )
                return
            self.holder = replace(self.holder, heartbeat=time.time())
            try:
                _replace(self.layout.lease, _payload(self.holder))
            except OSError as exc:  # a full disk must not end the heartbeat for good
                logger.debug(f"could not renew the lease {self.layout.lease}: {exc}")

    def release(self) -> None:
        """Stop renewing and remove the lease file if it is still this run's."""
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S)
        current = read_holder(self.layout)
        if current is None or current.token != self.holder.token:
            return
        fs, path = _fs(self.layout.lease)
        try:
            fs.rm(path)
        except OSError as exc:
            logger.debug(f"could not remove the lease {self.layout.lease}: {exc}")

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _refusal(layout: RunLayout, holder: LeaseHolder) -> OutputInUseError:
    return OutputInUseError(
        f"output '{layout.output}' is in use by another run ({holder.describe()}): wait for it "
        f"to finish (`ncl-pipeline status {layout.output}` shows its progress) or stop it, "
        f"then rerun; a run that stops heartbeating is taken over after {STALE_AFTER_S:.0f} s, "
        "and to run both at once give this one another output (--set output=...)."
    )


def acquire_lease(layout: RunLayout, job_name: str = "") -> Lease:
    """Take the output's lease, or raise `OutputInUseError` naming the live holder.

    A stale lease (no heartbeat for `STALE_AFTER_S`, or a holder process of this machine that
    no longer exists) is taken over, with a warning naming the old holder.
    """
    now = time.time()
    mine = LeaseHolder(
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=_dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="seconds"),
        heartbeat=now,
        token=uuid.uuid4().hex,
        job_name=job_name,
    )
    path = layout.lease
    local = "://" not in path
    if local and _create_exclusive(path, _payload(mine)):
        return Lease(layout, mine)
    holder = read_holder(layout)
    if holder is None and local:
        # Just created by another run and not yet written, or unreadable: look again once.
        time.sleep(0.5)
        holder = read_holder(layout)
    if holder is not None and holder.live():
        raise _refusal(layout, holder)
    if holder is None:
        logger.warning(f"replacing the unreadable lease file {path}")
    else:
        why = "its process is gone" if holder.gone() else "it stopped heartbeating"
        logger.warning(
            f"taking over the lease on {layout.output} from an earlier run ({holder.describe()}; "
            f"{why}); its finished stages are kept."
        )
    _replace(path, _payload(mine))
    if not local:
        time.sleep(0.2)  # object storage: the last writer wins; check that it is this run
    current = read_holder(layout)
    if current is not None and current.token != mine.token:
        raise _refusal(layout, current)
    return Lease(layout, mine)
