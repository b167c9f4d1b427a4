"""The stages of a job as data, and the one plan function that `run_job` and `ncl-pipeline
status` share (docs/architecture.md §4.3).

`stage_graph(job)` lists the stages in run order: each `Stage` names its kind (a key of
`DEPENDS_ON`, the config it hashes), its round and the stages it reads. What a kind does when it
runs (its spec, what it clears first, the outputs it leaves) is `pipeline.run.kinds`.
`plan_stage` decides, from the run state and what is on disk, whether a stage is reused or
recomputed and why; the runner then runs it, and status only records the prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from pipeline.run.state import (
    Decision,
    EmbedPlan,
    RunState,
    StageKey,
    decide,
    embed_key,
    embed_plan,
    embed_reason,
    shards_token,
    stage_config,
)

__all__ = ["Planned", "Stage", "plan_stage", "stage_graph", "stage_key"]


@dataclass(frozen=True)
class Stage:
    name: str  # "round0/embed", "round1/labels_a", "round1/filter", "publish", ...
    kind: str  # a key of DEPENDS_ON: embed, keys, warmup, labels, oracle, filter, train, publish
    round_index: int
    inputs: tuple[str, ...]  # the stages it reads

    @property
    def view(self) -> str:
        """A label pass's view ('a' or 'b')."""
        return self.name.rsplit("_", 1)[-1]


def _baseline_stages(job, r: int, labels_round1: tuple[str, ...]) -> list[Stage]:
    """train.mode oracle and cosine_filter read a label source of their own: the ground truth's
    clean pairs among round r's embedded pairs, or the pairs the scorer's cosines keep (one
    table for every round, made in round 1: the fitted fraction needs round 1's mixtures)."""
    mode = job.train.mode
    if mode == "oracle":
        return [Stage(f"round{r}/oracle", "oracle", r, (f"round{r}/embed",))]
    if mode == "cosine_filter" and r == 1:
        scorer = job.filter_scorer()
        scored = {"initial": ("round0/embed",), "warmed": ("round1/embed",)}.get(scorer, ())
        fitted = labels_round1 if job.train.filter_fraction is None or scorer == "labels" else ()
        return [Stage("round1/filter", "filter", 1, (*scored, *fitted))]
    return []


def stage_graph(job) -> list[Stage]:
    """The stages `run_job` runs for `job`, in order, with the stages each reads."""
    stages = [
        Stage("round0/embed", "embed", 0, ()),
        Stage("round0/keys", "keys", 0, ("round0/embed",)),
    ]
    models: tuple[str, ...] = ()
    if job.train.warmup_epochs > 0:
        stages.append(Stage("round0/warmup", "warmup", 0, ("round0/keys",)))
        models = ("round0/warmup",)
    last = job.train.rounds + 1
    labels_of = {r: (f"round{r}/labels_a", f"round{r}/labels_b") for r in range(1, last + 1)}
    for r in range(1, last + 1):
        embed = f"round{r}/embed"
        stages.append(Stage(embed, "embed", r, ("round0/keys", *models)))
        stages += [Stage(label, "labels", r, (embed,)) for label in labels_of[r]]
        if r == last:
            break
        stages += _baseline_stages(job, r, labels_of[1])
        read: tuple[str, ...] = {
            "coteach": labels_of[r],
            "oracle": (f"round{r}/oracle",),
            "cosine_filter": ("round1/filter",),
        }.get(job.train.mode, ())
        stages.append(Stage(f"round{r}/train", "train", r, (embed, *models, *read)))
        models = (f"round{r}/train",)
    stages.append(Stage("publish", "publish", last, (f"round{last}/embed", *labels_of[last])))
    return stages


def stage_key(job, stage: Stage, tokens: Mapping[str, str], shards: str) -> StageKey:
    """The key of a stage other than an embed pass: config, its inputs' tokens, its shards."""
    inputs = {name: tokens.get(name, "") for name in stage.inputs}
    inputs["shards"] = shards
    return StageKey(stage.name, stage_config(job, stage.kind), inputs)


@dataclass(frozen=True)
class Planned:
    """A stage's plan: reuse or recompute (`decision`), the key it runs under (an embed pass:
    its key before the shards), the token its readers hash if it runs as planned, whether its
    readers must count it as recomputed, and an embed pass's per-shard plan."""

    decision: Decision
    key: StageKey
    token: str
    recomputes: bool
    embed: EmbedPlan | None = None


def plan_stage(
    job,
    layout,
    stage: Stage,
    state: RunState,
    shard_keys: Mapping[str, str],
    outputs_present: Callable[[Stage, Collection[str]], bool],
    expected_to_fail: Collection[str] = (),
    paths: Mapping[str, str] | None = None,
) -> Planned:
    """Reuse or recompute `stage`, and why.

    Args:
        shard_keys: {shard: round-0 key} of the shards the stage reads.
        outputs_present: whether a done stage's outputs are still there (`pipeline.run.kinds`).
        expected_to_fail: shards of `shard_keys` that round 0 tries again but that status
            assumes fail again: they count in neither the stage's token nor its recomputation.
        paths: the shards' paths, for round 0's embed pass: a shard whose bytes changed under
            the same name and size is embedded again (`pipeline.io.admitted.rewritten_shards`).
    """
    records = state.records
    if stage.kind == "embed":
        plan = embed_plan(job, stage, state.tokens, state.recomputed, layout, shard_keys, paths)
        kept = {n: k for n, k in plan.expected.items() if n not in expected_to_fail}
        token = embed_key(plan.base, kept).key
        if not plan.pending:
            return Planned(Decision(stage.name, True), plan.base, token, False, plan)
        why = embed_reason(
            plan.base,
            records.get(stage.name),
            plan.pending,
            plan.found,
            state.recomputed,
            plan.rewritten,
        )
        recomputes = any(name not in expected_to_fail for name in plan.pending)
        return Planned(Decision(stage.name, False, why), plan.base, token, recomputes, plan)
    usable = {n: k for n, k in shard_keys.items() if n not in expected_to_fail}
    current = stage_key(job, stage, state.tokens, shards_token(usable))
    recorded = records.get(stage.name)
    present = True
    if recorded and recorded.get("key") == current.key and recorded.get("status") == "done":
        present = outputs_present(stage, list(usable))
    decision = decide(current, recorded, recomputed=state.recomputed, outputs_present=present)
    return Planned(decision, current, current.key, not decision.reuse)
