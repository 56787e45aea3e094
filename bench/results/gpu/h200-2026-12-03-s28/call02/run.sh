#!/usr/bin/env bash
# s28 call02: the pause only while the PDL wait lasts (OURO_FAST_TC_PACE_UNTIL_GO=1), and longer pauses (1500 / 2000
# ns) for gate_up, qkv and o_proj, against the defaults (all three at 1000 ns). The paced-bits GPU test first, then
# the captured loop at 1 and 8 rows (step_bench), two rounds, alternating. Repo root, .device-wheels carried.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 60 python3 -P -m pytest -q tests/test_tc_gemm.py -k paced > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 60 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=0
  run "untilgo-$rep" OURO_FAST_TC_PACE_UNTIL_GO=1
  run "g3-$rep" OURO_FAST_TC_PACE=11264x2048=3
  run "g4-$rep" OURO_FAST_TC_PACE=11264x2048=4
  run "q3-$rep" OURO_FAST_TC_PACE=6144x2048=3
  run "o3-$rep" OURO_FAST_TC_PACE=2048x2048=3
done
