"""The GPU check, in two parts that a bare GPU machine can run (docs/development.md, "GPU check").

    python3 benchmarks/gpu_check.py --part kernels [--device cpu]
    python3 benchmarks/gpu_check.py --part pipeline [--device cpu] [--work DIR]

kernels needs torch, torchvision, open_clip and faiss only (never Ray, pydantic or webdataset):
  1. the FAISS kernel smoke (pipeline.runtime.faiss_smoke) on GPU 0, before any FAISS GPU work;
  2. the embed pass's encode path (pipeline.models.encode) at ViT-B-32 / 224 px / bf16, random
     init: JPEG bytes decoded on the device (decode_pixels: nvJPEG on CUDA), resized,
     normalised, tokenised and encoded (pairs/s), and the ratio to the forward alone on the
     same pixels decoded and tokens made beforehand;
  3. one bf16 co-teaching step: each of two models trained with weighted InfoNCE on weights
     from its peer's per-sample losses (pipeline.core.losses, pipeline.core.coteach);
  4. FAISS at 1M vectors: an IVF index trained once, then built and searched on the GPU (when
     the smoke passed) and on CPU in the same run, through pipeline.core.search.knn.
pipeline needs the whole package (Ray): on a GPU, the suite's `gpu` tests (with pytest), then
the Ray job on a synthetic 224 px corpus: embed, warm-up, label passes on GPU index actors (when
the smoke passed), one co-teaching round, one DDP worker per GPU (CLI subprocesses).
Every figure is one JSON line on stdout; a missing dependency or a step that cannot run is a
line {"figure": ..., "skipped": "<why>"}, never a traceback. `--device cpu` runs the same steps
at tiny sizes (tests/test_gpu_check.py runs the kernels part that way).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package from this checkout, installed or not
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init only: nothing to download

# What each part imports, by module name -> the pip distribution that provides it.
KERNEL_DEPS = {
    "numpy": "numpy",
    "torch": "torch",
    "torchvision": "torchvision",
    "open_clip": "open_clip_torch",
    "faiss": "faiss-gpu>=1.14 (or faiss-cpu with --device cpu)",
    "PIL": "pillow",
}
PIPELINE_DEPS = {
    **KERNEL_DEPS,
    "ray": "ray[default,data]",
    "pydantic": "pydantic",
    "pyarrow": "pyarrow",
    "fsspec": "fsspec",
    "yaml": "pyyaml",
    "typer": "typer",
    "sklearn": "scikit-learn",
    "scipy": "scipy",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
}

# Sizes: the GPU figures of the issue, and tiny ones that keep --device cpu under a minute.
SIZES = {
    "cuda": dict(
        model="ViT-B-32", precision="bf16", jpeg_side=256, pairs=16384, batch=1024,
        train_batch=256, train_steps=5, knn_n=1_000_000, knn_queries=10_000, knn_dim=512,
        knn_factory="IVF4096,Flat", knn_train=131_072, knn_nprobe=32, knn_k=11,
        corpus=4000, image_size=224,
    ),
    "cpu": dict(
        model="ncl-tiny", precision="fp32", jpeg_side=80, pairs=32, batch=32,
        train_batch=16, train_steps=1, knn_n=10_000, knn_queries=500, knn_dim=128,
        knn_factory="IVF64,Flat", knn_train=4096, knn_nprobe=8, knn_k=11,
        corpus=400, image_size=64,
    ),
}  # fmt: skip


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def missing(deps: dict[str, str]) -> list[str]:
    """The pip names of `deps` whose module is not importable here."""
    return [dist for module, dist in deps.items() if importlib.util.find_spec(module) is None]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ environment


def environment(device) -> None:
    import faiss
    import open_clip
    import torch

    from pipeline.runtime.faiss_smoke import faiss_wheel

    gpu = {}
    if device.type == "cuda":
        gpu = {
            "gpu": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
        }
    emit(
        "environment",
        python=sys.version.split()[0],
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        open_clip=open_clip.__version__,
        faiss=faiss_wheel(),
        faiss_gpus=faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0,
        device=str(device),
        **gpu,
    )


def faiss_smoke() -> bool:
    """The kernel smoke on GPU 0; True when FAISS can index there."""
    from pipeline.runtime.faiss_smoke import faiss_gpu_problem

    start = time.perf_counter()
    problem = faiss_gpu_problem([0])
    emit("faiss_smoke", ok=problem is None, problem=problem, seconds=time.perf_counter() - start)
    return problem is None


# ------------------------------------------------------------------------------ encode


def synthetic_jpegs(count: int, side: int, seed: int = 0) -> list[bytes]:
    """`count` distinct smooth colour images as JPEG bytes (what a web shard holds)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    grid = np.linspace(0.0, 1.0, side, dtype=np.float32)
    out = []
    for _ in range(count):
        a, b, c = rng.random(3, dtype=np.float32)
        pixels = np.stack(
            [np.outer(grid, grid * a), np.outer(1 - grid, grid * b), np.full((side, side), c)], -1
        )
        buf = io.BytesIO()
        Image.fromarray((pixels * 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def device_decoder(loaded):
    """JPEG bytes -> (B, 3, S, S) float32 model-ready pixels on the model's device: the embed
    pass's device decode (torchvision's batched decode_jpeg, nvJPEG on CUDA; resize, crop and
    normalise there)."""
    from pipeline.models.encode import decode_pixels, pixel_spec

    spec = pixel_spec(loaded.preprocess)
    return lambda blobs: decode_pixels(blobs, spec, loaded.device)[0]


def encode_figures(device, sizes: dict) -> None:
    """Pairs/s end to end (bytes -> embeddings) and of the forward alone, on the same pairs."""
    from pipeline.models import ModelSpec, encode_pairs, load_clip

    spec = ModelSpec(name=sizes["model"], pretrained=None, precision=sizes["precision"])
    loaded = load_clip(spec, device)
    decode = device_decoder(loaded)
    batch, pairs = sizes["batch"], sizes["pairs"]
    blobs = synthetic_jpegs(batch, sizes["jpeg_side"])  # one batch of bytes, reused
    captions = [f"a photo of pattern {i} in colour {i % 7}" for i in range(batch)]
    batches = max(1, pairs // batch)

    def end_to_end():
        for _ in range(batches):
            pixels = decode(blobs)
            encode_pairs(loaded, pixels, loaded.tokenizer(captions))

    pixels, tokens = decode(blobs), loaded.tokenizer(captions).to(device)

    def forward():
        for _ in range(batches):
            encode_pairs(loaded, pixels, tokens)

    seconds = {}
    for name, run in (("end_to_end", end_to_end), ("forward", forward)):
        run()  # warm-up: kernels chosen, decoder initialised
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        seconds[name] = time.perf_counter() - start
    rate = {name: batches * batch / s for name, s in seconds.items()}
    emit(
        "encode",
        model=spec.name,
        image_size=int(pixels.shape[-1]),
        precision=spec.precision,
        batch=batch,
        pairs=batches * batch,
        decoder="pipeline.models.encode.decode_pixels",
        pairs_per_s=round(rate["end_to_end"], 1),
        forward_pairs_per_s=round(rate["forward"], 1),
        ratio_to_forward=round(rate["end_to_end"] / rate["forward"], 3),
    )


# ------------------------------------------------------------------------------ training


def coteach_step(models, optimizers, images, tokens, device, dtype) -> list[float]:
    """One co-teaching step: each model's weighted InfoNCE, weights from its peer's losses."""
    import numpy as np
    import torch

    from pipeline.core.coteach import Phase, training_targets
    from pipeline.core.losses.per_sample import infonce_per_sample
    from pipeline.core.losses.training import weighted_infonce
    from pipeline.core.partition.decisions import CLEAN

    def embed(model):
        img = torch.nn.functional.normalize(model.encode_image(images).float(), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(tokens).float(), dim=-1)
        return img, txt, model.logit_scale.exp()

    with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
        outputs = [embed(model) for model in models]
    labels = []
    for img, txt, scale in outputs:  # a peer's label: its per-sample loss, ranked, in [0, 1]
        i2t, t2i = infonce_per_sample(img.detach(), txt.detach(), scale.detach())
        rank = torch.argsort(torch.argsort(i2t + t2i)).float().cpu().numpy()
        labels.append(1.0 - rank / max(len(rank) - 1, 1))
    losses = []
    phase = Phase(noisy=True, quasi_clean=True)
    for (img, txt, scale), model, optimizer, peer in zip(
        outputs, models, optimizers, labels[::-1], strict=True
    ):
        subset = np.full(len(peer), CLEAN)
        weights = torch.from_numpy(training_targets("weights", phase, subset, peer).weight)
        loss = weighted_infonce(img, txt, scale, weights.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def training_figure(device, sizes: dict) -> None:
    import torch

    from pipeline.models import ModelSpec, load_clip
    from pipeline.models.encode import autocast_dtype_for

    batch = sizes["train_batch"]
    loaded = [
        load_clip(ModelSpec(sizes["model"], None, sizes["precision"], seed=s), device)
        for s in (0, 1)
    ]
    models = [x.model.train() for x in loaded]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-5, **fused) for m in models]
    decode = device_decoder(loaded[0])
    images = decode(synthetic_jpegs(batch, sizes["jpeg_side"], seed=1))
    tokens = loaded[0].tokenizer([f"pattern {i}" for i in range(batch)]).to(device)
    dtype = autocast_dtype_for(sizes["precision"], device) or torch.float32
    coteach_step(models, optimizers, images, tokens, device, dtype)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(sizes["train_steps"]):
        losses = coteach_step(models, optimizers, images, tokens, device, dtype)
    _sync(device)
    seconds = (time.perf_counter() - start) / sizes["train_steps"]
    emit(
        "coteach_step",
        model=sizes["model"],
        precision=str(dtype).removeprefix("torch."),
        batch=batch,
        seconds_per_step=round(seconds, 4),
        samples_per_s=round(2 * batch / seconds, 1),  # two models, one batch each
        losses=[round(x, 4) for x in losses],
        finite=all(x == x and abs(x) != float("inf") for x in losses),
    )


# ------------------------------------------------------------------------------ FAISS


def knn_figures(sizes: dict, gpu_ok: bool) -> None:
    """IVF build + search at `knn_n` vectors on the GPU (after the smoke) and on CPU."""
    import numpy as np

    from pipeline.core.search.knn import ShardedIndex, train_index

    n, dim, queries = sizes["knn_n"], sizes["knn_dim"], sizes["knn_queries"]
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    start = time.perf_counter()
    sample = vectors[rng.choice(n, min(n, sizes["knn_train"]), replace=False)]
    trained = train_index(sizes["knn_factory"], sample, ngpu=1 if gpu_ok else 0, niter=10)
    emit("faiss_train", factory=sizes["knn_factory"], rows=len(sample),
         on_gpu=gpu_ok, seconds=round(time.perf_counter() - start, 3))  # fmt: skip
    found, seconds = {}, {}
    for where, ngpu in (("gpu", 1), ("cpu", 0)):
        if where == "gpu" and not gpu_ok:
            emit("faiss_gpu", skipped="the FAISS kernel smoke failed (faiss_smoke line)")
            continue
        start = time.perf_counter()
        index = ShardedIndex.build(vectors, trained=trained, factory=sizes["knn_factory"],
                                   nprobe=sizes["knn_nprobe"], ngpu=ngpu)  # fmt: skip
        build_s = time.perf_counter() - start
        index.search(vectors[:8], sizes["knn_k"])  # warm-up
        start = time.perf_counter()
        _, found[where] = index.search(vectors[:queries], sizes["knn_k"])
        seconds[where] = time.perf_counter() - start
        self_found = float(np.mean(found[where][:, 0] == np.arange(queries)))
        emit(f"faiss_{where}", n=n, d=dim, queries=queries, k=sizes["knn_k"],
             factory=sizes["knn_factory"], nprobe=sizes["knn_nprobe"],
             build_s=round(build_s, 3), search_s=round(seconds[where], 4),
             queries_per_s=round(queries / seconds[where], 1),
             self_first=self_found)  # fmt: skip
    if len(seconds) == 2:
        pairs = zip(found["gpu"], found["cpu"], strict=True)
        same = float(np.mean([len(set(a) & set(b)) / len(a) for a, b in pairs]))
        emit("faiss_gpu_vs_cpu", search_speedup=round(seconds["cpu"] / seconds["gpu"], 2),
             same_neighbours=round(same, 4))  # fmt: skip


# ------------------------------------------------------------------------------ parts


def _step(name: str, run) -> None:
    """Run one step; any failure becomes its skipped line (the next steps still run)."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        emit(name, skipped=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")


def kernels(device_name: str) -> int:
    absent = missing(KERNEL_DEPS)
    if absent:
        emit("kernels", skipped=f"missing: pip install {' '.join(absent)}")
        return 2
    import torch

    if device_name == "cuda" and not torch.cuda.is_available():
        from pipeline.runtime.devices import cuda_unusable_reason

        emit("kernels", skipped=cuda_unusable_reason() or "CUDA is not available")
        return 2
    device = torch.device("cuda:0" if device_name == "cuda" else "cpu")
    sizes = SIZES[device_name]
    started = time.perf_counter()
    environment(device)
    gpu_ok = faiss_smoke()
    _step("encode", lambda: encode_figures(device, sizes))
    _step("coteach_step", lambda: training_figure(device, sizes))
    _step("faiss", lambda: knn_figures(sizes, gpu_ok))
    emit("kernels", seconds=round(time.perf_counter() - started, 1))
    return 0


def _job_yaml(work: Path, sizes: dict, device_name: str, index_gpus: int, workers: int) -> str:
    corpus = work / "corpus"
    gpu = device_name == "cuda"
    shards = max(1, sizes["corpus"] // 1000) if gpu else 2
    return f"""\
name: gpu-check
input: {{shards: "{corpus}/{{00000..{shards - 1:05d}}}.tar"}}
output: {work / "run"}
model: {{name: {sizes["model"]}, pretrained: null, precision: {"bf16" if gpu else "fp32"}}}
embed: {{batch_size: {256 if gpu else 64}, gpus_per_worker: {1 if gpu else 0},
         cpus_per_worker: {4 if gpu else 1}, decode_threads: {4 if gpu else 1}}}
labels: {{method: bicro}}
index: {{factory: Flat, shards: 1, gpus_per_actor: {index_gpus}}}
train:
  rounds: 1
  warmup_epochs: 1
  epochs_per_round: 1
  batch_size: {128 if gpu else 32}
  lr: 1.0e-4
  workers: {workers}
  warmup: {{mode: select, first_epoch_all: false}}
eval:
  ground_truth: {corpus}/ground_truth.parquet
  val_shards: {corpus}/val/00000.tar
  test_shards: {corpus}/test/00000.tar
seed: 0
"""


def _cli(args: list[str], log: Path) -> bool:
    """`python -m pipeline ARGS` with its output in `log`; False (and its tail on stderr)."""
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT).returncode  # fmt: skip
    if code != 0:
        sys.stderr.write("".join(log.read_text().splitlines(keepends=True)[-40:]))
    return code == 0


def job_figures(run: Path, workers: int) -> None:
    """The job's embed and training figures, from metrics.json and the training summaries."""
    metrics = json.loads((run / "metrics.json").read_text())
    for round_name, info in sorted(metrics.get("rounds", {}).items()):
        embed = info.get("embed") or {}
        emit("job_embed", round=int(round_name), pairs=embed.get("embedded"),
             pairs_per_s=embed.get("pairs_per_second"), seconds=embed.get("seconds"))  # fmt: skip
    for summary in sorted(run.glob("rounds/*/checkpoints/train_summary.json")):
        data = json.loads(summary.read_text())
        for view, info in data["views"].items():
            for record in info["history"]:
                emit("job_train", round=data["round"], view=view, epoch=record["epoch"],
                     workers=workers, samples_per_s=round(record["samples_per_s"], 1))  # fmt: skip


GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_knn.py", "tests/test_models.py")


def gpu_tests(work: Path) -> None:
    """The suite's `gpu` tests (explicit files: the rest of tests/ imports the dev extras)."""
    absent = missing({"pytest": "pytest", "pytest_timeout": "pytest-timeout"})
    if absent:
        emit("gpu_tests", skipped=f"missing: pip install {' '.join(absent)}")
        return
    log = work / "gpu_tests.log"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q",
                               "-p", "no:cacheprovider", *GPU_TEST_FILES], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT).returncode  # fmt: skip
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    emit("gpu_tests", ok=code == 0, summary=lines[-1] if lines else "", log=str(log))


def pipeline_part(device_name: str, work: Path) -> int:
    absent = missing(PIPELINE_DEPS)
    if absent:
        emit("pipeline", skipped=f"missing: pip install {' '.join(absent)}")
        return 2
    import torch

    sizes = SIZES[device_name]
    gpus = torch.cuda.device_count() if device_name == "cuda" else 0
    if device_name == "cuda" and gpus == 0:
        emit("pipeline", skipped="no CUDA GPU visible to torch")
        return 2
    index_gpus = 1 if gpus and faiss_smoke() else 0
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    corpus = work / "corpus"
    if not (corpus / "ground_truth.parquet").is_file():
        made = _cli(["make-corpus", "--out", str(corpus), "--samples", str(sizes["corpus"]),
                     "--samples-per-shard", str(1000 if gpus else sizes["corpus"] // 2),
                     "--val-samples", str(max(100, sizes["corpus"] // 8)),
                     "--test-samples", str(max(100, sizes["corpus"] // 8)),
                     "--image-size", str(sizes["image_size"])], work / "corpus.log")  # fmt: skip
        if not made:
            emit("pipeline", skipped=f"make-corpus failed: {work / 'corpus.log'}")
            return 1
    if gpus:
        gpu_tests(work)
    workers = max(1, gpus)
    (work / "job.yaml").write_text(_job_yaml(work, sizes, device_name, index_gpus, workers))
    shutil.rmtree(work / "run", ignore_errors=True)  # measure a whole run, nothing reused
    ran = _cli(["run", str(work / "job.yaml")], work / "run.log")
    emit("pipeline", ok=ran, index_gpus=index_gpus, workers=workers, log=str(work / "run.log"),
         seconds=round(time.perf_counter() - started, 1))  # fmt: skip
    if ran:
        job_figures(work / "run", workers)
    return 0 if ran else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--part", choices=("kernels", "pipeline"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--work", type=Path, default=None, help="pipeline: corpus and run here")
    args = parser.parse_args()
    if args.part == "kernels":
        return kernels(args.device)
    work = args.work or Path(tempfile.gettempdir()) / f"ncl-gpu-check-{args.device}"
    return pipeline_part(args.device, work)


if __name__ == "__main__":
    sys.exit(main())
