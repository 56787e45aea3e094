#!/usr/bin/env bash
# s27 call08: the final defaults (qkv, o_proj and gate_up paced in the decode loop): the GPU tests of the tensor-core
# matmuls and the GPU runner, then the captured loop at 1 and 8 rows once.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 90 python3 -P -m pytest -q tests/test_tc_gemm.py tests/test_gpu_runner.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
timeout -s KILL 40 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag final > "$O/step.jsonl" 2> "$O/step.err"
echo "rc=$? $(tail -1 "$O/step.jsonl")"
