"""Local paths and fsspec URLs (`s3://`, `gs://`, `memory://`, ...): one way to resolve, name and
list them.

Contract:
- `filesystem(path)` is fsspec's (filesystem, path inside it) for a local path or a URL.
- `as_url(fs, path)` names a path of `fs` so that any fsspec call resolves it to the same file:
  the plain path on a local disk, the URL with its scheme elsewhere (an object store's own paths
  drop the scheme and would read as local ones).
- `arrow_filesystem(fs)` is what `pyarrow.dataset` takes: None for a local disk (pyarrow's own,
  faster), else the fsspec filesystem.
- `parquet_files(fs, folder)`: a folder's Parquet tables, sorted, without hidden or `_` files;
  `folder_names(folder)`: the names of everything in a folder (none when it is missing).
- `file_sha256(path)`: a whole file's content hash, streamed.
"""

from __future__ import annotations

import os

__all__ = ["arrow_filesystem", "as_url", "filesystem", "folder_names", "is_local", "parquet_files"]


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    """The hex sha256 of the file at `path` (local or fsspec URL), read in `chunk`-byte blocks."""
    import hashlib

    import fsspec

    digest = hashlib.sha256()
    with fsspec.open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def filesystem(path: str | os.PathLike[str]):
    """(fsspec filesystem, path inside it) of a local path or an fsspec URL."""
    import fsspec

    return fsspec.core.url_to_fs(os.fspath(path))


def is_local(fs) -> bool:
    """Whether `fs` is the local disk."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def as_url(fs, path: str) -> str:
    """`path` of `fs` as any fsspec call resolves it (plain when local, else a URL)."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def arrow_filesystem(fs):
    """The `filesystem=` argument of `pyarrow.dataset` for files of `fs`."""
    return None if is_local(fs) else fs


def parquet_files(fs, folder: str) -> list[str]:
    """The Parquet tables of `folder` (paths of `fs`), sorted; hidden and `_` files left out."""
    if not fs.isdir(folder):
        return []
    return sorted(
        p
        for p in fs.ls(folder, detail=False)
        if p.endswith(".parquet") and not os.path.basename(p).startswith((".", "_"))
    )


def folder_names(folder: str) -> set[str]:
    """The names of the files and folders in `folder` (local or URL); empty when missing."""
    fs, path = filesystem(folder)
    if not fs.isdir(path):
        return set()
    return {entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)}
