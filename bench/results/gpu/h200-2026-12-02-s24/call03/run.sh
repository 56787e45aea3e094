#!/usr/bin/env bash
# s24 call03: issue 8's engine-only report at the current code: engine_probe (four cases, a closed loop at c=8
# full depth with a GPU-only trace of 60 calls, captured loop vs the floor, start-up, memory, profiler table
# and its c=1 trace), then trace_split on both traces (what each kernel adds to the chain, PDL overlaps removed).
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
OUT=$O PROBE_TAG=auto PROBE_TRACE=1 PROBE_TRACE_CPU=0 PROBE_CLOSED=8:1.0:64:16 \
  timeout -s KILL 400 python3 -P bench/gpu/engine_probe.py > "$O/probe.log" 2>&1
echo "probe rc=$?"
for t in trace closed_8_1.0; do
  [ -f "$O/$t.json" ] || continue
  python3 bench/gpu/trace_split.py "$O/$t.json" --top 30 --json "$O/split_$t.json" > "$O/split_$t.txt" 2>&1
  gzip -f "$O/$t.json"
done
grep -v "^ *$" "$O/probe.log" | tail -5
cat "$O/split_trace.txt" 2>/dev/null | head -20
