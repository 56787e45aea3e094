#!/usr/bin/env bash
# s31 call03 (e954cbe's code: the session's final kernels, the two-early-tiles switch removed): the fused decode
# attention's GPU tests, then served: full depth and threshold 0.5 at c=1 and c=8 (no rate runs).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 120 python3 -P -m pytest -q tests/test_decode_attention.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -5
OUT=$O COMMIT=e954cbed41add6c455935a7010ce6f34b4b4b6c1 RATE='' SKIP_SETUP=1 DEADLINE_S=320 timeout -s KILL 350 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$?"
cat "$O/summary.md"
