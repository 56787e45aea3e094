#!/usr/bin/env bash
# s22 call01: (1) the host time of one graph.replay() call for the runner's step graphs (decode at 1 and 8
# rows; a c=1 rider step, 1 lane + a 128-token prompt padded to 144 tokens), the GPU idle and busy
# (step_bench --host-replay); (2) served full depth and threshold 0.5 at concurrency 8 with the step's token
# budget at 512 (the server's default) and 2048 (engine_probe's), alternating, one server each.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 150 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 100 --host-replay \
  --prefill-lanes 1 --prefill-tokens 144 > "$O/step_bench.json" 2> "$O/step_bench.err"
cat "$O/step_bench.json"
serve() {  # tag, env...
  local tag=$1; shift
  env "$@" OUT="$O/$tag" SKIP_SETUP=1 CONCURRENCY=8:64 RATE='' THRESHOLD=0.5 COMMIT="${COMMIT:-}" DEADLINE_S=150 \
    bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "== $tag"; grep -E 'ready|-c8' "$O/$tag/summary.md"
}
serve t512a OURO_FAST_MAX_NUM_BATCHED_TOKENS=512
serve t2048a OURO_FAST_MAX_NUM_BATCHED_TOKENS=2048
serve t512b OURO_FAST_MAX_NUM_BATCHED_TOKENS=512
serve t2048b OURO_FAST_MAX_NUM_BATCHED_TOKENS=2048
cd "$O" && for t in t512a t2048a t512b t2048b; do cp $t/summary.md $t.md; done
tar czf all.tgz t512a t2048a t512b t2048b build.log step_bench.err && rm -rf t512a t2048a t512b t2048b build.log; ls
