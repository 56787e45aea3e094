#!/usr/bin/env bash
# s24 call05: the serving benchmark with the 160 KB shared-memory default (6982bb1), full depth c=1 and c=8 only
# (the device budget left ~6 minutes). Run from the repo root with .device-wheels carried.
COMMIT=6982bb1 RATE='' THRESHOLD='' DEADLINE_S=320 timeout -s KILL 390 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo rc=$?
