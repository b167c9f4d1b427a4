"""Broken, changed and repeated shards (issue 14): a run publishes the good shards, stops when
too many fail, keeps every key in one shard only, and explains worker failures in a paragraph."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_job import invoke_cli
from shared_run import PAIRS_PER_SHARD, write_corpus, write_job

from pipeline.clients.read import labels_folder
from pipeline.config import JobConfigError, load_job
from pipeline.errors import RunFailedError
from pipeline.io.admitted import (
    SHARD_BYTES_KEY,
    SHARD_SHA256_KEY,
    ShardReference,
    fingerprint_change,
    read_embeddings_footer,
    read_reference,
)
from pipeline.io.layout import STAGE_KEY_META
from pipeline.io.shards import ShardReadError, ShardReadStats, iter_shard_records
from pipeline.run.failures import explain_failure
from pipeline.run.runner import run_job
from pipeline.run.status import predict_rerun

HTML = b"<!DOCTYPE html><html><body><h1>503 Service Unavailable</h1></body></html>\n"


def _job(tmp: Path, corpus: Path, name: str, *overrides: str, warmup: int = 0):
    """The shared job on every shard in `corpus` (copies without the ground truth, so no
    held-out evaluation); no warm-up unless asked: only the test of a shard changed during
    training needs one."""
    return load_job(
        write_job(
            corpus,
            tmp / name,
            f"input.shards={corpus}/*.tar",
            f"train.warmup_epochs={warmup}",
            "eval.ground_truth=null",
            "eval.test_shards=null",
            *overrides,
        )
    )


@pytest.fixture(scope="module")
def clean_corpus(tmp_path_factory) -> Path:
    """The shared corpus's shards (tests/shared_run.py): 00000-00003, 80 pairs each."""
    return write_corpus(tmp_path_factory.mktemp("broken") / "clean")


def _copy_shards(clean: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for tar in sorted(clean.glob("*.tar")):
        shutil.copy(tar, dest / tar.name)
    return dest


def _sample_keys(path: Path) -> set[str]:
    return {r.key for r in iter_shard_records(str(path)) if r.key is not None}


def _published(out: Path) -> Path:
    """The generation of labels/ that readers see."""
    return Path(labels_folder(out)[1])


def _account(out: Path, readable: dict[str, set[str]]) -> None:
    """labels/ + quarantine/ hold every sample of every readable shard exactly once."""
    seen_label_keys: set[str] = set()
    for shard, keys in readable.items():
        labelled = pq.read_table(_published(out) / f"{shard}.parquet").column("key").to_pylist()
        quarantine = pq.read_table(out / "quarantine" / f"{shard}.parquet")
        quarantined = [k for k in quarantine.column("key").to_pylist() if k is not None]
        assert sorted(labelled + quarantined) == sorted(keys), shard
        assert not seen_label_keys & set(labelled), f"a key of {shard} is in two label files"
        seen_label_keys |= set(labelled)
    assert sorted(p.stem for p in _published(out).glob("*.parquet")) == sorted(readable)


# ------------------------------------------------------------------------------- fast checks


def test_max_failed_shards_is_a_count_or_a_fraction(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    assert _job(tmp_path, corpus, "a").input.failed_shards_allowed(10) == 1  # 5 %, rounded up
    job = _job(tmp_path, corpus, "b", "input.max_failed_shards=3")
    assert job.input.failed_shards_allowed(1000) == 3
    job = _job(tmp_path, corpus, "c", "input.max_failed_shards=0.1")
    assert job.input.failed_shards_allowed(1000) == 100
    with pytest.raises(JobConfigError, match="max_failed_shards"):
        _job(tmp_path, corpus, "d", "input.max_failed_shards=1.5")


def test_the_reader_fingerprints_the_bytes_it_read(clean_corpus, tmp_path):
    plain = clean_corpus / "00000.tar"
    packed = tmp_path / "00000.tar"  # gzip-compressed, still named .tar
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        stats = ShardReadStats()
        keys = [r.key for r in iter_shard_records(str(path), stats)]
        assert len(keys) == PAIRS_PER_SHARD and not stats.error
        data = path.read_bytes()
        assert (stats.size, stats.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    data = packed.read_bytes()
    reference = ShardReference(frozenset(), len(data), hashlib.sha256(data).hexdigest())
    assert fingerprint_change(str(plain), reference, stats.size, stats.sha256) is None
    changed = fingerprint_change(str(plain), reference, stats.size + 1, "0" * 64)
    assert changed and "changed after its embed pass" in changed


def test_the_embeddings_footer_is_read_without_the_data(tmp_path):
    import pyarrow as pa

    from pipeline.io.tables import embedding_schema

    meta = {STAGE_KEY_META: "k1", SHARD_BYTES_KEY: "1234", SHARD_SHA256_KEY: "ab" * 32}
    schema = embedding_schema(["a"], 4, {**meta, "ncl.logit_scale.a": "14.3"})
    rows = {field.name: [] for field in schema}
    for i in range(3):
        rows["key"].append(f"k{i}")
        rows["shard"].append("00000")
        rows["url"].append(None)
        rows["caption"].append("c")
        rows["image_sha256"].append(None)
        rows["uid"].append(None)
        rows["loss_batch"].append(0)
        for name in ("image_embedding_a", "text_embedding_a"):
            rows[name].append([0.5] * 4)
        for name in ("cosine_a", "loss_i2t_a", "loss_t2i_a", "loss_triplet_a"):
            rows[name].append(0.1)
    path = tmp_path / "00000.parquet"
    pq.write_table(pa.table(rows, schema=schema), path)
    footer = read_embeddings_footer(str(path))
    assert (footer.rows, footer.stage_key, footer.shard_bytes) == (3, "k1", 1234)
    assert footer.shard_sha256 == "ab" * 32 and footer.meta["ncl.logit_scale.a"] == "14.3"
    reference = read_reference(str(path))  # the same footer, read with the key column
    assert (reference.size, reference.sha256, len(reference.keys)) == (1234, "ab" * 32, 3)
    assert read_embeddings_footer(str(tmp_path / "missing.parquet")) is None
    pq.write_table(pa.table(rows, schema=embedding_schema(["a"], 4)), path)  # nothing recorded
    bare = read_embeddings_footer(str(path))
    assert (bare.stage_key, bare.shard_bytes, bare.shard_sha256) == ("", None, None)


def test_a_worker_failure_is_one_paragraph_and_a_log_file(local_ray, tmp_path):
    broken = tmp_path / "00042.tar"
    broken.write_bytes(HTML)

    @local_ray.remote(max_retries=0)
    def read(path):
        return list(iter_shard_records(path))

    with pytest.raises(Exception) as caught:
        local_ray.get(read.remote(str(broken)))
    error = explain_failure(caught.value, "the warm-up (round 0 training)", str(tmp_path / "run"))
    assert isinstance(error, RunFailedError)
    message = str(error)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith("the warm-up (round 0 training) failed: ShardReadError")
    assert str(broken) in message and error.log_path in message
    log = Path(error.log_path).read_text()
    assert "Traceback" in log and "ShardReadError" in log


# ------------------------------------------------------------------------------- end to end


@pytest.mark.ray
@pytest.mark.slow
def test_broken_shards_are_left_out_and_repeated_keys_kept_once(
    local_ray, clean_corpus, tmp_path, monkeypatch
):
    import pipeline.stages.keys as keys_stage

    monkeypatch.setattr(keys_stage, "KEYS_PER_PARTITION", 50)  # several hash partitions
    corpus = _copy_shards(clean_corpus, tmp_path / "corpus")
    (corpus / "00004.tar").write_bytes(b"")  # an interrupted download
    (corpus / "00005.tar").write_bytes(HTML)  # an error page saved as a shard
    packed = gzip.compress((corpus / "00003.tar").read_bytes())
    (corpus / "00003.tar").write_bytes(packed)  # gzip-compressed, named .tar: valid
    shutil.copy(corpus / "00002.tar", corpus / "00006.tar")  # two downloads merged

    # Two of seven shards fail: more than the default 5 % allows -> stop after the embed pass,
    # with exit status 3 (run through the command line).
    _job(tmp_path, corpus, "run")
    code, shown = invoke_cli("run", str(tmp_path / "run.yaml"))
    assert code == 3, shown[-3000:]
    assert "error: 2 of 7 shards could not be read" in shown
    assert "00004.tar" in shown and "00005.tar" in shown
    assert not (tmp_path / "run" / "labels").exists()
    assert (tmp_path / "run" / "rounds" / "0" / "embeddings" / "00006.parquet").exists()

    # Allowed: the same output resumes, retries the two and publishes the other eight.
    metrics = run_job(_job(tmp_path, corpus, "run", "input.max_failed_shards=2"))
    out = tmp_path / "run"
    for failed in ("00004", "00005"):
        rows = pq.read_table(out / "quarantine" / f"{failed}.parquet").to_pylist()
        assert [r["reason"] for r in rows] == ["unreadable_shard"]
    manifest_shards = metrics["shards"]
    assert sorted(f["shard"] for f in manifest_shards["failed"]) == ["00004", "00005"]
    assert manifest_shards["duplicate_keys"] == {"00006": PAIRS_PER_SHARD}

    copied = pq.read_table(out / "quarantine" / "00006.parquet").to_pylist()
    assert len(copied) == PAIRS_PER_SHARD and {r["reason"] for r in copied} == {"duplicate_key"}
    assert all("'00002'" in r["detail"] for r in copied)
    readable = {
        p.stem: _sample_keys(p)
        for p in sorted(corpus.glob("*.tar"))
        if p.stem not in ("00004", "00005")
    }
    assert len(readable["00003"]) == PAIRS_PER_SHARD
    _account(out, readable)
    assert pq.read_metadata(_published(out) / "00006.parquet").num_rows == 0


@pytest.mark.ray
@pytest.mark.slow
def test_a_shard_deleted_after_the_embed_pass_is_reported_not_mixed(
    local_ray, clean_corpus, tmp_path, monkeypatch
):
    import pipeline.stages.keys as keys_stage

    corpus = _copy_shards(clean_corpus, tmp_path / "corpus")
    original = keys_stage.run_key_check

    def then_delete(output, shards, **kwargs):
        result = original(output, shards, **kwargs)
        (corpus / "00003.tar").unlink()  # between the embed pass and the next one
        return result

    monkeypatch.setattr(keys_stage, "run_key_check", then_delete)
    metrics = run_job(_job(tmp_path, corpus, "run"))
    out = tmp_path / "run"
    changed = metrics["shards"]["changed"]
    assert [c["shard"] for c in changed] == ["00003"] and "disappeared" in changed[0]["error"]
    readable = {p.stem: _sample_keys(p) for p in sorted(corpus.glob("*.tar"))}
    assert "00003" not in readable and len(readable) == 3
    _account(out, readable)
    with pytest.raises(ShardReadError):
        list(iter_shard_records(str(tmp_path / "corpus" / "00003.tar")))
    assert read_reference(str(out / "rounds/0/embeddings/00000.parquet")).sha256


@pytest.mark.ray
@pytest.mark.slow
def test_a_shard_changed_in_place_stops_training_with_one_paragraph(
    local_ray, clean_corpus, tmp_path, monkeypatch, capfd
):
    import pipeline.stages.keys as keys_stage

    corpus = _copy_shards(clean_corpus, tmp_path / "corpus")
    original = keys_stage.run_key_check

    def then_touch(output, shards, **kwargs):
        result = original(output, shards, **kwargs)
        data = bytearray((corpus / "00001.tar").read_bytes())
        data[-1] ^= 1  # same size, same samples, other bytes (in the end-of-archive padding)
        (corpus / "00001.tar").write_bytes(bytes(data))
        return result

    monkeypatch.setattr(keys_stage, "run_key_check", then_touch)
    with pytest.raises(RunFailedError) as failed:
        run_job(_job(tmp_path, corpus, "run", warmup=1))
    message = str(failed.value)
    assert message.startswith("the warm-up (round 0 training) failed: ShardChangedError: shard ")
    assert "00001.tar" in message and "\n" not in message
    assert failed.value.log_path in message and Path(failed.value.log_path).exists()
    assert "raised on a training worker" in Path(failed.value.log_path).read_text()
    assert not (tmp_path / "run" / "labels").exists()
    # Not retried: the changed shard would fail every retry (train.max_failures is 3); the one
    # worker's task records the error and ends, so no retry starts.
    record = json.loads((tmp_path / "run" / "rounds/0/checkpoints/train_error.json").read_text())
    assert record["type"] == "ShardChangedError" and "restarts_ended" not in record
    # Ray's own reports of the failure (a traceback per layer) stay off the terminal.
    shown = "\n".join(capfd.readouterr())
    for ray_report in ("Error in training function", "[FailurePolicy]", "Full stack trace"):
        assert ray_report not in shown
    assert "ShardChangedError" not in shown

    # The rerun the message asks for embeds the rewritten shard again (its name and size, hence
    # its key, are unchanged) and only it: a shard copied over itself byte for byte is reused.
    shutil.copy(corpus / "00002.tar", tmp_path / "same.tar")
    shutil.move(tmp_path / "same.tar", corpus / "00002.tar")  # another inode and mtime
    monkeypatch.setattr(keys_stage, "run_key_check", original)
    job = _job(tmp_path, corpus, "run", warmup=1)
    embed = predict_rerun(str(tmp_path / "run"), job).decisions["round0/embed"]
    assert embed.reason == "input shards changed (rewritten since their embed pass: 00001)"
    metrics = run_job(job)
    assert metrics["rounds"]["0"]["embed"]["shards_skipped"] == len(list(corpus.glob("*.tar"))) - 1
    recorded = read_reference(str(tmp_path / "run" / "rounds/0/embeddings/00001.parquet"))
    assert recorded.sha256 == hashlib.sha256((corpus / "00001.tar").read_bytes()).hexdigest()
    assert (tmp_path / "run" / "labels").exists()
