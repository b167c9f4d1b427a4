"""Static checks of docker/: the fields the cluster deployment relies on.

Nothing is built or applied here (no Docker or Kubernetes in CI); these tests catch edits that
would break the image or the RayJob before someone finds out on a GPU cluster.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[1] / "docker"
REPO = DOCKER.parent
# The CUDA major of each FAISS GPU wheel's runtime: Meta's faiss-gpu (1.14, 1.15) requires the
# nvidia-*-cu12 wheels; faiss-gpu-cu<N> names it.
FAISS_CUDA_MAJOR = {"faiss-gpu": "12", "faiss-gpu-cu12": "12"}


@pytest.fixture(scope="module")
def rayjob() -> dict:
    with open(DOCKER / "rayjob.yaml", encoding="utf-8") as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (DOCKER / "Dockerfile").read_text(encoding="utf-8")


def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    lines = (ln.strip() for ln in joined.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _containers(rayjob: dict) -> list[dict]:
    spec = rayjob["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["spec"]["containers"]]


# --------------------------------------------------------------------------------------------
# rayjob.yaml


def _job_mount(rayjob: dict) -> str:
    """The path of the head container where the job file's ConfigMap is mounted."""
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    config_maps = {v["name"] for v in head["volumes"] if "configMap" in v}
    mounts = [m for m in head["containers"][0]["volumeMounts"] if m["name"] in config_maps]
    assert len(mounts) == 1, "the head must mount the job file's ConfigMap once"
    return mounts[0]["mountPath"]


def test_rayjob_kind_and_entrypoint(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1"
    assert rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert "ncl-pipeline run" in spec["entrypoint"]
    job_file = spec["entrypoint"].split("ncl-pipeline run", 1)[1].split()[0]
    # The job file comes from the ConfigMap (a new job needs no image rebuild).
    assert job_file.startswith(_job_mount(rayjob).rstrip("/") + "/")
    assert spec["shutdownAfterJobFinishes"] is True


def _gpu_workers(rayjob: dict) -> int:
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return sum(
        g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get(
            "nvidia.com/gpu", 0))
        for g in groups
    )  # fmt: skip


def test_cc3m_trains_on_every_gpu_of_the_rayjob(rayjob):
    from pipeline.config import load_job

    job = load_job(REPO / "jobs" / "cc3m.yaml")
    assert job.train.workers == _gpu_workers(rayjob) == 4


def test_gpu_pods_tolerate_the_gpu_taint_and_size_the_object_store(rayjob):
    spec = rayjob["spec"]["rayClusterSpec"]
    pods = [(spec["headGroupSpec"]["rayStartParams"], spec["headGroupSpec"]["template"])]
    pods += [(g["rayStartParams"], g["template"]) for g in spec["workerGroupSpecs"]]
    units = {"Gi": 1024**3, "Mi": 1024**2}
    for params, pod in pods:
        container = pod["spec"]["containers"][0]
        if "nvidia.com/gpu" in container["resources"]["limits"]:
            taints = {(t["key"], t.get("effect")) for t in pod["spec"].get("tolerations", [])}
            assert ("nvidia.com/gpu", "NoSchedule") in taints
        (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
        limit = shm["emptyDir"]["sizeLimit"]
        shm_bytes = int(limit[:-2]) * units[limit[-2:]]
        store = int(params["object-store-memory"])
        memory = container["resources"]["limits"]["memory"]
        # Ray's object store fits /dev/shm, which fits the pod's memory limit.
        assert store < shm_bytes < int(memory[:-2]) * units[memory[-2:]]


def test_cc3m_pixel_cache_is_on_a_worker_disk_that_holds_it(rayjob):
    """The readers' cache goes to a sized local volume of every GPU worker, not the container
    layer, and its budget fits that volume."""
    from pipeline.config import load_job

    job = load_job(REPO / "jobs" / "cc3m.yaml")
    for group in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        (mount,) = [p for p in mounts if job.train.pixel_cache_dir.startswith(p.rstrip("/") + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[mount]]
        limit = volume["emptyDir"]["sizeLimit"]
        assert limit.endswith("Gi") and job.train.pixel_cache_gb * 1e9 < int(limit[:-2]) * 2**30


def test_image_can_run_the_gpu_check(dockerfile):
    """The kernels part's modules come with the image's install, and the script is copied."""
    import tomllib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    install = next(ln for ln in _instructions(dockerfile) if re.search(r"pip install .*\.\[", ln))
    extras = re.search(r"\.\[([\w,]+)\]", install).group(1).split(",")
    installed = pyproject["dependencies"] + [
        d for extra in extras for d in pyproject["optional-dependencies"][extra]
    ]
    names = {re.match(r"[\w-]+", d).group(0).lower().replace("_", "-") for d in installed}
    for module, dist in gpu_check.KERNEL_DEPS.items():
        wanted = re.match(r"[\w-]+", dist).group(0).lower().replace("_", "-")
        assert wanted in names, f"{module}: the image does not install {dist}"
    copies = [ln for ln in _instructions(dockerfile) if ln.startswith("COPY ")]
    assert any("benchmarks/gpu_check.py" in ln for ln in copies)
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    assert "!benchmarks/gpu_check.py" in ignore  # in the build context


def test_rayjob_gpu_workers(rayjob):
    spec = rayjob["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head.get("resources", {}).get("limits", {})
    groups = spec["workerGroupSpecs"]
    assert groups and all(g["replicas"] >= 1 for g in groups)
    for group in groups:
        worker = group["template"]["spec"]["containers"][0]
        assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == 1
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_rayjob_volumes_mounted_everywhere(rayjob):
    spec = rayjob["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for container in pod["spec"]["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert {"/data", "/runs"} <= mounts.keys()
            for name in mounts.values():
                assert name in volumes  # every mount refers to a declared volume
    # The job reads and writes where the volumes are: input, output, eval shards, and the
    # weights cache, which every pod must share (the driver fetches once, every worker reads).
    job = yaml.safe_load((REPO / "jobs" / "cc3m.yaml").read_text(encoding="utf-8"))
    assert str(job["input"]["shards"]).startswith("/data/")
    assert str(job["eval"]["val_shards"]).startswith("/data/")
    assert str(job["output"]).startswith("/runs/")
    for container in _containers(rayjob):
        mounts = [m["mountPath"].rstrip("/") + "/" for m in container["volumeMounts"]]
        assert any(job["model"]["cache_dir"].startswith(m) for m in mounts)


def test_rayjob_image_and_ray_version_match_dockerfile(rayjob, dockerfile):
    images = {c["image"] for c in _containers(rayjob)}
    assert len(images) == 1, "head and workers must run the same image"
    (image,) = images
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")
    base_tag = re.search(r"^ARG BASE_TAG=(\S+)", dockerfile, re.M)
    assert base_tag, "Dockerfile must pin the base tag with ARG BASE_TAG=..."
    ray_version = rayjob["spec"]["rayClusterSpec"]["rayVersion"]
    assert base_tag.group(1).startswith(f"{ray_version}-")


# --------------------------------------------------------------------------------------------
# Dockerfile


def test_dockerfile_from_uses_arg_tag(dockerfile):
    lines = _instructions(dockerfile)
    froms = [ln for ln in lines if ln.upper().startswith("FROM ")]
    assert len(froms) == 1
    args_before = {
        m.group(1) for ln in lines[: lines.index(froms[0])] if (m := re.match(r"ARG (\w+)=\S+", ln))
    }
    referenced = set(re.findall(r"\$\{(\w+)\}", froms[0]))
    assert referenced and referenced <= args_before  # every FROM variable has a default
    assert re.search(r":\$\{\w+\}", froms[0]), "the tag itself must come from an ARG"


def test_dockerfile_installs_gpu_extra_without_cache(dockerfile):
    runs = [ln for ln in _instructions(dockerfile) if ln.startswith("RUN ")]
    pip_installs = [ln for ln in runs if "pip install" in ln]
    assert any(re.search(r"\.\[([\w,]*,)?gpu[,\]]", ln) for ln in pip_installs)
    assert all("--no-cache-dir" in ln for ln in pip_installs)
    assert not any("apt-get upgrade" in ln or "dist-upgrade" in ln for ln in runs)
    for ln in runs:
        if "apt-get install" in ln:
            assert "rm -rf /var/lib/apt/lists" in ln


def test_dockerfile_no_latest_and_non_root(dockerfile):
    assert not re.search(r"latest", dockerfile, re.I)
    lines = _instructions(dockerfile)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in {"root", "0"}
    # Dependency layer before the code: pyproject is copied before the package sources.
    copies = [ln for ln in lines if ln.startswith("COPY ")]
    first_pyproject = next(i for i, ln in enumerate(copies) if "pyproject.toml" in ln)
    first_code = next(i for i, ln in enumerate(copies) if "pipeline/" in ln)
    assert first_pyproject < first_code


def test_dockerfile_torch_cuda_matches_the_faiss_extra(dockerfile):
    """The image's torch and faiss-gpu must use one CUDA major: a CUDA 13 torch beside
    faiss's CUDA 12 runtime leaves torch without CUDA on drivers older than 580."""
    import tomllib

    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)", dockerfile, re.M)
    major = re.search(r"^ARG TORCH_CUDA_MAJOR=(\d+)", dockerfile, re.M)
    assert index and major, "the Dockerfile must pin TORCH_INDEX_URL and TORCH_CUDA_MAJOR"
    cuda = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)/?", index.group(1))
    assert cuda, f"{index.group(1)} is not a CUDA build index of download.pytorch.org"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (faiss_gpu,) = pyproject["project"]["optional-dependencies"]["gpu"]
    name = re.match(r"[\w-]+", faiss_gpu).group(0)
    assert name in FAISS_CUDA_MAJOR, f"{faiss_gpu}: which CUDA major does it use?"
    # cu128 -> CUDA 12.
    assert cuda.group(1)[:-1] == FAISS_CUDA_MAJOR[name] == major.group(1)
    # The build checks the installed torch's CUDA major against TORCH_CUDA_MAJOR.
    install = next(ln for ln in _instructions(dockerfile) if "${TORCH_INDEX_URL}" in ln)
    assert "torch.version.cuda" in install and "${TORCH_CUDA_MAJOR}" in install
    # The minimum driver is written down for whoever runs the image.
    assert re.search(r"[Mm]inimum NVIDIA driver", dockerfile)
