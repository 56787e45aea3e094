#!/usr/bin/env bash
# s26 call01: the down projection's own tile width, ring and shared-memory budget (OURO_FAST_TC_DOWN=TC:NBUF:KB),
# and every matmul at 128-wide tiles (OURO_FAST_TC_CONFIG=128:8:1): captured loop at 1 and 8 rows (step_bench),
# two rounds, alternating. First the tc_gemm GPU tests with down at 128-wide tiles (results against F.linear).
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
OURO_FAST_TC_DOWN=128:8:160 timeout -s KILL 150 python3 -P -m pytest -q -x tests/test_tc_gemm.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=1
  run "down128x8x160-$rep" OURO_FAST_TC_DOWN=128:8:160
  run "down128x6x113-$rep" OURO_FAST_TC_DOWN=128:6:113
  run "down256x2x113-$rep" OURO_FAST_TC_DOWN=256:2:113
  run "down128x4x90-$rep" OURO_FAST_TC_DOWN=128:4:90
  run "all128x8-$rep" OURO_FAST_TC_CONFIG=128:8:1
done
