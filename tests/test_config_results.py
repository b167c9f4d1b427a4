"""Every config field that changes results is in a stage key; no other field is (issue 34).

The config model marks each field resources-only (speed, resources, caches, logs, run guards) or
identity (names and paths), and leaves every other field a result (`pipeline.config.sections`).
The run state hashes, per kind of stage, the fields `DEPENDS_ON` names (`stage_config`). A result
field in no key would let a rerun reuse a result computed under another value; a resources-only
field in a key recomputes for nothing. These tests compute what the real `stage_config` hashes
for a job with every optional section filled, under every label method, and compare it with the
markers, so a new field fails here until it is either marked or put in a key.
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import (
    JobConfig,
    identity_fields,
    job_json_schema,
    leaf_fields,
    resources_only_fields,
    result_fields,
)
from pipeline.core.labels import LABEL_METHODS
from pipeline.run.state import DEPENDS_ON, NOT_RESULTS, stage_config
from pipeline.schemas import render_config_reference

# Result fields hashed outside `stage_config`, and how.
HASHED_ELSEWHERE = {
    "embed.from_embeddings.source": "round 0's from_embeddings input token (embed_base)",
    "embed.from_embeddings.model": "validated equal to model.name, which is in the keys",
    "embed.from_embeddings.pretrained": "validated equal to model.pretrained",
}
# Wrong today, left for the run-state rewrite of issue 34: remove a line when its fix lands (the
# tests fail while a fixed field is still listed, so the lists stay true).
# Result fields in no key, or resources-only fields in a key: none today. A new entry here is a
# bug to fix (a rerun would reuse a result computed under another configuration).
KNOWN_UNKEYED: dict[str, str] = {}
KNOWN_KEYED_RESOURCES: dict[str, str] = {}


def _full_job() -> JobConfig:
    """A job with every optional section and path set; identity values say IDENTITY."""
    return JobConfig.model_validate(
        {
            "name": "IDENTITYname",
            "output": "/IDENTITY/run",
            "input": {"sources": [{"name": "web", "shards": "/IDENTITY/web-{0..1}.tar"}]},
            "model": {"name": "ViT-B-32", "pretrained": "openai", "cache_dir": "/cache"},
            "embed": {
                "decode": "device",  # as a run on GPUs resolves auto
                "from_embeddings": {
                    "path": "/IDENTITY/clip-retrieval",
                    "model": "ViT-B-32",
                    "pretrained": "openai",
                    "source": "web",
                },
            },
            "labels": {"assign": {"mass": 0.5}},
            "train": {"filter_fraction": 0.5, "filter_scorer": "warmed", "torch_threads": 2},
            "eval": {"ground_truth": "/gt.parquet", "val_shards": "/v.tar", "test_shards": "/t"},
            "ray": {"address": "auto", "num_cpus": 2, "object_store_memory": 10**9},
        }
    )


def _hashed_configs() -> list[dict]:
    """What every kind of stage hashes, under every label method (coteach reads labels)."""
    job = _full_job()
    configs = []
    for method in LABEL_METHODS:
        labels = job.labels.model_copy(update={"method": method})
        variant = job.model_copy(update={"labels": labels})
        configs += [stage_config(variant, kind) for kind in DEPENDS_ON]
    return configs


def _keyed() -> set[str]:
    """The leaf fields some stage key hashes (a hashed key covers the fields below it: the
    sources' list is hashed as their names)."""
    hashed = {key for config in _hashed_configs() for key in config}
    return {
        field
        for field in leaf_fields()
        if any(field == key or field.startswith(f"{key}.") for key in hashed)
    }


def _flatten(value, prefix=""):
    """Dotted names of a dumped config's values; a list of sections by its items' fields."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        value = value[0]
    if not isinstance(value, dict):
        return [prefix]
    return [name for key, item in value.items() for name in _flatten(item, f"{prefix}{key}.")]


def test_leaf_fields_are_the_values_of_a_full_job():
    dumped = _flatten(_full_job().model_dump(mode="json"))
    assert list(leaf_fields()) == [name.rstrip(".") for name in dumped]


def test_every_field_is_a_result_resources_only_or_identity():
    resources, identity = set(resources_only_fields()), set(identity_fields())
    assert not resources & identity
    assert set(result_fields()) == set(leaf_fields()) - resources - identity
    assert {"name", "output", "input.shards", "input.sources.shards"} <= identity
    assert {"seed", "labels.method", "input.sources.name"} <= set(result_fields())


def _only_known(found: set[str], known: dict[str, str], problem: str) -> None:
    """`found` is exactly the `known` list: a new field fails with `problem`, a fixed one asks
    for its line to go."""
    new = sorted(found - set(known))
    assert not new, f"{', '.join(new)} {problem}"
    fixed = sorted(set(known) - found)
    assert not fixed, f"{', '.join(fixed)} are fixed: remove them from the known list"


def test_every_result_field_is_in_a_stage_key():
    keyed = _keyed()
    unkeyed = {f for f in result_fields() if f not in keyed and f not in HASHED_ELSEWHERE}
    _only_known(
        unkeyed,
        KNOWN_UNKEYED,
        "change results but are in no stage key, so a rerun would reuse results computed under "
        "another value: add them to DEPENDS_ON in pipeline/run/state.py, or mark them "
        "RESOURCES_ONLY in pipeline/config/sections.py if they never change results",
    )


def test_resources_only_fields_are_in_no_stage_key():
    _only_known(
        _keyed() & set(resources_only_fields()),
        KNOWN_KEYED_RESOURCES,
        "are marked resources-only but hashed into a stage key, so changing them recomputes for "
        "nothing: add them to NOT_RESULTS in pipeline/run/state.py, or unmark them in "
        "pipeline/config/sections.py if they do change results",
    )


def test_the_hand_list_of_non_results_is_marked():
    unmarked = sorted(set(NOT_RESULTS) - set(resources_only_fields()))
    assert not unmarked, f"mark {', '.join(unmarked)} RESOURCES_ONLY in pipeline/config/sections.py"


def test_identity_values_never_reach_a_key():
    for config in _hashed_configs():
        assert "IDENTITY" not in json.dumps(config), config
        assert config.get("input.sources", ["web"]) == ["web"]  # hashed by name only


def test_the_known_lists_name_real_fields():
    known = {*HASHED_ELSEWHERE, *KNOWN_UNKEYED}
    assert known <= set(result_fields())
    assert set(KNOWN_KEYED_RESOURCES) <= set(resources_only_fields())


@pytest.mark.parametrize(
    "section, name", [("TrainConfig", "torch_threads"), ("RayConfig", "address")]
)
def test_the_marker_is_in_the_json_schema(section, name):
    assert job_json_schema()["$defs"][section]["properties"][name]["resources_only"] is True


def test_the_reference_marks_exactly_the_resources_only_keys():
    marked = {
        line.split("`")[1]
        for line in render_config_reference().splitlines()
        if line.startswith("| `") and "| *Resources only.* " in line
    }
    assert marked == set(resources_only_fields())
