#!/usr/bin/env bash
# s24 call02: the fused decode attention with fewer, wider programs. The captured loop's GPU time (step_bench) at
# 1 / 8 / 16 rows with the attention's SPLITS:BLOCK_N:WARPS forced, contexts 160 and 512, each context twice.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
CFGS="1:128:8 2:128:8 2:64:4 4:64:4 4:64:2 8:32:2 8:32:4"
for rep in a b; do
  for ctx in 160 512; do
    timeout -s KILL 200 python3 -P bench/gpu/step_bench.py --rows 1 8 16 --replays 200 --context $ctx \
      --attn-config $CFGS --tag "ctx$ctx-$rep" >> "$O/step.jsonl" 2>> "$O/step.err"
    echo "rc=$? $(tail -1 "$O/step.jsonl")"
  done
done
