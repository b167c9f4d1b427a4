"""Exports of the project's contracts, generated from the code (docs/architecture.md §4.4).

`schemas/job.schema.json` is the job file's JSON Schema, `schemas/labels.v4.json` the label
table's columns and file metadata (docs/architecture.md §4.4; the previous versions'
`labels.v<n>.json` are kept for readers of old runs), and
`docs/config.md` the job file's reference for people: one Markdown table per section, rendered
from the pydantic models' field descriptions (`render_config_reference`). Tests fail when a
committed file differs from what this module generates; `ncl-pipeline schemas` (`make schemas`)
rewrites them all.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pipeline.config import JobConfig, job_json_schema, resources_only_fields
from pipeline.io.labels import READABLE_SCHEMA_NAMES, labels_json_schema

__all__ = [
    "CONFIG_DOC",
    "generated_schemas",
    "render_config_reference",
    "write_config_reference",
    "write_schemas",
]

CONFIG_DOC = Path("docs") / "config.md"  # relative to the repository root


def generated_schemas() -> dict[str, dict]:
    """File name -> JSON document, for every exported schema."""
    return {
        "job.schema.json": job_json_schema(),
        **{f"{name}.json": labels_json_schema(name) for name in READABLE_SCHEMA_NAMES},
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


# --------------------------------------------------------------------------------------------
# docs/config.md: the job file's reference, rendered from the config model

_CONFIG_INTRO = """\
# Job file reference

<!-- Generated from pipeline/config/ by `ncl-pipeline schemas` (`make schemas`); do not edit.
     tests/test_docs.py fails when this file differs from a fresh render. -->

A job is a YAML file with the sections below (`jobs/*.yaml` are examples). Every key can be
overridden on the command line with `--set section.key=value` (the value is parsed as YAML, so
`--set train.rounds=0` is an integer). Unknown keys and bad values fail before any work, naming
the key, the value and the fix. The same model is exported as a JSON Schema in
`schemas/job.schema.json`, for editors and validators.

Keys marked *Resources only* change how fast or where a run works, what it caches or logs, or
when it gives up, never what it computes: a rerun into the same output that changes only such
keys reuses every result. Every other key, except `name`, `output` and the paths of the shards
and of `embed.from_embeddings` (shards are known by name and size, that folder by its files), is
hashed into the key of each stage that reads it, so changing it recomputes those stages and the
ones after them (docs/architecture.md §4.3.1).
"""


def _section(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _optional_section(annotation: object) -> type[BaseModel] | None:
    """The section of a `Section | None` annotation (None for anything else)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return _section(args[0]) if len(args) == 1 else None


def _type_name(annotation: object) -> str:
    """A short, readable type: `int`, `str | null`, `"bmm" | "gmm"`, `list[str]`."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is not None:
        inner = ", ".join(_type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    return f"`{json.dumps(field.get_default(call_default_factory=True))}`"


def _cell(text: str) -> str:
    # A Markdown table cell: one line, pipes escaped.
    return " ".join(text.split()).replace("|", "\\|")


def _sections(
    model: type[BaseModel], prefix: str
) -> list[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """(dotted section name, model, its leaf fields) for `model` and every nested section."""
    leaves = []
    nested = []
    for name, field in model.model_fields.items():
        child = _section(field.annotation)
        if child is None:
            leaves.append((name, field))
        # An optional section (`Section | None`) is a key of its own (default null) and a
        # section whose keys are documented below.
        child = child or _optional_section(field.annotation)
        if child is not None:
            nested.extend(_sections(child, f"{prefix}{name}."))
    found = [(prefix.rstrip("."), model, leaves)] if leaves else []
    return found + nested


def render_config_reference() -> str:
    """The job file's reference as Markdown: one table per section (key, type, default,
    description), in the order of `JobConfig`, nested sections after their parent; the
    descriptions of resources-only keys say so first."""
    parts = [_CONFIG_INTRO]
    resources_only = set(resources_only_fields())
    for section, model, leaves in _sections(JobConfig, ""):
        title = f"`{section}`" if section else "Top level"
        parts.append(f"\n## {title}\n")
        doc = (model.__doc__ or "").strip() if section else ""
        if doc:
            parts.append(f"\n{' '.join(doc.split())}\n")
        parts.append("\n| key | type | default | description |\n|---|---|---|---|\n")
        for name, field in leaves:
            key = f"{section}.{name}" if section else name
            kind = _cell(_type_name(field.annotation))
            description = _cell(field.description or "")
            if key in resources_only:
                description = f"*Resources only.* {description}"
            parts.append(f"| `{key}` | `{kind}` | {_cell(_default(field))} | {description} |\n")
    return "".join(parts)


def write_config_reference(path: str | Path = CONFIG_DOC) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_config_reference())
    return path
