#!/usr/bin/env bash
# s27 call04: issue 8's engine report with rings capped at a CTA's tiles (as s26 call05): engine_probe at c=1 and c=8 full depth with
# the server's run-ahead (PROBE_RUN_AHEAD=full), closed loops with GPU-only traces, graph times, start-up, memory;
# trace_split on every trace (what each kernel adds to the chain).
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O/raw"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/raw/build.log" 2>&1 || { echo build failed; exit 1; }
OUT=$O/raw PROBE_TAG=full PROBE_RUN_AHEAD=full PROBE_TRACE=1 PROBE_TRACE_CPU=0 PROBE_CASES=1:1.0/8:1.0 \
  PROBE_CLOSED=1:1.0:16:4/8:1.0:64:16 timeout -s KILL 300 python3 -P bench/gpu/engine_probe.py > "$O/probe.log" 2>&1
echo "probe rc=$?"
for t in trace closed_1_1.0 closed_8_1.0; do
  [ -f "$O/raw/$t.json" ] || continue
  python3 bench/gpu/trace_split.py "$O/raw/$t.json" --top 30 --json "$O/raw/split_$t.json" > "$O/split_$t.txt" 2>&1
  gzip -f "$O/raw/$t.json"
done
tar -C "$O" -czf "$O/raw.tgz" raw && rm -rf "$O/raw"
grep '^{' "$O/probe.log" | cut -c1-400
head -14 "$O/split_trace.txt" 2>/dev/null
