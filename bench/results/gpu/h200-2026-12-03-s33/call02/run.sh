#!/usr/bin/env bash
# s33 call02 (b54bdec's code): served with vllm bench serve (full depth and threshold 0.5 at c=1 and c=8, no
# rate run), then the AIPerf scenarios at SCALE=2 (full depth, then latency_c1 and batch_c4 at 0.5).
# Repo root, .device-wheels and .aiperf-wheels carried.
set -u
O=${OUT:?}
C=${COMMIT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 200 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
t=$SECONDS
OUT=$O COMMIT=$C RATE='' SKIP_SETUP=1 DEADLINE_S=280 timeout -s KILL 300 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$? in $((SECONDS - t)) s"
cat "$O/summary.md"
t=$SECONDS
OUT=$O COMMIT=$C SCALE=2 DEADLINE_S=220 timeout -s KILL 240 bash bench/aiperf/run_gpu.sh > /dev/null 2>&1
echo "aiperf rc=$? in $((SECONDS - t)) s"
cat "$O"/aiperf/summary-*.md 2>/dev/null | grep -E '^\|' | cut -c1-220
