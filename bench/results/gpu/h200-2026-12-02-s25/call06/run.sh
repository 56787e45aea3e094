#!/usr/bin/env bash
# s25 call06: prompt-step attention tile configs (bench/gpu/prefill_attention_bench.py) on the riders' shapes. Repo root.
python3 -m pip install -q --no-build-isolation --no-deps . || { echo "project build failed"; exit 3; }
timeout 400 python3 -P -m bench.gpu.prefill_attention_bench > "$OUT/prefill_attention_bench.log" 2>&1
echo "rc=$?"
cat "$OUT/prefill_attention_bench.log"
