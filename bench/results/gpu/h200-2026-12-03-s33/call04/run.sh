#!/usr/bin/env bash
# s33 call04 (b54bdec's code, on call03's warm machine; the device tool's command line, kept here): the AIPerf
# scenario call03's deadline cut (kv_pressure, SCALE=2), then latency_c1 and batch_c4 at threshold 0.5.
# Carried as call03: .aiperf-wheels and the slim .device-wheels.
eval "$(bash .device-wheels/install.sh)"; python3 -m pip install -q --no-build-isolation --no-deps . > /dev/null 2>&1; OUT=$OUT COMMIT=bf8eb2945f59491e1a3bf01e8df7f321a16f09dc SCALE=2 FULL_SCENARIOS=kv_pressure DEADLINE_S=200 timeout -s KILL 225 bash bench/aiperf/run_gpu.sh > /dev/null 2>&1; echo "aiperf rc=$?"; cat $OUT/aiperf/summary-*.md | grep -E '^\|' | cut -c1-240
