#!/usr/bin/env bash
# s28 call03: the final defaults (pauses only while the PDL wait lasts): the GPU tests of the tensor-core matmuls,
# the GPU runner and the run-ahead lanes; the captured loop at 1, 8 and 16 rows with the defaults, pausing
# regardless, and o_proj at 500 ns; then served (full depth c=1 and c=8, threshold 0.5 c=1 and c=8, one server).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 110 python3 -P -m pytest -q tests/test_tc_gemm.py tests/test_gpu_runner.py tests/test_runahead.py \
  > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 60 python3 -P bench/gpu/step_bench.py --rows 1 8 16 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
run default X=0
run regardless OURO_FAST_TC_PACE_UNTIL_GO=0
run o1 OURO_FAST_TC_PACE=2048x2048=1
mkdir -p "$O/serve"
OUT=$O/serve COMMIT=${COMMIT:?} RATE='' SKIP_SETUP=1 DEADLINE_S=330 timeout -s KILL 370 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$?"
cat "$O/serve/summary.md"
