"""A real FAISS kernel on each granted GPU, in a child process, before any index work.

`faiss.get_num_gpus()` counts devices, not kernels: a wheel without machine code or PTX for the
GPU's architecture (faiss-gpu-cu12 on an H100/H200) still reports the GPU, and its first kernel
then stops the process with a C-level abort (CUDA error 209), never a Python exception. So
`faiss_gpu_problem` checks the count, then runs a tiny flat-index add + search on every device
in a child process (`SMOKE_SNIPPET`): it passes when the child exits 0 with the right
neighbours; otherwise it returns one sentence naming the installed wheel (distribution and
version, faiss's version and compile options) and each GPU's compute capability. A process runs
the smoke once per device set. Imports neither Ray nor torch (index actors import no torch);
used by `pipeline.runtime.devices.granted_faiss_gpus` and `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys

__all__ = [
    "FAISS_GPU_WHEEL",
    "SMOKE_SNIPPET",
    "faiss_gpu_problem",
    "faiss_kernel_failure",
    "faiss_wheel",
    "gpu_capabilities",
]

# The wheel to install for GPU indexes: Meta's build has kernels for compute capability 7.0 to
# 8.9 and 9.0 with PTX (pyproject.toml's `gpu` extra names it).
FAISS_GPU_WHEEL = "faiss-gpu>=1.14"

# argv[1:] = FAISS device numbers. Flat L2 on the GPU runs FAISS's own norm and k-selection
# kernels (cuBLAS brings its own), so a wheel without this architecture fails here.
SMOKE_SNIPPET = """\
import sys
import numpy as np
import faiss
x = np.random.default_rng(0).standard_normal((512, 32)).astype(np.float32)
for device in map(int, sys.argv[1:]):
    config = faiss.GpuIndexFlatConfig()
    config.device = device
    index = faiss.GpuIndexFlatL2(faiss.StandardGpuResources(), 32, config)
    index.add(x)
    ids = index.search(x[:64], 1)[1][:, 0]
    if not (ids == np.arange(64)).all():
        sys.exit(f"GPU {device} returned wrong neighbours: {ids[:8].tolist()}")
print("ok")
"""

_passed: set[tuple[int, ...]] = set()


def faiss_wheel() -> str:
    """The installed FAISS, e.g. "faiss-gpu-cu12 1.14.1.post1 (faiss 1.14.1; OPTIMIZE GPU AVX2)"."""
    import faiss

    dists = importlib.metadata.packages_distributions().get("faiss") or ["an unknown wheel"]
    names = []
    for dist in sorted(set(dists)):
        try:
            names.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            names.append(dist)
    options = faiss.get_compile_options().strip() if hasattr(faiss, "get_compile_options") else ""
    return f"{' + '.join(names)} (faiss {faiss.__version__}; built with {options or 'unknown'})"


def gpu_capabilities() -> str:
    """The visible GPUs' names and compute capabilities, as nvidia-smi reports them."""
    if shutil.which("nvidia-smi") is None:
        return "compute capability unknown (no nvidia-smi)"
    command = ["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        command += ["-i", visible]  # Ray's grant: nvidia-smi itself ignores the variable
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"compute capability unknown ({exc})"
    rows = [line.split(",") for line in out.stdout.strip().splitlines()]
    found = [
        f"{row[1].strip()} (compute capability {row[2].strip()})" for row in rows if len(row) == 3
    ]
    return ", ".join(found) or f"compute capability unknown ({out.stderr.strip() or 'no GPU'})"


def faiss_kernel_failure(
    devices: list[int], snippet: str = SMOKE_SNIPPET, timeout_s: float = 300.0
) -> str | None:
    """How `snippet` (the smoke) failed in a child Python on `devices`; None when it passed.

    The child inherits the environment (Ray's CUDA_VISIBLE_DEVICES included); the timeout covers
    the CUDA context and the kernels' first load on a cold GPU.
    """
    command = [sys.executable, "-c", snippet, *map(str, devices)]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"it did not finish in {timeout_s:.0f} s"
    if out.returncode == 0 and out.stdout.strip().endswith("ok"):
        return None
    lines = [line.strip() for line in out.stderr.splitlines() if line.strip()]
    detail = f": {lines[-1]}" if lines else ""
    if out.returncode < 0:
        name = signal.Signals(-out.returncode).name
        return f"the process was killed by {name}{detail}"
    return f"the process exited with status {out.returncode}{detail}"


def faiss_gpu_problem(devices: list[int], snippet: str = SMOKE_SNIPPET) -> str | None:
    """Why this FAISS cannot index on `devices` (FAISS device numbers), as a clause that names
    the wheel and the GPUs; None when a real kernel ran on each of them."""
    import faiss

    if tuple(devices) in _passed or not devices:
        return None
    seen = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if seen <= max(devices):
        failure = f"faiss sees {seen} GPU(s)"
    else:
        kernel_failure = faiss_kernel_failure(devices, snippet)
        if kernel_failure is None:
            _passed.add(tuple(devices))
            return None
        failure = f"a FAISS GPU kernel (flat index add + search) failed: {kernel_failure}"
    return (
        f"{failure}; the installed wheel is {faiss_wheel()} and the GPU is {gpu_capabilities()}: "
        f"install {FAISS_GPU_WHEEL} (kernels for compute capability 7.0 to 9.0), "
        "the only FAISS module in the environment"
    )
