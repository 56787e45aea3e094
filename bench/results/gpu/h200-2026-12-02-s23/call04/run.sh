#!/usr/bin/env bash
# s23 call04: the served figures of this session's code (the same serving code as s22), full depth, c=1
# (32 prompts) and c=8 (64), one server, the defaults.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
OUT="$O" CONCURRENCY=1:32,8:64 RATE='' THRESHOLD='' COMMIT="${COMMIT:-}" DEADLINE_S=300 \
  bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "rc=$?"; cat "$O/summary.md"
