"""Shared test set-up: offline model hub, loopback-only Ray, one local Ray per session."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
from pipeline.runtime import apply_loopback_defaults  # noqa: E402

apply_loopback_defaults()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def local_ray():
    """A real local Ray on 127.0.0.1 (2 CPUs), shared by every Ray test of the session."""
    import ray

    from pipeline.runtime import init_ray

    init_ray(None, num_cpus=2)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
