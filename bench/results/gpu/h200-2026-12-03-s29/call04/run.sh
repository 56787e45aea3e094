#!/usr/bin/env bash
# s29 call04: served at full depth, c=1 only (32 prompts), three servers in turn: the defaults (the attention capped
# at 128 registers at 1-2 rows), no cap (OURO_FAST_ATTN_MAXNREG=0), the defaults again.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
serve() {  # tag, then env assignments
  local tag=$1; shift
  mkdir -p "$O/$tag"
  env "$@" OUT=$O/$tag COMMIT=${COMMIT:?} CONCURRENCY=1:32 RATE='' THRESHOLD='' SKIP_SETUP=1 DEADLINE_S=110 \
    timeout -s KILL 130 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "$tag rc=$? $(grep '^| full-c1' "$O/$tag/summary.md")"
}
serve cap-a X=0
serve nocap OURO_FAST_ATTN_MAXNREG=0
serve cap-b X=0
