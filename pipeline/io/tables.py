"""Parquet tables: explicit schemas and atomic writes.

Contract:
- Every table is written with an explicit `pyarrow.Schema` (never inferred).
- `write_table_atomic` writes to a temporary name beside the target and renames it, so a file
  under its final name is always complete: its presence is the completion marker that reruns
  use to skip work. `open_atomic` is the one atomic writer (tables, JSON, checkpoints, copies,
  the synthetic corpus); its temporary names are `<name>.tmp-<8 hex>` (`TEMP_SUFFIX`), so a
  crash leaves only such debris, which reruns overwrite.
- The quarantine table (docs/architecture.md §4.3) has `key, shard, member, reason` (+ `detail`).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Mapping, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "sample_rows",
    "QUARANTINE_SCHEMA",
    "TEMP_SUFFIX",
    "open_atomic",
    "embedding_matrix",
    "embedding_schema",
    "read_schema",
    "read_table",
    "write_table_atomic",
    "read_json",
    "write_json_atomic",
    "file_exists",
]

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=True),  # null when the tar broke before a key
        pa.field("shard", pa.string(), nullable=False),
        pa.field("member", pa.string(), nullable=True),
        pa.field("reason", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("detail", pa.string(), nullable=True),
    ],
    metadata={"ncl.schema": "quarantine.v1"},
)


def embedding_schema(
    views: Sequence[str],
    dim: int,
    metadata: Mapping[str, str] | None = None,
    *,
    image_sha256: bool = True,
) -> pa.Schema:
    """Schema of `rounds/<r>/embeddings/<shard>.parquet`.

    Embeddings are fp16 fixed-size lists (docs/architecture.md §4.5: ~13 GB for CC3M, two
    views); scalars are float32. Column names are `<column>_<view>`, e.g. `loss_i2t_a`.
    `image_sha256` (hex sha256 of the image member's bytes in the tar) lets RCR rank unique
    images; `uid` (32 hex digits: the json's `uid`, else sha256(key)'s first 128 bits,
    `pipeline.io.labels.uid_of`) is what the published label table carries for DataComp-style
    joins. `image_sha256=False` gives the schema of tables written before these id columns
    existed (readers must accept both).
    """
    fields = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),
        pa.field("url", pa.string(), nullable=True),
        pa.field("caption", pa.string(), nullable=False),
    ]
    if image_sha256:
        fields.append(pa.field("image_sha256", pa.string(), nullable=True))
        fields.append(pa.field("uid", pa.string(), nullable=True))
    fields += [
        pa.field("loss_batch", pa.int32(), nullable=False),  # which fixed-size batch scored it
    ]
    for view in views:
        fields += [
            pa.field(f"image_embedding_{view}", pa.list_(pa.float16(), dim), nullable=False),
            pa.field(f"text_embedding_{view}", pa.list_(pa.float16(), dim), nullable=False),
            pa.field(f"cosine_{view}", pa.float32(), nullable=False),
            pa.field(f"loss_i2t_{view}", pa.float32(), nullable=False),
            pa.field(f"loss_t2i_{view}", pa.float32(), nullable=False),
            pa.field(f"loss_triplet_{view}", pa.float32(), nullable=False),
        ]
    return pa.schema(fields, metadata=dict(metadata or {}))


def file_exists(path: str) -> bool:
    fs, fs_path = fsspec.core.url_to_fs(path)
    return fs.exists(fs_path)


def remove_path(path: str) -> None:
    """Delete a file or a folder with everything in it (local path or fsspec URL); a missing
    one is fine."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    if fs.exists(fs_path):
        fs.rm(fs_path, recursive=True)


# A temporary file's name is its target's plus this suffix (regular expression): what a
# folder's owner may recognise as its own debris.
TEMP_SUFFIX = r"\.tmp-[0-9a-f]{8}"


@contextlib.contextmanager
def open_atomic(path: str | os.PathLike[str], mode: str = "wb"):
    """Context manager: write to a temporary name beside `path` (local or fsspec URL; parent
    folders are made), rename it to `path` on success.

    A file under its final name is therefore always complete; a crash leaves `*.tmp-*` debris.
    """
    fs, fs_path = fsspec.core.url_to_fs(os.fspath(path))
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp_path = f"{fs_path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp_path, mode) as handle:
        yield handle
    fs.mv(tmp_path, fs_path)


def write_table_atomic(table: pa.Table, path: str, schema: pa.Schema) -> None:
    """Write `table` cast to `schema` at `path` (local or fsspec URL), atomically.

    Raises:
        ValueError: the table does not match the schema (names the differing columns).
    """
    if table.schema.names != schema.names:
        raise ValueError(
            f"table for {path} has columns {table.schema.names}, expected {schema.names}"
        )
    with open_atomic(path) as handle:
        pq.write_table(table.cast(schema), handle, compression="zstd")


def write_json_atomic(payload: Mapping, path: str) -> None:
    with open_atomic(path, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True, default=str)
        handle.write("\n")


def read_json(path: str) -> dict | None:
    """The JSON object at `path`, or None when the file does not exist."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "r") as handle:
        return json.load(handle)


def read_table(path: str, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file (local or fsspec URL), optionally only `columns`.

    Read through one open handle: a path-based read opens the file twice (footer, then pages),
    and a writer renaming a new version in between (`open_atomic`, e.g. the audit's answers)
    would pair one file's footer with the other's pages.
    """
    fs, fs_path = fsspec.core.url_to_fs(path)
    with fs.open(fs_path, "rb") as handle:
        return pq.read_table(handle, columns=columns)


def read_schema(path: str) -> pa.Schema:
    """A Parquet file's schema with its key/value metadata (reads the footer only)."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    with fs.open(fs_path, "rb") as handle:
        return pq.read_schema(handle)


def embedding_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """(N, D) float32 rows of a fixed_size_list column, L2-renormalised after fp16 storage."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dim = array.type.list_size
    flat = array.flatten().to_numpy(zero_copy_only=False)
    rows = flat.astype(np.float32).reshape(-1, dim)  # (N, D)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norms > 0, rows / norms, rows).astype(np.float32)


def sample_rows(dataset, columns: list[str], max_rows: int) -> tuple[pa.Table, int]:
    """At most `max_rows` rows of a pyarrow dataset: every k-th row in file order, k =
    ceil(rows / max_rows), and k (1 = every row).

    Read batch by batch, so memory holds the sample and one batch whatever the dataset's
    size (a report over 400M pairs must not load 400M captions on the driver).
    """
    total = dataset.count_rows()
    stride = max(1, -(-total // max(1, max_rows)))
    if stride == 1:
        return dataset.to_table(columns=columns), 1
    parts, seen = [], 0
    for batch in dataset.to_batches(columns=columns):
        picks = np.arange((-seen) % stride, batch.num_rows, stride)
        if picks.size:
            parts.append(batch.take(pa.array(picks)))
        seen += batch.num_rows
    return pa.Table.from_batches(parts), stride
