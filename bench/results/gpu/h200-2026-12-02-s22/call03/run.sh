#!/usr/bin/env bash
# s22 call03 (the warm machine of call02, its build of d89f385 kept): served full depth at concurrency 8
# only, GIL switch interval 0.5 ms against Python's 5 ms (OURO_FAST_GIL_SWITCH_MS), alternating, one server
# each (call02 ran out of time after one pair).
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
serve() {  # tag, env...
  local tag=$1; shift
  env "$@" OUT="$O/$tag" SKIP_SETUP=1 CONCURRENCY=8:64 RATE='' THRESHOLD='' COMMIT="${COMMIT:-}" DEADLINE_S=80 \
    bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "== $tag"; grep -E 'ready|-c8 ' "$O/$tag/summary.md"; cp "$O/$tag/summary.md" "$O/$tag.md"
}
serve s05c OURO_FAST_GIL_SWITCH_MS=0.5
serve s5c
serve s05d OURO_FAST_GIL_SWITCH_MS=0.5
serve s5d
cd "$O" && tar czf all.tgz s05c s5c s05d s5d && rm -rf s05c s5c s05d s5d; ls
