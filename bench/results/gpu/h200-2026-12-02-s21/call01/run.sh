#!/usr/bin/env bash
# s21 call01: build; GPU tests of the fused decode attention (with the new L2-prefetch mode); the captured loop
# (step_bench) at 1/4/8/16 rows under each early-K/V mode and decode-attention tile/split settings.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; tail -20 "$O/build.log"; exit 1; }
timeout -s KILL 150 python3 -P -m pytest -q -x tests/test_decode_attention.py -k fused > "$O/tests.log" 2>&1
tail -2 "$O/tests.log"
sb() {  # tag, early mode, attn configs...
  local tag=$1 mode=$2; shift 2
  OURO_FAST_EARLY_KV=$mode timeout -s KILL 120 python3 -P bench/gpu/step_bench.py --rows 1 4 8 16 --tag "$tag" \
    --attn-config "$@" > "$O/sb_$tag.json" 2> "$O/sb_$tag.err"
  echo "== $tag"; cat "$O/sb_$tag.json"; tail -2 "$O/sb_$tag.err"
}
sb reg1 1 8:8 16:8 16:16:2 8:16:2 4:16:4 32:8
sb l2 l2 8:8 16:8 16:16:2 8:16:2
sb after 0 8:8 16:8
sb reg2 1 8:8 16:8
