#!/usr/bin/env bash
# s25 call06: prompt-step attention tile configs (bench/gpu/prefill_attention_bench.py) on the riders' shapes. Repo root.
# (the kernels import from the source tree: no build needed)
timeout 400 python3 -m bench.gpu.prefill_attention_bench > "$OUT/prefill_attention_bench.log" 2>&1
echo "rc=$?"
cat "$OUT/prefill_attention_bench.log"
