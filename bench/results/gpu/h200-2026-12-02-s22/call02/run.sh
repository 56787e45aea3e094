#!/usr/bin/env bash
# s22 call02: served full depth at concurrency 1 and 8 and threshold 0.5 at 8, the worker's GIL switch
# interval at Python's 5 ms against 0.5 ms (OURO_FAST_GIL_SWITCH_MS), alternating, one server each: does the
# engine-owner thread wait for the GIL behind the event loop (served c=8 trails the engine's closed loop)?
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
serve() {  # tag, env...
  local tag=$1; shift
  env "$@" OUT="$O/$tag" SKIP_SETUP=1 CONCURRENCY=1:32,8:64 RATE='' THRESHOLD=0.5 COMMIT="${COMMIT:-}" DEADLINE_S=150 \
    bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "== $tag"; grep -E 'ready|-c1 |-c8 ' "$O/$tag/summary.md"
}
serve s5a
serve s05a OURO_FAST_GIL_SWITCH_MS=0.5
serve s5b
serve s05b OURO_FAST_GIL_SWITCH_MS=0.5
cd "$O" && for t in s5a s05a s5b s05b; do cp $t/summary.md $t.md; done
tar czf all.tgz s5a s05a s5b s05b build.log && rm -rf s5a s05a s5b s05b build.log; ls
