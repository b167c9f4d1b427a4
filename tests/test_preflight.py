"""Resource preflight: the pure check on node lists (against a brute-force placement), the
requests each stage declares (the ones it passes to Ray), the GPU limits of the index config,
and refusals end to end (a job no node can host fails in seconds, naming the key)."""

from __future__ import annotations

import ast
import itertools
import logging
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import JobConfig, JobConfigError
from pipeline.core.search.faiss_gpu import gpu_index_problems
from pipeline.run.kinds import KINDS, job_requests
from pipeline.run.state import DEPENDS_ON
from pipeline.runtime.preflight import Request, check_cluster, check_requests, resources_of

BASE = {
    "name": "preflight",
    "input": {"shards": "/data/{00000..00001}.tar"},
    "output": "/tmp/preflight-run",
    "model": {"name": "ncl-tiny"},
}
STAGES = Path(__file__).resolve().parents[1] / "pipeline" / "stages"


def _job(**sections) -> JobConfig:
    return JobConfig.model_validate({**BASE, **sections})


def _findings(job: JobConfig, nodes: list[dict]):
    return check_requests(job_requests(job, sum(n.get("GPU", 0) for n in nodes)), nodes)


def _problems(job: JobConfig, nodes: list[dict]) -> list[str]:
    return _findings(job, nodes).problems


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


def test_gpu_training_workers_want_their_reader_cpus():
    """On GPUs each worker's readers would use READER_CPUS_PER_GPU CPUs: fewer is a warning
    (training waits for data), none beside a worker a refusal (its readers never run)."""
    from pipeline.stages.train.data import READER_CPUS_PER_GPU

    job = _job(train={"workers": 2})
    own_cpu = {"CPU": 1.0, "GPU": 1.0}  # the worker's own CPU, none for its readers
    refused = _findings(job, [own_cpu, own_cpu])
    assert len(refused.problems) == 1 and "train.workers" in refused.problems[0], refused
    assert "plus 2 CPU for the Ray Data tasks" in refused.problems[0]
    starved = _findings(job, [{"CPU": 2.0, "GPU": 1.0}] * 2)
    assert starved.problems == [] and len(starved.warnings) == 1, starved
    assert "leave 2 CPU" in starved.warnings[0]
    assert f"fewer than the {2 * READER_CPUS_PER_GPU}" in starved.warnings[0]
    fed = {"CPU": 1.0 + READER_CPUS_PER_GPU, "GPU": 1.0}
    assert _findings(job, [fed, fed]).warnings == []
    # Ray Data runs the readers on any node with a free CPU: a CPU node can feed the GPUs.
    assert _findings(job, [own_cpu, own_cpu, {"CPU": 2.0 * READER_CPUS_PER_GPU}]).warnings == []
    # On CPU the readers share the node's cores with the trainer: no count is wanted.
    assert _findings(job, [{"CPU": 4.0}]).warnings == []


def _brute_force_fits(request: Request, nodes: list[dict]) -> bool:
    """Some assignment of the gang's units to nodes fits and leaves `beside_cpus` whole CPUs."""
    for hosts in itertools.product(range(len(nodes)), repeat=request.count):
        left = [dict(node) for node in nodes]
        for host in hosts:
            for name, value in request.unit.items():
                left[host][name] = left[host].get(name, 0.0) - value
        fits = all(v >= -1e-9 for node in left for v in node.values())
        if fits and sum(int(node["CPU"] + 1e-9) for node in left) >= request.beside_cpus:
            return True
    return False


@pytest.mark.parametrize("seed", range(3))
def test_gang_refusals_match_a_brute_force_placement(seed):
    rng = np.random.default_rng(seed)
    for _ in range(150):
        nodes = [
            {"CPU": float(rng.integers(0, 5)), "GPU": float(rng.choice([0, 1, 2]))}
            for _ in range(rng.integers(1, 4))
        ]
        unit = {"CPU": float(rng.integers(0, 3)), "GPU": float(rng.choice([0, 0.5, 1]))}
        unit = unit if any(unit.values()) else {"CPU": 1.0}
        count, beside = int(rng.integers(1, 4)), int(rng.integers(0, 3))
        request = Request("unit", "k", unit, count=count, beside_cpus=beside)
        refused = check_requests([request], nodes).problems != []
        assert refused == (not _brute_force_fits(request, nodes)), (nodes, request)


def test_every_stage_s_one_cpu_tasks_give_one_message():
    problems = _problems(_job(), [{"CPU": 0.0}])
    tasks = [p for p in problems if "key-check task" in p]
    assert len(tasks) == 1 and "label-pass task" in tasks[0] and "publish task" in tasks[0]
    assert "largest: 0 CPU" in tasks[0] and tasks[0].endswith("raise ray.num_cpus"), tasks
    remote = _job(ray={"address": "ray://head:10001"})
    assert all("add CPUs to the cluster's nodes" in p for p in _problems(remote, [{"CPU": 0.0}]))


def test_job_requests_come_from_the_stages_the_job_runs():
    assert set(KINDS) == set(DEPENDS_ON)  # every stage kind declares what it asks

    def asked(job: JobConfig) -> list[str]:
        return [request.what for request in job_requests(job, 0.0)]

    assert asked(_job()) == [
        "embed worker",
        "key-check task",
        "training worker",
        "label-pass task",
        "publish task",
    ]
    assert "training worker" not in asked(_job(train={"warmup_epochs": 0, "rounds": 0}))
    assert "cosine-filter task" in asked(_job(train={"mode": "cosine_filter", "rounds": 1}))
    index = _job(index={"gpus_per_actor": 1, "shards": 2})
    assert "index actor" in asked(index) and "index actor" not in asked(_job())


def _literal_resources(source: str) -> list[int]:
    """Lines of calls that spell Ray resources (num_cpus=, num_gpus=) instead of passing a
    stage's declared options."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and any(kw.arg in ("num_cpus", "num_gpus") for kw in node.keywords)
    ]


def test_stages_pass_ray_only_their_declared_resources():
    """What a stage passes to Ray comes from the options its `ray_requests` reads, so the
    preflight and Ray cannot disagree."""
    assert _literal_resources("ray.remote(f).options(num_cpus=1, max_retries=2)") == [1]
    assert _literal_resources("ray.remote(f).options(**TASK_OPTIONS)") == []
    found = {
        str(path.relative_to(STAGES)): lines
        for path in sorted(STAGES.rglob("*.py"))
        if (lines := _literal_resources(path.read_text()))
    }
    assert not found, f"Ray resources spelled out instead of declared: {found}"


@pytest.mark.ray
def test_ray_grants_what_the_declared_options_request(local_ray):
    """Each declaration's request is what Ray grants a task started with it."""
    from pipeline.config import EmbedConfig, IndexConfig
    from pipeline.stages import embed, keys, publish
    from pipeline.stages.baselines import cosine_filter
    from pipeline.stages.labels import resources as labels
    from pipeline.stages.train import data, driver

    def granted() -> dict:
        import ray

        return ray.get_runtime_context().get_assigned_resources()

    declared = [
        embed.worker_options(EmbedConfig(cpus_per_worker=1), 0.0),
        keys.TASK_OPTIONS,
        labels.TASK_OPTIONS,
        labels.codebook_task_options(IndexConfig()),
        cosine_filter.TASK_OPTIONS,
        driver.worker_options(use_gpu=False),
        data.READER_TASK_OPTIONS,
        publish.TASK_OPTIONS,
    ]
    tasks = [local_ray.remote(granted).options(**options).remote() for options in declared]
    for options, got in zip(declared, local_ray.get(tasks), strict=True):
        assert got == resources_of(options), options


@pytest.mark.ray
def test_check_cluster_reads_the_live_nodes(local_ray, caplog):
    """The real check on the session's local Ray (2 CPUs, no GPU): the requests are asked
    for with the cluster's GPU count, warnings are logged, problems refuse the job."""
    asked = []

    def requests_for(gpus: float) -> list[Request]:
        asked.append(gpus)
        return [Request("probe", "probe.key", {"CPU": 1.0}, wanted_cpus=64, fix="add CPUs")]

    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.preflight"):
        check_cluster(_job(), requests_for)
    assert asked == [0.0] and "fewer than the 64 they would use" in caplog.text
    too_big = [Request("probe", "probe.key", {"CPU": 3.0}, fix="lower probe.key")]
    with pytest.raises(
        JobConfigError, match=r"probe asks for 3 CPU on one node \(probe.key\).*largest: 2 CPU"
    ):
        check_cluster(_job(), lambda gpus: too_big)
    check_cluster(_job(ray={"preflight": False}), lambda gpus: too_big)  # skipped


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


def test_cpu_embed_workers_take_one_cpu_each_unless_told_otherwise():
    """Without GPUs the pass runs one worker per `embed.cpus_per_worker` CPUs (default 1), each
    with as many torch threads and at most as many decode threads (docs/benchmarks.md: two
    1-CPU workers embed 1.4-1.6x the pairs/s of one 2-CPU worker on 2 cores)."""
    from dataclasses import replace

    from pipeline.config import EmbedConfig
    from pipeline.stages.embed import EmbedSpec
    from pipeline.stages.embed.driver import pool_size
    from pipeline.stages.embed.shard import cpu_threads

    spec = EmbedSpec(output="/o", round_index=0, views={}, seed=0)
    assert pool_size(spec, 10, cpus=2, gpus=0) == (2, {"num_cpus": 1.0})
    assert pool_size(spec, 1, cpus=2, gpus=0)[0] == 1  # never more workers than shards
    wide = replace(spec, embed=EmbedConfig(cpus_per_worker=2))
    assert pool_size(wide, 10, cpus=8, gpus=0)[0] == 4
    assert pool_size(spec, 10, cpus=16, gpus=4)[0] == 4  # a GPU each
    assert cpu_threads(EmbedConfig()) == (1, 1)  # decode_threads' default 4, capped
    assert cpu_threads(EmbedConfig(cpus_per_worker=4, decode_threads=2)) == (4, 2)
