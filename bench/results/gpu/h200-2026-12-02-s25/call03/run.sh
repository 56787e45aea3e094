#!/usr/bin/env bash
# s25 call03: the riders' cuBLAS matmuls at 129-264 rows (bench/gpu/rider_gemm_bench.py): torch's default BLAS,
# cuBLASLt with 1 MiB and 64 MiB of workspace. Repo root; needs only torch.
for cfg in "default:" "cublaslt:1024" "cublaslt:65536"; do
  blas=${cfg%%:*}; ws=${cfg#*:}
  env ${ws:+CUBLASLT_WORKSPACE_SIZE=$ws} timeout 200 python3 -m bench.gpu.rider_gemm_bench --blas "$blas" > "$OUT/rider_gemm_${blas}_${ws:-ws-default}.log" 2>&1
  echo "$blas $ws rc=$?"
done
for f in "$OUT"/*.log; do echo "== $f"; cat "$f"; done
