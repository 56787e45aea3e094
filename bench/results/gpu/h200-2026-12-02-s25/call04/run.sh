#!/usr/bin/env bash
# s25 call04: the riders' o_proj and down as split-K batched matmuls with fp32 partials (bench/gpu/rider_gemm_bench.py
# splitk<S>) against F.linear, torch's default BLAS. Repo root; needs only torch.
timeout 200 python3 -m bench.gpu.rider_gemm_bench --ms 129 136 144 --pads 144 --splits 2 4 8 > "$OUT/rider_gemm_splitk.log" 2>&1
echo "rc=$?"
cat "$OUT/rider_gemm_splitk.log"
