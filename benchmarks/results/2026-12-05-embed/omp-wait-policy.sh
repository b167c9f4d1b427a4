#!/bin/bash
# A/B of OpenMP's wait policy on the embed efficiency benchmark, alternating, from the bench tree.
cd /tmp/bench-tree
export PYTHONPATH=/tmp/bench-tree HF_HUB_OFFLINE=1
for i in 1 2; do
  for policy in default PASSIVE; do
    if [ "$policy" = default ]; then unset OMP_WAIT_POLICY; else export OMP_WAIT_POLICY=PASSIVE; fi
    echo "# policy=$policy run=$i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
    /work/main/.venv/bin/python benchmarks/embed.py --corpus /tmp/embed-demo --reps 3 --decode cpu device 2>/dev/null | grep -E "embed_efficiency|pairs_per_s.forward|pipeline_e2e"
  done
done
