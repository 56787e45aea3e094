#!/usr/bin/env bash
# s29 call03: the decode attention capped at 128 registers a thread at 1-2 rows (the default now): the GPU tests of
# the decode attention (the capped kernel bit for bit against the three launches, capped or not), the GPU runner
# and the run-ahead lanes; the loop against no cap at 1, 2, 4 and 8 rows; then served (full depth c=1 and c=8,
# threshold 0.5 c=1 and c=8, one server).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 120 python3 -P -m pytest -q tests/test_decode_attention.py tests/test_gpu_runner.py tests/test_runahead.py \
  > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
timeout -s KILL 120 python3 -P bench/gpu/loop_ab.py --rows 1 2 4 8 --rounds 2 --out "$O/step.jsonl" \
  base "nocap OURO_FAST_ATTN_MAXNREG=0"
echo "loop_ab rc=$?"
mkdir -p "$O/serve"
OUT=$O/serve COMMIT=${COMMIT:?} RATE='' SKIP_SETUP=1 DEADLINE_S=330 timeout -s KILL 370 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$?"
cat "$O/serve/summary.md"
