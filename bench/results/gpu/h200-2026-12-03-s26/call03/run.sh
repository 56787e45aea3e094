#!/usr/bin/env bash
# s26 call03: gate_up hands down silu(gate) * up (tc_gemm swiglu_out, default on). GPU tests (tc_gemm: the
# SwiGLU output bit for bit against silu_and_mul of the plain product, the MLP bit for bit against the SILU_MUL
# path, the engine against the fp32 dense reference; gpu_runner and run-ahead), then the captured loop at
# 1 / 8 / 16 rows with it on and off (OURO_FAST_TC_SWIGLU=0), two rounds, alternating.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 300 python3 -P -m pytest -q tests/test_tc_gemm.py tests/test_gpu_runner.py tests/test_runahead.py \
  > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 16 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-180)"
}
for rep in a b; do
  run "swiglu-$rep" X=1
  run "silu_mul-$rep" OURO_FAST_TC_SWIGLU=0
done
