"""GPU use follows Ray's grant, and FAISS on GPU: run by `benchmarks/gpu_check.py --part
pipeline` on a GPU machine (marked `gpu`: skipped without an NVIDIA GPU, failed when one is
there but CUDA is not usable, see tests/conftest.py). Written against the torch/faiss/Ray
documentation; not yet run on a GPU (README, GPU section)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_cuda_is_usable_here():
    from pipeline.runtime.devices import cuda_unusable_reason

    assert cuda_unusable_reason() is None


def test_bf16_check_is_exact_for_the_device():
    from pipeline.models.encode import autocast_dtype_for, bf16_native

    device = torch.device("cuda:0")
    native = torch.cuda.get_device_capability(device)[0] >= 8
    assert bf16_native(device) == native
    assert autocast_dtype_for("bf16", device) == (torch.bfloat16 if native else None)


@pytest.mark.ray
def test_torch_device_follows_the_ray_grant(local_ray):
    from pipeline.runtime.devices import granted_device

    ray = local_ray

    @ray.remote(num_gpus=1)
    def with_gpu():
        return str(granted_device("test task"))

    @ray.remote(num_gpus=0)
    def without_gpu():
        # Ray leaves every GPU visible to a 0-GPU task; the grant, not visibility, decides.
        return str(granted_device("test task")), torch.cuda.is_available()

    assert ray.get(with_gpu.remote()) == "cuda:0"
    device, _ = ray.get(without_gpu.remote())
    assert device == "cpu"


@pytest.mark.ray
def test_index_actor_uses_exactly_the_granted_gpus(local_ray):
    from pipeline.core.search.knn import is_gpu_index
    from pipeline.stages.labels.index_actors import IndexStoreActor

    ray = local_ray
    rows = _unit_rows(2000, 64, 0)
    part = {"ids": np.arange(2000, dtype=np.int64), "u": rows, "v": rows}

    def build(factory: str):
        store = IndexStoreActor(64, factory, 64, 0)
        store.add(part)
        trained = None if factory == "Flat" else store.train()
        store.build(trained)
        scores, ids = store.search("image", rows[:50], 10)
        return store.gpus, is_gpu_index(store.indexes["image"].index), ids

    on_gpu = ray.get(ray.remote(num_gpus=1)(build).remote("Flat"))
    on_cpu = ray.get(ray.remote(num_gpus=0)(build).remote("Flat"))
    assert on_gpu[:2] == ([0], True)
    assert on_cpu[:2] == ([], False)  # a 0-GPU actor on a GPU node stays on CPU
    np.testing.assert_array_equal(on_gpu[2], on_cpu[2])  # exact search: the same neighbours
    ivf_gpu = ray.get(ray.remote(num_gpus=1)(build).remote("IVF16,Flat"))
    ivf_cpu = ray.get(ray.remote(num_gpus=0)(build).remote("IVF16,Flat"))
    assert ivf_gpu[1] and not ivf_cpu[1]
    # nprobe 64 >= 16 lists: every list is probed, so IVF is exhaustive on both devices.
    np.testing.assert_array_equal(ivf_gpu[2], on_cpu[2])


def test_vectors_are_added_on_the_gpu_index_and_ids_survive():
    from pipeline.core.search.knn import build_index, is_gpu_index

    rows = _unit_rows(5000, 32, 1)
    ids = np.arange(5000, dtype=np.int64) * 7 + 3
    for factory in ("Flat", "IVF32,Flat", "IVF32,PQ8"):
        index = build_index(rows, ids, factory, gpus=[0], nprobe=32)
        assert is_gpu_index(index) and index.ntotal == 5000
        _, found = index.search(rows[:20], 1)
        if factory != "IVF32,PQ8":  # PQ codes are approximate
            np.testing.assert_array_equal(found[:, 0], ids[:20])
        assert set(found.ravel()) <= set(ids)


def test_training_on_gpu_frees_the_clustering_index():
    from pipeline.core.search.knn import train_index

    sample = _unit_rows(20_000, 64, 2)
    train_index("IVF64,Flat", sample, ngpu=1, niter=2)  # first use: CUDA context, cuBLAS
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(0)[0]
    for _ in range(3):
        index = train_index("IVF64,Flat", sample, ngpu=1, niter=2)
        assert index.is_trained
    free_after = torch.cuda.mem_get_info(0)[0]
    # Each GPU clustering index brings its own resources (~1.5 GB of temporary memory);
    # three leaked ones would show.
    assert free_before - free_after < 256 * 2**20, (free_before, free_after)


def test_gpu_search_deeper_than_faiss_limit_is_refused_at_config_time():
    from pipeline.config import JobConfig

    base = {
        "name": "gpu",
        "input": {"shards": "/data/x.tar"},
        "output": "/tmp/x",
        "model": {"name": "ncl-tiny"},
    }
    with pytest.raises(ValueError, match="labels.rcr.k <= 63"):
        JobConfig.model_validate(
            {**base, "index": {"gpus_per_actor": 1}, "labels": {"method": "rcr", "rcr": {"k": 100}}}
        )
