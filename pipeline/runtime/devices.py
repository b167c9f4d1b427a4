"""GPUs used only where Ray granted them, and a clear failure when a granted GPU is unusable.

Ray 2.60 leaves every GPU visible to an actor or task that asked for none, so "use CUDA when
torch sees it" puts CPU-sized actors on cuda:0 and index actors on every GPU of their node,
outside Ray's accounting. Here the grant decides: `ray.get_gpu_ids()` empty -> CPU; granted ->
CUDA, which must then work. Ray sets CUDA_VISIBLE_DEVICES to the granted GPUs, so inside the
process they are devices 0..n-1. An actor granted a GPU that torch (or faiss) cannot use fails
at once with the reason (CPU-only build, driver older than the build's CUDA), instead of
running on CPU while holding the GPU and failing hours later in training.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "GpuUnusableError",
    "cuda_unusable_reason",
    "granted_cpu_count",
    "granted_device",
    "granted_faiss_gpus",
    "granted_gpu_count",
]

logger = logging.getLogger(__name__)


class GpuUnusableError(RuntimeError):
    """Ray granted this process a GPU it cannot use; the message says why and what to do."""


def granted_gpu_count() -> int:
    """GPUs Ray granted the calling worker (0 outside a Ray worker or without a grant)."""
    import ray

    if not ray.is_initialized():
        return 0
    return len(ray.get_gpu_ids())


def granted_cpu_count() -> int:
    """Whole CPUs Ray granted the calling task or actor, at least 1 (1 outside Ray): the
    thread count its native libraries (FAISS's OpenMP) should use."""
    import ray

    if not ray.is_initialized():
        return 1
    try:
        granted = ray.get_runtime_context().get_assigned_resources()
    except AssertionError:  # the driver: Ray answers only in a task or actor
        return 1
    return max(1, int(granted.get("CPU", 0)))


def _driver_version() -> str:
    """The NVIDIA driver version nvidia-smi reports, or why it is unknown."""
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def cuda_unusable_reason() -> str | None:
    """Why torch cannot use CUDA in this process; None when it can."""
    import torch  # here, not at the top: index actors import this module and need no torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    if torch.cuda.is_available():
        return None
    try:
        torch.cuda.init()  # raises with the driver's own complaint, e.g. "driver too old"
        detail = "torch.cuda.is_available() is False"
    except Exception as exc:  # noqa: BLE001 - any failure here is the reason we report
        detail = str(exc).strip().splitlines()[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use the GPU: "
        f"{detail}; NVIDIA driver {_driver_version()}, CUDA_VISIBLE_DEVICES={visible!r}. "
        "A CUDA 12.x build needs driver >= 525, CUDA 13.x >= 580 (docker/README.md)"
    )


def granted_device(what: str) -> torch.device:
    """The torch device of a Ray worker: CUDA when Ray granted it a GPU, else CPU.

    Raises:
        GpuUnusableError: a GPU was granted but torch cannot use CUDA.
    """
    import torch

    if granted_gpu_count() == 0:
        return torch.device("cpu")
    reason = cuda_unusable_reason()
    if reason is not None:
        raise GpuUnusableError(f"{what} was granted a GPU by Ray but {reason}")
    return torch.device("cuda:0")


def granted_faiss_gpus(what: str) -> list[int]:
    """FAISS device numbers of the GPUs Ray granted (empty = CPU index), after a real FAISS
    kernel ran on each of them (`pipeline.runtime.faiss_smoke`, in a child process).

    Raises:
        GpuUnusableError: GPUs were granted but this faiss cannot use them (faiss-cpu, a wheel
            without kernels for this GPU's architecture, a CUDA the driver does not run).
    """
    granted = granted_gpu_count()
    if granted == 0:
        return []
    from pipeline.runtime.faiss_smoke import faiss_gpu_problem

    devices = list(range(granted))
    problem = faiss_gpu_problem(devices)
    if problem is not None:
        raise GpuUnusableError(
            f"{what} was granted {granted} GPU(s) by Ray but {problem}; or set "
            f"index.gpus_per_actor: 0 (NVIDIA driver {_driver_version()})"
        )
    return devices
