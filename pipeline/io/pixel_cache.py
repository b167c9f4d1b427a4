"""A node-local cache of shards decoded at a model's resolution: the training readers read a
shard's tar and decode its JPEGs once per node instead of once per epoch, view and round.

Contract:
- An entry holds what a reader needs of one shard: its samples' keys and captions in tar order
  (those that pass the record checks), their uint8 (3, size, size) pixels (`ok` False: the
  image did not decode), and the tar's size and SHA-256 as read.
- It is found before the tar is opened, by the shard's name and file signature (size and
  modification time, or an object store's ETag: `file_signature`), the pixel size, the decode
  options and the PIL and torchvision versions; a rewritten shard, another resolution or
  decoder never reads an entry made for something else, and the recorded SHA-256 is what the
  readers compare with the embed pass's fingerprint.
- Pixels come back bit-identical to decoding again (uint8 stored as is): the cache changes
  speed only, hence `train.pixel_cache_*` are resource-only settings.
- An entry is one `.npz` file written through `open_atomic`; a file that does not load is
  ignored with one warning and written again. Entries are added while the folder stays under
  the budget; to make room, entries unused for `STALE_S` are removed, least recently used
  first, never ones a running job reads; a budget of 0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.io.paths import filesystem, is_local
from pipeline.io.shard_patterns import split_source
from pipeline.io.tables import open_atomic

__all__ = ["CachedShard", "PixelCache", "default_cache_dir", "file_signature"]

logger = logging.getLogger(__name__)
SUFFIX = ".npz"
TEMP = ".tmp-"  # open_atomic's temporary names (`pipeline.io.tables.TEMP_SUFFIX`)
# Only entries unused this long are evicted: a running job reads each of its entries every
# epoch, so a corpus larger than the budget keeps the entries it has instead of replacing
# them in every epoch's shard order (writes that would never be read).
STALE_S = 6 * 3600
_VERSION_FIELDS = ("ETag", "etag", "generation", "md5Hash", "LastModified", "mtime")


def default_cache_dir() -> str:
    """`<temp dir>/ncl-pixel-cache` of the node the reader runs on."""
    return os.path.join(tempfile.gettempdir(), "ncl-pixel-cache")


def file_signature(location: str) -> str | None:
    """What changes when the shard at `location` (a local path or URL, maybe tagged with its
    source) is rewritten: its size, modification time in ns and inode, or an object store's
    size and version fields; None when it cannot be told (a `pipe:` command: not cached)."""
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


def _library_versions() -> str:
    import PIL
    import torchvision

    return f"pil{PIL.__version__}-tv{torchvision.__version__}"


def _pack(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings as UTF-8 bytes and their end offsets (numpy's own strings drop trailing NULs)."""
    blobs = [s.encode() for s in strings]
    ends = np.cumsum([len(b) for b in blobs], dtype=np.int64)
    return np.frombuffer(b"".join(blobs), dtype=np.uint8), ends


def _unpack(data, name: str) -> list[str]:
    raw, ends = data[name].tobytes(), data[f"{name}_ends"].tolist()
    starts = [0, *ends[:-1]] if ends else []
    return [raw[a:b].decode() for a, b in zip(starts, ends, strict=True)]


@dataclass(frozen=True)
class CachedShard:
    """One shard's entry (see the module docstring); `pixels[i]` is None where not `ok`."""

    keys: list[str]  # (N,) in tar order
    captions: list[str]  # (N,)
    pixels: list[np.ndarray | None]  # (N,) of (3, size, size) uint8, None: did not decode
    size: int  # the tar's bytes
    sha256: str


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
        """The entry's file: the shard's name for people, a digest of everything else."""
        tag = f"{location}|{signature}|{size}|{decode_tag}|{_library_versions()}"
        digest = hashlib.sha256(tag.encode()).hexdigest()[:24]
        return Path(self.folder or default_cache_dir()) / f"{shard}-{size}px-{digest}{SUFFIX}"

    def load(self, path: Path) -> CachedShard | None:
        """The entry at `path`, or None when there is none (or it does not load: warned)."""
        if not self.enabled or not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                keys, captions = _unpack(data, "keys"), _unpack(data, "captions")
                ok, pixels, meta = data["ok"], data["pixels"], data["meta"].tolist()
            if pixels.dtype != np.uint8 or pixels.ndim != 4 or len(pixels) != int(ok.sum()):
                raise ValueError(f"pixels {pixels.dtype} {pixels.shape} for {int(ok.sum())}")
            if not len(keys) == len(captions) == len(ok):
                raise ValueError(f"{len(keys)} keys, {len(captions)} captions, {len(ok)} flags")
        except Exception as exc:  # a truncated or foreign file: decode again, overwrite it
            name = type(exc).__name__
            logger.warning("pixel cache %s does not load (%s: %s); decoding", path, name, exc)
            return None
        os.utime(path)  # recently used: evicted last
        rows = iter(pixels)
        return CachedShard(
            keys,
            captions,
            [next(rows) if good else None for good in ok],
            int(meta[0]),
            str(meta[1]),
        )

    def store(self, path: Path, entry: CachedShard) -> bool:
        """Write `entry` if it fits the budget, after removing entries unused for `STALE_S`
        (least recently used first) as needed; False when it cannot fit (or be written)."""
        if not self.enabled:
            return False
        ok = np.array([p is not None for p in entry.pixels], dtype=bool)
        good = [p for p in entry.pixels if p is not None]
        pixels = np.stack(good) if good else np.zeros((0, 3, 1, 1), np.uint8)
        if not self._make_room(path.parent, pixels.nbytes):
            return False
        try:
            with open_atomic(path) as handle:
                keys, keys_ends = _pack(entry.keys)
                captions, captions_ends = _pack(entry.captions)
                np.savez(
                    handle,
                    keys=keys,
                    keys_ends=keys_ends,
                    captions=captions,
                    captions_ends=captions_ends,
                    ok=ok,
                    pixels=pixels,
                    meta=np.array([str(entry.size), entry.sha256]),
                )
        except OSError as exc:  # a full or read-only disk: train on, decoding
            logger.warning("pixel cache %s not written (%s)", path, exc)
            return False
        return True

    def _make_room(self, folder: Path, nbytes: int) -> bool:
        if nbytes > self.budget_bytes:
            return False
        folder.mkdir(parents=True, exist_ok=True)
        entries = []
        for entry in folder.iterdir():
            try:
                stat = entry.stat()
            except FileNotFoundError:  # another reader evicted or renamed it meanwhile
                continue
            if entry.name.endswith(SUFFIX) or TEMP in entry.name:
                entries.append((stat.st_mtime, stat.st_size, entry))
        used = sum(size for _, size, _ in entries)
        stale = time.time() - STALE_S
        for mtime, size, entry in sorted(entries, key=lambda e: e[0]):
            if used + nbytes <= self.budget_bytes or mtime > stale:
                break
            entry.unlink(missing_ok=True)
            used -= size
        return used + nbytes <= self.budget_bytes
