#!/usr/bin/env bash
# s25 call01: served full depth with newcomers aligned to the lanes' exits (the new default) against
# OURO_FAST_RUN_AHEAD_ALIGN=0, one machine: on (c=1, c=8), off (c=8), on (c=8) again. Repo root, .device-wheels carried.
C=${COMMIT:?}
OUT0=$OUT
OUT=$OUT0/on1 COMMIT=$C RATE='' THRESHOLD='' DEADLINE_S=320 timeout -s KILL 360 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "on1 rc=$?"
OUT=$OUT0/off OURO_FAST_RUN_AHEAD_ALIGN=0 SKIP_SETUP=1 CONCURRENCY=8:64 COMMIT=$C RATE='' THRESHOLD='' DEADLINE_S=95 \
  timeout -s KILL 110 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "off rc=$?"
OUT=$OUT0/on2 SKIP_SETUP=1 CONCURRENCY=8:64 COMMIT=$C RATE='' THRESHOLD='' DEADLINE_S=85 \
  timeout -s KILL 100 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "on2 rc=$?"
for d in on1 off on2; do echo "== $d"; cat $OUT0/$d/summary.md 2>/dev/null | head -30; done
