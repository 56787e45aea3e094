#!/usr/bin/env bash
# s27 call03: served with rings capped at a CTA's tiles (o_proj 2 slots): full depth at c=1 and c=8, and
# exit_threshold 0.5 at c=1 and c=8 (same server); then the GPU tests of the tensor-core matmuls, the GPU runner
# and the run-ahead lanes. Repo root, .device-wheels carried.
COMMIT=${COMMIT:?} RATE='' DEADLINE_S=420 timeout -s KILL 470 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo rc=$?
cat "$OUT/summary.md"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -P -m pytest -q tests/test_tc_gemm.py tests/test_gpu_runner.py tests/test_runahead.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$OUT/tests.log")"
