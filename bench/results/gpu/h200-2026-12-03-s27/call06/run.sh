#!/usr/bin/env bash
# s27 call06: gate_up paced by default (PACE 2, from call05); pacing qkv, down or o_proj too (OURO_FAST_TC_PACE=NxK=2),
# whose first tiles also stream beside a running kernel. Captured loop at 1 and 8 rows (step_bench), two rounds.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=1
  run "qpace-$rep" OURO_FAST_TC_PACE=6144x2048=2
  run "dpace-$rep" OURO_FAST_TC_PACE=2048x5632=2
  run "opace-$rep" OURO_FAST_TC_PACE=2048x2048=2
done
