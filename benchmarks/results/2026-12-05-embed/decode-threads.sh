#!/bin/bash
cd /tmp/bench-tree
export PYTHONPATH=/tmp/bench-tree HF_HUB_OFFLINE=1
for i in 1 2; do
  for dt in 2 1; do
    echo "# decode_threads=$dt run=$i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
    /work/main/.venv/bin/python benchmarks/embed.py --corpus /tmp/embed-demo --reps 3 --decode cpu device --decode-threads $dt 2>/dev/null | grep -E "embed_efficiency|pairs_per_s.forward|pipeline_e2e"
  done
done
