#!/usr/bin/env bash
# s33 call02 (b54bdec's code): served with vllm bench serve (full depth and threshold 0.5 at c=1 and c=8, no
# rate run), then test_dataflow.py (the one GPU test file call01's timeout cut) in what is left of the call.
# Repo root, .device-wheels carried. (AIPerf was dropped: the tree and both wheel folders exceed the 64 MiB
# the device tool carries.)
set -u
O=${OUT:?}
C=${COMMIT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 200 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
t=$SECONDS
OUT=$O COMMIT=$C RATE='' SKIP_SETUP=1 DEADLINE_S=250 timeout -s KILL 270 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$? in $((SECONDS - t)) s"
cat "$O/summary.md"
left=$((575 - SECONDS))
t=$SECONDS
timeout -s KILL "$left" python3 -P -m pytest -q -p no:cacheprovider tests/test_dataflow.py > "$O/tests_dataflow.log" 2>&1
echo "dataflow tests rc=$? in $((SECONDS - t)) s (limit $left): $(tail -1 "$O/tests_dataflow.log")"
