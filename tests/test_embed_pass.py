"""The embed pass on a real local Ray: outputs, quarantine reconciliation, resume, conflicts."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from shard_fixtures import write_corrupt_shard

from pipeline.config import EmbedConfig, load_job
from pipeline.data.synthetic import make_corpus
from pipeline.io.shards import IMAGE_EXTENSIONS, RawRecord, iter_shard_records, shard_name
from pipeline.run.runner import run_job

pytestmark = pytest.mark.ray

JOB = """
name: embed-test
input: {{shards: {shards}}}
output: {output}
model: {{name: ncl-tiny, pretrained: null}}
embed: {{batch_size: 16, gpus_per_worker: 0, cpus_per_worker: 1, decode_threads: 2, concurrency: 2}}
train: {{warmup_epochs: 0, rounds: 0}}
seed: 3
"""


def _all_keys(paths: list[str]) -> set[tuple[str, str]]:
    """(shard, key) of every sample group in the shards, read independently of the stage."""
    keys = set()
    for path in paths:
        for item in iter_shard_records(path):
            if item.key is not None:
                keys.add((shard_name(path), item.key))
    return keys


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    summary = make_corpus(
        root / "demo",
        samples=90,
        noise=0.4,
        partial=0.1,
        seed=1,
        samples_per_shard=30,
        test_samples=10,
        corrupt=0.05,
    )
    expected = write_corrupt_shard(str(root / "bad" / "00077.tar"))
    garbage = root / "bad" / "00078.tar"
    garbage.write_bytes(b"this is not a tar archive at all" * 10)
    shards = [str(p) for p in summary.shards] + [str(root / "bad" / "00077.tar"), str(garbage)]
    return {"root": root, "shards": shards, "corrupt_expected": expected, "garbage": str(garbage)}


def _write_job(tmp_path: Path, shards: list[str], name: str = "run") -> Path:
    job = tmp_path / f"{name}.yaml"
    job.write_text(JOB.format(shards="[" + ", ".join(shards) + "]", output=tmp_path / name))
    return job


def test_embed_pass_writes_tables_that_reconcile(local_ray, corpus, tmp_path, caplog):
    job = load_job(_write_job(tmp_path, corpus["shards"]))
    caplog.set_level(logging.DEBUG, logger="pipeline")
    metrics = run_job(job, until="round0/keys")
    embed = metrics["rounds"]["0"]["embed"]
    out = Path(job.output)
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    assert sorted(stages) == ["round0/embed", "round0/keys"]  # until= stopped after the keys

    # The driver logs one line per finished shard (DEBUG, shown with -v; a warning for the
    # unreadable one), then the summary table as one record.
    shard_lines = {
        record.getMessage().split("]")[1].split(":")[0].strip(): record.levelno
        for record in caplog.records
        if record.name == "pipeline.stages.embed.driver" and record.getMessage().startswith("  [")
    }
    assert set(shard_lines) == {shard_name(p) for p in corpus["shards"]}
    assert shard_lines["00078"] == logging.WARNING and shard_lines["00000"] == logging.DEBUG
    summaries = [
        record.getMessage()
        for record in caplog.records
        if record.name == "pipeline.run.summary" and record.getMessage().startswith("\nsummary\n")
    ]
    assert len(summaries) == 1 and f"  embedded:     {embed['embedded']}\n" in summaries[0]
    assert f"FAILED shard {corpus['garbage']}" in summaries[0]

    embeddings = ds.dataset(out / "rounds" / "0" / "embeddings", format="parquet").to_table()
    quarantine = ds.dataset(out / "quarantine", format="parquet").to_table()
    # The fixture shard reuses keys of shard 00000: the corpus-wide key check keeps them there
    # and quarantines them in 00077 as duplicate_key (member null, detail naming 00000).
    crossed = metrics["rounds"]["0"]["keys"]["by_shard"]
    assert set(crossed) == {"00077"}
    assert embeddings.num_rows == embed["embedded"] - crossed["00077"]
    assert quarantine.num_rows == embed["quarantined"] + crossed["00077"]

    # Every sample of the input is in exactly one of the two tables (identity: (shard, key)).
    emb_keys = list(
        zip(
            embeddings.column("shard").to_pylist(),
            embeddings.column("key").to_pylist(),
            strict=True,
        )
    )
    q_rows = quarantine.to_pylist()
    q_keys = [
        (r["shard"], r["key"])
        for r in q_rows
        if r["key"] is not None and (r["reason"] != "duplicate_key" or r["member"] is None)
    ]
    assert len(set(emb_keys)) == len(emb_keys)
    assert not set(emb_keys) & set(q_keys)
    # A repeated key keeps its first sample; the repeat is quarantined under the same key.
    duplicates = {
        (r["shard"], r["key"])
        for r in q_rows
        if r["reason"] == "duplicate_key" and r["member"] is not None
    }
    # (or, for a key shard 00000 also has, in that shard: then both 00077 groups are quarantined)
    assert duplicates and duplicates <= set(emb_keys) | set(q_keys)
    assert set(emb_keys) | set(q_keys) == _all_keys(corpus["shards"][:-1])

    # The corrupt fixture shard: its reasons are all there, counted exactly.
    bad = quarantine.filter(pa.compute.equal(quarantine.column("shard"), "00077")).to_pandas()
    expected = corpus["corrupt_expected"]
    reasons = dict(expected["reasons"])
    reasons["duplicate_key"] = reasons.get("duplicate_key", 0) + crossed["00077"]
    assert bad["reason"].astype(str).value_counts().to_dict() == reasons
    assert (
        bad[bad["member"].isna() & (bad["reason"] == "duplicate_key")]["detail"]
        .str.contains("'00000'")
        .all()
    )
    bad_emb = embeddings.filter(pa.compute.equal(embeddings.column("shard"), "00077"))
    assert bad_emb.num_rows == expected["good"] - crossed["00077"]

    # The unreadable shard is reported with its path, not embedded, and quarantined as a shard.
    assert [f["path"] for f in embed["shards_failed"]] == [corpus["garbage"]]
    garbage_rows = quarantine.filter(pa.compute.equal(quarantine.column("shard"), "00078"))
    assert garbage_rows.column("reason").to_pylist() == ["unreadable_shard"]
    assert not (out / "rounds" / "0" / "embeddings" / "00078.parquet").exists()

    # Schema and values.
    schema = pq.read_schema(out / "rounds" / "0" / "embeddings" / "00000.parquet")
    assert schema.field("image_embedding_a").type == pa.list_(pa.float16(), 128)
    assert schema.metadata[b"ncl.schema"] == b"embeddings.v1"
    image = np.stack(embeddings.column("image_embedding_a").to_numpy(zero_copy_only=False)).astype(
        np.float32
    )
    np.testing.assert_allclose(np.linalg.norm(image, axis=1), 1.0, atol=2e-3)
    for column in ("loss_i2t_a", "loss_t2i_a", "loss_triplet_a", "cosine_a"):
        values = embeddings.column(column).to_numpy()
        assert np.isfinite(values).all(), column
    assert (embeddings.column("loss_batch").to_numpy() >= 0).all()
    # image_sha256: the hex sha256 of the image member's bytes as stored in the tar.
    digests = {}
    for path in corpus["shards"][:-1]:
        for item in iter_shard_records(path):
            images = [e for e in IMAGE_EXTENSIONS if e in getattr(item, "members", {})]
            if isinstance(item, RawRecord) and images:  # the member decode_record picks
                digest = hashlib.sha256(item.members[images[0]]).hexdigest()
                digests[(shard_name(path), item.key)] = digest
    assert embeddings.column("image_sha256").to_pylist() == [digests[k] for k in emb_keys]
    # With b = 16 negatives, an untrained model's InfoNCE sits near log(16).
    assert abs(np.median(embeddings.column("loss_i2t_a").to_numpy()) - np.log(16)) < 0.5
    assert embed["records_read"] == embed["embedded"] + embed["quarantined"] - 1  # + unreadable


def test_rerun_skips_complete_shards_and_redoes_partial_ones(local_ray, corpus, tmp_path):
    """One rerun covers both sides: complete shards are left untouched (same mtime), a shard
    whose write was cut off (only its temporary file is left) is recomputed identically. A
    rerun without any change is tests/test_rerun.py's first case."""
    shards = corpus["shards"][:3]
    job = load_job(_write_job(tmp_path, shards))
    first = run_job(job, until="round0/embed")["rounds"]["0"]["embed"]
    emb_dir = Path(job.output) / "rounds" / "0" / "embeddings"
    done = emb_dir / "00001.parquet"
    reference = pq.read_table(done)
    done.unlink()
    (emb_dir / "00001.parquet.tmp-deadbeef").write_bytes(b"partial")
    before = {p.name: p.stat().st_mtime_ns for p in emb_dir.glob("*.parquet")}
    assert len(before) == 2

    again = run_job(job, until="round0/embed")["rounds"]["0"]["embed"]
    assert again["shards_skipped"] == 2 and again["embedded"] == reference.num_rows
    after = {p.name: p.stat().st_mtime_ns for p in emb_dir.glob("*.parquet")}
    assert {name: after[name] for name in before} == before
    assert pq.read_table(done).equals(reference)
    assert first["embedded"] == sum(pq.read_metadata(p).num_rows for p in emb_dir.glob("*.parquet"))


def test_until_names_a_stage_of_the_job(local_ray, corpus, tmp_path):
    from pipeline.config import JobConfigError

    job = load_job(_write_job(tmp_path, corpus["shards"][:1]))
    with pytest.raises(JobConfigError, match=r"until='round9/embed' is not a stage.*round0/keys"):
        run_job(job, until="round9/embed")


def test_changed_configuration_recomputes_the_embeddings(local_ray, corpus, tmp_path):
    """A changed seed is no conflict any more: a rerun recomputes the embeddings and everything
    after them (what `ncl-pipeline status --job` predicts; tests/test_rerun.py runs reruns)."""
    from pipeline.run.status import predict_rerun

    path = _write_job(tmp_path, corpus["shards"][:1])
    run_job(load_job(path))
    job = load_job(path, ["seed=4"])
    decisions = predict_rerun(job.output, job).decisions
    assert decisions["round0/embed"].describe() == "recomputed because seed changed"
    assert not any(d.reuse for d in decisions.values())
    assert all(d.reuse for d in predict_rerun(job.output, load_job(path)).decisions.values())


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # '::ffff:127.0.0.1' is IPv4 loopback
    return (mapped or address).is_loopback


def test_local_ray_listens_on_loopback_only(local_ray):
    import psutil

    ray_pids = {
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("ray" in part for part in (p.info["cmdline"] or []))
    }
    listening = [
        c
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ray_pids and c.pid != os.getpid()
    ]
    assert listening, "expected Ray processes to listen on some port"
    exposed = [(c.laddr.ip, c.laddr.port) for c in listening if not _is_loopback(c.laddr.ip)]
    assert not exposed, f"Ray listens beyond loopback: {exposed}"


def test_a_pooled_worker_reloads_a_checkpoint_rewritten_in_place(tmp_path):
    """The CPU pass's task keeps its models between calls in one worker process; a checkpoint
    rewritten at the same path (a round retrained by a rerun) must be loaded anew, not served
    from that cache. Runs the task function in this process, as a pooled worker would."""
    from pipeline.io.checkpoints import save_torch_atomic
    from pipeline.models import ModelSpec, load_clip
    from pipeline.stages.embed import EmbedSpec, embed_shards_on_cpu

    summary = make_corpus(
        tmp_path / "corpus", samples=24, samples_per_shard=24, test_samples=0, image_size=32
    )
    checkpoint = tmp_path / "model.pt"

    def embed_with(seed: int, output: Path) -> np.ndarray:
        save_torch_atomic(
            load_clip(ModelSpec("ncl-tiny", None, seed=seed)).model.state_dict(), str(checkpoint)
        )
        spec = EmbedSpec(
            output=str(output),
            round_index=0,
            views={"a": ModelSpec("ncl-tiny", str(checkpoint))},
            seed=0,
            embed=EmbedConfig(decode="cpu"),  # as run_embed_pass resolves auto on CPU
            device="cpu",
        )
        rows = embed_shards_on_cpu({"path": np.array([summary.shards[0]])}, spec)
        assert rows["embedded"].tolist() == [24]
        table = pq.read_table(output / "rounds" / "0" / "embeddings" / "00000.parquet")
        return table.column("cosine_a").to_numpy()

    first = embed_with(0, tmp_path / "first")
    assert np.array_equal(embed_with(0, tmp_path / "again"), first)  # same file: same model
    rewritten = embed_with(1, tmp_path / "rewritten")
    fresh = embed_with(1, tmp_path / "fresh")
    assert not np.allclose(rewritten, first)
    assert np.array_equal(rewritten, fresh)
