"""Reading `manifest.json`, the run state's record: a damaged file is never fatal.

A manifest that cannot be read as a JSON object (cut short by a full disk, overwritten,
corrupted) gives one warning and an empty run state. `run_job` keeps the damaged file aside as
`manifest.json.damaged-<time>` and rebuilds the state from what the outputs record: each
embeddings table carries its stage key in its footer (`pipeline.run.state.table_keys`), so the
embed passes reuse every table of the current key; the stages after them are recomputed (their
outputs do not record the keys they were made under). `ncl-pipeline status` reads the same way
and changes nothing.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging

from pipeline.io.layout import RunLayout

__all__ = ["DAMAGED_SUFFIX", "read_manifest"]

logger = logging.getLogger(__name__)

DAMAGED_SUFFIX = ".damaged-"  # manifest.json.damaged-<UTC time>: a damaged manifest kept aside


def _load(path: str) -> dict | None:
    """The manifest at `path`; None when there is none. Raises ValueError when damaged."""
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "rb") as handle:
        raw = handle.read()
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(manifest, dict):
        raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    if not isinstance(manifest.get("stages", {}), dict):
        raise ValueError("its 'stages' is not an object")
    return manifest


def read_manifest(layout: RunLayout, *, keep_aside: bool) -> dict | None:
    """The run directory's manifest; None when it has none; {} when it is damaged.

    Args:
        keep_aside: rename a damaged manifest to `manifest.json.damaged-<time>` (a run, which
            then writes a new one); False for readers (`status`), which change nothing.
    """
    path = layout.manifest
    try:
        return _load(path)
    except (ValueError, OSError) as exc:
        why = str(exc) if isinstance(exc, ValueError) else f"unreadable: {exc}"
    rebuilt = (
        "the run state is rebuilt: embeddings whose footers hold their current stage key are "
        "reused, the other stages are recomputed"
    )
    if not keep_aside:
        logger.warning(
            f"{path} is damaged ({why}); showing what the outputs record. A rerun keeps the "
            f"file aside as manifest.json{DAMAGED_SUFFIX}<time> and {rebuilt}."
        )
        return {}
    import fsspec

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = f"{path}{DAMAGED_SUFFIX}{stamp}"
    fs, fs_path = fsspec.core.url_to_fs(path)
    try:
        fs.mv(fs_path, fsspec.core.url_to_fs(aside)[1])
        kept = f"kept aside as {aside}"
    except OSError as error:
        kept = f"could not be kept aside ({error}) and is replaced"
    logger.warning(f"{path} is damaged ({why}); it is {kept}, and {rebuilt}.")
    return {}
