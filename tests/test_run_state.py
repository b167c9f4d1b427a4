"""The run state's pure parts: which config keys each stage hashes, the stage graph, and the
reuse / recompute decision with its reason (no Ray; files only for embeddings footers)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import JobConfig
from pipeline.io.layout import RunLayout
from pipeline.run.graph import stage_graph
from pipeline.run.specs import with_decode_for
from pipeline.run.state import (
    STAGE_KEY_META,
    RunState,
    StageKey,
    decide,
    embed_plan,
    embed_reason,
    pending_shards,
    shard_key,
    shards_token,
    stage_config,
)


def _job(cluster_gpus: float | None = 0.0, **sections) -> JobConfig:
    """A job as a run on a cluster with `cluster_gpus` keys it (None: embed.decode unresolved)."""
    base = {
        "name": "unit",
        "input": {"shards": "/data/{00000..00003}.tar"},
        "output": "/tmp/out",
        "model": {"name": "ncl-tiny"},
        "labels": {"method": "bicro"},  # the tests below name BiCro's keys
        "train": {"rounds": 1},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    job = JobConfig.model_validate(base)
    return job if cluster_gpus is None else with_decode_for(job, cluster_gpus)


def test_each_stage_hashes_exactly_the_keys_it_depends_on():
    job = _job()
    embed = stage_config(job, "embed")
    assert "embed.batch_size" in embed and "model.name" in embed and "seed" in embed
    assert "embed.loss_permutations" in embed  # the losses, hence every later stage, change
    # embed.decode auto, keyed as resolved for the cluster: the device decode's pixels differ
    # from PIL's slightly, so a job moved between GPU and CPU workers embeds again.
    assert embed["embed.decode"] == "cpu"  # a cluster without GPUs
    on_gpus = stage_config(_job(cluster_gpus=4), "embed")
    assert on_gpus["embed.decode"] == "device"  # the default: a GPU per embed worker
    assert stage_config(_job(cluster_gpus=4, embed={"decode": "device"}), "embed") == on_gpus
    cpu_workers = _job(cluster_gpus=4, embed={"gpus_per_worker": 0})
    assert stage_config(cpu_workers, "embed")["embed.decode"] == "cpu"
    assert stage_config(_job(embed={"decode": "cpu"}), "embed") == embed
    with pytest.raises(ValueError, match="resolved for the cluster"):
        stage_config(_job(cluster_gpus=None), "embed")  # never keyed as "auto"
    # Resources, speed-only knobs and the shard list (decided per shard) are not part of it.
    assert not {"embed.concurrency", "embed.decode_threads", "input.shards"} & set(embed)
    assert "embed.forward_batch_size" not in embed  # rounding only (tests/test_embed_decode.py)
    warmup = stage_config(job, "warmup")
    assert "train.lr" in warmup and "train.warmup.mode" in warmup
    assert not {"train.rounds", "train.mode", "labels.method", "train.torch_threads"} & set(warmup)
    labels = stage_config(job, "labels")
    assert "labels.bicro.theta" in labels and "mixture.kind" in labels
    assert not any(k.startswith(("labels.rcr", "labels.sps", "train.")) for k in labels)
    assert "index.shards" in labels  # IVF codebooks train on the first index shard's rows
    train = stage_config(job, "train")
    assert {"train.rounds", "train.lr", "labels.method", "labels.bicro.theta"} <= set(train)
    vanilla = stage_config(_job(train={"rounds": 1, "mode": "vanilla"}), "train")
    assert "labels.method" not in vanilla  # vanilla does not read the labels
    # Changing a resource key (or where the weights are cached) changes no stage's config.
    faster = _job(
        embed={"concurrency": 4},
        train={"rounds": 1, "torch_threads": 2},
        model={"cache_dir": "/shared/open_clip"},
    )
    for kind in ("embed", "warmup", "labels", "train", "publish"):
        assert stage_config(faster, kind) == stage_config(job, kind)


def test_every_labels_setting_keys_the_label_passes():
    """A setting of `labels` left out of the label passes' key would let a rerun publish labels
    computed under the old value (it happened to `labels.posterior`)."""
    from pipeline.config import LabelsConfig
    from pipeline.core.labels import LABEL_METHODS

    for method in LABEL_METHODS:
        keyed = stage_config(_job(labels={"method": method}), "labels")
        for name in LabelsConfig.model_fields:
            if name in LABEL_METHODS and name != method:
                assert not any(k.startswith(f"labels.{name}.") for k in keyed), name
            else:
                assert any(
                    k == f"labels.{name}" or k.startswith(f"labels.{name}.") for k in keyed
                ), (
                    method,
                    name,
                )


def test_stage_graph_follows_the_runner_and_train_mode():
    job = _job()
    nodes = {n.name: n for n in stage_graph(job)}
    assert list(nodes) == [
        "round0/embed",
        "round0/keys",
        "round0/warmup",
        "round1/embed",
        "round1/labels_a",
        "round1/labels_b",
        "round1/train",
        "round2/embed",
        "round2/labels_a",
        "round2/labels_b",
        "publish",
    ]
    assert nodes["round1/train"].inputs == (
        "round1/embed",
        "round0/warmup",
        "round1/labels_a",
        "round1/labels_b",
    )
    assert nodes["round2/embed"].inputs == ("round0/keys", "round1/train")
    vanilla = {n.name: n for n in stage_graph(_job(train={"rounds": 1, "mode": "vanilla"}))}
    assert vanilla["round1/train"].inputs == ("round1/embed", "round0/warmup")
    cold = {n.name: n for n in stage_graph(_job(train={"rounds": 0, "warmup_epochs": 0}))}
    assert "round0/warmup" not in cold and cold["round1/embed"].inputs == ("round0/keys",)


def test_the_baselines_label_sources_are_stages():
    """oracle: one table per round from that round's pairs; cosine_filter: one table made in
    round 1 (from the scorer's embed pass, and round 1's mixtures for the fitted fraction)."""
    truth = {"ground_truth": "/data/ground_truth.parquet"}
    oracle_job = _job(train={"rounds": 2, "mode": "oracle"}, eval=truth)
    oracle = {n.name: n for n in stage_graph(oracle_job)}
    assert oracle["round2/oracle"].inputs == ("round2/embed",)
    assert oracle["round2/train"].inputs == ("round2/embed", "round1/train", "round2/oracle")
    names = list(oracle)
    assert names.index("round1/oracle") < names.index("round1/train")
    fitted = {n.name: n for n in stage_graph(_job(train={"rounds": 2, "mode": "cosine_filter"}))}
    assert "round2/filter" not in fitted
    assert fitted["round1/filter"].inputs == ("round1/embed", "round1/labels_a", "round1/labels_b")
    assert fitted["round2/train"].inputs[-1] == "round1/filter"
    initial = _job(
        model={"name": "ncl-tiny", "pretrained": "/w/teacher.pt"},
        train={"rounds": 1, "mode": "cosine_filter", "filter_fraction": 0.5},
    )
    scored = {n.name: n for n in stage_graph(initial)}["round1/filter"]
    assert scored.inputs == ("round0/embed",)  # the initial model, scored once; no mixtures
    labels = _job(train={"rounds": 1, "mode": "cosine_filter", "filter_scorer": "labels"})
    by_labels = {n.name: n for n in stage_graph(labels)}["round1/filter"]
    assert by_labels.inputs == ("round1/labels_a", "round1/labels_b")


def _key(lr=1e-3, warmup="w1", shards="s1") -> StageKey:
    return StageKey("round1/train", {"train.lr": lr}, {"round0/warmup": warmup, "shards": shards})


def _done(key: StageKey, **extra) -> dict:
    return {
        "key": key.key,
        "config": dict(key.config),
        "inputs": dict(key.inputs),
        "status": "done",
        "summary": {},
        **extra,
    }


def test_decide_reuses_only_an_identical_complete_stage():
    key = _key()
    assert decide(key, _done(key)).reuse
    assert decide(key, None).describe() == "recomputed because it has not run before"
    assert decide(_key(lr=2e-3), _done(key)).describe() == ("recomputed because train.lr changed")
    assert decide(_key(warmup="w2"), _done(key), recomputed={"round0/warmup"}).reason == (
        "its input round0/warmup was recomputed"
    )
    assert decide(_key(shards="s2"), _done(key)).reason == "input shards changed"
    # Same key, but an input was recomputed in this run (its bytes may differ: GPU training).
    assert not decide(key, _done(key), recomputed={"round0/warmup"}).reuse
    interrupted = decide(key, {**_done(key), "status": "running"})
    assert not interrupted.reuse and interrupted.resume
    assert decide(key, _done(key), outputs_present=False).reason == "its outputs are missing"
    old = decide(key, {"complete": True, "finished_at": "2026-01-01"})
    assert "older run directory" in old.reason
    both = decide(_key(lr=2e-3, warmup="w2"), _done(key), recomputed={"round0/warmup"})
    assert both.reason == "train.lr changed; its input round0/warmup was recomputed"


def test_shard_keys_reuse_shards_one_by_one():
    base = StageKey("round0/embed", {"seed": 0}).key
    expected = {s: shard_key(base, f"{s}:100") for s in ("00000", "00001", "00002")}
    found = {"00000": expected["00000"], "00001": "other", "00002": None}
    assert pending_shards(expected, found) == ["00001", "00002"]
    why = embed_reason(StageKey("round0/embed", {"seed": 0}), None, ["00001", "00002"], found)
    assert (
        why == "input shards changed (no embeddings yet: 00002; embedded under another key: 00001)"
    )
    # The key of a shard set depends on names and keys, not on their order.
    assert shards_token({"a": "1", "b": "2"}) == shards_token({"b": "2", "a": "1"})
    assert shards_token({"a": "1"}) != shards_token({"a": "1", "b": "2"})
    recorded = _done(StageKey("round0/embed", {"seed": 0}, {"shards": "x"}))
    changed = embed_reason(StageKey("round0/embed", {"seed": 1}), recorded, ["00000"], found)
    assert changed == "seed changed"


def test_a_first_embed_pass_says_it_has_not_run_before_even_after_recomputed_inputs():
    base = StageKey("round1/embed", {"seed": 0}, {"round0/keys": "k"})
    none = {"00000": None, "00001": None}
    first = embed_reason(base, None, ["00000", "00001"], none, {"round0/keys"})
    assert first == "it has not run before"
    # With a record, a recomputed input is the reason.
    recorded = _done(StageKey("round1/embed", {"seed": 0}, {"round0/keys": "k", "shards": "x"}))
    rerun = embed_reason(base, recorded, ["00000"], none, {"round0/keys"})
    assert rerun == "its input round0/keys was recomputed"


def test_an_embed_plan_redoes_missing_and_foreign_tables_and_everything_after_new_models(
    tmp_path,
):
    job = _job(output=str(tmp_path))
    node = next(n for n in stage_graph(job) if n.name == "round1/embed")
    layout = RunLayout(str(tmp_path))
    round0 = {"00000": "k0", "00001": "k1"}
    plan = embed_plan(job, node, {}, set(), layout, round0)
    assert plan.pending == ["00000", "00001"] and plan.found == {"00000": None, "00001": None}
    # A later round's table key builds on the round-0 key and on this round's models.
    assert plan.expected["00000"] != "k0"
    other_models = embed_plan(job, node, {node.inputs[0]: "other"}, set(), layout, round0)
    assert other_models.expected["00000"] != plan.expected["00000"]

    table = layout.embeddings(1, "00000")
    (tmp_path / table).parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("key", pa.string())], metadata={STAGE_KEY_META: plan.expected["00000"]})
    pq.write_table(pa.table({"key": ["a"]}, schema=schema), table)
    assert embed_plan(job, node, {}, set(), layout, round0).pending == ["00001"]
    # Its models were retrained in this run: same key, maybe other bits, so every shard again.
    again = embed_plan(job, node, {}, {node.inputs[0]}, layout, round0)
    assert again.pending == ["00000", "00001"]


def test_run_state_records_start_and_finish():
    saved = []
    records: dict = {}
    state = RunState(records, save=lambda: saved.append(dict(records)))
    key = _key()
    assert not decide(key, records.get(key.stage)).reuse
    state.start(key)
    assert records["round1/train"]["status"] == "running" and len(saved) == 1
    state.finish("round1/train", {"views": {}})
    record = records["round1/train"]
    assert record["status"] == "done" and record["key"] == key.key and record["seconds"] >= 0
    assert state.recomputed == {"round1/train"} and state.tokens["round1/train"] == key.key
    again = RunState(records)
    assert decide(key, again.records[key.stage]).reuse
    assert again.summary("round1/train") == {"views": {}}


def test_a_changed_method_names_its_sections():
    job, other = _job(), _job(labels={"method": "rcr"})
    old, new = (
        StageKey("l", stage_config(job, "labels")),
        StageKey("l", stage_config(other, "labels")),
    )
    assert decide(new, _done(old)).reason == "labels.method, labels.bicro, labels.rcr changed"
