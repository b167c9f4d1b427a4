"""Job configuration: YAML in, a frozen, typed `JobConfig` out.

Contract (docs/architecture.md §4.2): the top-level sections and keys below exist; more may be
added. Unknown keys and bad values fail at load time, before any work, with a `JobConfigError`
whose message names the dotted key, the bad value and the fix. Overrides use dotted keys
(`labels.method=rcr`); their values are parsed as YAML scalars (`train.rounds=0` is an int).
`leaf_fields`, `resources_only_fields`, `identity_fields` and `result_fields` name the fields by
what they do to results (the markers in `pipeline.config.sections`): the stage keys must cover
every result field.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from pipeline.config.sections import (  # noqa: F401  (the public names of the config)
    IDENTITY,
    RESOURCES_ONLY,
    AssignLabelsConfig,
    BicroLabelsConfig,
    BicroTrainConfig,
    EmbedConfig,
    EvalConfig,
    FromEmbeddingsConfig,
    IndexConfig,
    InputConfig,
    LabelsConfig,
    MixtureConfig,
    ModelConfig,
    RayConfig,
    RcrLabelsConfig,
    SpsLabelsConfig,
    SpsTrainConfig,
    TrainConfig,
    WarmupConfig,
    _Section,
)
from pipeline.errors import UserError

__all__ = [
    "JobConfig",
    "JobConfigError",
    "identity_fields",
    "job_json_schema",
    "leaf_fields",
    "load_job",
    "parse_overrides",
    "resources_only_fields",
    "result_fields",
    "with_overrides",
]


class JobConfigError(UserError, ValueError):
    """A job file that cannot be used; the message is meant for the user as is."""


class JobConfig(_Section):
    name: str = Field(
        description="Job name, used in logs and run metadata.", json_schema_extra=IDENTITY
    )
    input: InputConfig
    output: str = Field(
        description="Run directory: local path or fsspec URL.", json_schema_extra=IDENTITY
    )
    model: ModelConfig
    embed: EmbedConfig = EmbedConfig()
    mixture: MixtureConfig = MixtureConfig()
    labels: LabelsConfig = LabelsConfig()
    index: IndexConfig = IndexConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    ray: RayConfig = RayConfig()
    seed: int = Field(0, description="Seeds model init, batch permutations and sampling.")

    @model_validator(mode="after")
    def _name_is_simple(self) -> JobConfig:
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ValueError("name must be non-empty without '/', '\\' or spaces")
        return self

    @model_validator(mode="after")
    def _training_fits_labels(self) -> JobConfig:
        if self.train.mode == "oracle" and self.eval.ground_truth is None:
            raise ValueError(
                "train.mode=oracle trains on the ground-truth clean pairs: set "
                "eval.ground_truth to the corpus's ground_truth.parquet"
            )
        if self.train.label_loss == "soft_margin_triplet" and self.labels.method not in (
            "bicro",
            "cosine",
        ):
            raise ValueError(
                f"train.label_loss=soft_margin_triplet reads labels as margins (BiCro); "
                f"labels.method={self.labels.method} needs train.label_loss=weighted_infonce"
            )
        return self

    @model_validator(mode="after")
    def _embeddings_fit_model(self) -> JobConfig:
        # Later rounds and training start from model.*: embeddings of another model would
        # make round 0 disagree with everything after it.
        given = self.embed.from_embeddings
        if given is None:
            return self

        def tag(value: str | None) -> str | None:
            return value and value.strip().lower().replace("-", "_")

        same_name = given.model.replace("/", "-") == self.model.name.replace("/", "-")
        if not same_name or tag(given.pretrained) != tag(self.model.pretrained):
            raise ValueError(
                f"embed.from_embeddings was made by {given.model} ({given.pretrained}) but the "
                f"job's model is {self.model.name} ({self.model.pretrained}); later rounds start "
                "from model.*, so set model.name and model.pretrained to the embeddings' model"
            )
        names = [source.name for source in self.input.sources or ()]
        if names and given.source not in names:
            raise ValueError(
                f"embed.from_embeddings.source is {given.source}; under input.sources it must "
                f"name the source whose download was embedded, one of {', '.join(names)}"
            )
        if not names and given.source is not None:
            raise ValueError(
                "embed.from_embeddings.source names a source but the job has input.shards; "
                "leave it out (or use input.sources)"
            )
        return self

    @model_validator(mode="after")
    def _index_fits_gpu(self) -> JobConfig:
        if self.index.gpus_per_actor > 0:
            from pipeline.core.labels.rcr import max_search_depth
            from pipeline.core.search.faiss_gpu import gpu_index_problems

            # Only RCR searches deeper than one neighbour (its image de-duplication widens).
            depth = max_search_depth(self.labels.rcr.k) if self.labels.method == "rcr" else 1
            # auto only picks factories that run on GPU.
            factory = "Flat" if self.index.factory == "auto" else self.index.factory
            problems = gpu_index_problems(factory, self.index.nprobe, depth)
            if problems:
                raise ValueError(
                    f"index.gpus_per_actor={self.index.gpus_per_actor:g} puts the index on GPU, "
                    f"where {'; '.join(problems)}; or set index.gpus_per_actor: 0 (CPU index)"
                )
        return self

    def filter_scorer(self) -> str:
        """train.filter_scorer with its default resolved: a job that starts from pretrained
        weights filters as DataComp does, with those weights (``initial``)."""
        if self.train.filter_scorer is not None:
            return self.train.filter_scorer
        return "initial" if self.model.pretrained else "warmed"

    def stage_hash(self, *sections: str) -> str:
        """Short, stable hash of the named sections (all when none): the resume guard's key."""
        dumped = self.model_dump(mode="json")
        chosen = {k: dumped[k] for k in sections} if sections else dumped
        blob = json.dumps(chosen, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Loading and error formatting


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """Parse `dotted.key=value` strings into a nested dict (values parsed as YAML scalars).

    Raises:
        JobConfigError: an override without '=' or with an empty key.
    """
    nested: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise JobConfigError(
                f"override '{item}' is not of the form dotted.key=value, e.g. train.rounds=0"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise JobConfigError(f"override '{item}' conflicts with an earlier override")
            node = child
        node[parts[-1]] = value
    return nested


def with_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """A job's raw mapping with `dotted.key=value` overrides applied, as `load_job` does."""
    return _merge(raw, parse_overrides(overrides))


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _section_model(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _field_path(
    loc: tuple[Any, ...], unknown_last: bool
) -> tuple[list[str], type[BaseModel] | None]:
    """Keep the real field names of a pydantic error location.

    pydantic appends union-branch tags such as 'int' or "literal['auto']" to `loc`; those are
    not keys the user wrote. Returns the dotted path and the model that owns its last key.
    """
    path: list[str] = []
    owner: type[BaseModel] | None = JobConfig
    for index, part in enumerate(loc):
        fields = owner.model_fields if owner is not None else {}
        if isinstance(part, str) and part in fields:
            path.append(part)
            nested = _section_model(fields[part].annotation)
            if nested is None:
                break
            owner = nested
        elif unknown_last and index == len(loc) - 1:
            path.append(str(part))
        else:
            break
    return path, owner


def _describe_error(error: ErrorDetails) -> str:
    kind = error["type"]
    path, owner = _field_path(tuple(error["loc"]), unknown_last=kind == "extra_forbidden")
    dotted = ".".join(path) or "(top level)"
    if kind == "extra_forbidden":
        known = list(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(path[-1], known, n=1)
        hints = []
        if close:
            hints.append(f"did you mean '{'.'.join([*path[:-1], close[0]])}'?")
        if known:
            hints.append(f"allowed keys here: {', '.join(known)}")
        return f"unknown key '{dotted}'" + (f" ({'; '.join(hints)})" if hints else "")
    if kind == "missing":
        return f"missing required key '{dotted}': add it to the job file or pass --set {dotted}=..."
    if kind == "value_error" and (not path or isinstance(error.get("input"), dict)):
        # A whole-job or whole-section check (e.g. train.mode vs eval.ground_truth, input.shards
        # vs input.sources): its message names the keys.
        return str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    plain = isinstance(value, (str, int, float, bool, type(None)))
    shown = json.dumps(value) if plain else repr(value)
    return (
        f"bad value for '{dotted}': {shown} ({error['msg']}); "
        f"fix it in the job file or with --set {dotted}=..."
    )


def _format_validation_error(source: str, exc: ValidationError) -> str:
    lines = [f"invalid job {source}:"]
    seen: set[str] = set()
    for error in exc.errors():
        text = _describe_error(error)
        if text not in seen:
            seen.add(text)
            lines.append(f"  - {text}")
    return "\n".join(lines)


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Load and validate a job YAML file, applying `dotted.key=value` overrides.

    Args:
        path: the job YAML file.
        overrides: strings like `train.rounds=0`, applied after the file.

    Returns:
        The validated, frozen JobConfig.

    Raises:
        JobConfigError: unreadable file, invalid YAML, unknown keys or bad values; the message
            names the file, the dotted key, the bad value and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobConfigError(f"job file '{path}' does not exist") from None
    except OSError as exc:
        raise JobConfigError(f"job file '{path}' cannot be read: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobConfigError(f"job file '{path}' is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise JobConfigError(
            f"job file '{path}' must be a YAML mapping of sections (name, input, ...)"
        )
    merged = with_overrides(raw, overrides)
    try:
        return JobConfig.model_validate(merged)
    except ValidationError as exc:
        raise JobConfigError(_format_validation_error(f"'{path}'", exc)) from None


def job_json_schema() -> dict[str, Any]:
    """The JSON Schema of the job file, as exported to schemas/job.schema.json."""
    schema = JobConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ncl-pipeline job"
    return schema


# --------------------------------------------------------------------------------------------
# Fields by what they do to results


def _nested_section(annotation: Any) -> type[BaseModel] | None:
    """The section in `Section`, `Section | None` or `list[Section] | None`, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = [s for arg in typing.get_args(annotation) if (s := _nested_section(arg))]
    return found[0] if len(found) == 1 else None


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        section = _nested_section(field.annotation)
        if section is None:
            yield f"{prefix}{name}", field
        else:
            yield from _leaves(section, f"{prefix}{name}.")


def _marked(field: FieldInfo, marker: dict[str, Any]) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and all(extra.get(k) == v for k, v in marker.items())


def leaf_fields() -> tuple[str, ...]:
    """Dotted names of every field of the job that holds a value, nested sections walked, in
    the model's order. An optional section is walked (`embed.from_embeddings.path`); a list of
    sections names its items' fields under the list's name (`input.sources.name`)."""
    return tuple(name for name, _ in _leaves(JobConfig))


def resources_only_fields() -> tuple[str, ...]:
    """The leaf fields marked `RESOURCES_ONLY`: speed, resources, caches, logs and run guards;
    a rerun that changes only these reuses every result."""
    return tuple(name for name, field in _leaves(JobConfig) if _marked(field, RESOURCES_ONLY))


def identity_fields() -> tuple[str, ...]:
    """The leaf fields marked `IDENTITY`: the run's name, where it writes and the paths it
    reads; what is read is hashed by content (shards by name and size), not by path."""
    return tuple(name for name, field in _leaves(JobConfig) if _marked(field, IDENTITY))


def result_fields() -> tuple[str, ...]:
    """The leaf fields that change what a stage computes: every stage key must cover them."""
    skip = {*resources_only_fields(), *identity_fields()}
    return tuple(name for name in leaf_fields() if name not in skip)
