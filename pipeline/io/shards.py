"""Reading img2dataset WebDataset tar shards: shard patterns, streaming members, safe decoding.

Contract (the long form, with every quarantine reason: docs/shards.md):
- `expand_shard_patterns` / `expand_sources` turn brace patterns, globs, paths and fsspec URLs
  into an ordered list of shard locations (local paths absolute; names unique by `shard_name`).
- `iter_shard_records` yields exactly one `RawRecord` or `Rejection` per sample group (members
  grouped webdataset-style by key); `decode_record` turns each `RawRecord` into exactly one
  `DecodedSample` or `Rejection`, so good + quarantined == records. A shard that breaks mid-way
  adds one `truncated_shard` row (key None); one that cannot be opened raises `ShardReadError`.
- Only allow-listed members are read (images by PIL as JPEG/PNG/WEBP with a pixel limit, strict
  UTF-8 text, JSON); nothing is unpickled or extracted. Every image becomes RGB.
- This module re-exports the code in `shard_patterns`, `tar_reader`, `decode` and `records`.
"""

from __future__ import annotations

from pipeline.io.decode import DecodedSample, DecodeOptions, decode_record
from pipeline.io.records import (
    IMAGE_EXTENSIONS,
    META_EXTENSIONS,
    QUARANTINE_REASONS,
    TEXT_EXTENSIONS,
    RawRecord,
    Rejection,
)
from pipeline.io.shard_patterns import (
    ShardPatternError,
    expand_shard_patterns,
    expand_sources,
    qualify_key,
    shard_name,
    source_location,
    split_source,
)
from pipeline.io.tar_reader import (
    DEFAULT_MAX_MEMBER_BYTES,
    ShardReadError,
    ShardReadStats,
    iter_shard_records,
)

__all__ = [
    "DEFAULT_MAX_MEMBER_BYTES",
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
    "expand_sources",
    "iter_shard_records",
    "qualify_key",
    "shard_name",
    "source_location",
    "split_source",
]
