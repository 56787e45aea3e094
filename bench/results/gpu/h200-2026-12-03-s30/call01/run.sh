#!/usr/bin/env bash
# s30 call01: what the decode attention's merge costs the loop, and what qkv's three fp32 slots cost it. Timing-only
# switches (WRONG results, step_bench only): OURO_FAST_ATTN_TIMING_NO_MERGE=1 (every slice writes its own output, no
# counter, no merge) and OURO_FAST_ATTN_TIMING_ONE_SLOT=1 (q, k, v from qkv's first slot only). First the fused
# attention's GPU tests at the defaults (the switches off must change nothing).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 100 python3 -P -m pytest -q tests/test_decode_attention.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
timeout -s KILL 380 python3 -P bench/gpu/loop_ab.py --rows 1 2 8 --rounds 2 --out "$O/step.jsonl" \
  base "nomerge OURO_FAST_ATTN_TIMING_NO_MERGE=1" "oneslot OURO_FAST_ATTN_TIMING_ONE_SLOT=1" \
  "both OURO_FAST_ATTN_TIMING_NO_MERGE=1 OURO_FAST_ATTN_TIMING_ONE_SLOT=1"
echo "loop_ab rc=$?"
