"""Generations of the published `labels/`: readers see one run's rows, never a mix.

Contract:
- A publish writes every table of a new folder `labels/gen-<n>/` (n one more than any
  generation there), then switches `labels/_CURRENT` to name it. The pointer is one line
  (`gen-<n>`), written whole: a rename on a filesystem, one PUT (atomic) on object storage.
- A reader resolves the pointer once and reads only that folder. Without a pointer, `labels/`
  itself is the folder (the flat layout of runs before generations).
- After a switch, every generation but the new one and the previous one is removed: a reader
  that resolved the previous pointer just before the switch still finds its files; the next
  publish removes them. Flat tables count as the generation before the first one.
- Paths are fsspec paths of one filesystem (`fs`, as from `fsspec.core.url_to_fs`).
"""

from __future__ import annotations

import logging
import uuid

from pipeline.io.layout import LABEL_PASS_SUMMARY, LABELS_GENERATION_PREFIX, LABELS_POINTER
from pipeline.io.paths import as_url, filesystem

__all__ = [
    "current_generation",
    "current_labels_folder",
    "next_generation",
    "published_labels_folder",
    "switch_generation",
    "remove_stale_generations",
]

logger = logging.getLogger(__name__)

FLAT_NAMES = (".parquet", LABEL_PASS_SUMMARY)  # what a flat labels/ holds


def _generation_number(name: str) -> int | None:
    suffix = name[len(LABELS_GENERATION_PREFIX) :]
    if name.startswith(LABELS_GENERATION_PREFIX) and suffix.isdigit():
        return int(suffix)
    return None


def _base(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def current_generation(fs, root: str) -> str | None:
    """The generation `root/_CURRENT` names (`gen-<n>`), or None when there is no pointer."""
    pointer = f"{root.rstrip('/')}/{LABELS_POINTER}"
    try:
        with fs.open(pointer, "r") as handle:
            name = handle.read().strip()
    except FileNotFoundError:
        return None
    if _generation_number(name) is None:
        raise ValueError(f"{pointer} names {name!r}, not a {LABELS_GENERATION_PREFIX}<n> folder")
    return name


def current_labels_folder(fs, root: str) -> str:
    """The folder whose tables are the published labels under `root`: the generation the
    pointer names, else `root` itself (flat layout)."""
    root = root.rstrip("/")
    name = current_generation(fs, root)
    return f"{root}/{name}" if name else root


def published_labels_folder(labels_root: str) -> str:
    """`current_labels_folder` of `labels/` given as a local path or URL, named the same way."""
    fs, root = filesystem(labels_root)
    return as_url(fs, current_labels_folder(fs, root))


def _generations(fs, root: str) -> list[str]:
    if not fs.isdir(root):
        return []
    numbered = [(_generation_number(_base(p)), _base(p)) for p in fs.ls(root, detail=False)]
    return [name for number, name in sorted((n, name) for n, name in numbered if n is not None)]


def next_generation(fs, root: str) -> str:
    """A generation name not used under `root` yet (`gen-<n>`, n one more than the highest):
    a publish cut short leaves its folder, which the next publish skips and then removes."""
    names = [*_generations(fs, root), current_generation(fs, root) or ""]
    used = [n for n in map(_generation_number, names) if n is not None]
    return f"{LABELS_GENERATION_PREFIX}{max(used, default=0) + 1}"


def switch_generation(fs, root: str, name: str) -> str | None:
    """Point `root/_CURRENT` at `name` (atomically); returns the generation it named before."""
    root = root.rstrip("/")
    previous = current_generation(fs, root)
    pointer = f"{root}/{LABELS_POINTER}"
    tmp = f"{pointer}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "w") as handle:
        handle.write(f"{name}\n")
    fs.mv(tmp, pointer)
    return previous


def remove_stale_generations(fs, root: str, current: str, previous: str | None) -> list[str]:
    """Remove every generation under `root` but `current` and `previous`, and the flat tables
    once a previous generation exists (they were the one before it). Returns what was removed.
    """
    root = root.rstrip("/")
    keep = {current, previous}
    stale = [f"{root}/{n}" for n in _generations(fs, root) if n not in keep]
    if previous is not None:
        stale += [
            p
            for p in fs.ls(root, detail=False)
            if _base(p).endswith(FLAT_NAMES) and not fs.isdir(p)
        ]
    for path in stale:
        logger.debug(f"labels: removing {path} (an older generation)")
        fs.rm(path, recursive=True)
    return stale
