#!/usr/bin/env bash
# s21 call04: served full depth at concurrency 8 only, run-ahead depth 1 against 2 (OURO_FAST_RUN_AHEAD_DEPTH),
# alternating, one server each: does the served run (the engine thread shares the GIL with the event loop)
# gain from a second launch queued ahead, where the engine alone did not (s20 call04)?
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
serve() {  # tag, env...
  local tag=$1; shift
  env "$@" OUT="$O/$tag" SKIP_SETUP=1 CONCURRENCY=8:64 RATE='' THRESHOLD='' COMMIT="${COMMIT:-}" DEADLINE_S=170 \
    bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "== $tag"; grep -E 'ready|full-c8' "$O/$tag/summary.md"
}
serve d1a
serve d2a OURO_FAST_RUN_AHEAD_DEPTH=2
serve d1b
serve d2b OURO_FAST_RUN_AHEAD_DEPTH=2
cd "$O" && for t in d1a d2a d1b d2b; do cp $t/summary.md $t.md; done; tar czf all.tgz d1a d2a d1b d2b build.log && rm -rf d1a d2a d1b d2b build.log; ls
