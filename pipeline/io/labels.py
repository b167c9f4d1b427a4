"""The soft-label table `labels.v4` (docs/architecture.md §4.4): its one explicit schema, its
file metadata and its JSON export.

Contract:
- `LABELS_SCHEMA` is the only definition of the label table: the label pass writes every file
  with it plus `labels_file_metadata`, `pipeline.clients.read` reads with it, and
  `schemas/labels.v4.json` is generated from it (`labels_json_schema`).
- Score columns come from the label-method registry (`pipeline.core.labels.SCORE_COLUMNS`); a
  new score column changes the table and needs a new version here.
- Each version is a prefix of the next or renames file metadata only; readers accept every
  `READABLE_SCHEMA_NAMES` entry (`labelling_view` reads the view under its old key too). The
  version history is in docs/architecture.md §4.4.
- `open_label_table` reads one table of any readable version as the current schema: columns a
  later version appended read null, except `uid`, which labels.v1 lacks: `uid_of(key)`.
- `kept_filter`/`read_kept` and `DEFAULT_MIN_LABEL`/`DEFAULT_SUBSETS`: which rows a consumer
  keeps (the export, the publish diagnostics and the audit apply the same rule); a `RankCut` is
  `--keep-fraction`'s last kept pair.
- `uid_of`: DataComp's 128-bit uid. `SPS_PROXIES_SCHEMA`: SPS's intermediate table (not a
  contract).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.core.labels import SCORE_COLUMNS, SCORE_DESCRIPTIONS
from pipeline.core.partition.decisions import SUBSETS

__all__ = [
    "DEFAULT_MIN_LABEL",
    "DEFAULT_SUBSETS",
    "LABELS_SCHEMA",
    "LABELS_SCHEMA_NAME",
    "LABELS_V1_SCHEMA",
    "LABELS_V2_SCHEMA",
    "LABELS_V3_SCHEMA",
    "READABLE_SCHEMA_NAMES",
    "REQUIRED_METADATA",
    "SPS_PROXIES_SCHEMA",
    "SPS_PROXIES_SCHEMA_NAME",
    "SUBSET_VALUES",
    "LABELLING_VIEW_KEY",
    "LabelFooter",
    "RankCut",
    "fused_scores",
    "kept_filter",
    "labelling_view",
    "labels_file_metadata",
    "labels_json_schema",
    "open_label_table",
    "read_kept",
    "read_label_footer",
    "uid_of",
]

LABELS_SCHEMA_NAME = "labels.v4"
# what `read_labels` accepts
READABLE_SCHEMA_NAMES = ("labels.v1", "labels.v2", "labels.v3", "labels.v4")
# The view whose embeddings and losses made the labels (SPS: the trainee's; every other method:
# the view itself). labels.v1-v3 wrote it under the misleading `ncl.trainee_view`.
LABELLING_VIEW_KEY = "ncl.labelling_view"
_OLD_LABELLING_VIEW_KEY = "ncl.trainee_view"
SUBSET_VALUES = SUBSETS  # `subset` dictionary values: the partition's names, by its int8 codes
# v2 = v1 + `caption`, `p_hat_img`, `p_hat_txt` appended (the text-direction proxy pair trains)
SPS_PROXIES_SCHEMA_NAME = "sps_proxies.v2"

_V1_SCORES = ("bicro", "rcr", "sps")  # score columns in their labels.v1 positions


def _score_column(name: str) -> tuple[str, pa.DataType, bool, str]:
    return (name, pa.float32(), True, SCORE_DESCRIPTIONS[name])


# (name, type, nullable, description): the table of docs/architecture.md §4.4, in column order.
_COLUMNS: tuple[tuple[str, pa.DataType, bool, str], ...] = (
    ("key", pa.string(), False, "img2dataset key, unique in the corpus"),
    ("shard", pa.string(), False, "tar shard basename, e.g. 00042"),
    ("url", pa.string(), True, "the sample's url from its json"),
    ("caption", pa.string(), True, "the sample's caption (txt member)"),
    (
        "soft_label",
        pa.float32(),
        False,
        "label in [0, 1] the configured method assigns; what training consumes",
    ),
    ("clean_prob", pa.float32(), False, "mixture posterior of the clean component, in [0, 1]"),
    (
        "subset",
        pa.dictionary(pa.int8(), pa.string()),
        False,
        "clean / quasi_clean / noisy (method-specific split)",
    ),
    ("loss", pa.float32(), False, "per-sample loss the mixture was fitted on"),
    ("cosine", pa.float32(), False, "image-text cosine similarity (CLIP-score baseline)"),
    *(_score_column(name) for name in _V1_SCORES),
    (
        "image_anchor_key",
        pa.string(),
        True,
        "BiCro: key of the nearest clean anchor by image (SPS: nearest reliable pair)",
    ),
    (
        "text_anchor_key",
        pa.string(),
        True,
        "BiCro: key of the nearest clean anchor by text (SPS: nearest reliable pair)",
    ),
    ("round", pa.int16(), False, "co-teaching round that produced the row"),
    # labels.v2: appended, nullable (a v1 file reads with nulls here).
    (
        "uid",
        pa.string(),
        True,
        "128-bit sample id, 32 hex digits: the json's uid, else the first 128 bits of "
        "sha256(key) (labels.v2)",
    ),
    (
        "image_sha256",
        pa.string(),
        True,
        "hex sha256 of the image member's bytes as stored in the tar (labels.v2)",
    ),
    # labels.v3: every later method's score column, appended, nullable.
    *(_score_column(name) for name in SCORE_COLUMNS if name not in _V1_SCORES),
)
# Each version is a prefix of the next: its number of leading columns.
# labels.v4 = labels.v3's columns; only the labelling view's metadata key changed.
_VERSION_COLUMNS = {
    "labels.v1": 15,
    "labels.v2": 17,
    "labels.v3": len(_COLUMNS),
    "labels.v4": len(_COLUMNS),
}

REQUIRED_METADATA = (
    "ncl.schema",
    "ncl.pipeline_version",
    "ncl.job_hash",
    "ncl.model_id",
    "ncl.mixture",
)

LABELS_SCHEMA = pa.schema(
    [
        pa.field(name, dtype, nullable=nullable, metadata={"description": text})
        for name, dtype, nullable, text in _COLUMNS
    ],
    metadata={"ncl.schema": LABELS_SCHEMA_NAME},
)


def _version_schema(version: str) -> pa.Schema:
    return pa.schema(
        list(LABELS_SCHEMA)[: _VERSION_COLUMNS[version]], metadata={"ncl.schema": version}
    )


LABELS_V1_SCHEMA = _version_schema("labels.v1")
LABELS_V2_SCHEMA = _version_schema("labels.v2")
LABELS_V3_SCHEMA = _version_schema("labels.v3")


def labelling_view(metadata: Mapping[str, str]) -> str | None:
    """The labelling view a label file's `ncl.*` metadata records, under the current key or the
    one labels.v1-v3 used; None when neither is there (e.g. published a+b tables of old runs)."""
    return metadata.get(LABELLING_VIEW_KEY, metadata.get(_OLD_LABELLING_VIEW_KEY))


@dataclass(frozen=True)
class LabelFooter:
    """What a label table's Parquet footer says, read without its rows: the row count and the
    file's `ncl.*` metadata (decoded), with the labelling view under `LABELLING_VIEW_KEY` also
    when an older version wrote it."""

    rows: int
    metadata: dict[str, str]

    @property
    def schema_name(self) -> str | None:
        return self.metadata.get("ncl.schema")

    @property
    def shard_path(self) -> str | None:
        """The source tar the table labels (None when not recorded)."""
        return self.metadata.get("ncl.shard_path") or None


def read_label_footer(fs, path: str) -> LabelFooter:
    """The footer of the label table `path` on `fs` (an fsspec or a pyarrow filesystem)."""
    import pyarrow.parquet as pq

    opener = getattr(fs, "open_input_file", None)
    with opener(path) if opener is not None else fs.open(path, "rb") as handle:
        footer = pq.read_metadata(handle)
    raw = footer.metadata or {}
    metadata = {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"ncl.")}
    view = labelling_view(metadata)
    if view is not None:
        metadata[LABELLING_VIEW_KEY] = view
    return LabelFooter(footer.num_rows, metadata)


_UID_RE = re.compile(r"^[0-9a-fA-F]{32}$")


def uid_of(key: str, meta_uid: object = None) -> str:
    """The sample's 128-bit uid as 32 lowercase hex digits (DataComp's `json["uid"]` format).

    Args:
        key: the img2dataset key.
        meta_uid: the sample json's `uid` when present; used when it is 32 hex digits (what
            DataComp's resharder can parse), otherwise ignored.

    Returns:
        `meta_uid` lower-cased, or the first 32 hex digits of sha256(key as UTF-8).
    """
    if isinstance(meta_uid, str) and _UID_RE.match(meta_uid):
        return meta_uid.lower()
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def open_label_table(path: str, columns: list[str], filter: Any = None) -> pa.Table:
    """`columns` of the label table at `path` (any `READABLE_SCHEMA_NAMES` version), the rows
    matching `filter` (a pyarrow expression), as `LABELS_SCHEMA` reads them; a null `uid` (a
    labels.v1 table) is filled with `uid_of(key)`, so `uid` needs `key` among `columns`."""
    import pyarrow.dataset as ds

    dataset = ds.dataset([path], schema=LABELS_SCHEMA, format="parquet")
    table = dataset.to_table(columns=columns, filter=filter)
    if "uid" not in columns or not table.column("uid").null_count:
        return table
    keys, uids = table.column("key").to_pylist(), table.column("uid").to_pylist()
    filled = [u if u is not None else uid_of(k) for u, k in zip(uids, keys, strict=True)]
    return table.set_column(columns.index("uid"), "uid", pa.array(filled, pa.string()))


SPS_PROXIES_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),  # the noisy pair
        pa.field("image_proxy_key", pa.string(), nullable=True),  # İ: nearest reliable image
        # Ṫ: İ's caption, the text the trainer pairs with I_n (no lookup by key needed)
        pa.field("image_proxy_caption", pa.string(), nullable=True),
        pa.field("y_p_img", pa.float32(), nullable=False),  # label of (I_n, proxy caption)
        pa.field("s_img", pa.float32(), nullable=False),  # S(I_n, İ)
        pa.field("text_proxy_key", pa.string(), nullable=True),  # T̈: nearest reliable text
        pa.field("y_p_txt", pa.float32(), nullable=False),  # label of (proxy image, T_n)
        pa.field("s_txt", pa.float32(), nullable=False),  # S(T_n, T̈)
        # v2: T_n, the noisy pair's own caption, which the trainer pairs with the proxy image
        # Ï (the image of text_proxy_key) without opening the noisy pair's shard
        pa.field("caption", pa.string(), nullable=True),
        # P^(I_n, Ṫ), duplicates masked; `labels.sps.proxy: prototype`: the consensus |t|
        pa.field("p_hat_img", pa.float32(), nullable=False),
        pa.field("p_hat_txt", pa.float32(), nullable=False),  # P^(Ï, T_n)
    ],
    metadata={"ncl.schema": SPS_PROXIES_SCHEMA_NAME},
)


def labels_file_metadata(
    *,
    pipeline_version: str,
    job_hash: str,
    model_id: str,
    mixture: Mapping[str, Any],
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The file-level metadata of one label table (docs/architecture.md §4.4), as Parquet
    key/value strings.

    Args:
        pipeline_version: `pipeline.__version__`.
        job_hash: hash of the job that produced the table.
        model_id: the model whose embeddings and losses were labelled.
        mixture: JSON-ready mixture parameters (`MixtureFit.to_dict` per fit).
        extra: more `ncl.*` keys (method, round, view, shard path).
    """
    metadata = {
        "ncl.schema": LABELS_SCHEMA_NAME,
        "ncl.pipeline_version": pipeline_version,
        "ncl.job_hash": job_hash,
        "ncl.model_id": model_id,
        "ncl.mixture": json.dumps(mixture, sort_keys=True),
    }
    metadata.update(extra or {})
    return metadata


def labels_json_schema(version: str = LABELS_SCHEMA_NAME) -> dict[str, Any]:
    """`schemas/<version>.json`: the column list and the required file metadata.

    Args:
        version: `labels.v4` (current), or an older `READABLE_SCHEMA_NAMES` entry (kept for
            readers of old runs).
    """
    if version not in READABLE_SCHEMA_NAMES:
        raise ValueError(f"unknown label table version {version!r}; use {READABLE_SCHEMA_NAMES}")
    schema = _version_schema(version)
    metadata = {
        "required": list(REQUIRED_METADATA),
        "ncl.schema": version,
        "ncl.mixture": "JSON object: fitted mixture parameters of the label pass",
    }
    if version == "labels.v4":  # older versions: the same value under ncl.trainee_view
        metadata[LABELLING_VIEW_KEY] = (
            "the view whose embeddings and losses made the labels (SPS: the view that trains "
            "on them; every other method: the labelled view)"
        )
    return {
        "title": version,
        "description": (
            "Soft correspondence labels, one Parquet file per input shard under <output>/labels/ "
            "(docs/architecture.md §4.4). Written with exactly these columns, in this order."
        ),
        "columns": [
            {
                "name": field.name,
                "type": str(field.type),
                "nullable": field.nullable,
                "description": field.metadata[b"description"].decode(),
            }
            for field in schema
        ],
        "subset_values": list(SUBSET_VALUES),
        "file_metadata": metadata,
    }


# The export's keep rule by default (`ncl-pipeline export`): every clean and quasi-clean pair.
DEFAULT_MIN_LABEL = 0.0
DEFAULT_SUBSETS = ("clean", "quasi_clean")


@dataclass(frozen=True)
class RankCut:
    """The last pair `--keep-fraction` keeps: a row stays when its score under `rank_by` is
    larger than `score`, or equal with a key <= `key` (ties go to the smaller key). `grids`
    is set for `rank_by="fusion"`: (column, grid) per fused column (`core.selection.fused_rank`),
    a score that is no column of the table."""

    rank_by: str
    score: float
    key: str
    grids: tuple[tuple[str, Any], ...] = ()


def kept_filter(min_label: float, subsets: tuple[str, ...], cut: RankCut | None = None):
    """The pyarrow filter of kept rows: soft_label >= min_label and subset in `subsets`, and
    with a column `cut` (`--keep-fraction`), the rows ranked at or above it."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    keep = (ds.field("soft_label") >= pa.scalar(min_label, pa.float32())) & pc.is_in(
        ds.field("subset").cast(pa.string()), value_set=pa.array(list(subsets), pa.string())
    )
    if cut is None:
        return keep
    if cut.grids:
        raise ValueError("a fusion cut is no column filter: use read_kept")
    value = pa.scalar(cut.score, pa.float32())
    ranked = (ds.field(cut.rank_by) > value) | (
        (ds.field(cut.rank_by) == value) & (ds.field("key") <= pa.scalar(cut.key, pa.string()))
    )
    return keep & ranked


def read_kept(
    path: str,
    columns: list[str],
    min_label: float,
    subsets: tuple[str, ...],
    cut: RankCut | None = None,
) -> pa.Table:
    """`columns` of the kept rows of one label table: `kept_filter`, or for a fusion cut the
    base rule as a filter, then the fused score against the cut (one rule, every reader)."""
    if cut is None or not cut.grids:
        return open_label_table(path, columns, kept_filter(min_label, subsets, cut))
    import numpy as np

    needed = list(dict.fromkeys([*columns, "key", *(c for c, _ in cut.grids)]))
    table = open_label_table(path, needed, kept_filter(min_label, subsets))
    fused = fused_scores(table, cut)
    keys = np.asarray(table.column("key").to_pylist(), dtype=object)
    ranked = (fused > cut.score) | ((fused == cut.score) & (keys <= cut.key))
    return table.filter(pa.array(ranked, pa.bool_())).select(columns)


def fused_scores(table: pa.Table, cut: RankCut):
    """(N,) int64 fused score of a table's rows under a fusion cut (`core.selection`)."""
    from pipeline.core.selection import fused_rank

    return fused_rank(
        [(table.column(c).to_numpy(zero_copy_only=False), grid) for c, grid in cut.grids]
    )
