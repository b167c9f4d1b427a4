#!/bin/bash
# Trainer vs plain loop: the per-epoch pipelines (main, 1e93744) against one pipeline per round
# (round-pipeline branch), alternating, each on a fresh local Ray, the machine otherwise idle.
export HF_HUB_OFFLINE=1
for i in 1 2; do
  for tree in /tmp/bench-tree /tmp/wt-pipe; do
    echo "# tree=$tree run=$i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
    (cd $tree && PYTHONPATH=$tree /work/main/.venv/bin/python benchmarks/train.py --samples 2000 --epochs 5 --throughput-only 2>/dev/null | grep train_throughput)
  done
done
