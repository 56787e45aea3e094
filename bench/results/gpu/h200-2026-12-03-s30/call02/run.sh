#!/usr/bin/env bash
# s30 call02: o_proj merges the decode attention's split partials (kernels/merge_o_proj.py, OURO_FAST_MERGE_O_PROJ =
# the most rows). Its GPU tests and the fused attention's, then the captured loop at 1 / 2 / 4 / 8 rows against the
# defaults, at four configs (OURO_FAST_MERGE_O_PROJ_CONFIG = BN:HPP:W_MODE:WARPS; the default 64:2:2:8).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 150 python3 -P -m pytest -q tests/test_merge_o_proj.py tests/test_decode_attention.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "FAILED|Error" "$O/tests.log" | head -5
timeout -s KILL 400 python3 -P bench/gpu/loop_ab.py --rows 1 2 4 8 --rounds 2 --out "$O/step.jsonl" \
  base "m OURO_FAST_MERGE_O_PROJ=8" "m128 OURO_FAST_MERGE_O_PROJ=8 OURO_FAST_MERGE_O_PROJ_CONFIG=128:2:2:8" \
  "mload OURO_FAST_MERGE_O_PROJ=8 OURO_FAST_MERGE_O_PROJ_CONFIG=64:2:1:8" \
  "mw4 OURO_FAST_MERGE_O_PROJ=8 OURO_FAST_MERGE_O_PROJ_CONFIG=64:2:2:4"
echo "loop_ab rc=$?"
