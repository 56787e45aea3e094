#!/usr/bin/env bash
# s26 call04: served with gate_up's SwiGLU output (tc_gemm swiglu_out): full depth at c=1 and c=8, and
# exit_threshold 0.5 at c=1 and c=8 (same server). Repo root, .device-wheels carried.
COMMIT=${COMMIT:?} RATE='' DEADLINE_S=420 timeout -s KILL 470 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo rc=$?
cat "$OUT/summary.md"
