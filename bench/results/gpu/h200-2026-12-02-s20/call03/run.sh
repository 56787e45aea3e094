#!/usr/bin/env bash
# s20 call03: the GPU timeline between lane graphs once an unchanged launch copies no inputs (call02's
# method), a cProfile of the host in a closed loop at concurrency 1 (where rider launches leave the GPU
# idle), and the GPU tests of run-ahead and the runner.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
git log --oneline -1 > "$O/commit.txt" 2>/dev/null
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
export PROBE_PROFILE=0 PROBE_RUN_AHEAD=full PROBE_CASES=none OUT=$O
PROBE_TRACE_CPU=0 PROBE_CLOSED=1:1.0:8:3/8:1.0:40:12 PROBE_TAG=trace timeout -s KILL 150 python3 -P bench/gpu/engine_probe.py > "$O/probe_trace.log" 2>&1
grep -E 'closed' "$O/probe_trace.log" | cut -c1-200
PROBE_CLOSED=1:1.0:16 PROBE_TAG=cprof timeout -s KILL 150 python3 -P -m cProfile -o "$O/cprof_c1.prof" bench/gpu/engine_probe.py > "$O/probe_cprof.log" 2>&1
grep -E 'closed' "$O/probe_cprof.log" | cut -c1-200
timeout -s KILL 240 python3 -P -m pytest -q -x tests/test_runahead.py tests/test_gpu_runner.py > "$O/tests.log" 2>&1
tail -3 "$O/tests.log"
cd "$O" && gzip -f closed_*.json && tar czf logs.tgz *.log engine_probe_*.json && rm -f *.log engine_probe_*.json; ls -la
