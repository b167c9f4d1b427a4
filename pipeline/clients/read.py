"""Public reader of the soft-label tables (`labels.v4` and every older version;
docs/architecture.md §4.4).

Contract: `read_labels(path)` returns a `pyarrow.dataset.Dataset` over one folder of label
tables (for a run, the generation `labels/_CURRENT` names, resolved once, so a publish during
the read does not mix two runs' rows; an older run's flat `labels/` reads too;
`pipeline.io.generations`), with the explicit (current) `LABELS_SCHEMA`, after checking that
every file declares one of `READABLE_SCHEMA_NAMES` (`labels.v1` to `v4`) as `ncl.schema` in
its Parquet metadata. `label_table_metadata` returns a table's `ncl.*` metadata with the
labelling view under its labels.v4 key whichever version wrote the file.
An older file reads with the columns later versions appended null (v1: `uid`, `image_sha256`,
`assign`; v2: `assign`). It reads nothing else: filter, project and
convert with pyarrow (`.to_table(columns=[...], filter=...)`, `.to_batches()`), or hand the
files to pandas / polars / DuckDB / Spark.
"""

from __future__ import annotations

import os

import pyarrow.dataset as ds

from pipeline.errors import UserError
from pipeline.io.generations import current_generation
from pipeline.io.labels import (
    LABELS_SCHEMA,
    READABLE_SCHEMA_NAMES,
    read_label_footer,
)
from pipeline.io.paths import arrow_filesystem, as_url, filesystem, parquet_files

__all__ = [
    "LabelTableError",
    "label_files",
    "label_table_metadata",
    "labels_folder",
    "labels_folder_url",
    "read_labels",
]


class LabelTableError(UserError, ValueError):
    """The path holds no label tables, or a file that is not a readable label table."""


def labels_folder(path: str | os.PathLike, view: str | None = None) -> tuple[object, str]:
    """Resolve `path` to (filesystem, folder of label tables).

    Accepted: a run directory (its `labels/`), a folder of label tables itself
    (`labels/`, `labels/gen-<n>/`, `rounds/<r>/labels_<view>/`), or a round directory
    `rounds/<r>` (its `labels_<view>/`; `view` picks one when there are several). A `labels/`
    with a `_CURRENT` pointer resolves to the generation it names, else to its own tables.

    Raises:
        LabelTableError: nothing matching holds label tables.
    """
    fs, root = filesystem(path)
    root = root.rstrip("/")
    for candidate in (f"{root}/labels", root):
        generation = current_generation(fs, candidate)
        if generation is not None:
            if not parquet_files(fs, f"{candidate}/{generation}"):
                raise LabelTableError(
                    f"{candidate}/_CURRENT names {generation}, which holds no label tables "
                    "(removed by hand? rerun the job to publish again)"
                )
            return fs, f"{candidate}/{generation}"
        if parquet_files(fs, candidate):
            return fs, candidate
    if fs.isdir(root):
        names = sorted(
            os.path.basename(p.rstrip("/"))
            for p in fs.ls(root, detail=False)
            if os.path.basename(p.rstrip("/")).startswith("labels_") and fs.isdir(p)
        )
        if view is not None:
            names = [n for n in names if n == f"labels_{view}"]
        names = [n for n in names if parquet_files(fs, f"{root}/{n}")]
        if len(names) == 1:
            return fs, f"{root}/{names[0]}"
        if names:
            raise LabelTableError(
                f"{path} holds label tables of several views ({', '.join(names)}): pass view="
            )
    raise LabelTableError(
        f"no label tables under {path}: expected <run>/labels/*.parquet, a folder of label "
        "tables, or a round directory with labels_<view>/ (has the label pass run?)"
    )


def labels_folder_url(path: str | os.PathLike, view: str | None = None) -> str:
    """`labels_folder`'s folder as a path any fsspec call resolves the same way: the URL on an
    object store (`s3://bucket/run/labels`; the filesystem's own paths drop the scheme and
    would read as local), the plain path on a local disk."""
    fs, folder = labels_folder(path, view)
    return as_url(fs, folder)


def label_files(path: str | os.PathLike, view: str | None = None) -> dict[str, str]:
    """{shard: path of its label table} under `path` (`labels_folder`'s rules, resolved once),
    each path as any fsspec call resolves it (the URL on an object store)."""
    fs, folder = labels_folder(path, view)
    return {
        os.path.basename(p)[: -len(".parquet")]: as_url(fs, p) for p in parquet_files(fs, folder)
    }


def read_labels(path: str | os.PathLike, *, view: str | None = None) -> ds.Dataset:
    """The label tables under `path` as one pyarrow Dataset (schema `labels.v4`).

    Args:
        path: run directory, label folder or round directory (see `labels_folder`); a local
            path or an fsspec URL.
        view: for a round directory with several `labels_<view>/` folders, which one.

    Returns:
        A `pyarrow.dataset.Dataset` with schema `LABELS_SCHEMA`, one fragment per shard.

    Raises:
        LabelTableError: no label tables, or a file whose `ncl.schema` is not one of
            `READABLE_SCHEMA_NAMES`.
    """
    fs, folder = labels_folder(path, view)
    files = parquet_files(fs, folder)
    for name in files:
        found = read_label_footer(fs, name).schema_name
        if found not in READABLE_SCHEMA_NAMES:
            raise LabelTableError(
                f"{name} is not a {' or '.join(READABLE_SCHEMA_NAMES)} label table "
                f"(ncl.schema={found or 'none'})"
            )
    return ds.dataset(
        files, schema=LABELS_SCHEMA, format="parquet", filesystem=arrow_filesystem(fs)
    )


def label_table_metadata(dataset: ds.Dataset) -> dict[str, str]:
    """The `ncl.*` metadata of the first file of a `read_labels` dataset, with the labelling
    view under `LABELLING_VIEW_KEY` also when an older version wrote it (`ncl.trainee_view`)."""
    return read_label_footer(dataset.filesystem, dataset.files[0]).metadata
