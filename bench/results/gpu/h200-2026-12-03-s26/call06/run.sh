#!/usr/bin/env bash
# s26 call06: the add + RMSNorm kernels' warps (OURO_FAST_NORM_WARPS; default 16 at hidden 2048) now that the norm
# after down waits longer (call05). Captured loop at 1 and 8 rows (step_bench), two rounds, alternating.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
for rep in a b; do
  for w in 0 8 32 4; do
    OURO_FAST_NORM_WARPS=$w timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 \
      --tag "norm$w-$rep" >> "$O/step.jsonl" 2>> "$O/step.err"
    echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
  done
done
