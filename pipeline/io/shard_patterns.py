"""Shard specs -> shard locations: brace and glob expansion, existence checks, shard names.

Contract (part of `pipeline.io.shards`; the full rules: docs/shards.md):
- `expand_shard_patterns` accepts brace patterns, globs, plain paths, fsspec URLs and lists of
  these; local paths come back absolute, order is the user's (sorted within a glob), missing
  listed paths, specs matching nothing and two shards with the same `shard_name` are errors,
  `pipe:` is refused unless `allow_pipe=True`.
- Existence is checked without reading any shard: one listing per directory on object stores,
  per-path checks for small sets.
- Several sources (`expand_sources`): locations are tagged `<source>=<location>`; a tagged
  shard is named `<source>-<name>` and its keys read `<source>/<key>` (`qualify_key`), so two
  downloads never collide. Whoever opens a shard strips the tag first (`split_source`).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from braceexpand import (  # type: ignore[attr-defined]  # the stub omits the exception
    UnbalancedBracesError,
    braceexpand,
)
from fsspec.core import url_to_fs

from pipeline.errors import UserError

__all__ = [
    "SOURCE_NAME_RE",
    "ShardPatternError",
    "expand_shard_patterns",
    "expand_sources",
    "qualify_key",
    "shard_name",
    "source_location",
    "split_source",
]

logger = logging.getLogger(__name__)

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
_RANGE_RE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?\}")  # a numeric brace range
_GLOB_CHARS = frozenset("*?[")
# A source name: an identifier, so "<source>-<shard>" and "<source>/<key>" split back one way.
SOURCE_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
# Expanded locations are absolute paths, URLs ("proto://", "a::b") or "pipe:" commands: none
# starts with an identifier followed by "=", so the tag cannot be mistaken for a location.
_TAGGED_RE = re.compile(r"([A-Za-z][A-Za-z0-9_]*)=(.+)\Z", re.S)


class ShardPatternError(UserError, ValueError):
    """A shard spec is malformed, refused, or matches no (or not all of the listed) shards."""


# --------------------------------------------------------------------------- brace expansion


def _expand_braces(pattern: str) -> list[str]:
    """``pattern``'s brace expansion (bash's rules, by `braceexpand`: ``{a,b}``, nesting,
    ``{0..9}``, zero padding, ``{first..last..step}`` in either direction; ``{x}`` and ``{}``
    stay literal; backslashes are path characters, not escapes).

    Refused in one sentence: unbalanced braces, a zero step, and more than `_MAX_EXPANSION`
    names (a range is sized before anything is generated, since `braceexpand` builds a
    range's names whole).
    """
    for match in _RANGE_RE.finditer(pattern):
        first, last, step = int(match.group(1)), int(match.group(2)), match.group(3)
        if step is not None and int(step) == 0:
            raise ShardPatternError(f"brace range step must not be 0 in {pattern!r}")
        count = abs(last - first) // (abs(int(step)) if step else 1) + 1
        if count > _MAX_EXPANSION:
            raise ShardPatternError(
                f"brace range in {pattern!r} expands to {count} names (limit {_MAX_EXPANSION}); "
                "check the range bounds"
            )
    try:
        names = list(itertools.islice(braceexpand(pattern, escape=False), _MAX_EXPANSION + 1))
    except UnbalancedBracesError:
        raise ShardPatternError(f"unbalanced braces in shard pattern {pattern!r}") from None
    if len(names) > _MAX_EXPANSION:
        raise ShardPatternError(
            f"{pattern!r} expands to more than {_MAX_EXPANSION} names; check the braces"
        )
    return names


# --------------------------------------------------------------------------- existence checks


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


# --------------------------------------------------------------------------- expansion


@dataclass
class _Matches:
    """What one (non-``pipe:``) pattern resolves to."""

    # Per expanded candidate, in expansion order: the (location, dedup key) pairs it contributes.
    found: list[list[tuple[str, tuple[str, str]]]]
    missing_braced: list[str] = field(default_factory=list)  # skipped with a warning
    missing_listed: list[str] = field(default_factory=list)  # an error: the corpus is incomplete


def _pattern_list(spec: str | Sequence[str]) -> list[str]:
    if isinstance(spec, (str, os.PathLike)):
        patterns = [os.fspath(spec)]
    else:
        patterns = [os.fspath(p) for p in spec]
    if not patterns or any(not isinstance(p, str) or not p.strip() for p in patterns):
        raise ShardPatternError(f"shard spec must be non-empty path strings, got {spec!r}")
    return patterns


def _match_pattern(pattern: str) -> _Matches:
    """Brace-expand ``pattern``, then resolve globs and check that literal paths exist."""
    expanded = _expand_braces(pattern)
    braced = expanded != [pattern]
    candidates = [c if _is_url(c) else _normalise_local(c) for c in expanded]
    matches = _Matches(found=[[] for _ in candidates])
    literal_by_fs: dict[int, tuple[Any, list[tuple[int, str]]]] = {}
    for pos, candidate in enumerate(candidates):
        fs, stripped, chain = _listing_fs(candidate)
        if _has_glob(stripped):
            infos = fs.glob(stripped, detail=True)
            for path in sorted(p for p, info in infos.items() if info.get("type") == "file"):
                location = chain + fs.unstrip_protocol(path) if _is_url(candidate) else path
                matches.found[pos].append((location, (str(fs.protocol), path)))
        else:
            literal_by_fs.setdefault(id(fs), (fs, []))[1].append((pos, stripped))

    # Literal paths are checked together per filesystem so each directory is listed once.
    for fs, items in literal_by_fs.values():
        present = _existing(fs, [stripped for _, stripped in items])
        for pos, stripped in items:
            if stripped in present:
                matches.found[pos].append((candidates[pos], (str(fs.protocol), stripped)))
            elif braced:
                matches.missing_braced.append(candidates[pos])
            elif fs.isdir(stripped):
                raise ShardPatternError(_folder_message(fs, stripped, candidates[pos]))
            else:
                matches.missing_listed.append(candidates[pos])
    return matches


def _folder_message(fs: Any, stripped: str, given: str) -> str:
    """The sentence for a folder given where shards are expected: its tars, and the pattern."""
    tars = sorted(
        os.path.basename(e["name"])
        for e in fs.ls(stripped, detail=True)
        if e.get("type") == "file" and e["name"].endswith(".tar")
    )
    folder = given.rstrip("/")
    if not tars:
        return f"shard path {given!r} is a folder with no .tar files in it; point it at the tars"
    stems = [name[: -len(".tar")] for name in tars]
    numbered = all(stem.isdigit() and len(stem) == len(stems[0]) for stem in stems)
    pattern = (
        f"{folder}/{{{stems[0]}..{stems[-1]}}}.tar"
        if numbered and len(stems) > 1
        else f"{folder}/*.tar"
    )
    shown = ", ".join(tars[:3]) + (f", ... {tars[-1]}" if len(tars) > 3 else "")
    return (
        f"shard path {given!r} is a folder, not a shard: it holds {len(tars)} tars "
        f"({shown}); write the pattern {pattern!r}"
    )


def _check_complete(patterns: list[str], results: list[str], missing_listed: list[str]) -> None:
    """Raise when the spec matched nothing, a listed path is missing, or two names collide."""
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
    patterns = _pattern_list(spec)
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

        matches = _match_pattern(pattern)
        missing_listed += matches.missing_listed
        for entries in matches.found:
            for location, dedup_key in entries:
                add(location, dedup_key)
        if not any(matches.found):
            if len(patterns) > 1:
                logger.warning("shard pattern %r matches nothing", pattern)
        elif matches.missing_braced:
            logger.warning(
                "%d of %d paths from %r do not exist and are skipped, e.g. %s",
                len(matches.missing_braced),
                len(matches.found),
                pattern,
                ", ".join(matches.missing_braced[:5]),
            )

    _check_complete(patterns, results, missing_listed)
    return results


def source_location(source: str, location: str) -> str:
    """``location`` tagged as a shard of ``source``: ``"cc3m=/d/cc3m/00000.tar"``."""
    return f"{source}={location}"


def split_source(location: str) -> tuple[str | None, str]:
    """(source or None, the location to open) of a possibly tagged shard location."""
    match = _TAGGED_RE.match(location)
    return (match.group(1), match.group(2)) if match else (None, location)


def qualify_key(source: str | None, key: str) -> str:
    """A sample key as every table carries it: ``"<source>/<key>"``, or the key as given
    for an unnamed source (``input.shards``)."""
    return key if source is None else f"{source}/{key}"


def expand_sources(
    sources: Sequence[tuple[str | None, str | Sequence[str]]], *, allow_pipe: bool = False
) -> list[str]:
    """Expand the shard specs of one or more sources into shard locations.

    Args:
        sources: (name, spec) pairs; a single ``(None, spec)`` is the unnamed source of
            ``input.shards`` and gives exactly :func:`expand_shard_patterns`'s locations.
        allow_pipe: as in :func:`expand_shard_patterns`.

    Returns:
        Locations, source by source in the given order; named sources' locations tagged with
        :func:`source_location`.

    Raises:
        ShardPatternError: a spec fails to expand (the message names its source), a source name
            is not an identifier or repeats, or one shard belongs to two sources.
    """
    if len(sources) == 1 and sources[0][0] is None:
        return expand_shard_patterns(sources[0][1], allow_pipe=allow_pipe)
    owner: dict[str, str] = {}  # location -> its source
    tagged: list[str] = []
    names = [name for name, _ in sources]
    for name, spec in sources:
        if name is None or not SOURCE_NAME_RE.match(name) or names.count(name) > 1:
            raise ShardPatternError(
                f"source name {name!r} must be an identifier (a letter, then letters, digits or "
                "'_') used by one source only"
            )
        try:
            locations = expand_shard_patterns(spec, allow_pipe=allow_pipe)
        except ShardPatternError as exc:
            raise ShardPatternError(f"source {name!r}: {exc}") from exc
        for location in locations:
            if location in owner:
                raise ShardPatternError(
                    f"shard {location!r} is in source {owner[location]!r} and in source "
                    f"{name!r}; list each shard in one source only"
                )
            owner[location] = name
            tagged.append(source_location(name, location))
    return tagged


def shard_name(path: str) -> str:
    """Shard name used for output tables: the basename without its tar suffix.

    Args:
        path: Local path, fsspec URL (query strings are dropped) or ``pipe:`` command (the last
            ``*.tar``-like word of the command is used), tagged with its source or not.

    Returns:
        E.g. ``"/x/00042.tar"`` -> ``"00042"``, ``"s3://b/00042.tar.gz"`` -> ``"00042"``,
        ``"cc3m=/x/00042.tar"`` -> ``"cc3m-00042"``.
    """
    source, path = split_source(path)
    name = _base_name(path)
    return name if source is None else f"{source}-{name}"


def _base_name(path: str) -> str:
    if path.startswith("pipe:"):
        matches = _SHARD_IN_COMMAND_RE.findall(path)
        if matches:
            return matches[-1]
        return path[len("pipe:") :].strip().split()[-1].rstrip("/").rsplit("/", 1)[-1]
    if "://" in path:
        path = path.split("?", 1)[0].split("#", 1)[0]
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return _SHARD_SUFFIX_RE.sub("", base)
