"""JSON exports of the project's contracts, generated from the code (docs/architecture.md §4.4).

`schemas/job.schema.json` is the job file's JSON Schema, `schemas/labels.v2.json` the label
table's columns and file metadata (docs/architecture.md §4.4; `labels.v1.json`, the previous
version, is kept
for readers of old runs); a test fails when the committed file
differs from what this module generates (`ncl-pipeline schemas` rewrites them).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import job_json_schema
from pipeline.io.labels import labels_json_schema

__all__ = ["generated_schemas", "write_schemas"]


def generated_schemas() -> dict[str, dict]:
    """File name -> JSON document, for every exported schema."""
    return {
        "job.schema.json": job_json_schema(),
        "labels.v1.json": labels_json_schema("labels.v1"),
        "labels.v2.json": labels_json_schema("labels.v2"),
    }


def render(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_schemas(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, document in generated_schemas().items():
        path = folder / name
        path.write_text(render(document))
        written.append(path)
    return written
