"""Atomic torch checkpoints (tensors and plain Python only: loadable with weights_only=True).

Contract: `save_torch_atomic` writes to a temporary name beside the target and renames it, so a
file under its final name is always complete; `load_torch` refuses pickled objects
(`weights_only=True`) and returns None when the file does not exist.
"""

from __future__ import annotations

import io
import uuid

import fsspec
import torch

__all__ = ["save_torch_atomic", "load_torch"]


def save_torch_atomic(obj: object, path: str) -> None:
    fs, fs_path = fsspec.core.url_to_fs(path)
    parent = fs_path.rsplit("/", 1)[0] if "/" in fs_path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp_path = f"{fs_path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp_path, "wb") as handle:
        handle.write(buffer.getvalue())
    fs.mv(tmp_path, fs_path)


def load_torch(path: str) -> dict | None:
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "rb") as handle:
        return torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=True)
