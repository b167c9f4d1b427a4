"""Streaming one tar shard as sample groups: grouping, member safety, truncation detection.

Contract (part of :mod:`pipeline.io.shards`, docs/architecture.md §4.1):

* :func:`iter_shard_records` reads a shard in one sequential pass (``tarfile`` mode ``r|*``
  over ``fsspec``, or a ``pipe:`` command's stdout) and never seeks, extracts to disk or
  decodes: it yields exactly one :class:`RawRecord` or keyed :class:`Rejection` per sample
  group, then at most one ``truncated_shard`` row with ``key=None`` when the shard broke.
* Members are grouped webdataset-style (consecutive members sharing the name up to the first
  ``.`` of the basename). Only allow-listed members (:data:`ALLOWED_EXTENSIONS`) are read; every
  other member is skipped unread and counted in :attr:`ShardReadStats.ignored_members`.
* Unsafe names (absolute, ``..``) and links that would provide an allow-listed member reject
  their sample as ``unsafe_member``; other non-regular members are ignored and counted.
* A shard that cannot be opened at all raises :class:`ShardReadError`.
* The bytes are hashed as they stream past: after a complete read, :attr:`ShardReadStats.size`
  and :attr:`ShardReadStats.sha256` fingerprint the file as read (trailing padding after the
  end-of-archive marker included), so a later reader can tell the same shard from a changed one.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import subprocess
import tarfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec

from pipeline.io.records import ALLOWED_EXTENSIONS, RawRecord, Rejection
from pipeline.io.shard_patterns import qualify_key, shard_name, split_source

__all__ = [
    "DEFAULT_MAX_MEMBER_BYTES",
    "ShardReadError",
    "ShardReadStats",
    "iter_shard_records",
]

DEFAULT_MAX_MEMBER_BYTES = 64 * 1024 * 1024  # far above any web image; bounds worker memory

_DRIVE_RE = re.compile(r"^[A-Za-z]:")


class ShardReadError(Exception):
    """A shard cannot be opened as a tar archive; the message names the path."""


@dataclass
class ShardReadStats:
    """Counters filled while :func:`iter_shard_records` iterates one shard."""

    members_total: int = 0  # tar members seen, of any type
    records: int = 0  # sample groups yielded, as RawRecord or keyed Rejection
    ignored_members: dict[str, int] = field(default_factory=dict)  # ext or "<type>" -> count
    rejected: dict[str, int] = field(default_factory=dict)  # reader reason -> count
    error: str | None = None  # set when the shard broke mid-way (see truncated_shard)
    size: int | None = None  # bytes of the file as read (set after a complete read)
    sha256: str | None = None  # hex sha256 of those bytes (set after a complete read)


class _HashingReader:
    """A read-only stream that hashes and counts every byte read through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        self.size += len(data)
        return data

    def drain(self, chunk: int = 1 << 20) -> None:
        """Read (and hash) whatever the tar reader left unread: the padding after the end."""
        while self.read(chunk):
            pass


# --------------------------------------------------------------------------- members


class _RecordingTarInfo(tarfile.TarInfo):
    """TarInfo whose header parser remembers the last header error on the archive.

    In stream mode ``TarFile.next()`` treats a truncated, empty or corrupt header after the
    first member as a normal end of archive; only an all-zero block is a real end marker.
    Recording the error lets the reader tell a complete shard from a cut one.
    """

    @classmethod
    def fromtarfile(cls, tarfile_obj: tarfile.TarFile) -> _RecordingTarInfo:
        try:
            return super().fromtarfile(tarfile_obj)
        except tarfile.HeaderError as exc:
            tarfile_obj._ncl_header_error = exc  # type: ignore[attr-defined]
            raise


def _split_member_name(name: str) -> tuple[str, str]:
    """(key, lower-cased extension) by the webdataset rule: split at the basename's first dot."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :].lower()


def _is_unsafe_name(name: str) -> bool:
    if name.startswith(("/", "\\")) or _DRIVE_RE.match(name):
        return True
    return ".." in re.split(r"[/\\]", name)


def _member_type(info: tarfile.TarInfo) -> str:
    if info.isdir():
        return "<dir>"
    if info.issym():
        return "<symlink>"
    if info.islnk():
        return "<hardlink>"
    if info.ischr() or info.isblk():
        return "<device>"
    if info.isfifo():
        return "<fifo>"
    return "<other>"


@contextlib.contextmanager
def _open_stream(path: str, allow_pipe: bool) -> Iterator[tuple[BinaryIO, Any]]:
    """Open ``path`` for sequential reading; yields (file object, pipe process or None)."""
    if path.startswith("pipe:"):
        if not allow_pipe:
            raise ValueError(f"{path!r} is a pipe: command; pass allow_pipe=True to run it")
        proc = subprocess.Popen(  # noqa: S602 - the job explicitly opted into pipe: commands
            path[len("pipe:") :], shell=True, stdout=subprocess.PIPE
        )
        try:
            yield proc.stdout, proc  # type: ignore[misc]
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()  # type: ignore[union-attr]
            proc.wait()
        return
    try:
        handle = fsspec.open(path, "rb").open()
    except Exception as exc:  # backends raise anything from FileNotFoundError to ClientError
        raise ShardReadError(f"cannot open shard {path!r}: {exc}") from exc
    try:
        yield handle, None
    finally:
        handle.close()


class _Group:
    """The sample group being accumulated while streaming."""

    def __init__(self, key: str, first_member: str) -> None:
        self.key = key
        self.first_member = first_member
        self.members: dict[str, bytes] = {}
        self.problem: tuple[str, str, str] | None = None  # (reason, member, detail), first wins

    def flag(self, reason: str, member: str, detail: str) -> None:
        if self.problem is None:
            self.problem = (reason, member, detail)


# --------------------------------------------------------------------------- grouping


def _ignore(stats: ShardReadStats, label: str) -> None:
    stats.ignored_members[label] = stats.ignored_members.get(label, 0) + 1


def _finish(done: _Group, shard: str, stats: ShardReadStats) -> RawRecord | Rejection:
    """The one item a completed sample group yields, counted in ``stats``."""
    stats.records += 1
    if done.problem is None:
        return RawRecord(key=done.key, shard=shard, members=done.members)
    reason, member, detail = done.problem
    stats.rejected[reason] = stats.rejected.get(reason, 0) + 1
    return Rejection(key=done.key, shard=shard, member=member, reason=reason, detail=detail)


def _end_of_archive_error(archive: tarfile.TarFile) -> str | None:
    """Why the archive ended without a proper end-of-archive marker, or None if it had one."""
    header_error = getattr(archive, "_ncl_header_error", None)
    if header_error is not None and not isinstance(header_error, tarfile.EOFHeaderError):  # type: ignore[attr-defined]
        # Only an all-zero block ends a tar; anything else here means it was cut.
        return (
            f"{type(header_error).__name__}: {header_error or 'no data'} "
            "(no end-of-archive marker: truncated or corrupt tar)"
        )
    return None


def _not_a_sample_member(info: tarfile.TarInfo, key: str, ext: str, unsafe: bool) -> str | None:
    """The ignore label of a member that forms no sample, or None when it joins a group.

    Unsafe names always join their group (to reject it); links join only when they would
    provide an allow-listed member (to reject it too).
    """
    if not unsafe and not info.isreg():
        is_link = info.issym() or info.islnk()
        if not (is_link and key and ext in ALLOWED_EXTENSIONS):
            return _member_type(info)
    elif not unsafe and (not key or not ext):
        return ext or "<no extension>"  # dotfiles and extension-less names: not samples
    return None


def _new_group(key: str, name: str, seen_keys: set[str]) -> _Group:
    group = _Group(key, name)
    if key in seen_keys:
        # Flagged up front so the later group's bytes are never read.
        group.flag(
            "duplicate_key",
            name,
            f"key {key!r} already appeared earlier in this shard; the first group is kept",
        )
    seen_keys.add(key)
    return group


def _wants_bytes(
    group: _Group,
    info: tarfile.TarInfo,
    ext: str,
    unsafe: bool,
    max_member_bytes: int,
    stats: ShardReadStats,
) -> bool:
    """Flag what is wrong with a member of ``group``; True when its bytes are to be read."""
    name = info.name
    if unsafe:
        group.flag("unsafe_member", name, f"member name {name!r} escapes the archive")
    elif not info.isreg():
        group.flag(
            "unsafe_member",
            name,
            f"{_member_type(info)[1:-1]} member {name!r} -> {info.linkname!r} would "
            "provide sample data",
        )
    elif ext not in ALLOWED_EXTENSIONS:
        _ignore(stats, ext)  # never read: .pkl, .pyd, .npy, .pth ... are not ours to decode
    elif ext in group.members:
        group.flag("duplicate_member", name, f"second {ext!r} member in sample {group.key!r}")
    elif info.size > max_member_bytes:
        group.flag(
            "member_too_large",
            name,
            f"{info.size} bytes exceeds max_member_bytes={max_member_bytes}",
        )
    else:
        return group.problem is None  # a rejected group's bytes are not needed
    return False


def _iter_archive(
    archive: tarfile.TarFile,
    shard: str,
    stats: ShardReadStats,
    max_member_bytes: int,
    source: str | None,
) -> Generator[RawRecord | Rejection, None, tuple[str | None, str | None, str | None]]:
    """Group an open stream-mode archive into samples (see :func:`iter_shard_records`); keys
    come out qualified by ``source`` (:func:`qualify_key`).

    Returns (through ``StopIteration.value``) ``(error, last_good_member, pending_key)``; error
    is None when the archive ended with a proper end-of-archive marker.
    """
    seen_keys: set[str] = set()
    group: _Group | None = None
    last_good: str | None = None

    def broken(error: str) -> tuple[str, str | None, str | None]:
        return error, last_good, group.key if group else None

    while True:
        try:
            info = archive.next()
        except Exception as exc:  # corrupt data, decompression or transport failure
            return broken(f"{type(exc).__name__}: {exc}")
        if info is None:
            end_error = _end_of_archive_error(archive)
            if end_error is not None:
                return broken(end_error)
            break
        # Stream mode keeps every TarInfo in .members; drop them so memory stays flat.
        archive.members = []  # type: ignore[attr-defined]
        stats.members_total += 1
        name = info.name
        key, ext = _split_member_name(name)
        key = qualify_key(source, key) if key else key  # an empty key forms no sample
        unsafe = _is_unsafe_name(name)
        ignored = _not_a_sample_member(info, key, ext, unsafe)
        if ignored is not None:
            _ignore(stats, ignored)
            last_good = name
            continue

        if group is None or key != group.key:
            if group is not None:
                yield _finish(group, shard, stats)
            group = _new_group(key, name, seen_keys)
        if _wants_bytes(group, info, ext, unsafe, max_member_bytes, stats):
            try:
                extracted = archive.extractfile(info)
                data = extracted.read() if extracted is not None else b""
            except Exception as exc:  # truncated member data, decompression error
                return broken(f"{type(exc).__name__}: {exc}")
            group.members[ext] = data
        last_good = name

    if group is not None:
        yield _finish(group, shard, stats)
    return None, last_good, None


def iter_shard_records(
    path: str,
    stats: ShardReadStats | None = None,
    *,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    allow_pipe: bool = False,
) -> Iterator[RawRecord | Rejection]:
    """Stream one tar shard as sample groups, without seeking and without decoding.

    The shard is read with ``tarfile`` mode ``r|*`` over ``fsspec.open(path, "rb")`` (or the
    stdout of a ``pipe:`` command), so ``.tar.gz``/``.tar.bz2``/``.tar.xz`` work and object
    stores are read in one sequential pass. See the module docstring for grouping, allow-list
    and safety rules. Transport errors after the first member also end in ``truncated_shard``
    with ``stats.error`` set; callers should treat that as a retryable shard failure.

    Args:
        path: Shard location as returned by :func:`expand_shard_patterns` or, tagged with its
            source, by :func:`expand_sources` (keys then read as ``<source>/<key>``).
        stats: Counters to fill; a fresh one is used when None.
        max_member_bytes: Allow-listed members larger than this are not read and their sample
            is rejected as ``member_too_large``.
        allow_pipe: Run ``pipe:`` commands; a ``pipe:`` path without it raises ``ValueError``.

    Yields:
        One :class:`RawRecord` or keyed :class:`Rejection` per sample group, then, if the shard
        broke mid-way, one ``truncated_shard`` :class:`Rejection` with ``key=None``.

    Raises:
        ShardReadError: The shard is missing or is not a readable tar archive at all.
    """
    stats = stats if stats is not None else ShardReadStats()
    shard = shard_name(path)
    source, location = split_source(path)
    with _open_stream(location, allow_pipe) as (raw, proc):
        fileobj = _HashingReader(raw)
        try:
            # Closed by the with below; a failed open needs its own error naming the path.
            archive = tarfile.open(  # type: ignore[call-overload]  # noqa: SIM115
                fileobj=fileobj, mode="r|*", tarinfo=_RecordingTarInfo
            )
        except Exception as exc:  # ReadError, CompressionError, EOFError, transport errors
            raise ShardReadError(f"cannot read shard {path!r} as a tar archive: {exc}") from exc
        with archive:
            error, last_good, pending_key = yield from _iter_archive(
                archive, shard, stats, max_member_bytes, source
            )
        if error is None:
            try:
                fileobj.drain()
                stats.size, stats.sha256 = fileobj.size, fileobj.digest.hexdigest()
            except Exception as exc:  # transport failure in the padding: the read is incomplete
                error = f"{type(exc).__name__}: {exc}"
        if error is None and proc is not None:
            raw.close()
            returncode = proc.wait()
            if returncode != 0:
                error = f"pipe command exited with status {returncode}"
    if error is not None:
        stats.error = error
        stats.rejected["truncated_shard"] = stats.rejected.get("truncated_shard", 0) + 1
        pending = f"; partial sample {pending_key!r} discarded" if pending_key is not None else ""
        yield Rejection(
            key=None,
            shard=shard,
            member=last_good,
            reason="truncated_shard",
            detail=f"shard {path!r} broke after member {last_good!r}: {error}{pending}",
        )
