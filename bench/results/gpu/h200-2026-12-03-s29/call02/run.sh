#!/usr/bin/env bash
# s29 call02: call01 found the decode attention capped at 128 registers a thread faster at one row (0.8447 against
# 0.851 ms) and slower at 8 (0.977 against 0.960). Which cap, up to how many rows: 96 / 112 / 128 / 144 against the
# compiler's choice at 1, 2, 4 and 8 rows, two rounds, alternating.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 400 python3 -P bench/gpu/loop_ab.py --rows 1 2 4 8 --rounds 2 --out "$O/step.jsonl" \
  base "a96 OURO_FAST_ATTN_MAXNREG=96" "a112 OURO_FAST_ATTN_MAXNREG=112" "a128 OURO_FAST_ATTN_MAXNREG=128" \
  "a144 OURO_FAST_ATTN_MAXNREG=144"
echo "loop_ab rc=$?"
