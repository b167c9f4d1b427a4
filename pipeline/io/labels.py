"""The soft-label table `labels.v3` (docs/architecture.md §4.4): its one explicit schema and
its JSON export.

Contract:
- `LABELS_SCHEMA` is the only definition of the label table. The label pass writes every file
  with it (plus per-file metadata from `labels_file_metadata`), `pipeline.clients.read.read_labels`
  reads with it, and `schemas/labels.v3.json` is generated from it (`labels_json_schema`).
- Score columns come from the label-method registry (`pipeline.core.labels.SCORE_COLUMNS` and
  their `SCORE_DESCRIPTIONS`): v1's three (`bicro`, `rcr`, `sps`) keep their v1 positions, every
  later method's column is appended after v2's columns. A method that adds a score column
  therefore changes the table: `schemas/labels.v3.json` stops matching (a test) and the change
  needs a new version here.
- Versions (contracts change only by a versioned, documented step). `labels.v2` =
  `labels.v1` + two nullable columns appended at the end, `uid` and `image_sha256`, the stable
  ids downstream joins need; no v1 column changed name, type, order or meaning. What a reader
  of v1 sees in a v2 file: the same first 15 columns, two more at the end (pandas, polars,
  DuckDB, Spark and pyarrow read them as ordinary columns; code that selects columns by name is
  unaffected), and `ncl.schema=labels.v2`, which a strict v1 checker (the `read_labels` of
  releases before v2) refuses with "not a labels.v1 label table" rather than misreading.
  `labels.v3` = `labels.v2` + the nullable score column `assign` appended, in the same way.
  Readers of this version accept all three (`READABLE_SCHEMA_NAMES`); an older file reads with
  the columns it lacks null. `LABELS_V1_SCHEMA`, `LABELS_V2_SCHEMA` and their
  `schemas/labels.v1.json`, `labels.v2.json` stay for reference.
- `uid` (DataComp's convention): the sample json's `uid` when it is 32 hex digits, else the first
  128 bits of the SHA-256 of the key (`uid_of`); 32 lowercase hex digits. `image_sha256`: hex
  SHA-256 of the image member's bytes as stored in the tar (what the embed pass hashes).
- File-level metadata always holds `ncl.schema=labels.v3`, the pipeline version, the job hash,
  the model id and the mixture parameters (JSON); `REQUIRED_METADATA` lists those keys.
  `ncl.shard_path` (the source tar, for report thumbnails) and the method/round/view are
  recorded too, and `ncl.trainee_view`: the view whose embeddings and losses made the labels
  (SPS's trainee; the view itself for every other method).
- `SPS_PROXIES_SCHEMA` is the intermediate table of SPS proxy pairs under `rounds/` (free to
  change, not a contract; its version in `ncl.schema`: `sps_proxies.v2` appended the noisy
  caption T_n and the two P^ columns to v1, so the trainer can train the text direction).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.core.labels import SCORE_COLUMNS, SCORE_DESCRIPTIONS

__all__ = [
    "LABELS_SCHEMA",
    "LABELS_SCHEMA_NAME",
    "LABELS_V1_SCHEMA",
    "LABELS_V2_SCHEMA",
    "READABLE_SCHEMA_NAMES",
    "REQUIRED_METADATA",
    "SPS_PROXIES_SCHEMA",
    "SPS_PROXIES_SCHEMA_NAME",
    "SUBSET_VALUES",
    "labels_file_metadata",
    "labels_json_schema",
    "uid_of",
]

LABELS_SCHEMA_NAME = "labels.v3"
READABLE_SCHEMA_NAMES = ("labels.v1", "labels.v2", "labels.v3")  # what `read_labels` accepts
SUBSET_VALUES = ("clean", "quasi_clean", "noisy")  # `subset` dictionary values
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
_VERSION_COLUMNS = {"labels.v1": 15, "labels.v2": 17, "labels.v3": len(_COLUMNS)}

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
        pa.field("p_hat_img", pa.float32(), nullable=False),  # P^(I_n, Ṫ), duplicates masked
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
        version: `labels.v3` (current), or `labels.v2` / `labels.v1` (its first 17 / 15
            columns, kept for reference).
    """
    if version not in READABLE_SCHEMA_NAMES:
        raise ValueError(f"unknown label table version {version!r}; use {READABLE_SCHEMA_NAMES}")
    schema = _version_schema(version)
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
        "file_metadata": {
            "required": list(REQUIRED_METADATA),
            "ncl.schema": version,
            "ncl.mixture": "JSON object: fitted mixture parameters of the label pass",
        },
    }
