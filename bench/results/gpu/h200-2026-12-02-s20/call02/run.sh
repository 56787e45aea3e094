#!/usr/bin/env bash
# s20 call02: GPU timelines (torch profiler, CUDA activity only) of 60 engine calls in closed loops at
# concurrency 1 and 8, full depth: what runs between two lane graphs.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
git log --oneline -1 > "$O/commit.txt" 2>/dev/null
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
export PROBE_PROFILE=0 PROBE_RUN_AHEAD=full PROBE_CASES=none OUT=$O PROBE_TRACE_CPU=0
PROBE_CLOSED=1:1.0:8:3/8:1.0:40:12 PROBE_TAG=trace timeout -s KILL 150 python3 -P bench/gpu/engine_probe.py > "$O/probe_trace.log" 2>&1
PROBE_TRACE_CPU=1 PROBE_CLOSED=1:1.0:8:3 PROBE_TAG=tracecpu OUT=$O/cpu timeout -s KILL 100 bash -c 'mkdir -p $OUT; python3 -P bench/gpu/engine_probe.py' > "$O/probe_tracecpu.log" 2>&1
grep -E 'closed' "$O/probe_trace.log" | cut -c1-300
cd "$O" && gzip -f closed_*.json cpu/closed_*.json; ls -la "$O" "$O/cpu"
