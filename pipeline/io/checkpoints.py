"""Atomic torch checkpoints (tensors and plain Python only: loadable with weights_only=True).

Contract: `save_torch_atomic` writes to a temporary name beside the target and renames it, so a
file under its final name is always complete; `load_torch` refuses pickled objects
(`weights_only=True`) and returns None when the file does not exist.
"""

from __future__ import annotations

import io

import fsspec
import torch

from pipeline.io.tables import open_atomic

__all__ = ["save_torch_atomic", "load_torch"]


def save_torch_atomic(obj: object, path: str) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open_atomic(path) as handle:
        handle.write(buffer.getvalue())


def load_torch(path: str) -> dict | None:
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "rb") as handle:
        return torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=True)
