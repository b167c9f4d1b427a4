#!/usr/bin/env bash
# One 2-CPU embed worker (the old CPU default) vs two 1-CPU workers (the new), alternating,
# each run --reps 3 on the demo corpus (CORPUS=...; ROUNDS=... alternations); quiet machine.
# Output: workers-ab.log (3,980 pairs), workers-ab-16k.log (16,000 pairs, ROUNDS=1)
set -u
cd "$(dirname "$0")/../../.."
for round in $(seq 1 "${ROUNDS:-2}"); do
  for workers in 1 2; do
    echo "# round $round, --workers $workers, $(date -u +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg)"
    python benchmarks/embed.py --corpus "${CORPUS:-/tmp/embed-demo}" --reps 3 \
      --workers "$workers" 2>>/tmp/workers-ab.err | grep '^{'
  done
done
