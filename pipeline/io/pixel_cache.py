"""A node-local cache of shards' images decoded at a model's resolution, so the training
readers decode each shard's JPEGs once per node instead of once per epoch, view and round.

Contract:
- One entry per (shard bytes, pixel size, decode options, PIL and torchvision versions): the
  uint8 (N, 3, size, size) pixels of the keys that decoded, and the keys that did not. The
  shard's SHA-256 (what the reader computes while it reads the tar) names it, so a changed
  shard, another resolution or another decoder never reads an entry made for something else.
- Pixels come back bit-identical to decoding again (uint8 stored as is): the cache changes
  speed only, hence `train.pixel_cache_*` are resource-only settings.
- An entry is one `.npz` file written through `open_atomic`; a file that does not load is
  ignored with one warning and written again. Entries are added while the folder stays under
  the budget, the least recently used removed first; a budget of 0 turns the cache off.
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

from pipeline.io.tables import open_atomic

__all__ = ["CachedPixels", "PixelCache", "default_cache_dir"]

logger = logging.getLogger(__name__)
SUFFIX = ".npz"
TEMP = ".tmp-"  # open_atomic's temporary names (`pipeline.io.tables.TEMP_SUFFIX`)


def default_cache_dir() -> str:
    """`<temp dir>/ncl-pixel-cache` of the node the reader runs on."""
    return os.path.join(tempfile.gettempdir(), "ncl-pixel-cache")


def _library_versions() -> str:
    import PIL
    import torchvision

    return f"pil{PIL.__version__}-tv{torchvision.__version__}"


@dataclass(frozen=True)
class CachedPixels:
    """One shard's entry: `pixels[i]` is the image of `keys[i]`; `failed` did not decode."""

    keys: dict[str, int]  # key -> row of pixels
    pixels: np.ndarray  # (N, 3, size, size) uint8
    failed: frozenset[str]


@dataclass(frozen=True)
class PixelCache:
    """Where entries live (`folder`: None = `default_cache_dir()` on the reading node) and the
    most bytes they may take (`budget_bytes`; 0 = off)."""

    folder: str | None
    budget_bytes: int

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def path(self, shard: str, shard_sha256: str, size: int, decode_tag: str) -> Path:
        """The entry's file: the shard's name for people, a digest of everything else."""
        tag = f"{shard_sha256}|{size}|{decode_tag}|{_library_versions()}"
        digest = hashlib.sha256(tag.encode()).hexdigest()[:24]
        return Path(self.folder or default_cache_dir()) / f"{shard}-{size}px-{digest}{SUFFIX}"

    def load(self, path: Path) -> CachedPixels | None:
        """The entry at `path`, or None when there is none (or it does not load: warned)."""
        if not self.enabled or not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                keys, pixels, failed = data["keys"], data["pixels"], data["failed"]
            if pixels.dtype != np.uint8 or pixels.ndim != 4 or len(pixels) != len(keys):
                raise ValueError(f"pixels {pixels.dtype} {pixels.shape} for {len(keys)} keys")
        except Exception as exc:  # a truncated or foreign file: decode again, overwrite it
            name = type(exc).__name__
            logger.warning("pixel cache %s does not load (%s: %s); decoding", path, name, exc)
            return None
        os.utime(path)  # recently used: evicted last
        return CachedPixels(
            {str(k): i for i, k in enumerate(keys.tolist())}, pixels, frozenset(failed.tolist())
        )

    def store(self, path: Path, pixels: dict[str, np.ndarray], failed: set[str]) -> bool:
        """Write the entry for `pixels` (key -> (3, size, size) uint8) and `failed`, evicting
        the least recently used entries to stay under the budget; False when it cannot fit."""
        if not self.enabled or not pixels:
            return False
        keys = sorted(pixels)
        stacked = np.stack([pixels[k] for k in keys])
        if not self._make_room(path.parent, stacked.nbytes):
            return False
        try:
            with open_atomic(path) as handle:
                np.savez(
                    handle,
                    keys=np.array(keys),
                    pixels=stacked,
                    failed=np.array(sorted(failed), dtype=str),
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
        for mtime, size, entry in sorted(entries, key=lambda e: e[0]):
            if used + nbytes <= self.budget_bytes:
                break
            if TEMP in entry.name and time.time() - mtime < 600:
                continue  # another reader is writing it now
            entry.unlink(missing_ok=True)
            used -= size
        return used + nbytes <= self.budget_bytes
