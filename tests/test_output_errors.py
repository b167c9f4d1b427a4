"""Errors that name the real cause (issue 37 item 4): a full disk, a quota, no permission or a
read-only filesystem while writing the output say which path, what was being written, how
much the remaining stages need and that a rerun resumes; the shard advice appears only when a
shard is at fault; a preflight warns when the output's free space is below the estimate."""

from __future__ import annotations

import errno

import pytest
from shared_run import write_corpus

from pipeline.config import load_job
from pipeline.io.shards import ShardReadError
from pipeline.run import runner, space
from pipeline.run.failures import explain_failure
from pipeline.run.graph import stage_graph

SHARD_ADVICE = "shard named above"
STAGE = "the warm-up (round 0 training)"


def _message(exc: BaseException, output: str, note=None) -> str:
    return str(explain_failure(exc, STAGE, output, space_note=note))


def test_a_full_disk_names_the_path_the_space_needed_and_the_rerun(tmp_path):
    out = str(tmp_path / "run")
    target = f"{out}/rounds/0/checkpoints/A/model.pt"
    message = _message(
        OSError(errno.ENOSPC, "No space left on device", target), out, lambda: "Needs 3 GB."
    )
    assert message.startswith(f"{STAGE} failed: the output's filesystem is full")
    assert target in message and "Needs 3 GB." in message
    assert "rerun the same command" in message and "resumes" in message
    assert SHARD_ADVICE not in message and "input.shards" not in message
    # A write that fills the disk often has no path: the output is named instead.
    message = _message(OSError(errno.ENOSPC, "No space left on device"), out)
    assert f"writing its outputs to {out}." in message and SHARD_ADVICE not in message
    quota = _message(OSError(errno.EDQUOT, "Disk quota exceeded"), out, lambda: "Needs 1 GB.")
    assert "quota" in quota and "Needs 1 GB." in quota


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_an_unwritable_output_says_so(tmp_path, code):
    out = str(tmp_path / "run")
    message = _message(OSError(code, "denied", f"{out}/metrics.json"), out, lambda: "unused")
    assert ("permission denied" in message) or ("read-only" in message)
    assert f"{out}/metrics.json" in message and "Make it writable" in message
    assert "unused" not in message and SHARD_ADVICE not in message


def test_the_shard_advice_only_when_a_shard_is_at_fault(tmp_path):
    out = str(tmp_path / "run")
    assert SHARD_ADVICE in _message(ShardReadError("cannot open shard '/d/00001.tar'"), out)
    # issue 37: a run-directory file another run was rewriting is no shard's fault.
    missing = f"{out}/rounds/2/labels_b/00001.parquet"
    message = _message(FileNotFoundError(errno.ENOENT, "No such file", missing), out)
    assert SHARD_ADVICE not in message and "input.shards" not in message
    assert "file of the run directory" in message
    shard = _message(PermissionError(errno.EACCES, "denied", "/data/00003.tar"), out)
    assert "/data/00003.tar is readable" in shard  # not in the output: an input


def test_the_preflight_warns_below_the_estimate(tmp_path, caplog, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")
    shards = [str(corpus / "00000.tar"), str(corpus / "00001.tar")]
    assert space.count_pairs(shards) == 160  # from the img2dataset _stats.json files
    job = load_job(
        "jobs/demo.yaml", [f"output={tmp_path / 'run'}", f"input.shards={corpus}/0000[01].tar"]
    )
    layout = runner.RunLayout(job.output)
    need = space.estimate_output_bytes(job, 160)
    assert need == 160 * (2_300 + 3 * 4_400 + 3 * 2 * 1_300 + 300)  # rounds 1..3, two views
    with caplog.at_level("WARNING", logger="pipeline"):
        space.check_output_space(job, layout, shards, {})
        assert "estimated to write" not in caplog.text  # this disk has more than ~5 MB free
        monkeypatch.setattr(space, "free_bytes", lambda output: need - 1)
        space.check_output_space(job, layout, shards, {})
    assert "estimated to write 3.8 MB more" in caplog.text and "160 pairs at" in caplog.text
    done = {"round0/embed": {"status": "done"}}
    assert space.estimate_output_bytes(job, 160, done) == need - 160 * 2_300
    # A measured round's weights per training stage (the warm-up and each round), and the
    # resume state of the round in training once.
    trainings = [node for node in stage_graph(job) if node.kind in ("warmup", "train")]
    assert len(trainings) == 1 + job.train.rounds
    ckpt = space.estimate_output_bytes(job, 160, checkpoint_bytes=1_000) - need
    assert ckpt == len(trainings) * 1_000 + space.TRAINING_STATE_FACTOR * 1_000
    trained = {node.name: {"status": "done"} for node in stage_graph(job)}
    assert space.estimate_output_bytes(job, 160, trained, checkpoint_bytes=1_000) == 0


@pytest.mark.ray
def test_enospc_in_a_stage_is_one_sentence_with_the_estimate(local_ray, tmp_path, monkeypatch):
    """Through run_job: a stage raising ENOSPC (a fake stage list) ends in the message above,
    with the estimate of the stages still to run; the preflight warned first."""
    corpus = write_corpus(tmp_path / "corpus")
    job = load_job(
        "jobs/demo.yaml", [f"output={tmp_path / 'run'}", f"input.shards={corpus}/0000[01].tar"]
    )
    job = job.model_copy(update={"eval": job.eval.model_copy(update={"ground_truth": None})})

    def full_disk(run, until):
        run.stage = STAGE
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runner, "_run_stages", full_disk)
    monkeypatch.setattr(space, "free_bytes", lambda output: 1000)
    with pytest.raises(runner.RunFailedError) as failed:
        runner.run_job(job)
    message = str(failed.value)
    assert message.startswith(f"{STAGE} failed: the output's filesystem is full")
    assert "The stages still to run need about 3.8 MB more (160 pairs at" in message
    assert "rerun the same command" in message and SHARD_ADVICE not in message
    assert not (tmp_path / "run" / "_lease.json").exists()
