#!/usr/bin/env bash
# The one-command GPU check (< 8 min on one GPU): run it on the first GPU machine, from the
# repository root, in an environment with the `gpu` extra (the Docker image, or
# `pip install -e '.[gpu,dev]'` beside a CUDA 12 torch; see docker/README.md).
#
#   benchmarks/gpu_check.sh [WORKDIR]        # default /tmp/ncl-gpu-check
#
# 1. CUDA usable by torch and faiss, else stop with the reason (driver/CUDA build).
# 2. The `gpu` tests (they fail, never skip, on a GPU machine without working CUDA).
# 3. Embed pairs/s, pipeline vs forward-only: ViT-B-32 random init, bf16, 224 px corpus.
# 4. FAISS at 1M vectors: an IVF index built and searched on one GPU, the same on CPU.
# 5. A cc3m-shaped job end to end (ViT-B-32 random init, bf16, 224 px, GPU embed actors, GPU
#    index actor, one warm-up epoch and one co-teaching round) with two training workers on
#    one GPU each when two GPUs are present; prints embed pairs/s and training samples/s.
# Every figure is one JSON line on stdout; the log of each step goes to WORKDIR/*.log.
set -euo pipefail

WORK=${1:-/tmp/ncl-gpu-check}
PY=${PYTHON:-python}
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
mkdir -p "$WORK"
started=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - started )) s)" >&2; }

step "1. CUDA"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >&2
GPUS=$(nvidia-smi -L | grep -c '^GPU ')
$PY - <<'EOF'
import json, sys

import faiss
import torch

from pipeline.runtime.devices import cuda_unusable_reason

reason = cuda_unusable_reason()
if reason:
    sys.exit(f"GPU check: {reason}")
if faiss.get_num_gpus() < 1:
    sys.exit("GPU check: faiss sees no GPU: install the gpu extra (faiss-gpu-cu12)")
from pipeline.models.encode import bf16_native

device = torch.device("cuda:0")
print(json.dumps({
    "figure": "gpu", "name": torch.cuda.get_device_name(device),
    "capability": list(torch.cuda.get_device_capability(device)),
    "bf16_native": bf16_native(device), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "faiss": faiss.__version__,
    "faiss_gpus": faiss.get_num_gpus(),
}), flush=True)
EOF

step "2. gpu tests"
$PY -m pytest -m gpu -q -p no:cacheprovider > "$WORK/pytest_gpu.log" 2>&1 \
    || { tail -40 "$WORK/pytest_gpu.log" >&2; exit 1; }
tail -1 "$WORK/pytest_gpu.log" >&2

step "3. corpus (224 px) and embed pairs/s"
CORPUS="$WORK/corpus"
if [ ! -f "$CORPUS/val/ground_truth.parquet" ] && [ ! -f "$CORPUS/ground_truth.parquet" ]; then
    ncl-pipeline make-corpus --out "$CORPUS" --samples 8000 --noise 0.4 --partial 0.1 \
        --seed 0 --samples-per-shard 1000 --test-samples 1000 --val-samples 500 \
        --image-size 224 > "$WORK/corpus.log" 2>&1
fi
$PY benchmarks/embed.py --corpus "$CORPUS" --model ViT-B-32 --batch 256 --threads 8 \
    --reps 1 --precision bf16 --device cuda 2> "$WORK/embed.log"

step "4. FAISS 1M vectors, GPU vs CPU"
for ngpu in 1 0; do
    $PY benchmarks/knn.py --skip-exact --approx-n 1000000 --approx-queries 2000 \
        --exact-reps 1 --reps 1 --ngpu "$ngpu" 2> "$WORK/knn_ngpu$ngpu.log" \
        | sed "s/^{/{\"ngpu\": $ngpu, /"
done

step "5. cc3m-shaped job ($GPUS GPU(s))"
WORKERS=$(( GPUS >= 2 ? 2 : 1 ))
cat > "$WORK/job.yaml" <<EOF
name: gpu-check
input: {shards: "$CORPUS/{00000..00007}.tar"}
output: $WORK/run
model: {name: ViT-B-32, pretrained: null, precision: bf16}
embed: {batch_size: 256, gpus_per_worker: 1, cpus_per_worker: 4, decode_threads: 4}
labels: {method: bicro}
index: {factory: Flat, shards: 1, gpus_per_actor: 1}
train:
  rounds: 1
  warmup_epochs: 1
  epochs_per_round: 1
  batch_size: 128
  lr: 1.0e-4
  workers: $WORKERS
  warmup: {mode: select, first_epoch_all: false}
eval:
  ground_truth: $CORPUS/ground_truth.parquet
  val_shards: $CORPUS/val/00000.tar
  test_shards: $CORPUS/test/00000.tar
seed: 0
EOF
rm -rf "$WORK/run"
ncl-pipeline run "$WORK/job.yaml" > "$WORK/run.log" 2>&1 || { tail -60 "$WORK/run.log" >&2; exit 1; }
$PY - "$WORK/run" "$WORKERS" <<'EOF'
import json, sys
from pathlib import Path

run, workers = Path(sys.argv[1]), int(sys.argv[2])
metrics = json.loads((run / "metrics.json").read_text())
print(json.dumps({"figure": "job.embed_pairs_per_s", "value": metrics.get("embed", {}).get("pairs_per_second")}))
for summary in sorted(run.glob("rounds/*/checkpoints/train_summary.json")):
    data = json.loads(summary.read_text())
    for view, info in data["views"].items():
        for record in info["history"]:
            print(json.dumps({
                "figure": "job.train_samples_per_s", "round": data["round"], "view": view,
                "epoch": record["epoch"], "workers": workers,
                "value": round(record["samples_per_s"], 1),
            }))
EOF
step "done"
