"""What the round-0 embed pass admitted of a shard, and whether the shard is still that file.

Contract (docs/architecture.md §4.1, "Broken, changed and repeated shards"):

* The round-0 embeddings table `rounds/0/embeddings/<shard>.parquet` is the shard's admission
  record: its `key` column lists the samples every later stage may use (decoded, not
  quarantined, not a corpus-wide duplicate), and its footer records the tar's fingerprint as
  the embed pass read it: `ncl.shard_bytes` (size) and `ncl.shard_sha256` (content hash).
* Every later reader of the tar (the embed pass of rounds >= 1, training) keeps only the admitted
  keys and compares the fingerprint of what it read with the recorded one: a changed shard is
  never mixed with its earlier embeddings or labels (:class:`ShardChangedError`).
* The driver checks, before each stage that reads tars, that every shard still exists with its
  recorded size (:func:`changed_shards`, one ``stat`` per shard); a missing or resized shard is
  left out of the rest of the run and reported. :func:`file_signature` tells a rewritten file
  from the same one without reading it (the training readers' pixel cache finds entries by it).
* The footer records that signature too; before a rerun's round-0 embed pass,
  :func:`rewritten_shards` hashes the shards whose signature moved and names those whose bytes
  differ: they are embedded again (a same-size rewrite keeps the shard's key).
* :func:`read_embeddings_footer` is the one reader of an embeddings table's footer (row count,
  stage key, fingerprint, the embed pass's other `ncl.*` entries) without reading its data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.io.layout import STAGE_KEY_META
from pipeline.io.paths import filesystem, is_local
from pipeline.io.shard_patterns import split_source

__all__ = [
    "SHARD_BYTES_KEY",
    "SHARD_SHA256_KEY",
    "SHARD_SIGNATURE_KEY",
    "EmbeddingsFooter",
    "ShardChangedError",
    "ShardReference",
    "changed_shards",
    "file_signature",
    "fingerprint_change",
    "read_embeddings_footer",
    "read_reference",
    "rewritten_shards",
    "shard_size",
]

SHARD_BYTES_KEY = "ncl.shard_bytes"
SHARD_SHA256_KEY = "ncl.shard_sha256"
SHARD_SIGNATURE_KEY = "ncl.shard_signature"


class ShardChangedError(RuntimeError):
    """A shard's bytes differ from what the embed pass read; the message names the shard."""


@dataclass(frozen=True)
class ShardReference:
    """A shard as the round-0 embed pass admitted it."""

    keys: frozenset[str]
    size: int | None  # None for tables written before fingerprints were recorded
    sha256: str | None


@dataclass(frozen=True)
class EmbeddingsFooter:
    """What an embeddings table's footer records (`rounds/<r>/embeddings/<shard>.parquet`)."""

    rows: int
    stage_key: str  # the run-state key it was embedded under; "" when none was recorded
    shard_bytes: int | None  # the tar's size as the embed pass read it; None: not recorded
    shard_sha256: str | None
    shard_signature: str | None  # `file_signature` when embedded; None: not recorded
    meta: dict[str, str]  # every key/value entry, decoded (model ids, logit scales, ...)


def _footer(rows: int, raw: dict[bytes, bytes] | None) -> EmbeddingsFooter:
    meta = {k.decode(): v.decode() for k, v in (raw or {}).items()}
    size = meta.get(SHARD_BYTES_KEY)
    return EmbeddingsFooter(
        rows=rows,
        stage_key=meta.get(STAGE_KEY_META, ""),
        shard_bytes=int(size) if size else None,
        shard_sha256=meta.get(SHARD_SHA256_KEY) or None,
        shard_signature=meta.get(SHARD_SIGNATURE_KEY) or None,
        meta=meta,
    )


def read_embeddings_footer(path: str) -> EmbeddingsFooter | None:
    """The footer of the embeddings table at `path` (local or fsspec URL; no data read), or
    None when there is no table."""
    import fsspec
    import pyarrow.parquet as pq

    fs, fs_path = fsspec.core.url_to_fs(path)
    try:
        with fs.open(fs_path, "rb") as handle:
            metadata = pq.read_metadata(handle)
    except FileNotFoundError:
        return None
    return _footer(metadata.num_rows, metadata.metadata)


def read_reference(embeddings_path: str) -> ShardReference:
    """The admitted keys and recorded fingerprint from a round-0 embeddings table."""
    import pyarrow.parquet as pq

    table = pq.read_table(embeddings_path, columns=["key"])
    footer = _footer(table.num_rows, table.schema.metadata)
    return ShardReference(
        keys=frozenset(table.column("key").to_pylist()),
        size=footer.shard_bytes,
        sha256=footer.shard_sha256,
    )


def fingerprint_change(
    path: str, reference: ShardReference, size: int | None, sha256: str | None
) -> str | None:
    """Why the shard read as (size, sha256) is not the one recorded, or None when it is."""
    if reference.sha256 is None:
        return None  # nothing recorded to compare with
    if size is None or sha256 is None:
        return f"shard {path!r} could not be read completely again after its embed pass"
    if size != reference.size or sha256 != reference.sha256:
        return (
            f"shard {path!r} changed after its embed pass ({reference.size} bytes, sha256 "
            f"{reference.sha256[:12]}... then; {size} bytes, sha256 {sha256[:12]}... now)"
        )
    return None


def shard_size(path: str) -> int | None:
    """The file's size in bytes (one `stat`), None when it is not there."""
    import fsspec

    try:
        fs, _, paths = fsspec.get_fs_token_paths(split_source(path)[1])
        return int(fs.info(paths[0])["size"])
    except (FileNotFoundError, OSError, KeyError, ValueError):
        return None


# Object-store fields that change when an object is rewritten (s3fs, gcsfs, adlfs, ...).
_VERSION_FIELDS = ("ETag", "etag", "generation", "md5Hash", "LastModified", "mtime")


def file_signature(location: str) -> str | None:
    """What changes when the shard at `location` (a local path or URL, maybe tagged with its
    source) is rewritten: its size, modification time in ns and inode, or an object store's
    size and version fields; None when it cannot be told (a `pipe:` command)."""
    path = split_source(location)[1]
    if path.startswith("pipe:"):
        return None
    try:
        fs, fs_path = filesystem(path)
        if is_local(fs):
            stat = os.stat(fs_path)
            return f"{stat.st_size}-{stat.st_mtime_ns}-{stat.st_ino}"
        info = fs.info(fs_path)
    except (OSError, ValueError):
        return None
    version = [str(info[name]) for name in _VERSION_FIELDS if info.get(name) is not None]
    return f"{info.get('size')}-{'-'.join(version)}" if version else None


def changed_shards(recorded: dict[str, tuple[str, int | None]]) -> dict[str, str]:
    """{shard: why} for shards missing or resized since the embed pass.

    Args:
        recorded: shard name -> (path, size recorded by the embed pass; None: not recorded).
    """
    changed = {}
    for shard, (path, size) in recorded.items():
        if split_source(path)[1].startswith("pipe:"):
            continue  # a command's output has no size to check before reading it
        now = shard_size(path)
        if now is None:
            changed[shard] = f"shard {path!r} disappeared after its embed pass"
        elif size is not None and now != size:
            changed[shard] = f"shard {path!r} changed size after its embed pass ({size} -> {now})"
    return changed


def rewritten_shards(shards: Mapping[str, tuple[str, EmbeddingsFooter | None]]) -> list[str]:
    """The shards whose bytes differ from what their round-0 embed pass read.

    Only a shard whose file signature moved since then is read (hashed); a copy with the same
    bytes is not rewritten. Shards without a table or a recorded signature (tables written
    before signatures were) are not checked: training still refuses their changed bytes.

    Args:
        shards: shard name -> (shard path, its round-0 embeddings footer or None).
    """
    from pipeline.io.paths import file_sha256

    rewritten = []
    for shard, (path, footer) in shards.items():
        if footer is None or footer.shard_signature is None or footer.shard_sha256 is None:
            continue
        now = file_signature(path)
        if now is None or now == footer.shard_signature:
            continue
        try:
            if file_sha256(split_source(path)[1]) != footer.shard_sha256:
                rewritten.append(shard)
        except (OSError, ValueError):
            continue  # unreadable now: the embed pass reports it
    return rewritten
