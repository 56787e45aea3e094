#!/usr/bin/env bash
# s33 call02 (b54bdec's code): served with vllm bench serve (full depth and threshold 0.5 at c=1 and c=8, no
# rate run), then the AIPerf scenarios at SCALE=1 (full depth, then latency_c1 and batch_c4 at 0.5), then
# test_dataflow.py (the one GPU test file call01's timeout cut) in what is left of the call.
# Repo root, .device-wheels and .aiperf-wheels carried.
set -u
O=${OUT:?}
C=${COMMIT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 200 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
t=$SECONDS
OUT=$O COMMIT=$C RATE='' SKIP_SETUP=1 DEADLINE_S=250 timeout -s KILL 270 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$? in $((SECONDS - t)) s"
cat "$O/summary.md"
t=$SECONDS
OUT=$O COMMIT=$C SCALE=1 DEADLINE_S=170 timeout -s KILL 190 bash bench/aiperf/run_gpu.sh > /dev/null 2>&1
echo "aiperf rc=$? in $((SECONDS - t)) s"
cat "$O"/aiperf/summary-*.md 2>/dev/null | grep -E '^\|' | cut -c1-220
left=$((575 - SECONDS))
t=$SECONDS
timeout -s KILL "$left" python3 -P -m pytest -q -p no:cacheprovider tests/test_dataflow.py > "$O/tests_dataflow.log" 2>&1
echo "dataflow tests rc=$? in $((SECONDS - t)) s (limit $left): $(tail -1 "$O/tests_dataflow.log")"
