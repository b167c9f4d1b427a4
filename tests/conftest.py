"""Shared test set-up: offline model hub, loopback-only Ray, one local Ray per session."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
from pipeline.runtime.ray import apply_loopback_defaults  # noqa: E402

apply_loopback_defaults()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def local_ray():
    """A real local Ray on 127.0.0.1 (2 CPUs), shared by every Ray test of the session that
    runs its jobs in this process (`own_ray` modules run after it is stopped)."""
    import ray

    from pipeline.runtime.ray import init_ray

    init_ray(None, num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def pipeline_run(local_ray, tmp_path_factory) -> dict:
    """One small real run (embed, labels, publish; export_fixtures.pipeline_run), shared by
    the modules that only read its outputs."""
    from export_fixtures import pipeline_run as run

    return run(tmp_path_factory.mktemp("pipeline_run"))


@pytest.fixture(scope="session")
def warmed_run(local_ray, tmp_path_factory) -> dict:
    """{"corpus", "out"}: the shared job (tests/shared_run.py) run up to its warm-up on the
    session's local Ray; the rerun and co-teaching tests copy it."""
    from shared_run import warmed_run as run

    return run(tmp_path_factory.mktemp("warmed_run"))


@pytest.fixture(scope="session")
def cli_reference(tmp_path_factory) -> dict:
    """{"corpus", "out", "job"}: the shared job run to its end by the CLI in a subprocess, on
    a Ray of its own (so only `own_ray` tests ask for it): the undisturbed run that the fault
    tests compare with and the damaged-manifest test starts from."""
    from shared_run import cli_reference as run

    return run(tmp_path_factory.mktemp("cli_reference"))


def _nvidia_gpus() -> int:
    """GPUs nvidia-smi lists (0 without nvidia-smi): the machine's own answer, not torch's."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


_GPU_STATE: list[str | None] = []  # [None] = CUDA works; ["absent"]; [why CUDA is unusable]


def _gpu_state() -> str | None:
    if not _GPU_STATE:
        import torch

        if torch.cuda.is_available():
            _GPU_STATE.append(None)
        elif _nvidia_gpus() == 0:
            _GPU_STATE.append("absent")
        else:
            from pipeline.runtime.devices import cuda_unusable_reason

            _GPU_STATE.append(cuda_unusable_reason() or "torch.cuda.is_available() is False")
    return _GPU_STATE[0]


def pytest_collection_modifyitems(config, items):
    """`own_ray` modules go last (see `pytest_runtest_setup`). `gpu` tests skip on a machine
    without an NVIDIA GPU; on one whose GPU torch cannot use (CPU-only torch, driver too old
    for torch's CUDA) they fail, in `pytest_runtest_setup`."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is not None)  # stable
    for item in items:
        if item.get_closest_marker("own_ray") and "local_ray" in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"{item.nodeid} is marked own_ray but uses local_ray")
    if not any("gpu" in item.keywords for item in items) or _gpu_state() != "absent":
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (nvidia-smi lists none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_setup(item):
    if item.get_closest_marker("own_ray") is not None:
        # The session's idle local Ray (GCS, raylet, agents, pooled workers, Ray Data's system
        # actors: ~1% of a core per process) would take CPU from the test's own Ray, on 2 cores.
        import ray

        if ray.is_initialized():
            ray.shutdown()
    if "gpu" in item.keywords:
        state = _gpu_state()
        if state not in (None, "absent"):
            pytest.fail(f"this machine has an NVIDIA GPU but CUDA is unusable: {state}")


@pytest.fixture()
def hub_endpoint(monkeypatch):
    """Call with True or False: HF_HUB_OFFLINE is then unset, as users have it, and the hub's
    endpoint (HF_ENDPOINT) is on loopback, a port that accepts connections (True) or a closed
    one (False). Returns the endpoint URL."""
    import socket

    from huggingface_hub import constants

    sockets: list[socket.socket] = []

    def endpoint(reachable: bool) -> str:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # frozen when first imported
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if reachable:
            listener.listen(8)
            sockets.append(listener)
        else:
            listener.close()  # nothing listens there: the connection is refused
        url = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("HF_ENDPOINT", url)
        return url

    yield endpoint
    for listener in sockets:
        listener.close()
