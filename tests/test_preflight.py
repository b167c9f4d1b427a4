"""Resource preflight: the pure check on node lists, the GPU limits of the index config, and a
refusal end to end (a job no node can host fails in seconds, naming the key)."""

from __future__ import annotations

import pytest

from pipeline.config import JobConfig, JobConfigError
from pipeline.core.search.faiss_gpu import gpu_index_problems
from pipeline.runtime.preflight import check_requests, plan_requests

BASE = {
    "name": "preflight",
    "input": {"shards": "/data/{00000..00001}.tar"},
    "output": "/tmp/preflight-run",
    "model": {"name": "ncl-tiny"},
}


def _job(**sections) -> JobConfig:
    return JobConfig.model_validate({**BASE, **sections})


def _problems(job: JobConfig, nodes: list[dict]) -> list[str]:
    return check_requests(plan_requests(job, sum(n.get("GPU", 0) for n in nodes)), nodes)


def test_embed_worker_larger_than_every_node_is_refused():
    job = _job(embed={"cpus_per_worker": 2})
    problems = _problems(job, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    assert len(problems) == 1 and "embed.cpus_per_worker" in problems[0], problems
    assert "2 CPU" in problems[0] and "largest: 1 CPU" in problems[0]
    assert _problems(job, [{"CPU": 1.0}, {"CPU": 2.0}]) == []


def test_training_workers_need_a_reader_cpu_each():
    job = _job(train={"workers": 2})
    refused = _problems(job, [{"CPU": 2.0}])
    assert len(refused) == 1 and "train.workers" in refused[0], refused
    assert "plus 2 CPU for the Ray Data tasks" in refused[0]
    assert "ray.num_cpus" in refused[0]  # a local Ray: the fix is more logical CPUs
    assert _problems(job, [{"CPU": 3.0}]) != []  # one reader CPU for two workers can hang
    assert _problems(job, [{"CPU": 4.0}]) == []
    assert _problems(job, [{"CPU": 2.0}, {"CPU": 2.0}]) == []
    # No training at all: nothing to place.
    untrained = _job(train={"workers": 2, "warmup_epochs": 0, "rounds": 0})
    assert _problems(untrained, [{"CPU": 2.0}]) == []


def test_gpu_cluster_requests():
    gpu_node = {"CPU": 8.0, "GPU": 1.0}
    job = _job(train={"workers": 2}, embed={"gpus_per_worker": 1})
    assert _problems(job, [gpu_node, gpu_node]) == []
    # Three GPU workers on two GPUs: the placement group never forms.
    refused = _problems(_job(train={"workers": 3}), [gpu_node, gpu_node])
    assert len(refused) == 1 and "train.workers" in refused[0] and "3 GPU" in refused[0]
    # An embed worker asking two GPUs on one-GPU nodes.
    refused = _problems(_job(embed={"gpus_per_worker": 2}), [gpu_node, gpu_node])
    assert len(refused) == 1 and "embed.gpus_per_worker" in refused[0], refused


def test_index_actors_on_gpu_need_gpus():
    job = _job(index={"gpus_per_actor": 1, "shards": 2})
    refused = _problems(job, [{"CPU": 4.0}])
    assert len(refused) == 1 and "index.gpus_per_actor" in refused[0], refused
    assert _problems(job, [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]) == []
    refused = _problems(job, [{"CPU": 4.0, "GPU": 1.0}])  # two actors, one GPU
    assert len(refused) == 1 and "index.shards" in refused[0]


def test_gpu_index_limits_at_config_time():
    assert gpu_index_problems("Flat", 32, 11) == []
    assert gpu_index_problems("IVF1024,PQ64", 32, 11) == []
    assert gpu_index_problems("OPQ16_64,IVF4096,PQ16", 64, 1) == []
    assert gpu_index_problems("IVF1024,SQ8", 64, 1) == []
    for factory in ("HNSW32", "IVF1024,PQ32x4fs", "PQ64", "IVF1024_HNSW32,Flat", "IVF1024,PQ36"):
        (problem,) = gpu_index_problems(factory, 32, 11)
        assert factory in problem
    assert "index.nprobe=4096" in gpu_index_problems("IVF65536,PQ64", 4096, 1)[0]
    assert "2048" in gpu_index_problems("Flat", 32, 4096)[0]

    with pytest.raises(ValueError, match="index.factory 'HNSW32'.*index.gpus_per_actor: 0"):
        _job(index={"factory": "HNSW32", "gpus_per_actor": 1})
    # RCR's de-duplicating image search reaches 32 * (K + 1) neighbours: K = 63 fits, 64 not.
    _job(index={"gpus_per_actor": 1}, labels={"method": "rcr", "rcr": {"k": 63}})
    with pytest.raises(ValueError, match="labels.rcr.k <= 63"):
        _job(index={"gpus_per_actor": 1}, labels={"method": "rcr", "rcr": {"k": 64}})
    # On CPU the same settings are fine.
    _job(index={"factory": "HNSW32"}, labels={"method": "rcr", "rcr": {"k": 64}})


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from pipeline.data.synthetic import make_corpus

    root = tmp_path_factory.mktemp("preflight") / "c"
    make_corpus(
        root,
        samples=40,
        noise=0.2,
        partial=0.0,
        seed=1,
        samples_per_shard=20,
        test_samples=0,
        image_size=32,
    )
    return root


@pytest.mark.ray
@pytest.mark.parametrize(
    ("setting", "key"),
    [("embed.cpus_per_worker=3", "embed.cpus_per_worker"), ("train.workers=2", "train.workers")],
)
def test_run_refuses_in_seconds_what_the_local_ray_cannot_host(
    local_ray, tiny_corpus, tmp_path, setting, key
):
    """The session's local Ray has 2 CPUs: an embed worker of 3 CPUs would wait forever, and
    two training workers would leave no CPU for their readers."""
    from pipeline.config import load_job
    from pipeline.run.runner import run_job

    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        f"name: refused\ninput: {{shards: '{tiny_corpus}/{{00000..00001}}.tar'}}\n"
        f"output: {tmp_path / 'run'}\nmodel: {{name: ncl-tiny}}\nray: {{num_cpus: 2}}\n"
    )
    job = load_job(job_file, [setting])
    with pytest.raises(JobConfigError, match=key) as refused:
        run_job(job)
    # Refused by the preflight, before any stage ran (not by a stage that timed out).
    assert any("preflight" in str(entry.path) for entry in refused.traceback)
    assert not (tmp_path / "run" / "rounds").exists()
