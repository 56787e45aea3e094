#!/usr/bin/env bash
# s33 call03 (b54bdec's code): the AIPerf scenarios on the GPU at SCALE=2 (every scenario at full depth, then
# latency_c1 and batch_c4 at threshold 0.5). Repo root; carried: .aiperf-wheels and a slim .device-wheels (the
# server's wheels without the vLLM client, whose 11 MB and vLLM-only wheels would take the carried tree past
# the device tool's 64 MiB; its install.sh skips the client when absent).
set -u
O=${OUT:?}
C=${COMMIT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 200 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
t=$SECONDS
OUT=$O COMMIT=$C SCALE=2 DEADLINE_S=270 timeout -s KILL 300 bash bench/aiperf/run_gpu.sh > /dev/null 2>&1
echo "aiperf rc=$? in $((SECONDS - t)) s"
grep -E 'left|skipped|valid|FAIL|rror' "$O/aiperf/run_gpu.log" | head -12
cat "$O"/aiperf/summary-*.md 2>/dev/null | grep -E '^\|' | cut -c1-240
