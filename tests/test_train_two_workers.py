"""Two DDP workers (gloo, CPU) on a local Ray with enough logical CPUs: every decision that ends
or changes the loop is shared, so a warm-up with selection stopped by patience (only rank 0
holds the validation split) and a co-teaching round whose loss leaves the temperature without a
gradient both end by themselves, on the same epoch for both ranks.

The run happens in a child process with its own Ray (4 logical CPUs: two workers plus one
Ray Data reader each; the session's Ray has 2) under a timeout: a rank left alone in a
collective hangs rather than fails, and a hang must fail the test. While it trains, the child
records every listening TCP socket of itself and its descendants (Ray's processes, the
training workers with torch's rendezvous store and gloo): all must be on loopback.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from log_capture import printed_before_timeout

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.own_ray]

REPO = Path(__file__).resolve().parents[1]
MAX_WARMUP_EPOCHS = 6


def _specs(corpus: Path, output: Path):
    from pipeline.config import TrainConfig
    from pipeline.io.shards import shard_name
    from pipeline.models import ModelSpec
    from pipeline.stages.train import TrainSpec, ViewSpec

    shards = tuple(str(p) for p in sorted(corpus.glob("0*.tar")))
    train = TrainConfig.model_validate(
        {
            "workers": 2,
            "batch_size": 16,
            "lr": 3e-3,
            "weight_decay": 0.1,
            "torch_threads": 1,
            "checkpoint_every_steps": 0,
            "label_loss": "soft_margin_triplet",  # the temperature gets no gradient
            "warmup": {
                "mode": "select",
                "first_epoch_all": False,
                "plateau_fraction": 0.99,
                "patience": 1,
            },
        }
    )
    # One view keeps the test lean: the decisions under test are per view anyway.
    views = (ViewSpec(name="A", init=ModelSpec("ncl-tiny", None, "fp32", seed=0), seed=0),)
    warmup = TrainSpec(
        output=str(output),
        round_index=0,
        views=views,
        shards=shards,
        shard_sizes={shard_name(p): 64 for p in shards},
        val_shards=(str(corpus / "val" / "00000.tar"),),
        train=train,
        round_kind="warmup",
        max_epochs=MAX_WARMUP_EPOCHS,
    )
    return warmup, views


def _listening(found: dict) -> None:
    """Add every listening TCP socket of this process and its descendants to `found`."""
    import psutil

    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            for c in proc.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found[f"{c.laddr.ip} {c.laddr.port}"] = " ".join(proc.cmdline()[:3])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def _watch_sockets(found: dict, stop: threading.Event, handlers: set) -> None:
    while not stop.wait(0.1):
        _listening(found)
        handlers.add(_handler_name())


def _scenario(corpus: Path, output: Path, sockets: Path) -> None:
    """The child process: its own local Ray, the warm-up, then one co-teaching round; the
    listening sockets seen before training and while it ran, into `sockets` (JSON)."""
    from pipeline.runtime.ray import init_ray

    init_ray(None, num_cpus=4)
    signal.signal(signal.SIGINT, _ours)
    handlers: set = set()
    before: dict = {}
    _listening(before)
    during: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_sockets, args=(during, stop, handlers), daemon=True)
    watcher.start()
    try:
        _train(corpus, output)
    finally:
        stop.set()
        watcher.join()
        handlers.add(_handler_name())
        record = {"before": before, "during": during, "sigint": sorted(handlers)}
        sockets.write_text(json.dumps(record))


def _handler_name() -> str:
    handler = signal.getsignal(signal.SIGINT)
    return getattr(handler, "__qualname__", repr(handler))


def _ours(signum, frame) -> None:
    """The process's SIGINT handler while it trains: Ray Train must never replace it."""


def _train(corpus: Path, output: Path) -> None:
    from pipeline.io.layout import RunLayout
    from pipeline.models import ModelSpec
    from pipeline.stages.train import run_training

    warmup, views = _specs(corpus, output)
    run_training(warmup)
    layout = RunLayout(str(output))
    coteach = dataclasses.replace(
        warmup,
        round_index=1,
        round_kind="labels",
        max_epochs=1,
        coteach_epochs=(0, 1),
        views=tuple(
            dataclasses.replace(
                v, init=ModelSpec("ncl-tiny", layout.model_checkpoint(0, v.name), "fp32")
            )
            for v in views
        ),
    )
    run_training(coteach)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from pipeline.data.synthetic import make_corpus

    root = tmp_path_factory.mktemp("two_workers") / "c"
    make_corpus(
        root,
        samples=256,
        noise=0.2,
        partial=0.0,
        seed=11,
        samples_per_shard=64,
        test_samples=0,
        val_samples=40,
        image_size=32,
    )
    return root


def test_two_workers_share_every_decision_and_end_by_themselves(corpus, tmp_path):
    import torch

    from pipeline.io.layout import RunLayout
    from pipeline.models import ModelSpec, load_clip

    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    sockets = tmp_path / "sockets.json"
    try:
        done = subprocess.run(
            [sys.executable, __file__, str(corpus), str(tmp_path / "run"), str(sockets)],
            env=env,
            capture_output=True,
            text=True,
            timeout=540,  # under the suite's 600 s per test: a hang fails here, with its log
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        log = printed_before_timeout(exc)
        pytest.fail(f"two-worker training did not end by itself:\n{log}")
    assert done.returncode == 0, done.stderr[-4000:]
    layout = RunLayout(str(tmp_path / "run"))
    warm = json.loads(Path(layout.train_summary(0)).read_text())
    state = warm["views"]["A"]["warmup"]
    assert state["left_plateau"], state  # selection was on for the later epochs
    assert "did not improve" in state["reason"], state  # stopped by patience (rank 0's rSum)...
    assert warm["views"]["A"]["epochs"] < MAX_WARMUP_EPOCHS  # ...before the maximum
    # Epoch figures are pooled over both ranks: 4 shards of 64 pairs.
    assert all(h["pairs"] == 256 for h in warm["views"]["A"]["history"]), warm
    rounds = json.loads(Path(layout.train_summary(1)).read_text())
    assert rounds["views"]["A"]["epochs"] == 1
    assert rounds["views"]["A"]["steps"] == 256 // (2 * 16)  # 16 pairs per rank and step
    for round_index in (0, 1):
        path = layout.model_checkpoint(round_index, "A")
        loaded = load_clip(ModelSpec("ncl-tiny", path, "fp32"), torch.device("cpu"))
        assert loaded.embed_dim > 0
    # Every port of the run (Ray's and the training's) listens on loopback only.
    seen = json.loads(sockets.read_text())
    opened = set(seen["during"]) - set(seen["before"])
    # The training workers' own (the rendezvous store, gloo), not only Ray's core workers'.
    assert any(seen["during"][s].startswith("ray::RayTrainWorker") for s in opened), seen
    exposed = {s: who for s, who in seen["during"].items() if not _is_loopback(s.split(" ")[0])} | {
        s: who for s, who in seen["before"].items() if not _is_loopback(s.split(" ")[0])
    }
    assert not exposed, f"listening beyond loopback: {exposed}"
    # Ray Train's fit never replaced the process's SIGINT handler (it runs off the main thread).
    assert seen["sigint"] == ["_ours"], seen["sigint"]


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # '::ffff:127.0.0.1' is IPv4 loopback
    return (mapped or address).is_loopback


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
