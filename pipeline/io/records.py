"""What the shard reader and the decoder exchange: member allow-list, raw records, quarantine rows.

Contract (the full reading contract is in :mod:`pipeline.io.shards`):

* Only members whose lower-cased extension is in :data:`ALLOWED_EXTENSIONS` (the union of
  :data:`IMAGE_EXTENSIONS`, :data:`TEXT_EXTENSIONS` and :data:`META_EXTENSIONS`) are ever read
  into memory; the reader (:mod:`pipeline.io.tar_reader`) and the decoder
  (:mod:`pipeline.io.decode`) share this one list so they cannot disagree.
* A :class:`RawRecord` holds one sample group's allow-listed member bytes, undecoded.
* A :class:`Rejection` is one quarantine row; its ``reason`` is one of
  :data:`QUARANTINE_REASONS`, listed reader reasons first, then decoder reasons in check order.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALLOWED_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "META_EXTENSIONS",
    "QUARANTINE_REASONS",
    "TEXT_EXTENSIONS",
    "RawRecord",
    "Rejection",
    "quarantine_columns",
]

IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
TEXT_EXTENSIONS: tuple[str, ...] = ("txt",)
META_EXTENSIONS: tuple[str, ...] = ("json",)
ALLOWED_EXTENSIONS = frozenset(IMAGE_EXTENSIONS + TEXT_EXTENSIONS + META_EXTENSIONS)

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


def quarantine_columns(rejections: list[Rejection]) -> dict[str, list]:
    """The quarantine table's columns (`pipeline.io.tables.QUARANTINE_SCHEMA`) of `rejections`,
    in order."""
    return {
        name: [getattr(r, name) for r in rejections]
        for name in ("key", "shard", "member", "reason", "detail")
    }
