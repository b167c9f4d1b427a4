"""Reading img2dataset WebDataset tar shards: shard patterns, streaming members, safe decoding.

Contract (docs/architecture.md §4.1):

* **Shard specs.** :func:`expand_shard_patterns` accepts brace patterns
  (``/d/{00000..00331}.tar``, ``{a,b}``, nested), globs (``*``, ``?``, ``[..]``) on local paths
  and fsspec URLs, plain paths, fsspec URLs (``s3://``, ``gs://``, ``memory://``, ``file://``,
  chained ``simplecache::s3://``) and lists of any of these. Local paths come back absolute (Ray
  workers do not share the driver's working directory); URLs keep their protocol. Order is the
  user's order, sorted within each glob, first occurrence wins. Missing brace-expanded paths are
  skipped with a warning, missing plainly listed paths are an error, a spec matching nothing is an
  error, two shards with the same :func:`shard_name` are an error (outputs are keyed by it).
  ``pipe:`` commands are refused unless the job opts in with ``allow_pipe=True``.
* **Grouping.** Members are grouped into samples webdataset-style: consecutive members sharing a
  key, the member name up to the first ``.`` of its basename (``dir/000000001.jpg`` has key
  ``dir/000000001`` and extension ``jpg``). Extensions are compared lower-cased. Keys are kept as
  given. Members with an empty key (dotfiles such as ``._x.jpg``, ``.DS_Store``) or no extension
  do not form samples; they are ignored and counted.
* **Allow-list.** Only :data:`IMAGE_EXTENSIONS`, :data:`TEXT_EXTENSIONS` and
  :data:`META_EXTENSIONS` members are read into memory. Every other member (``.pkl``, ``.pyd``,
  ``.npy``, ``.pth``, ``.cls``, ...) is skipped unread and counted in
  :attr:`ShardReadStats.ignored_members` by extension; a sample consisting only of such members
  still counts as a sample (and is quarantined as ``missing_image``). Images are decoded by PIL
  restricted to JPEG/PNG/WEBP whatever the file extension says, with a pixel limit checked from
  the header before any pixel is decoded. Text is strict UTF-8, metadata is JSON. Nothing is ever
  unpickled, nothing is ever extracted to the filesystem, and no PIL global is modified.
* **Member safety.** Names that are absolute or contain a ``..`` component, and symlinks or
  hardlinks that would provide an allow-listed member, make their sample ``unsafe_member``. Other
  non-regular members (directories, devices, fifos, links with other extensions) are ignored and
  counted under ``"<dir>"``, ``"<symlink>"``, ``"<hardlink>"``, ``"<device>"``, ``"<fifo>"``,
  ``"<other>"``.
* **Reconciliation.** :func:`iter_shard_records` yields exactly one item per sample group, either
  a :class:`RawRecord` or a :class:`Rejection` with a key, and counts groups in
  :attr:`ShardReadStats.records`. :func:`decode_record` turns each :class:`RawRecord` into exactly
  one :class:`DecodedSample` or :class:`Rejection`. Hence ``good + quarantined == records``.
  A shard that breaks mid-way additionally yields one final ``truncated_shard`` row with
  ``key=None`` that is not a sample; the partly read sample in progress is discarded because its
  completeness cannot be established. A shard that cannot be opened at all raises
  :class:`ShardReadError`.

Quarantine reasons (:data:`QUARANTINE_REASONS`). Reader reasons, one per sample group:

* ``unsafe_member``: an absolute or ``..`` member name, or a symlink/hardlink member with an
  allow-listed extension.
* ``duplicate_member``: the same extension twice within one sample group.
* ``duplicate_key``: a key already seen earlier in the shard (the earlier group is kept).
* ``member_too_large``: an allow-listed member bigger than ``max_member_bytes`` (never read).
* ``truncated_shard``: the tar broke mid-way (truncated data, corrupt header, missing
  end-of-archive marker, decompression or transport error); ``key`` is None, ``member`` is the
  last member read completely, ``detail`` the error.

Decode reasons, checked in this order (the first failing check wins; cheap checks run before the
image is decoded):

* ``missing_image``: no image member (or not the configured ``image_key``).
* ``empty_image``: the image member has zero bytes.
* ``missing_caption``: no ``caption_key`` member.
* ``invalid_utf8``: the caption is not valid UTF-8.
* ``empty_caption``: the caption is empty or whitespace after stripping.
* ``invalid_json``: the ``.json`` member is not valid JSON or not an object.
* ``image_too_large``: width * height from the header exceeds ``max_image_pixels`` (or PIL's
  own decompression-bomb limit, twice ``PIL.Image.MAX_IMAGE_PIXELS``, whichever is lower).
* ``undecodable_image``: PIL cannot identify or decode the image as JPEG/PNG/WEBP.

Colour handling: every mode becomes RGB. Transparency (alpha channels, palette or single-colour
``tRNS`` transparency) is composited onto white, so transparent logos do not turn into black
squares. 16-bit greyscale is scaled to 8 bits (``>> 8``) instead of being clipped. EXIF
orientation is not applied, matching how open_clip's training loaders read images.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import tarfile
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any, BinaryIO

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from PIL import Image, UnidentifiedImageError

__all__ = [
    "IMAGE_EXTENSIONS",
    "META_EXTENSIONS",
    "QUARANTINE_REASONS",
    "TEXT_EXTENSIONS",
    "DecodeOptions",
    "DecodedSample",
    "RawRecord",
    "Rejection",
    "ShardPatternError",
    "ShardReadError",
    "ShardReadStats",
    "decode_record",
    "expand_shard_patterns",
    "iter_shard_records",
    "shard_name",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
TEXT_EXTENSIONS: tuple[str, ...] = ("txt",)
META_EXTENSIONS: tuple[str, ...] = ("json",)
_ALLOWED_EXTENSIONS = frozenset(IMAGE_EXTENSIONS + TEXT_EXTENSIONS + META_EXTENSIONS)

# PIL format names tried for every image member: img2dataset's extension reflects the
# requested output format, not necessarily the bytes, so any allowed format is accepted for
# any image extension, and nothing else (GIF, TIFF, EPS, ...) is ever parsed.
_PIL_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP")

QUARANTINE_REASONS: tuple[str, ...] = (
    # reader (iter_shard_records)
    "unsafe_member",
    "duplicate_member",
    "duplicate_key",
    "member_too_large",
    "truncated_shard",
    # decoder (decode_record), in check order
    "missing_image",
    "empty_image",
    "missing_caption",
    "invalid_utf8",
    "empty_caption",
    "invalid_json",
    "image_too_large",
    "undecodable_image",
)

DEFAULT_MAX_MEMBER_BYTES = 64 * 1024 * 1024  # far above any web image; bounds worker memory

# A brace range bigger than this is almost surely a typo ({0..99999999}) and would exhaust memory.
_MAX_EXPANSION = 1_000_000
# Listing a directory once beats one existence request per shard on object stores; below this
# many candidates in one directory, per-path checks are cheaper than listing a big prefix.
_LIST_THRESHOLD = 8

_SHARD_SUFFIX_RE = re.compile(r"\.(?:tar(?:\.(?:gz|bz2|xz|zst|lz4))?|tgz|tbz2?|txz)$", re.I)
_SHARD_IN_COMMAND_RE = re.compile(
    r"([^/\s'\"|;&?#=]+?)\.(?:tar(?:\.(?:gz|bz2|xz|zst|lz4))?|tgz|tbz2?|txz)(?=$|[\s'\"|;&?#])",
    re.I,
)
_RANGE_RE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_GLOB_CHARS = frozenset("*?[")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")


class ShardPatternError(ValueError):
    """A shard spec is malformed, refused, or matches no (or not all of the listed) shards."""


class ShardReadError(Exception):
    """A shard cannot be opened as a tar archive; the message names the path."""


# --------------------------------------------------------------------------- shard patterns


def _matching_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``start``, or None when unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def _split_top_level(body: str) -> list[str]:
    """Split a brace body on commas that are not inside nested braces."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[last:i])
            last = i + 1
    parts.append(body[last:])
    return parts


def _expand_range(match: re.Match[str], pattern: str) -> list[str]:
    first, last, step_text = match.group(1), match.group(2), match.group(3)
    start, stop = int(first), int(last)
    step = abs(int(step_text)) if step_text else 1
    if step == 0:
        raise ShardPatternError(f"brace range step must not be 0 in {pattern!r}")
    count = abs(stop - start) // step + 1
    if count > _MAX_EXPANSION:
        raise ShardPatternError(
            f"brace range in {pattern!r} expands to {count} names (limit {_MAX_EXPANSION}); "
            "check the range bounds"
        )

    # Bash semantics: a leading zero on either endpoint pads every number to the wider endpoint.
    def padded(text: str) -> bool:
        digits = text.lstrip("-")
        return len(digits) > 1 and digits.startswith("0")

    width = max(len(first), len(last)) if padded(first) or padded(last) else 0
    direction = step if stop >= start else -step
    return [f"{n:0{width}d}" for n in range(start, stop + direction, direction)]


def _expand_braces(pattern: str) -> list[str]:
    """Expand the first valid brace expression in ``pattern``, recursively.

    A brace pair holding neither a top-level comma nor a numeric range (``{x}``, ``{}``) is kept
    literally, as in bash.
    """
    i = 0
    while i < len(pattern):
        if pattern[i] != "{":
            i += 1
            continue
        end = _matching_brace(pattern, i)
        if end is None:
            break
        body = pattern[i + 1 : end]
        range_match = _RANGE_RE.match(body)
        if range_match:
            alternatives = _expand_range(range_match, pattern)
        else:
            parts = _split_top_level(body)
            if len(parts) < 2:
                i += 1  # literal '{'; a valid expression may still be nested inside it
                continue
            alternatives = [alt for part in parts for alt in _expand_braces(part)]
        prefix, suffixes = pattern[:i], _expand_braces(pattern[end + 1 :])
        if len(alternatives) * len(suffixes) > _MAX_EXPANSION:
            raise ShardPatternError(
                f"{pattern!r} expands to more than {_MAX_EXPANSION} names; check the braces"
            )
        return [prefix + alt + suffix for alt in alternatives for suffix in suffixes]
    return [pattern]


def _has_glob(path: str) -> bool:
    return any(ch in _GLOB_CHARS for ch in path)


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


def _listing_fs(path: str) -> tuple[Any, str, str]:
    """Filesystem to list ``path`` with, its stripped path, and the chain prefix to re-add.

    For chained URLs (``simplecache::s3://b/x.tar``) listing goes to the innermost filesystem
    while the returned names keep the chain, so reads still go through the cache.
    """
    chain = ""
    if "::" in path:
        chain_head, path = path.rsplit("::", 1)
        chain = chain_head + "::"
    fs, stripped = url_to_fs(path)
    return fs, stripped, chain


def _normalise_local(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _existing(fs: Any, stripped_paths: list[str]) -> set[str]:
    """Subset of ``stripped_paths`` that are files on ``fs``, listing each directory once."""
    by_parent: dict[str, list[str]] = {}
    for path in stripped_paths:
        by_parent.setdefault(fs._parent(path), []).append(path)
    found: set[str] = set()
    for parent, paths in by_parent.items():
        unresolved = paths
        if len(paths) >= _LIST_THRESHOLD:
            try:
                entries = fs.ls(parent, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                continue  # the directory is missing, so are all of its candidates
            files = {fs._strip_protocol(e["name"]) for e in entries if e.get("type") == "file"}
            found.update(p for p in paths if p in files)
            unresolved = [p for p in paths if p not in files]
        for path in unresolved:
            # Per-path fallback keeps listing-format quirks of some backends from losing shards.
            try:
                if fs.isfile(path):
                    found.add(path)
            except (FileNotFoundError, PermissionError, NotADirectoryError):
                pass
    return found


def expand_shard_patterns(spec: str | Sequence[str], *, allow_pipe: bool = False) -> list[str]:
    """Expand a shard spec into the ordered list of shard paths/URLs that exist.

    Args:
        spec: One pattern or a sequence of patterns. Each may contain brace expressions
            (``{00000..00331}`` zero-padded ranges, ``{a..b..step}``, ``{x,y}`` alternatives,
            nested), glob characters (``*``, ``?``, ``[..]``), or be a plain local path or fsspec
            URL (``s3://``, ``gs://``, ``memory://``, ``file://``, chained ``a::b://``).
        allow_pipe: Accept ``pipe:`` shell commands (webdataset syntax). They are brace-expanded
            and returned as given, never checked; off by default because they run shell code.

    Returns:
        Shard locations: local paths absolute, URLs as written (glob matches rebuilt with their
        protocol). Order follows the spec, sorted within each glob; duplicates are dropped.

    Raises:
        ShardPatternError: The spec is empty, uses ``pipe:`` without ``allow_pipe``, matches
            nothing, lists plain paths of which some are missing (a partially downloaded corpus
            must not silently shrink), or yields two shards with the same :func:`shard_name`.
    """
    if isinstance(spec, (str, os.PathLike)):
        patterns = [os.fspath(spec)]
    else:
        patterns = [os.fspath(p) for p in spec]
    if not patterns or any(not isinstance(p, str) or not p.strip() for p in patterns):
        raise ShardPatternError(f"shard spec must be non-empty path strings, got {spec!r}")

    results: list[str] = []
    seen: set[tuple[str, str]] = set()
    missing_listed: list[str] = []

    def add(location: str, dedup_key: tuple[str, str]) -> None:
        if dedup_key not in seen:
            seen.add(dedup_key)
            results.append(location)

    for pattern in patterns:
        if pattern.startswith("pipe:"):
            if not allow_pipe:
                raise ShardPatternError(
                    f"{pattern!r} is a pipe: command, which runs shell code; refused unless the "
                    "job opts in (allow_pipe=True)"
                )
            for command in _expand_braces(pattern):
                add(command, ("pipe", command))
            continue

        expanded = _expand_braces(pattern)
        braced = expanded != [pattern]
        candidates = [c if _is_url(c) else _normalise_local(c) for c in expanded]
        # Per candidate position: the (location, dedup key) pairs it contributes.
        found: list[list[tuple[str, tuple[str, str]]]] = [[] for _ in candidates]
        literal_by_fs: dict[int, tuple[Any, list[tuple[int, str]]]] = {}
        for pos, candidate in enumerate(candidates):
            fs, stripped, chain = _listing_fs(candidate)
            if _has_glob(stripped):
                infos = fs.glob(stripped, detail=True)
                for path in sorted(p for p, info in infos.items() if info.get("type") == "file"):
                    location = chain + fs.unstrip_protocol(path) if _is_url(candidate) else path
                    found[pos].append((location, (str(fs.protocol), path)))
            else:
                literal_by_fs.setdefault(id(fs), (fs, []))[1].append((pos, stripped))

        missing_braced: list[str] = []
        for fs, items in literal_by_fs.values():
            present = _existing(fs, [stripped for _, stripped in items])
            for pos, stripped in items:
                if stripped in present:
                    found[pos].append((candidates[pos], (str(fs.protocol), stripped)))
                elif braced:
                    missing_braced.append(candidates[pos])
                else:
                    missing_listed.append(candidates[pos])

        for entries in found:
            for location, dedup_key in entries:
                add(location, dedup_key)
        if not any(found):
            if len(patterns) > 1:
                logger.warning("shard pattern %r matches nothing", pattern)
        elif missing_braced:
            logger.warning(
                "%d of %d paths from %r do not exist and are skipped, e.g. %s",
                len(missing_braced),
                len(candidates),
                pattern,
                ", ".join(missing_braced[:5]),
            )

    if not results:
        shown = ", ".join(repr(p) for p in patterns[:5])
        more = f" (and {len(patterns) - 5} more)" if len(patterns) > 5 else ""
        raise ShardPatternError(f"no shards match {shown}{more}; check the path and the pattern")
    if missing_listed:
        more = f" (and {len(missing_listed) - 5} more)" if len(missing_listed) > 5 else ""
        raise ShardPatternError(
            f"{len(missing_listed)} listed shard(s) do not exist or are not files: "
            f"{', '.join(missing_listed[:5])}{more}; is the download complete?"
        )
    by_name: dict[str, str] = {}
    for location in results:
        name = shard_name(location)
        if name in by_name:
            raise ShardPatternError(
                f"shards {by_name[name]!r} and {location!r} share the name {name!r}; output "
                "tables are named by shard, so list shards with distinct basenames"
            )
        by_name[name] = location
    return results


def shard_name(path: str) -> str:
    """Shard name used for output tables: the basename without its tar suffix.

    Args:
        path: Local path, fsspec URL (query strings are dropped) or ``pipe:`` command (the last
            ``*.tar``-like word of the command is used).

    Returns:
        E.g. ``"/x/00042.tar"`` -> ``"00042"``, ``"s3://b/00042.tar.gz"`` -> ``"00042"``.
    """
    if path.startswith("pipe:"):
        matches = _SHARD_IN_COMMAND_RE.findall(path)
        if matches:
            return matches[-1]
        return path[len("pipe:") :].strip().split()[-1].rstrip("/").rsplit("/", 1)[-1]
    if "://" in path:
        path = path.split("?", 1)[0].split("#", 1)[0]
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return _SHARD_SUFFIX_RE.sub("", base)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DecodeOptions:
    """How :func:`decode_record` picks and checks members."""

    image_key: str = "auto"  # "auto": first of IMAGE_EXTENSIONS present; else one explicit ext
    caption_key: str = "txt"  # img2dataset writes captions as {key}.txt
    max_image_pixels: int = 50_000_000  # decompression-bomb guard, read from the header

    def __post_init__(self) -> None:
        if self.image_key != "auto" and self.image_key not in IMAGE_EXTENSIONS:
            raise ValueError(
                f"image_key={self.image_key!r} is not allowed; use 'auto' or one of "
                f"{', '.join(IMAGE_EXTENSIONS)}"
            )
        if self.caption_key not in TEXT_EXTENSIONS:
            raise ValueError(
                f"caption_key={self.caption_key!r} is not allowed; use one of "
                f"{', '.join(TEXT_EXTENSIONS)}"
            )
        if self.max_image_pixels <= 0:
            raise ValueError(
                f"max_image_pixels={self.max_image_pixels} must be a positive pixel count"
            )


@dataclass
class RawRecord:
    """One sample's allow-listed members, still undecoded bytes."""

    key: str  # img2dataset key, kept as given (may include a directory prefix)
    shard: str  # shard_name() of the tar it came from
    members: dict[str, bytes]  # lower-cased extension -> bytes, e.g. {"jpg": ..., "txt": ...}


@dataclass(frozen=True)
class Rejection:
    """One quarantine row: why a sample (or the rest of a shard) could not be used."""

    key: str | None  # None only for a shard-level truncated_shard row
    shard: str
    member: str | None  # offending/expected member name, e.g. "000000001.jpg"; None if n/a
    reason: str  # one of QUARANTINE_REASONS
    detail: str  # human-readable explanation, e.g. the decoder's error text


@dataclass(frozen=True)
class DecodedSample:
    """A usable image-text pair."""

    key: str
    shard: str
    image: Image.Image  # mode RGB, pixels loaded, independent of the source bytes
    caption: str  # UTF-8 decoded, surrounding whitespace stripped
    url: str | None  # from the sample's json "url" when present
    meta: dict[str, Any]  # the parsed json object, {} when the sample has no json
    # hex sha256 of the image member's raw bytes (as stored in the tar): identical files, the
    # same image (RCR ranks unique images, docs/methods.md §6.3); "" when not computed.
    image_sha256: str = ""


@dataclass
class ShardReadStats:
    """Counters filled while :func:`iter_shard_records` iterates one shard."""

    members_total: int = 0  # tar members seen, of any type
    records: int = 0  # sample groups yielded, as RawRecord or keyed Rejection
    ignored_members: dict[str, int] = field(default_factory=dict)  # ext or "<type>" -> count
    rejected: dict[str, int] = field(default_factory=dict)  # reader reason -> count
    error: str | None = None  # set when the shard broke mid-way (see truncated_shard)


# --------------------------------------------------------------------------- tar reading


class _RecordingTarInfo(tarfile.TarInfo):
    """TarInfo whose header parser remembers the last header error on the archive.

    In stream mode ``TarFile.next()`` treats a truncated, empty or corrupt header after the
    first member as a normal end of archive; only an all-zero block is a real end marker.
    Recording the error lets the reader tell a complete shard from a cut one.
    """

    @classmethod
    def fromtarfile(cls, tarfile_obj: tarfile.TarFile) -> tarfile.TarInfo:
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


def _iter_archive(
    archive: tarfile.TarFile, shard: str, stats: ShardReadStats, max_member_bytes: int
) -> Generator[RawRecord | Rejection, None, tuple[str | None, str | None, str | None]]:
    """Group an open stream-mode archive into samples (see :func:`iter_shard_records`).

    Returns (through ``StopIteration.value``) ``(error, last_good_member, pending_key)``; error
    is None when the archive ended with a proper end-of-archive marker.
    """
    seen_keys: set[str] = set()
    group: _Group | None = None
    last_good: str | None = None

    def finish(done: _Group) -> RawRecord | Rejection:
        stats.records += 1
        if done.problem is None:
            return RawRecord(key=done.key, shard=shard, members=done.members)
        reason, member, detail = done.problem
        stats.rejected[reason] = stats.rejected.get(reason, 0) + 1
        return Rejection(key=done.key, shard=shard, member=member, reason=reason, detail=detail)

    def ignore(label: str) -> None:
        stats.ignored_members[label] = stats.ignored_members.get(label, 0) + 1

    def broken(exc: BaseException) -> tuple[str, str | None, str | None]:
        return f"{type(exc).__name__}: {exc}", last_good, group.key if group else None

    while True:
        try:
            info = archive.next()
        except Exception as exc:  # corrupt data, decompression or transport failure
            return broken(exc)
        if info is None:
            header_error = getattr(archive, "_ncl_header_error", None)
            if header_error is not None and not isinstance(header_error, tarfile.EOFHeaderError):
                # Only an all-zero block ends a tar; anything else here means it was cut.
                return (
                    f"{type(header_error).__name__}: {header_error or 'no data'} "
                    "(no end-of-archive marker: truncated or corrupt tar)",
                    last_good,
                    group.key if group else None,
                )
            break
        # Stream mode keeps every TarInfo in .members; drop them so memory stays flat.
        archive.members = []
        stats.members_total += 1
        name = info.name
        key, ext = _split_member_name(name)
        unsafe = _is_unsafe_name(name)

        if not unsafe and not info.isreg():
            is_link = info.issym() or info.islnk()
            if not (is_link and key and ext in _ALLOWED_EXTENSIONS):
                ignore(_member_type(info))
                last_good = name
                continue
        elif not unsafe and (not key or not ext):
            ignore(ext or "<no extension>")  # dotfiles and extension-less names: not samples
            last_good = name
            continue

        if group is None or key != group.key:
            if group is not None:
                yield finish(group)
            group = _Group(key, name)
            if key in seen_keys:
                # Flagged up front so the later group's bytes are never read.
                group.flag(
                    "duplicate_key",
                    name,
                    f"key {key!r} already appeared earlier in this shard; the first group is kept",
                )
            seen_keys.add(key)

        if unsafe:
            group.flag("unsafe_member", name, f"member name {name!r} escapes the archive")
        elif not info.isreg():
            group.flag(
                "unsafe_member",
                name,
                f"{_member_type(info)[1:-1]} member {name!r} -> {info.linkname!r} would "
                "provide sample data",
            )
        elif ext not in _ALLOWED_EXTENSIONS:
            ignore(ext)  # never read: .pkl, .pyd, .npy, .pth ... are not ours to decode
        elif ext in group.members:
            group.flag("duplicate_member", name, f"second {ext!r} member in sample {key!r}")
        elif info.size > max_member_bytes:
            group.flag(
                "member_too_large",
                name,
                f"{info.size} bytes exceeds max_member_bytes={max_member_bytes}",
            )
        elif group.problem is None:  # a rejected group's bytes are not needed
            try:
                extracted = archive.extractfile(info)
                data = extracted.read() if extracted is not None else b""
            except Exception as exc:  # truncated member data, decompression error
                return broken(exc)
            group.members[ext] = data
        last_good = name

    if group is not None:
        yield finish(group)
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
        path: Shard location as returned by :func:`expand_shard_patterns`.
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
    with _open_stream(path, allow_pipe) as (fileobj, proc):
        try:
            # Closed by the with below; a failed open needs its own error naming the path.
            archive = tarfile.open(  # noqa: SIM115
                fileobj=fileobj, mode="r|*", tarinfo=_RecordingTarInfo
            )
        except Exception as exc:  # ReadError, CompressionError, EOFError, transport errors
            raise ShardReadError(f"cannot read shard {path!r} as a tar archive: {exc}") from exc
        with archive:
            error, last_good, pending_key = yield from _iter_archive(
                archive, shard, stats, max_member_bytes
            )
        if error is None and proc is not None:
            fileobj.close()
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


# --------------------------------------------------------------------------- decoding


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to a new, loaded RGB image (alpha composited onto white)."""
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        array = np.asarray(image).astype(np.int64)
        # PNG 16-bit greyscale spans 0..65535; keep the top byte rather than clipping to 255.
        grey = (np.clip(array, 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")  # returns a copy even for RGB, detached from the source bytes


def decode_record(
    record: RawRecord, options: DecodeOptions = DecodeOptions()
) -> DecodedSample | Rejection:
    """Decode one sample's members into an RGB image, a caption and metadata.

    Pure and thread-safe: no globals are read or written beyond PIL's own constants, so the
    embed stage may call it from a thread pool.

    Args:
        record: Members from :func:`iter_shard_records`.
        options: Which members to use and the pixel limit.

    Returns:
        A :class:`DecodedSample`, or a :class:`Rejection` naming the key, shard, member and the
        first failing check (order in the module docstring).
    """
    key, shard, members = record.key, record.shard, record.members

    def reject(ext: str | None, reason: str, detail: str) -> Rejection:
        member = f"{key}.{ext}" if ext is not None else None
        return Rejection(key=key, shard=shard, member=member, reason=reason, detail=detail)

    if options.image_key == "auto":
        image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in members), None)
    else:
        image_ext = options.image_key if options.image_key in members else None
    if image_ext is None:
        wanted = IMAGE_EXTENSIONS if options.image_key == "auto" else (options.image_key,)
        present = ", ".join(sorted(members)) or "none"
        return reject(
            None if options.image_key == "auto" else options.image_key,
            "missing_image",
            f"no image member ({'/'.join(wanted)}); allow-listed members present: {present}",
        )
    image_bytes = members[image_ext]
    if not image_bytes:
        return reject(image_ext, "empty_image", "image member has zero bytes")

    caption_ext = options.caption_key
    if caption_ext not in members:
        return reject(caption_ext, "missing_caption", f"no .{caption_ext} member")
    try:
        caption = members[caption_ext].decode("utf-8")
    except UnicodeDecodeError as exc:
        return reject(caption_ext, "invalid_utf8", f"caption is not UTF-8: {exc}")
    caption = caption.lstrip("\ufeff").strip()  # a BOM or trailing newline is not caption text
    if not caption:
        return reject(caption_ext, "empty_caption", "caption is empty or whitespace only")

    meta: dict[str, Any] = {}
    url: str | None = None
    for meta_ext in META_EXTENSIONS:
        if meta_ext not in members:
            continue
        try:
            parsed = json.loads(members[meta_ext])
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
            return reject(meta_ext, "invalid_json", f"not valid JSON: {exc}")
        if not isinstance(parsed, dict):
            return reject(
                meta_ext, "invalid_json", f"JSON is a {type(parsed).__name__}, not an object"
            )
        meta = parsed
        url = parsed.get("url") if isinstance(parsed.get("url"), str) else None

    try:
        with Image.open(BytesIO(image_bytes), formats=list(_PIL_FORMATS)) as image:
            width, height = image.size
            if width * height > options.max_image_pixels:
                return reject(
                    image_ext,
                    "image_too_large",
                    f"{width}x{height} = {width * height} pixels exceeds "
                    f"max_image_pixels={options.max_image_pixels}",
                )
            image.load()
            rgb = _to_rgb(image)
    except Image.DecompressionBombError as exc:  # PIL's own limit, hit while reading the header
        return reject(image_ext, "image_too_large", str(exc))
    except UnidentifiedImageError:  # its message names a BytesIO address, useless in a table
        return reject(
            image_ext,
            "undecodable_image",
            f"not a {'/'.join(_PIL_FORMATS)} image (first bytes {image_bytes[:8]!r})",
        )
    except Exception as exc:  # UnidentifiedImageError, truncated data, codec errors
        return reject(image_ext, "undecodable_image", f"{type(exc).__name__}: {exc}")
    return DecodedSample(
        key=key,
        shard=shard,
        image=rgb,
        caption=caption,
        url=url,
        meta=meta,
        image_sha256=hashlib.sha256(image_bytes).hexdigest(),
    )
