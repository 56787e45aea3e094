#!/usr/bin/env bash
# s27 call01: ring slots per matmul (OURO_FAST_TC_RING="NxK=slots,..."). The new default caps a ring at the CTA's
# tiles (o_proj 2 slots instead of 4), so o_proj's CTAs fit beside qkv's and gate_up's beside o_proj's; 3-slot
# qkv and down fit beside each other. Captured loop at 1 and 8 rows (step_bench), two rounds, alternating.
# First the tc_gemm GPU tests at the new default.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 150 python3 -P -m pytest -q -x tests/test_tc_gemm.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=1
  run "o4-$rep" OURO_FAST_TC_RING=2048x2048=4
  run "q3d3-$rep" OURO_FAST_TC_RING=6144x2048=3,2048x5632=3
  run "q3-$rep" OURO_FAST_TC_RING=6144x2048=3
  run "d3-$rep" OURO_FAST_TC_RING=2048x5632=3
  run "q2-$rep" OURO_FAST_TC_RING=6144x2048=2
done
