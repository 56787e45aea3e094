#!/usr/bin/env bash
# s27 call07: pacing qkv and o_proj together, and qkv at 500 ns (call06: qkv paced 0.856 / 0.964 ms, o_proj 0.862 / 0.968,
# against 0.866 / 0.978 with gate_up alone). Captured loop at 1 and 8 rows (step_bench), two rounds.
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
  run "q2-$rep" OURO_FAST_TC_PACE=6144x2048=2
  run "q2o2-$rep" OURO_FAST_TC_PACE=6144x2048=2,2048x2048=2
  run "q1o2-$rep" OURO_FAST_TC_PACE=6144x2048=1,2048x2048=2
done
