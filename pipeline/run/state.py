"""The run state: which stages of a run directory are done, what each was computed from, and
whether a rerun may reuse it (docs/architecture.md §4.3, "Run state").

Every stage has a key: the hash of exactly the config keys it depends on (`DEPENDS_ON`), of
the tokens of the stages it consumed (their keys) and of the shards it read (their round-0
keys). `manifest.json` keeps one record per stage (`stages`): key, the config values and input
tokens that made it (so a changed key can be explained), status, times and the stage's summary.
A rerun reuses a stage whose record is done under the same key, when no stage it reads was
recomputed in this run and its outputs are still there; otherwise it recomputes the stage and,
through the keys and the "recomputed" rule, everything downstream.

Embed passes are decided per shard: every embeddings table carries its shard's key in its
footer (`STAGE_KEY_META`); a shard whose table has the expected key is reused, so adding a
shard embeds only that shard (and then recomputes every corpus-wide stage).

Pure: hashing and decisions only, plus `table_keys`, which reads footers. The stages and the one
plan function over them are `pipeline.run.graph`; the runner and `ncl-pipeline status` both
plan with it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import resources_only_fields
from pipeline.io.layout import STAGE_KEY_META

__all__ = [
    "DEPENDS_ON",
    "STAGE_KEY_META",
    "Decision",
    "EmbedPlan",
    "RunState",
    "StageKey",
    "decide",
    "digest",
    "embed_plan",
    "round0_shard_keys",
    "shard_key",
    "shards_token",
    "stage_config",
]

_DECODE = ("input.image_key", "input.caption_key", "input.max_image_pixels")
_OPTIMISER = (
    "train.lr",
    "train.batch_size",
    "train.weight_decay",
    "train.lr_warmup_steps",
    "train.grad_clip",
    "train.workers",  # the global batch is batch_size x workers
)
# The config keys each kind of stage depends on: a dotted key names itself and everything
# below it; "{method}" is the job's labels.method. Keys that change only resources or speed
# (embed concurrency, CPUs, GPUs, index shards, torch threads, checkpoint cadence, Ray) are
# left out on purpose: changing them reuses everything.
DEPENDS_ON: dict[str, tuple[str, ...]] = {
    "embed": (
        *_DECODE,
        "input.sources",
        "model",
        "embed.batch_size",
        "embed.loss_permutations",
        "embed.decode",  # the device decode's pixels differ from PIL's by a level or two
        "embed.from_embeddings.key_column",
        "seed",
    ),
    "keys": ("input.sources",),
    "warmup": (
        *_DECODE,
        "model",
        "seed",
        *_OPTIMISER,
        "train.warmup_epochs",
        "train.warmup",
        "eval.val_shards",
        "eval.test_shards",
    ),
    "labels": (
        "labels.method",
        "labels.loss",
        "labels.loss_negatives",
        "labels.loss_competitors",
        "labels.posterior",
        "labels.{method}",
        "mixture",
        "index.factory",
        "index.nprobe",
        "index.shards",  # IVF codebooks train on the first index shard's rows
        "eval.ground_truth",
        "seed",
    ),
    "oracle": ("eval.ground_truth",),
    "filter": ("train.filter_fraction", "train.filter_scorer"),
    "train": (*_DECODE, "model", "seed", "train", "eval"),
    "publish": ("eval.ground_truth",),
}
# Inside the sections above, these change how fast a stage runs, not what it produces.
NOT_RESULTS = tuple(resources_only_fields())  # marked in the config model (RESOURCES_ONLY)
_TRAIN_READS_LABELS = ("labels.method", "labels.{method}")  # coteach mode only


def digest(payload: Any) -> str:
    """Short, stable hash of a JSON-able value."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
    return flat


def stage_config(job, kind: str) -> dict[str, Any]:
    """{dotted key: value} of exactly the config keys a `kind` of stage depends on."""
    wanted = list(DEPENDS_ON[kind])
    if kind == "train" and job.train.mode == "coteach":
        wanted += _TRAIN_READS_LABELS
    wanted = [w.replace("{method}", job.labels.method) for w in wanted]
    flat = _flatten(job.model_dump(mode="json"))
    # Sources count by name (their shards' paths, like input.shards', are not results); absent
    # under input.shards, so the keys of runs made before sources existed stay as they were.
    sources = flat.pop("input.sources", None)
    if sources:
        flat["input.sources"] = [source["name"] for source in sources]
    config = {
        key: value
        for key, value in sorted(flat.items())
        if any(key == w or key.startswith(f"{w}.") for w in wanted) and key not in NOT_RESULTS
    }
    if config.get("embed.decode") == "auto":  # the two decodes' pixels differ: key what runs
        raise ValueError("embed.decode: auto must be resolved for the cluster first (decode_on)")
    return config


def shard_key(base: str, identity: str) -> str:
    """A shard's key in an embed pass: the pass's key and what identifies the shard (round 0:
    its name and size; later rounds: its round-0 key)."""
    return digest([base, identity])


def shard_identity(name: str, size: int | None, path: str) -> str:
    """A shard as round 0 sees it before reading it: name and size (a command's output has no
    size: its command line)."""
    return f"{name}:{size}" if size is not None else f"{name}:{path}"


def shards_token(keys: Mapping[str, str]) -> str:
    """Token of a set of shards: their names and round-0 keys."""
    return digest(sorted(keys.items()))


@dataclass(frozen=True)
class StageKey:
    """What a stage is computed from: its config values and its inputs' tokens."""

    stage: str  # "round0/embed", "round1/labels_a", "publish", ...
    config: Mapping[str, Any]
    inputs: Mapping[str, str] = field(default_factory=dict)  # stage id or "shards" -> token

    @property
    def key(self) -> str:
        return digest({"stage": self.stage, "config": self.config, "inputs": self.inputs})

    def stamp(self) -> dict[str, Any]:
        """What a stage's summary file records of its key (`RUN_STATE_FIELD`), so that a
        damaged manifest.json is rebuilt from the outputs (`pipeline.run.manifest`)."""
        return {
            "stage": self.stage,
            "key": self.key,
            "config": dict(self.config),
            "inputs": dict(self.inputs),
        }


@dataclass(frozen=True)
class Decision:
    stage: str
    reuse: bool
    reason: str = ""  # why it is recomputed ("" when reused)
    resume: bool = False  # same key, interrupted: its partial outputs may be kept

    def describe(self) -> str:
        return "reused" if self.reuse else f"recomputed because {self.reason}"


def _names(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _config_changes(old: Mapping, new: Mapping) -> list[str]:
    """The changed keys: values first, then keys that came or went, named by their section
    (labels.method=rcr instead of bicro: "labels.method, labels.bicro, labels.rcr changed")."""
    changed = [k for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    sections = sorted({k.rsplit(".", 1)[0] for k in set(old) ^ set(new)})
    names = changed + [s for s in sections if s not in changed]
    return [f"{_names(names)} changed"] if names else []


def _input_changes(old: Mapping, new: Mapping, recomputed: Collection[str]) -> list[str]:
    why = []
    for name, token in new.items():
        if old.get(name) == token:
            continue
        if name == "shards":
            why.append("input shards changed")
        elif name in recomputed:
            why.append(f"its input {name} was recomputed")
        else:
            why.append(f"its input {name} changed")
    return why + [f"it no longer reads {name}" for name in old if name not in new]


def changes(current: StageKey, recorded: Mapping, recomputed: Collection[str] = ()) -> list[str]:
    """Why `current` differs from `recorded` (empty when the keys are equal), config first."""
    if recorded.get("key") == current.key:
        return []
    if "config" not in recorded:
        return ["it has no run-state record (an older run directory)"]
    why = _config_changes(recorded.get("config") or {}, current.config)
    why += _input_changes(recorded.get("inputs") or {}, current.inputs, recomputed)
    return why or ["its record is of another version"]


def decide(
    current: StageKey,
    recorded: Mapping | None,
    *,
    recomputed: Collection[str] = (),
    outputs_present: bool = True,
) -> Decision:
    """Reuse `current`'s recorded result, or recompute it (and say why).

    Args:
        recorded: the stage's record from manifest.json, None when there is none.
        recomputed: stages recomputed in this run: a stage reading one of them is recomputed
            even under an unchanged key (its input's bytes may differ, e.g. GPU training).
        outputs_present: whether the stage's outputs are still on disk.
    """
    stage = current.stage
    if recorded is None:
        return Decision(stage, False, "it has not run before")
    why = changes(current, recorded, recomputed)
    if why:
        return Decision(stage, False, "; ".join(why[:2]) + ("; ..." if len(why) > 2 else ""))
    upstream = [name for name in current.inputs if name in recomputed]
    if upstream:
        return Decision(stage, False, f"its input {upstream[0]} was recomputed")
    if recorded.get("status") != "done":
        return Decision(stage, False, "it was interrupted (resumed)", resume=True)
    if not outputs_present or "summary" not in recorded:
        return Decision(stage, False, "its outputs are missing")
    return Decision(stage, True)


# ------------------------------------------------------------------------------------------
# Embed passes: decided per shard


def embed_base(job, node, tokens: Mapping[str, str]) -> StageKey:
    """An embed pass's key before its shards: config and the models and admission it reads;
    round 0 from embed.from_embeddings also the folder's identity (its files' sizes and times:
    rewritten embeddings are ingested again)."""
    inputs = {name: tokens.get(name, "") for name in node.inputs}
    if node.round_index == 0 and job.embed.from_embeddings is not None:
        from pipeline.io.clip_retrieval import folder_token

        given = job.embed.from_embeddings
        token = folder_token(given.path)
        inputs["from_embeddings"] = token if given.source is None else f"{given.source}:{token}"
    return StageKey(node.name, stage_config(job, "embed"), inputs)


def embed_key(base: StageKey, shard_keys: Mapping[str, str]) -> StageKey:
    """An embed pass's recorded key: its base and the shards it holds tables for."""
    return StageKey(base.stage, base.config, {**base.inputs, "shards": shards_token(shard_keys)})


def pending_shards(expected: Mapping[str, str], found: Mapping[str, str | None]) -> list[str]:
    """The shards an embed pass must (re)compute: no table, or a table of another key."""
    return [shard for shard, key in expected.items() if found.get(shard) != key]


def round0_shard_keys(
    job, node, tokens: Mapping[str, str], paths: Mapping[str, str]
) -> dict[str, str]:
    """Shard -> the key of its round-0 embeddings: the embed config and the shard's identity
    (name, size, path); every later stage of the shard builds on it."""
    from pipeline.io.admitted import shard_size

    base = embed_base(job, node, tokens).key
    return {
        name: shard_key(base, shard_identity(name, shard_size(path), path))
        for name, path in paths.items()
    }


@dataclass(frozen=True)
class EmbedPlan:
    """What an embed pass finds before it runs: its key before the shards (`base`), the key
    each shard's table must hold (`expected`), the keys the tables hold (`found`, None: no
    table), the shards to (re)compute (`pending`) and those of them whose table holds the
    expected key but whose bytes changed (`rewritten`)."""

    base: StageKey
    expected: dict[str, str]
    found: dict[str, str | None]
    pending: list[str]
    rewritten: list[str] = field(default_factory=list)


def embed_plan(
    job,
    node,
    tokens: Mapping[str, str],
    recomputed: Collection[str],
    layout,
    round0_keys: Mapping[str, str],
    paths: Mapping[str, str] | None = None,
) -> EmbedPlan:
    """The plan of `node`'s embed pass over the shards of `round0_keys` (shard -> its round-0
    key: config and identity); the runner runs it, `ncl-pipeline status` predicts it. With the
    shards' `paths` (round 0), a shard whose bytes changed under the same name and size
    (`pipeline.io.admitted.rewritten_shards`) is embedded again."""
    from pipeline.io.admitted import read_embeddings_footer, rewritten_shards

    base = embed_base(job, node, tokens)
    if node.round_index == 0:
        expected = dict(round0_keys)
    else:  # a later round's models over the same admitted shards
        expected = {name: shard_key(base.key, key) for name, key in round0_keys.items()}
    footers = {n: read_embeddings_footer(layout.embeddings(node.round_index, n)) for n in expected}
    found = {n: None if f is None else f.stage_key for n, f in footers.items()}
    pending = pending_shards(expected, found)
    given = paths or {}
    rewritten = rewritten_shards(
        {n: (given[n], footers[n]) for n in expected if n in given and n not in pending}
    )
    pending += rewritten
    if any(name in recomputed for name in node.inputs):
        pending = list(expected)  # its models may differ bit for bit under the same key
    return EmbedPlan(base, expected, found, pending, rewritten)


def embed_reason(
    base: StageKey,
    recorded: Mapping | None,
    pending: list[str],
    found: Mapping[str, str | None],
    recomputed: Collection[str] = (),
    rewritten: Collection[str] = (),
) -> str:
    """Why an embed pass recomputes `pending` shards (its other shards are reused)."""
    if recorded is None and not any(found.values()):
        # A first run: that its inputs were computed in this run too is not the reason.
        return "it has not run before"
    if recorded is not None and "config" in recorded:
        old_inputs = {k: v for k, v in (recorded.get("inputs") or {}).items() if k != "shards"}
        why = _config_changes(recorded.get("config") or {}, base.config)
        why += _input_changes(old_inputs, base.inputs, recomputed)
        if why:
            return "; ".join(why[:2])
    upstream = [name for name in base.inputs if name in recomputed]
    if upstream:
        return f"its input {upstream[0]} was recomputed"
    new = [s for s in pending if found.get(s) is None]
    other = [s for s in pending if found.get(s) is not None and s not in rewritten]
    parts = [f"no embeddings yet: {_names(new)}"] if new else []
    parts += [f"embedded under another key: {_names(other)}"] if other else []
    parts += [f"rewritten since their embed pass: {_names(list(rewritten))}"] if rewritten else []
    return f"input shards changed ({'; '.join(parts)})"


# ------------------------------------------------------------------------------------------
# The state of one run directory


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class RunState:
    """The stage records of a run directory and this run's decisions.

    `records` is manifest.json's `stages` object, changed in place; `save` writes the manifest
    (called whenever a record changes, so a killed run leaves a truthful state).
    """

    def __init__(self, records: dict, save: Callable[[], None] = lambda: None) -> None:
        self.records = records
        self.save = save
        self.recomputed: set[str] = set()
        self.tokens: dict[str, str] = {}  # stage -> the token its readers hash
        self._started: dict[str, float] = {}

    def summary(self, stage: str) -> dict:
        return self.records[stage]["summary"]

    def start(self, current: StageKey) -> None:
        """Record that `current` is being computed: its old outputs are no longer valid."""
        self.records[current.stage] = {
            **{name: value for name, value in current.stamp().items() if name != "stage"},
            "status": "running",
            "started_at": _now(),
        }
        self._started[current.stage] = time.perf_counter()
        self.save()

    def finish(
        self,
        stage: str,
        summary: dict,
        *,
        final: StageKey | None = None,
        recomputed: bool = True,
    ) -> None:
        """Mark `stage` done (under `final`'s key when its key is known only now)."""
        record = self.records[stage]
        if final is not None:
            record.update(key=final.key, config=dict(final.config), inputs=dict(final.inputs))
        started = self._started.pop(stage, time.perf_counter())
        record.update(
            status="done",
            finished_at=_now(),
            seconds=round(time.perf_counter() - started, 3),
            summary=summary,
        )
        self.tokens[stage] = record["key"]
        if recomputed:
            self.recomputed.add(stage)
        self.save()


# ------------------------------------------------------------------------------------------
# What is on disk (read-only)


def table_keys(paths: Mapping[str, str]) -> dict[str, str | None]:
    """{shard: the key in its embeddings table's footer}; None when there is no table."""
    from pipeline.io.admitted import read_embeddings_footer

    found: dict[str, str | None] = {}
    for shard, path in paths.items():
        footer = read_embeddings_footer(path)
        found[shard] = None if footer is None else footer.stage_key
    return found
