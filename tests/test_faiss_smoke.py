"""The FAISS kernel smoke (pipeline.runtime.faiss_smoke) on this CPU machine: the real snippet
in a real child process fails under faiss-cpu, and the sentence names the wheel; a child that
aborts (what a FAISS assertion does on a GPU without kernels) is reported by its signal."""

from __future__ import annotations

import importlib.metadata

import faiss

from pipeline.runtime.faiss_smoke import (
    FAISS_GPU_WHEEL,
    faiss_gpu_problem,
    faiss_kernel_failure,
    faiss_wheel,
)

WHEEL = importlib.metadata.packages_distributions()["faiss"][0]


def test_the_real_smoke_fails_without_gpu_faiss_and_says_why():
    failure = faiss_kernel_failure([0])
    assert failure is not None
    assert "exited with status 1: AttributeError: module 'faiss' has no attribute 'Gpu" in failure


def test_the_sentence_names_the_wheel_and_the_fix():
    problem = faiss_gpu_problem([0])
    assert problem is not None
    version = importlib.metadata.version(WHEEL)
    assert f"{WHEEL} {version} (faiss {faiss.__version__}; built with " in problem
    assert "faiss sees 0 GPU(s)" in problem and "compute capability" in problem
    assert FAISS_GPU_WHEEL in problem
    assert faiss_wheel() in problem


def test_an_aborting_kernel_is_reported_by_its_signal():
    aborts = "import sys, os; print('CUDA error 209', file=sys.stderr, flush=True); os.abort()"
    failure = faiss_kernel_failure([0], snippet=aborts)
    assert failure == "the process was killed by SIGABRT: CUDA error 209"


def test_a_passing_kernel_and_a_hung_one():
    ok = "import sys, faiss; print(sys.argv[1:]); print('ok')"
    assert faiss_kernel_failure([0, 1], snippet=ok) is None
    hangs = "import time; time.sleep(30)"
    assert faiss_kernel_failure([0], snippet=hangs, timeout_s=1) == "it did not finish in 1 s"
