#!/usr/bin/env bash
# s24 call01: the tensor-core matmuls asking L2 for the tiles past their ring before the PDL wait. The captured
# loop's GPU time (step_bench, 1 and 8 rows, context 160) with OURO_FAST_TC_L2_AHEAD 0 / 2 / 5 / 8, twice,
# alternating; then the tc_gemm GPU tests with it at 5.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$O/gpu.txt" 2>&1
for rep in a b; do
  for v in 0 2 5 8; do
    OURO_FAST_TC_L2_AHEAD=$v timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 \
      --tag "ahead$v-$rep" >> "$O/step.jsonl" 2>> "$O/step.err"
    echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-300)"
  done
done
OURO_FAST_TC_L2_AHEAD=5 timeout -s KILL 150 python3 -P -m pytest -q -x tests/test_tc_gemm.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
