#!/usr/bin/env bash
# s23 call03: which matmul's prologue norm costs what. The captured one-row loop's GPU time (step_bench)
# with OURO_FAST_TC_NORM off, on for both matmuls, for qkv only and for gate_up only, twice, alternating.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
for rep in a b; do
  for v in 0 1 qkv gate_up; do
    OURO_FAST_TC_NORM=$v timeout -s KILL 100 python3 -P bench/gpu/step_bench.py --rows 1 --replays 300 \
      --tag "$v-$rep" >> "$O/step.jsonl" 2>> "$O/step.err"
    echo "rc=$? $(tail -1 "$O/step.jsonl")"
  done
done
