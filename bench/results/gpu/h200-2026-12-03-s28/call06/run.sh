#!/usr/bin/env bash
# s28 call06: with the pause taken only while the PDL wait lasts, qkv or gate_up at 500 ns instead of 1000 (s27
# measured 500 ns with the pause taken regardless). Captured loop at 1 and 8 rows, two rounds, alternating.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 60 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=0
  run "q1-$rep" OURO_FAST_TC_PACE=6144x2048=1
  run "g1-$rep" OURO_FAST_TC_PACE=11264x2048=1
done
