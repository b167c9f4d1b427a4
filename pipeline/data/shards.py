"""Writing one img2dataset shard: ``NNNNN.tar``, ``NNNNN.parquet`` and ``NNNNN_stats.json``.

Contract (part of :mod:`pipeline.data.synthetic`): :func:`write_shard` writes, per sample and in
this order, ``{key}.jpg``, ``{key}.txt`` and ``{key}.json`` members with fixed tar headers, so the
bytes depend only on the samples and their images; the Parquet table has
``IMG2DATASET_SCHEMA``. A sample's ``corrupt`` mode damages its members as written (the json
and Parquet ``sha256`` stay the hash of the intact JPEG). Files are written through
:func:`pipeline.io.tables.open_atomic` (a temporary name, then a rename).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.noise import CORRUPT_MODES, Sample
from pipeline.io.tables import open_atomic

__all__ = ["IMG2DATASET_SCHEMA", "write_shard"]

_TAR_MTIME = 946_684_800  # fixed (2000-01-01) so tar bytes do not depend on when they were made

IMG2DATASET_SCHEMA = pa.schema(
    [
        pa.field("url", pa.string()),
        pa.field("caption", pa.string()),
        pa.field("key", pa.string()),
        pa.field("status", pa.string()),
        pa.field("error_message", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("original_width", pa.int32()),
        pa.field("original_height", pa.int32()),
        pa.field("exif", pa.string()),
        pa.field("sha256", pa.string()),
    ]
)


def _damage(mode: str | None, jpg: bytes, txt: bytes | None) -> tuple[bytes, bytes | None]:
    """Return the (image, caption) member bytes as written; None means no .txt member."""
    if mode is None:
        return jpg, txt
    if mode == "truncated_jpeg":
        # Cut halfway through the entropy-coded data after the start-of-scan marker, so the
        # headers parse (Image.open succeeds) and only decoding fails, as with a cut download.
        start_of_scan = max(jpg.find(b"\xff\xda"), 0)
        return jpg[: start_of_scan + (len(jpg) - start_of_scan) // 2], txt
    if mode == "empty_image":
        return b"", txt
    if mode == "missing_txt":
        return jpg, None
    if mode == "invalid_utf8":
        assert txt is not None, "invalid_utf8 damages a caption: the sample needs one"
        # 0xff never occurs in UTF-8; a lone continuation byte mid-text is invalid as well.
        half = len(txt) // 2
        return jpg, b"\xff" + txt[:half] + b"\x80" + txt[half:]
    if mode == "empty_caption":
        return jpg, b""
    raise ValueError(f"unknown corrupt mode {mode!r}; expected one of {CORRUPT_MODES}")


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = _TAR_MTIME
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_shard(
    directory: Path,
    shard: str,
    samples: Sequence[Sample],
    image_size: int,
    jpegs: Iterable[bytes],
) -> Path:
    """Write `shard`.tar, .parquet and _stats.json for `samples` (their images are `jpegs`, in
    the same order, made lazily); return the tar path."""
    start = time.time()
    rows = []
    tar_path = directory / f"{shard}.tar"
    with (
        open_atomic(tar_path) as handle,
        tarfile.open(fileobj=handle, mode="w", format=tarfile.USTAR_FORMAT) as tar,
    ):
        for sample, jpg in zip(samples, jpegs, strict=True):
            caption = "" if sample.corrupt == "empty_caption" else sample.noisy_caption
            meta = {
                "url": f"https://example.invalid/img/{sample.key}.jpg",
                "caption": caption,
                "key": sample.key,
                "status": "success",
                "error_message": None,
                "width": image_size,
                "height": image_size,
                "original_width": sample.original_size[0],
                "original_height": sample.original_size[1],
                "exif": None,
                "sha256": hashlib.sha256(jpg).hexdigest(),
            }
            rows.append(meta)
            jpg_bytes, txt_bytes = _damage(sample.corrupt, jpg, caption.encode("utf-8"))
            _add_member(tar, f"{sample.key}.jpg", jpg_bytes)
            if txt_bytes is not None:
                _add_member(tar, f"{sample.key}.txt", txt_bytes)
            _add_member(tar, f"{sample.key}.json", json.dumps(meta, indent=4).encode("utf-8"))

    table = pa.Table.from_pylist(rows, schema=IMG2DATASET_SCHEMA)
    with open_atomic(directory / f"{shard}.parquet") as handle:
        pq.write_table(table, handle)

    end = time.time()
    stats = {
        "count": len(samples),
        "successes": len(samples),
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "duration": end - start,
        "start_time": start,
        "end_time": end,
        "status_dict": {"success": len(samples)},
    }
    with open_atomic(directory / f"{shard}_stats.json", "w") as handle:
        handle.write(json.dumps(stats, indent=4))
    return tar_path
