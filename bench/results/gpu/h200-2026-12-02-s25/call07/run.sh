#!/usr/bin/env bash
# s25 call07: served full depth c=1 and c=8 with the session's final serving code (4-warp prompt attention).
# Repo root, .device-wheels carried.
COMMIT=${COMMIT:?} RATE='' THRESHOLD='' DEADLINE_S=320 timeout -s KILL 360 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo rc=$?
cat "$OUT/summary.md"
