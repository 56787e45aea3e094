#!/usr/bin/env bash
# s20 call04: the serving benchmark at this session's code, then an engine-only A/B of the run-ahead
# depth (closed loops as vllm bench serve runs them: 1 and 8 streams, 128 in / 64 out, full depth).
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:?}
COMMIT=${COMMIT:-} DEADLINE_S=330 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1; echo "serve rc $?"
cat "$O/summary.md" | head -30
mkdir -p /tmp/ab && export PROBE_PROFILE=0 PROBE_RUN_AHEAD=full PROBE_CASES=none PROBE_CLOSED=1:1.0:16/8:1.0:64 OUT=/tmp/ab
for tag in d1a d2a d1b d2b; do
  PROBE_RUN_AHEAD_DEPTH=${tag:1:1} PROBE_TAG=$tag timeout -s KILL 100 python3 -P bench/gpu/engine_probe.py > /tmp/ab/probe_$tag.log 2>&1
  echo "== $tag"; grep closed /tmp/ab/probe_$tag.log | cut -c1-120
done
tar czf "$O/depth_ab.tgz" -C /tmp/ab .
