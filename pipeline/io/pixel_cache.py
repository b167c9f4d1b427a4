"""A node-local cache of shards decoded at a model's resolution: the training readers read a
shard's tar and decode its JPEGs once per node instead of once per epoch, view and round.

Contract:
- An entry holds what a reader needs of one shard: its samples' keys and captions in tar order
  (those that pass the record checks), their uint8 (3, size, size) pixels (`ok` False: the
  image did not decode), and the tar's size and SHA-256 as read.
- It is found before the tar is opened, by the shard's location and file signature (size and
  modification time, or an object store's ETag: `pipeline.io.admitted.file_signature`), the
  pixel size, the decode options and the PIL and torchvision versions; a rewritten shard,
  another resolution or decoder never reads an entry made for something else, and the
  recorded SHA-256 is what the readers compare with the embed pass's fingerprint.
- Pixels come back bit-identical to decoding again: `train.pixel_cache_*` are resource-only.
- An entry is an index (a Parquet table: keys, captions, flags, and the size and SHA-256 in
  its metadata; written last, through `write_table_atomic`) and its pixels (`.npy`,
  memory-mapped: a reader keeps no decoded shard in its own memory, whether it writes the
  entry or reads it); one that does not load is ignored with one warning and written again.
  Entries are added while the folder stays under the budget; to make room, entries unused
  for `STALE_S` are removed, least recently used first, never ones a running job reads; a
  budget of 0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io.admitted import SHARD_BYTES_KEY, SHARD_SHA256_KEY
from pipeline.io.tables import read_table, write_table_atomic

__all__ = ["CachedShard", "PixelCache", "PixelWriter", "default_cache_dir"]

logger = logging.getLogger(__name__)
SUFFIX = ".parquet"  # an entry's index; its pixels: the same name, ".npy"
TEMP = ".tmp-"  # open_atomic's temporary names (`pipeline.io.tables.TEMP_SUFFIX`)
# Only entries unused this long are evicted: a running job reads each of its entries every
# epoch, so a corpus larger than the budget keeps the entries it has instead of replacing
# them in every epoch's shard order (writes that would never be read).
STALE_S = 6 * 3600


def default_cache_dir() -> str:
    """`<temp dir>/ncl-pixel-cache` of the node the reader runs on."""
    return os.path.join(tempfile.gettempdir(), "ncl-pixel-cache")


def _library_versions() -> str:
    import PIL
    import torchvision

    return f"pil{PIL.__version__}-tv{torchvision.__version__}"


# An entry's index: its samples in tar order; the tar's size and SHA-256 in the metadata, under
# the keys of the embeddings footer's fingerprint.
INDEX_SCHEMA = pa.schema([("key", pa.string()), ("caption", pa.string()), ("ok", pa.bool_())])


@dataclass(frozen=True)
class CachedShard:
    """One shard's entry (see the module docstring): row i of `pixels` is the image of
    `keys[i]` where `ok[i]` (else zeros: it did not decode)."""

    keys: list[str]  # (N,) in tar order
    captions: list[str]  # (N,)
    ok: np.ndarray  # (N,) bool
    pixels: np.ndarray  # (N, 3, size, size) uint8, memory-mapped
    size: int  # the tar's bytes
    sha256: str


class PixelWriter:
    """An entry being written: decoded rows go straight to a memory-mapped file (a reader
    holds no shard of decoded pixels in its own memory); `commit` publishes it."""

    def __init__(self, path: Path, rows: int, size: int):
        self.path = path
        self._tmp = path.with_name(f"{path.stem}.npy{TEMP}{uuid.uuid4().hex[:8]}")
        self.pixels = np.lib.format.open_memmap(
            self._tmp, mode="w+", dtype=np.uint8, shape=(rows, 3, size, size)
        )
        self.ok = np.zeros(rows, dtype=bool)

    def put(self, row: int, pixels: np.ndarray) -> np.ndarray:
        """Store one decoded (3, size, size) image; returns its row of the file."""
        self.pixels[row] = pixels
        self.ok[row] = True
        return self.pixels[row]

    def commit(self, keys: list[str], captions: list[str], size: int, sha256: str) -> bool:
        """Publish the entry (pixels first, then the index that `load` looks for)."""
        try:
            self.pixels.flush()
            os.replace(self._tmp, self.path.with_suffix(".npy"))
            index = pa.table({"key": keys, "caption": captions, "ok": self.ok})
            metadata = {SHARD_BYTES_KEY: str(size), SHARD_SHA256_KEY: sha256}
            write_table_atomic(index, str(self.path), INDEX_SCHEMA.with_metadata(metadata))
        except OSError as exc:  # a full or read-only disk: train on, decoding
            logger.warning("pixel cache %s not written (%s)", self.path, exc)
            self.discard()
            return False
        return True

    def discard(self) -> None:
        """Drop an entry that will not be completed (the pipeline stopped early)."""
        self._tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class PixelCache:
    """Where entries live (`folder`: None = `default_cache_dir()` on the reading node) and the
    most bytes they may take (`budget_bytes`; 0 = off)."""

    folder: str | None
    budget_bytes: int

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def path(self, location: str, shard: str, signature: str, size: int, decode_tag: str) -> Path:
        """The entry's index file (its pixels: the same name, `.npy`): the shard's name for
        people, a digest of everything else."""
        tag = f"{location}|{signature}|{size}|{decode_tag}|{_library_versions()}"
        digest = hashlib.sha256(tag.encode()).hexdigest()[:24]
        return Path(self.folder or default_cache_dir()) / f"{shard}-{size}px-{digest}{SUFFIX}"

    def load(self, path: Path) -> CachedShard | None:
        """The entry at `path`, or None when there is none (or it does not load: warned)."""
        if not self.enabled or not path.exists():
            return None
        try:
            index = read_table(str(path))
            metadata = index.schema.metadata or {}
            keys = index.column("key").to_pylist()
            captions = index.column("caption").to_pylist()
            ok = index.column("ok").to_numpy(zero_copy_only=False)
            size = int(metadata[SHARD_BYTES_KEY.encode()])
            sha256 = metadata[SHARD_SHA256_KEY.encode()].decode()
            pixels = np.load(path.with_suffix(".npy"), mmap_mode="r", allow_pickle=False)
            if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[1] != 3:
                raise ValueError(f"pixels {pixels.dtype} {pixels.shape}")
            if not len(keys) == len(captions) == len(ok) == len(pixels):
                raise ValueError(f"{len(keys)} keys, {len(ok)} flags, {len(pixels)} images")
        except Exception as exc:  # a truncated or foreign file: decode again, overwrite it
            name = type(exc).__name__
            logger.warning("pixel cache %s does not load (%s: %s); decoding", path, name, exc)
            return None
        os.utime(path)  # recently used: not evicted
        return CachedShard(keys, captions, ok, pixels, size, sha256)

    def writer(self, path: Path, rows: int, size: int) -> PixelWriter | None:
        """A writer for an entry of `rows` images of `size` px, or None when it cannot fit
        the budget (after removing entries unused for `STALE_S`, least recently used first)."""
        if not self.enabled or not self._make_room(path.parent, rows * 3 * size * size):
            return None
        try:
            return PixelWriter(path, rows, size)
        except OSError as exc:
            logger.warning("pixel cache %s not written (%s)", path, exc)
            return None

    def _make_room(self, folder: Path, nbytes: int) -> bool:
        if nbytes > self.budget_bytes:
            return False
        folder.mkdir(parents=True, exist_ok=True)
        entries: dict[str, list] = {}  # entry name -> [index mtime, bytes, files]
        for file in folder.iterdir():
            try:
                stat = file.stat()
            except FileNotFoundError:  # another reader evicted or renamed it meanwhile
                continue
            name = file.name
            stem = name if TEMP in name else name.removesuffix(SUFFIX).removesuffix(".npy")
            entry = entries.setdefault(stem, [stat.st_mtime, 0, []])
            if file.suffix == SUFFIX or TEMP in file.name:
                entry[0] = stat.st_mtime  # an index's (or a temp file's) time is its use
            entry[1] += stat.st_size
            entry[2].append(file)
        used = sum(size for _, size, _ in entries.values())
        stale = time.time() - STALE_S
        for mtime, size, files in sorted(entries.values(), key=lambda e: e[0]):
            if used + nbytes <= self.budget_bytes or mtime > stale:
                break
            for file in sorted(files, key=lambda f: f.suffix != SUFFIX):  # the index first
                file.unlink(missing_ok=True)
            used -= size
        return used + nbytes <= self.budget_bytes
