#!/usr/bin/env bash
# s30 call04 (4d0e3b2119fa0fca94bf200744cff5231bc8d79c's code): the counter reset relaxed (default) against acq_rel (OURO_FAST_ATTN_RESET_SEM), as a
# captured loop at 1 / 2 / 8 rows; the attention timeline again (event 5 from one replay); then served at full depth
# (c=1 and c=8; no threshold or rate runs: the device budget). First the fused attention's GPU tests.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 120 python3 -P -m pytest -q tests/test_decode_attention.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -5
timeout -s KILL 120 python3 -P bench/gpu/loop_ab.py --rows 1 2 8 --rounds 2 --out "$O/step.jsonl" \
  base "acqrel OURO_FAST_ATTN_RESET_SEM=acq_rel"
echo "loop_ab rc=$?"
timeout -s KILL 60 python3 -P bench/gpu/attn_timeline.py --rows 1 8 --tag relaxed > "$O/timeline.jsonl" 2> "$O/timeline.err"
echo "timeline rc=$?"; cut -c1-900 "$O/timeline.jsonl"
mkdir -p "$O/serve"
OUT=$O/serve COMMIT=4d0e3b2119fa0fca94bf200744cff5231bc8d79c RATE='' THRESHOLD='' SKIP_SETUP=1 DEADLINE_S=200 timeout -s KILL 230 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$?"
cat "$O/serve/summary.md"
