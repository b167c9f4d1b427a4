"""A clip-retrieval embeddings folder: what `embed.from_embeddings` ingests as round 0.

Contract:
- Layout (clip-retrieval's `inference` output): `img_emb/img_emb_<i>.npy` and
  `text_emb/text_emb_<i>.npy`, (N_i, D) float16 or float32 with rows aligned, and
  `metadata/metadata_<i>.parquet` with N_i rows in the same order; `<i>` may be zero-padded.
  The metadata's key column is `key` (the img2dataset key, written with `--enable_metadata`)
  or else `image_path` (clip-retrieval's webdataset `__key__`).
- `open_embeddings_folder` checks the layout and returns an `EmbeddingsFolder` (small, plain
  data, shipped to workers); anything unusable raises `EmbeddingsFolderError` naming the file.
- `folder_token` is the folder's identity for the run state: every part's name, size and
  modification time (etag on object stores), so a rewritten folder is ingested again.
- `EmbeddingLookup` (one per worker process) maps keys to rows and reads only the rows asked
  for (ranged reads of the .npy files, local or fsspec). A key the folder holds twice, or whose
  metadata caption is not the pair's caption, is not used: it may belong to another pair.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow.parquet as pq

from pipeline.errors import UserError

__all__ = [
    "EmbeddingLookup",
    "EmbeddingsFolder",
    "EmbeddingsFolderError",
    "KEY_COLUMNS",
    "check_dim",
    "folder_token",
    "ingest_sentence",
    "open_embeddings_folder",
]

KEY_COLUMNS = ("key", "image_path")  # the metadata's key column, in the order `auto` tries
_KINDS = {
    "image": ("img_emb", "npy"),
    "text": ("text_emb", "npy"),
    "metadata": ("metadata", "parquet"),
}
_GAP_ROWS = 256  # rows a ranged read may skip rather than start a second read


class EmbeddingsFolderError(UserError, ValueError):
    """The embeddings folder cannot be ingested; the message names the file and the fix."""


@dataclass(frozen=True)
class EmbeddingPart:
    index: int
    image: str  # img_emb_<i>.npy
    text: str  # text_emb_<i>.npy
    metadata: str  # metadata_<i>.parquet
    rows: int
    offsets: tuple[int, int]  # where the image and the text array's data start in their files


@dataclass(frozen=True)
class EmbeddingsFolder:
    path: str
    parts: tuple[EmbeddingPart, ...]
    dim: int
    dtype: str  # "float16" or "float32"
    key_column: str
    token: str  # folder_token: a rewritten folder is another folder (and another lookup)


def _listing(fs, root: str, kind: str) -> dict[int, dict]:
    folder, ext = _KINDS[kind]
    pattern = re.compile(rf"{folder}_(\d+)\.{ext}$")
    if not fs.isdir(f"{root}/{folder}"):
        return {}
    found = {}
    for info in fs.ls(f"{root}/{folder}", detail=True):
        match = pattern.search(info["name"].rsplit("/", 1)[-1])
        if match:
            found[int(match.group(1))] = info
    return found


def _listings(path: str):
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/")
    return fs, root, {kind: _listing(fs, root, kind) for kind in _KINDS}


def folder_token(path: str) -> str:
    """The folder's identity: each part file's name, size and modification time (or etag)."""
    import hashlib
    import json

    _, _, listings = _listings(path)
    entries = sorted(
        (kind, index, info.get("size"), str(info.get("mtime") or info.get("ETag") or ""))
        for kind, found in listings.items()
        for index, info in found.items()
    )
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def _npy_header(fs, path: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) of a .npy file, from its header only."""
    with fs.open(path, "rb") as handle:
        try:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(handle)
        except ValueError as exc:
            raise EmbeddingsFolderError(f"{path} is not a .npy array file ({exc})") from exc
        if fortran:
            raise EmbeddingsFolderError(f"{path} is stored column-major; save it with np.save")
        return tuple(shape), np.dtype(dtype), handle.tell()


def _key_column(schema_names: Sequence[str], wanted: str, path: str) -> str:
    choices = KEY_COLUMNS if wanted == "auto" else (wanted,)
    for name in choices:
        if name in schema_names:
            return name
    raise EmbeddingsFolderError(
        f"{path} has no key column ({' or '.join(choices)}; it has {', '.join(schema_names)}): "
        "run clip-retrieval with --enable_metadata True, or set embed.from_embeddings.key_column"
    )


def _open_part(fs, index, infos, key_column) -> tuple[EmbeddingPart, int, np.dtype, str]:
    image_path, text_path, meta_path = (infos[k]["name"] for k in ("image", "text", "metadata"))
    (image_shape, image_dtype, image_at), (text_shape, text_dtype, text_at) = (
        _npy_header(fs, image_path),
        _npy_header(fs, text_path),
    )
    for shape, dtype, name in (
        (image_shape, image_dtype, image_path),
        (text_shape, text_dtype, text_path),
    ):
        if len(shape) != 2 or dtype not in (np.float16, np.float32):
            raise EmbeddingsFolderError(
                f"{name} holds a {dtype} array of shape {shape}; expected (rows, dim) "
                "float16 or float32"
            )
    if image_shape != text_shape or image_dtype != text_dtype:
        raise EmbeddingsFolderError(
            f"{image_path} is {image_dtype} {image_shape} but {text_path} is {text_dtype} "
            f"{text_shape}: the image and text embeddings of a part must be row-aligned"
        )
    with fs.open(meta_path, "rb") as handle:
        meta = pq.ParquetFile(handle).metadata
        rows, names = meta.num_rows, meta.schema.to_arrow_schema().names
    if rows != image_shape[0]:
        raise EmbeddingsFolderError(
            f"{meta_path} has {rows} rows but {image_path} has {image_shape[0]}: "
            "metadata and embeddings must be row-aligned"
        )
    column = _key_column(names, key_column, meta_path)
    part = EmbeddingPart(index, image_path, text_path, meta_path, rows, (image_at, text_at))
    return part, image_shape[1], image_dtype, column


def open_embeddings_folder(path: str, key_column: str = "auto") -> EmbeddingsFolder:
    """Check a clip-retrieval folder's layout (headers only) and describe it.

    Raises:
        EmbeddingsFolderError: no parts, a part without its image, text or metadata file,
            arrays that are not (rows, dim) float16/float32, parts of different dims or dtypes,
            metadata without a key column or with another row count than its arrays.
    """
    fs, root, listings = _listings(path)
    indices = sorted(set().union(*listings.values()))
    if not indices:
        raise EmbeddingsFolderError(
            f"{path} holds no clip-retrieval embeddings: expected img_emb/img_emb_<i>.npy, "
            "text_emb/text_emb_<i>.npy and metadata/metadata_<i>.parquet"
        )
    parts, shapes = [], set()
    for index in indices:
        missing = [
            f"{_KINDS[k][0]}_{index}.{_KINDS[k][1]}" for k in _KINDS if index not in listings[k]
        ]
        if missing:
            raise EmbeddingsFolderError(
                f"{path}: part {index} has no {', '.join(missing)}; every part needs image "
                "embeddings, text embeddings and metadata"
            )
        infos = {kind: listings[kind][index] for kind in _KINDS}
        part, dim, dtype, column = _open_part(fs, index, infos, key_column)
        parts.append(part)
        shapes.add((dim, str(dtype), column))
    if len(shapes) > 1:
        raise EmbeddingsFolderError(
            f"{path}: its parts differ in (dim, dtype, key column): {sorted(shapes)}; "
            "a folder must come from one model and one clip-retrieval run"
        )
    dim, dtype_name, column = shapes.pop()
    return EmbeddingsFolder(path, tuple(parts), dim, dtype_name, column, folder_token(path))


def check_dim(folder: EmbeddingsFolder, dim: int | None, model: str) -> None:
    """Refuse embeddings of another width than the model's `dim` (None: not known yet)."""
    if dim is not None and dim != folder.dim:
        raise EmbeddingsFolderError(
            f"{folder.path} holds {folder.dim}-dimensional embeddings but {model} embeds in "
            f"{dim} dimensions: they were made by another model"
        )


_NOT_INGESTED = {  # EmbeddingLookup.find's reasons, as the run's sentence says them
    "not_in_folder": "not in it",
    "repeated_key": "their key on several rows",
    "caption_differs": "their key under another caption",
}


def ingest_sentence(
    folder: str, ingested: int, pairs: int, missed: Mapping[str, int], examples: Sequence[str]
) -> str:
    """What a round-0 pass from `folder` took from it, and which pairs the model embedded."""
    line = f"round 0: {ingested:,} of {pairs:,} pairs' embeddings from {folder}"
    if not missed:
        return line
    reasons = ", ".join(f"{n:,} {_NOT_INGESTED.get(why, why)}" for why, n in sorted(missed.items()))
    return (
        f"{line}; {sum(missed.values()):,} pairs had no usable embedding there ({reasons}; "
        f"e.g. {', '.join(examples)}) and were embedded by the model"
    )


def caption_crc(captions: Sequence[str]) -> np.ndarray:
    """(N,) uint32 crc32 of each stripped caption: the check that a key's row is its pair's."""
    return np.array([zlib.crc32(c.strip().encode()) for c in captions], dtype=np.uint32)


def _key_bytes(keys: Sequence) -> np.ndarray:
    return np.array([str(k).encode() for k in keys], dtype=bytes)


class EmbeddingLookup:
    """The folder's keys (sorted, with their part and row) and the reads of their rows."""

    def __init__(self, folder: EmbeddingsFolder) -> None:
        self.folder = folder
        self.fs, _ = fsspec.core.url_to_fs(folder.path)
        # One part's metadata at a time, reduced to fixed-width arrays: a worker's peak memory
        # is one part's Python strings, not the folder's.
        parts = [self._metadata(part) for part in folder.parts]
        # Captions are compared only when every part has them (clip-retrieval writes them).
        self.has_captions = all(crc is not None for _, crc in parts)
        keys = np.concatenate([part_keys for part_keys, _ in parts])
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]  # (K,) UTF-8 bytes, sorted: a quarter of numpy's str
        self.part = np.concatenate(
            [np.full(p.rows, i, dtype=np.int32) for i, p in enumerate(folder.parts)]
        )[order]
        self.row = np.concatenate([np.arange(p.rows, dtype=np.int64) for p in folder.parts])[order]
        self.crc = np.zeros(len(keys), dtype=np.uint32)
        if self.has_captions:
            self.crc = np.concatenate([crc for _, crc in parts])[order]
        same = self.keys[1:] == self.keys[:-1]
        self.repeated = np.zeros(len(keys), dtype=bool)  # a key on more than one row
        self.repeated[1:] |= same
        self.repeated[:-1] |= same

    def _metadata(self, part: EmbeddingPart) -> tuple[np.ndarray, np.ndarray | None]:
        """(rows,) key bytes and caption checksums (None without a caption column)."""
        with self.fs.open(part.metadata, "rb") as handle:
            names = pq.ParquetFile(handle).schema_arrow.names
            handle.seek(0)
            wanted = [self.folder.key_column] + (["caption"] if "caption" in names else [])
            table = pq.read_table(handle, columns=wanted)
        keys = _key_bytes(table.column(self.folder.key_column).to_pylist())
        if "caption" not in wanted:
            return keys, None
        return keys, caption_crc([c or "" for c in table.column("caption").to_pylist()])

    def find(self, keys: Sequence[str], captions: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """(N,) index into the sorted keys (-1: not usable) and, per key, why not ("" if found):
        `not_in_folder`, `repeated_key` (the folder holds it twice) or `caption_differs`."""
        wanted = _key_bytes(keys)
        at = np.searchsorted(self.keys, wanted)
        present = at < len(self.keys)
        present[present] = self.keys[at[present]] == wanted[present]
        crc = caption_crc(captions)
        found = np.full(len(wanted), -1, dtype=np.int64)
        reasons = []
        for i in range(len(wanted)):
            if not present[i]:
                reasons.append("not_in_folder")
            elif self.repeated[at[i]]:
                reasons.append("repeated_key")
            elif self.has_captions and self.crc[at[i]] != crc[i]:
                reasons.append("caption_differs")
            else:
                reasons.append("")
                found[i] = at[i]
        return found, reasons

    def read(self, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of `found` (indices from `find`, all >= 0): (N, D) image and text
        embeddings in the folder's dtype."""
        dim = self.folder.dim
        image = np.zeros((len(found), dim), dtype=self.folder.dtype)
        text = np.zeros_like(image)
        for number in np.unique(self.part[found]):
            mine = np.flatnonzero(self.part[found] == number)
            part = self.folder.parts[int(number)]
            rows = self.row[found[mine]]
            for out, path, offset in (
                (image, part.image, part.offsets[0]),
                (text, part.text, part.offsets[1]),
            ):
                out[mine] = self._rows(path, offset, rows)
        return image, text

    def _rows(self, path: str, offset: int, rows: np.ndarray) -> np.ndarray:
        """Rows of one .npy file, read as a few contiguous ranges."""
        dtype = np.dtype(self.folder.dtype)
        width = self.folder.dim * dtype.itemsize
        order = np.argsort(rows)
        ordered = rows[order]
        result = np.zeros((len(rows), self.folder.dim), dtype=dtype)
        breaks = np.flatnonzero(np.diff(ordered) > _GAP_ROWS) + 1
        with self.fs.open(path, "rb") as handle:
            for span in np.split(np.arange(len(ordered)), breaks):
                first, last = int(ordered[span[0]]), int(ordered[span[-1]])
                handle.seek(offset + first * width)
                block = np.frombuffer(handle.read((last - first + 1) * width), dtype=dtype)
                block = block.reshape(-1, self.folder.dim)
                result[order[span]] = block[ordered[span] - first]
        return result
