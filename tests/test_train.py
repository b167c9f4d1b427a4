"""Warm-up of two models on Ray Train: learning, retrieval above chance, checkpoint resume."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.data.synthetic import make_corpus
from pipeline.io.layout import RunLayout
from pipeline.io.shards import shard_name
from pipeline.models import ModelSpec
from pipeline.stages.train import TrainSpec, ViewSpec, epoch_shard_order, run_training

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(
        tmp_path_factory.mktemp("train") / "c",
        samples=640,
        noise=0.2,
        partial=0.0,
        seed=5,
        samples_per_shard=160,
        test_samples=100,
    )


def _spec(corpus, output: Path, **changes) -> TrainSpec:
    views = tuple(
        ViewSpec(name=name, init=ModelSpec("ncl-tiny", None, "fp32", seed=seed), seed=seed)
        for name, seed in (("A", 0), ("B", 1))
    )
    spec = TrainSpec(
        output=str(output),
        round_index=0,
        views=views,
        shards=tuple(str(p) for p in corpus.shards),
        shard_sizes={shard_name(str(p)): 160 for p in corpus.shards},
        test_shards=tuple(str(p) for p in corpus.test_shards),
        round_kind="warmup",
        max_epochs=4,
        train=TrainConfig.model_validate(
            {
                "batch_size": 64,
                "lr": 1e-3,
                "weight_decay": 0.1,
                "grad_clip": 1.0,
                "warmup": {"patience": 10},
                "checkpoint_every_steps": 3,
                "max_failures": 0,  # the resume test fails on purpose and reruns itself
            }
        ),
    )
    return dataclasses.replace(spec, **changes)


def test_epoch_order_is_seeded_per_view_and_epoch():
    shards = tuple(f"/d/{i:05d}.tar" for i in range(20))
    assert epoch_shard_order(shards, 0, 0) == epoch_shard_order(shards, 0, 0)
    assert epoch_shard_order(shards, 0, 0) != epoch_shard_order(shards, 1, 0)
    assert epoch_shard_order(shards, 0, 0) != epoch_shard_order(shards, 0, 1)
    assert sorted(epoch_shard_order(shards, 3, 2)) == list(shards)


EPOCHS = 2  # the loss drops by 0.4-0.6 and rSum reaches ~120 (chance 32) in two epochs here


@pytest.fixture(scope="module")
def warmed(local_ray, corpus, tmp_path_factory) -> tuple[Path, dict]:
    """One undisturbed warm-up: the learning test reads it, the resume test compares with it
    (a training round costs seconds of start-up here, so the two share one)."""
    output = tmp_path_factory.mktemp("warmup")
    sigint = signal.getsignal(signal.SIGINT)
    summary = run_training(_spec(corpus, output, max_epochs=EPOCHS))
    assert signal.getsignal(signal.SIGINT) is sigint
    return output, summary


def test_warmup_learns_and_beats_chance_retrieval(warmed):
    output, summary = warmed
    for view in ("A", "B"):
        history = summary["views"][view]["history"]
        assert len(history) == EPOCHS
        assert history[-1]["loss"] < history[0]["loss"] - 0.2, history
        assert Path(summary["views"][view]["checkpoint"]).exists()
    # Chance for 100 test pairs: R@K = K%, so rSum = 2 * (1 + 5 + 10) = 32.
    retrieval = summary["retrieval"]
    assert set(retrieval) == {"A", "B", "A+B"}
    assert retrieval["A+B"]["rsum"] > 2 * 32, retrieval
    # A and B started from different seeds and saw different orders: different weights.
    a = torch.load(RunLayout(str(output)).model_checkpoint(0, "A"), weights_only=True)
    b = torch.load(RunLayout(str(output)).model_checkpoint(0, "B"), weights_only=True)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_one_worker_trains_without_ray_train(warmed):
    """A one-worker round runs its loop in one Ray task: Ray Train (whose controller and worker
    group cost seconds per round and set up nothing for one worker) keeps no storage for it."""
    output, _ = warmed
    assert not (Path(RunLayout(str(output)).round_dir(0)) / "ray_train").exists()


def test_a_finished_round_keeps_only_its_weights(warmed):
    """After train_summary.json, a round's resume state and best-epoch copy are removed: a
    finished round is never resumed, and model.pt holds the weights it kept."""
    output, _ = warmed
    for view in ("A", "B"):
        folder = Path(RunLayout(str(output)).model_checkpoint(0, view)).parent
        assert sorted(p.name for p in folder.iterdir()) == ["model.pt"]


def test_resume_after_a_failure_mid_epoch_gives_identical_weights(corpus, warmed, tmp_path):
    """A run killed mid-epoch resumes from its last step checkpoint and skips the consumed
    batches; the data order is a pure function of (seed, epoch), so the result is bit-identical
    to an uninterrupted run (CPU, deterministic kernels)."""
    reference, _ = warmed
    resumed = tmp_path / "resumed"
    with pytest.raises(Exception, match="injected failure"):
        run_training(_spec(corpus, resumed, max_epochs=EPOCHS, fail_after_steps=5))
    state = torch.load(RunLayout(str(resumed)).resume_state(0, "A"), weights_only=True)
    assert state["step"] == 3 and state["epoch"] == 0  # the checkpoint before the failure
    # The views' states are separate files: a worker lost between A's save and B's leaves B
    # behind. Each view must resume from its own step (B here from the start).
    Path(RunLayout(str(resumed)).resume_state(0, "B")).unlink()
    summary = run_training(_spec(corpus, resumed, max_epochs=EPOCHS))

    assert summary["views"]["A"]["steps"] == summary["views"]["B"]["steps"] == EPOCHS * (640 // 64)
    for view in ("A", "B"):
        want = torch.load(RunLayout(str(reference)).model_checkpoint(0, view), weights_only=True)
        got = torch.load(RunLayout(str(resumed)).model_checkpoint(0, view), weights_only=True)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
