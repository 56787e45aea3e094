#!/usr/bin/env bash
# s29 call01: the one-function pause (7c18790, compiled offline only until now): the GPU tests of the tensor-core
# matmuls (the paced-bits test for paces 1-4 with and without the flag), the GPU runner and the run-ahead lanes;
# then bench/gpu/loop_ab.py's first GPU run: the defaults against pausing regardless, and three switches not
# timed since the pacing (norms on 8 warps, the attention capped at 128 registers, 144 KB of matmul shared memory).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 130 python3 -P -m pytest -q tests/test_tc_gemm.py tests/test_gpu_runner.py tests/test_runahead.py \
  > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
timeout -s KILL 330 python3 -P bench/gpu/loop_ab.py --rows 1 8 --rounds 2 --out "$O/step.jsonl" \
  base "regardless OURO_FAST_TC_PACE_UNTIL_GO=0" "nw8 OURO_FAST_NORM_WARPS=8" "a128 OURO_FAST_ATTN_MAXNREG=128" \
  "s144 OURO_FAST_TC_SMEM=147456"
echo "loop_ab rc=$?"
