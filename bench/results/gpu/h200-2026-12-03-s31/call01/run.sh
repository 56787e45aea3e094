#!/usr/bin/env bash
# s31 call01 (7978e78's code): the fused decode attention's GPU tests (the stamps test first run since the shared stamp
# helper); OURO_FAST_EARLY_KV_TILES=2 against the default as a captured loop at 1 / 2 / 8 rows; then launch settings
# (SPLITS:BLOCK_N:WARPS) at 1 and 8 rows with one and two early K/V tiles: with two tiles a slice of 2 tiles is loaded
# whole before the PDL wait, and 1:128 needs no merge at all.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 150 python3 -P -m pytest -q tests/test_decode_attention.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -5
timeout -s KILL 150 python3 -P bench/gpu/loop_ab.py --rows 1 2 8 --rounds 2 --out "$O/step.jsonl" \
  base "t2 OURO_FAST_EARLY_KV_TILES=2"
echo "loop_ab rc=$?"
for t in 1 2; do
  OURO_FAST_EARLY_KV_TILES=$t timeout -s KILL 120 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 \
    --tag "cfg-t$t" --attn-config 16:16:2 8:16:2 4:32:2 2:64:4 1:128:4 1:128:8 >> "$O/configs.jsonl" 2>> "$O/configs.err"
  echo "configs t$t rc=$?"
done
cat "$O/configs.jsonl"; tail -3 "$O/configs.err"
