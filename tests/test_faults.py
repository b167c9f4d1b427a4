"""Faults on a real multi-node Ray (`ray.cluster_utils.Cluster` on loopback: a head and two
worker nodes): a lost worker node, a killed driver. The job must finish by itself (or on a
plain rerun after the driver died) with the labels of an undisturbed one-node run, and with
nothing written twice.

Every job runs as `python -m pipeline.cli run` in a subprocess (the driver). Kill points are
deterministic: the test waits for a file the stage writes (its first output table, its first
resume checkpoint) and only then removes the node that runs the stage's actor or kills the
driver. The label pass of this small job can end within a fraction of a second of its index
actors' restore tables appearing, so for that loss the driver is paused (SIGSTOP) until the lost
actor is back, which pins the loss between "the actors hold their rows" and "the pass ends".

The job has a warm-up and no co-teaching round (`train.rounds: 0`): a co-teaching round runs
the same stages again (embed, label pass, training that resumes from the same `resume.pt`
path), so one of each is what a fault can hit; a round more cost about a minute per full run
here, and this module runs four of them. Co-teaching itself is tested in
tests/test_coteach_rounds.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_job import poll_until
from shared_run import PAIRS_PER_SHARD, SHARDS, write_job

from pipeline.clients.read import read_labels

# A test's budget covers the session's reference run too (the first test sets it up).
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.own_ray, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(cli_reference) -> Path:
    return cli_reference["corpus"]


def _start(corpus: Path, output: Path, address: str | None) -> subprocess.Popen:
    job = write_job(corpus, output, f"ray.address={address or 'null'}")
    log = (output.parent / f"{output.name}.log").open("a")
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(job)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _log(output: Path, tail: int | None = 4000) -> str:
    path = output.parent / f"{output.name}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-tail:] if tail else text


def _finish(proc: subprocess.Popen, output: Path, timeout: float = 600) -> None:
    assert proc.wait(timeout=timeout) == 0, _log(output)


def _wait_for(proc: subprocess.Popen, output: Path, pattern: str, timeout: float = 400) -> None:
    """Block until files matching every `|`-separated glob (under the run directory) exist."""

    def present() -> bool:
        return all(list(output.glob(p)) for p in pattern.split("|"))

    poll_until(proc, present, pattern, lambda: _log(output), timeout, every=0.05)


def _labels(output: Path) -> pa.Table:
    table = read_labels(str(output)).to_table(columns=["key", "soft_label", "subset"])
    return table.sort_by("key")


def _assert_same_labels(got: pa.Table, want: pa.Table) -> None:
    assert got.num_rows == want.num_rows == PAIRS_PER_SHARD * SHARDS
    assert len(set(got.column("key").to_pylist())) == got.num_rows  # no key twice
    assert got.equals(want), "labels differ from the undisturbed one-node run"


@pytest.fixture(scope="module")
def reference(cli_reference) -> pa.Table:
    """The undisturbed run on one node (the driver's own local Ray): the shared job's."""
    return _labels(cli_reference["out"])


@pytest.fixture(scope="module")
def cluster(reference):
    """A head without CPUs (nothing of the job runs there, so removing a worker node always
    takes work with it) and two worker nodes, all on 127.0.0.1. Started after the reference
    run: while a cluster is up, `ray.init()` without an address joins it instead of starting
    a private local Ray."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 0,
            "node_ip_address": "127.0.0.1",
            # A removed node is declared dead after ~3 s instead of Ray's ~15 s (3 s period x
            # 5 failures); what recovers, and how, is the same.
            "_system_config": {
                "health_check_period_ms": 1000,
                "health_check_timeout_ms": 2000,
                "health_check_failure_threshold": 3,
            },
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture
def nodes(cluster):
    """Two live worker nodes before each test (a test may have removed one)."""
    while len(cluster.worker_nodes) < 2:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    return cluster


def _processes(title: str) -> list[psutil.Process]:
    """The live processes titled `title` (Ray names worker processes `ray::<Class>` or
    `ray::<Class>.<method>`)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith("ray::") and title in cmdline:
            found.append(proc)
    return found


def _node_running(cluster, title: str):
    """The worker node whose raylet is an ancestor of a process titled `title`."""
    from ray._private import ray_constants

    raylets = {
        node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: node
        for node in cluster.worker_nodes
    }
    for proc in _processes(title):
        with contextlib.suppress(psutil.Error):
            for parent in proc.parents():
                if parent.pid in raylets:
                    return raylets[parent.pid]
    raise AssertionError(f"no worker node runs a {title!r} process")


def _pause_running(proc: subprocess.Popen, output: Path, title: str, timeout: float = 400):
    """Pause (SIGSTOP) processes titled `title` and return those still titled so once stopped.
    A worker renames itself when its task ends, so a title read before the stop can be stale:
    the title read after it is what proves the task is paused mid-way."""

    def pause() -> list[psutil.Process]:
        running = []
        for worker in _processes(title):
            with contextlib.suppress(psutil.Error):
                worker.send_signal(signal.SIGSTOP)
                if title in " ".join(worker.cmdline()):
                    running.append(worker)
                else:
                    worker.send_signal(signal.SIGCONT)
        return running

    return poll_until(proc, pause, f"a {title} process", lambda: _log(output), timeout, every=0.02)


def _wait_for_new_process(title: str, before: set[int], timeout: float = 60) -> None:
    """Block until a `ray::<title>` process whose pid is not in `before` runs (a restarted
    actor, a task under way)."""
    deadline = time.monotonic() + timeout
    while not {proc.pid for proc in _processes(title)} - before:
        if time.monotonic() > deadline:
            pytest.fail(f"no new {title} process ran within {timeout}s")
        time.sleep(0.02)


# The stages in the order one job reaches them: (stage, file that shows it is under way, the
# process whose node is removed then). The embed pass is caught by its process alone: its 3
# shards' tasks can all end within a second of the first table appearing.
NODE_LOSSES = (
    ("embed", None, "embed_shards_on_cpu"),
    ("train", "rounds/0/checkpoints/A/resume.pt", "train_worker"),  # the one worker's task
    # both index actors hold their rows (restore tables written), no shard is labelled yet
    (
        "labels",
        "rounds/1/index_a/_restore/*/store_000.parquet|rounds/1/index_a/_restore/*/store_001.parquet",
        "IndexStoreActor",
    ),
)


def test_worker_nodes_lost_in_each_stage_change_no_label(nodes, corpus, reference, tmp_path):
    """One job loses a worker node during the embed pass, then during the warm-up, then during
    round 1's label pass (a fresh node joins after each loss, as an autoscaler would add one);
    it still finishes on its own (Ray Data retries the lost embed task, Ray Train restarts the
    worker group from resume.pt, index actors rebuild from their restore tables) with the
    one-node labels. (So this also shows that three nodes give the labels of one.) One job
    for the three losses: each stage's recovery is checked at its own kill point, and a
    job per stage tripled the test's time."""
    output = tmp_path / "run"
    proc = _start(corpus, output, nodes.address)
    for stage, marker, title in NODE_LOSSES:
        paused = []
        if marker is None:
            # An embed task lasts about a second per shard and its worker then idles: the
            # worker is paused mid-shard, so its node goes with that shard under way.
            paused = _pause_running(proc, output, title)
        else:
            _wait_for(proc, output, marker)
        if stage != "labels":
            nodes.remove_node(_node_running(nodes, title))
            for worker in paused:  # a stopped process would outlive its raylet
                with contextlib.suppress(psutil.Error):
                    worker.kill()
            nodes.add_node(num_cpus=2, node_ip_address="127.0.0.1")
            continue
        # The label tasks of 240 pairs take a fraction of a second once the actors hold their
        # rows: the pass could end, and its actors be killed, before the node goes. The
        # driver is paused until the lost actor is back (Ray restarts it either way).
        proc.send_signal(signal.SIGSTOP)
        try:
            before = {proc.pid for proc in _processes(title)}
            nodes.remove_node(_node_running(nodes, title))
            nodes.add_node(num_cpus=2, node_ip_address="127.0.0.1")
            _wait_for_new_process(title, before)
        finally:
            proc.send_signal(signal.SIGCONT)
    _finish(proc, output)
    _assert_same_labels(_labels(output), reference)
    # the lost index actor came back with its index (not an empty one)
    assert "index actor restarted, rebuilt" in _log(output, tail=None)


# The driver is killed (SIGKILL) when each stage is under way, one after the other: every rerun
# of the same job into the same output resumes, and the last one finishes.
DRIVER_KILLS = (
    "rounds/0/embeddings/00000.parquet",  # the round-0 embed pass
    # the warm-up: resume.pt while it trains, model.pt once it is done (resume.pt removed)
    "rounds/0/checkpoints/A/*.pt",
    "rounds/1/labels_a/0000*.parquet",  # round 1's label pass
    "labels/gen-*/0000*.parquet",  # publishing
)


def test_a_killed_driver_rerun_gives_the_same_labels(nodes, corpus, reference, tmp_path):
    output = tmp_path / "run"
    for marker in DRIVER_KILLS:
        proc = _start(corpus, output, nodes.address)
        _wait_for(proc, output, marker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    _finish(_start(corpus, output, nodes.address), output)
    got = _labels(output)
    _assert_same_labels(got, reference)
    quarantine = list((output / "quarantine").glob("*.parquet"))
    keys = [k for p in quarantine for k in pq.read_table(p)["key"].to_pylist()]
    assert len(keys) == len(set(keys))  # no quarantine row written twice
