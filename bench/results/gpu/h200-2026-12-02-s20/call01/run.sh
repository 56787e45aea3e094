#!/usr/bin/env bash
# s20 call01: build, GPU tests of the changed paths, engine-only A/B of the lanes' PDL launches and the
# finer token buckets (each setting its own process, alternating).
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
git log --oneline -1 > "$O/commit.txt" 2>/dev/null
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; tail -20 "$O/build.log"; exit 1; }
export PROBE_PROFILE=0 PROBE_RUN_AHEAD=full PROBE_CASES=1:1.0/8:1.0 PROBE_CLOSED=1:1.0:16/8:1.0:64 OUT=$O
probe() {  # tag, env...
  local tag=$1; shift
  env "$@" PROBE_TAG=$tag timeout -s KILL 100 python3 -P bench/gpu/engine_probe.py > "$O/probe_$tag.log" 2>&1
  echo "== $tag"; grep -E '"closed|conc|graph_loop' "$O/probe_$tag.log" | cut -c1-400
}
probe new1
probe old1 OURO_FAST_PDL_PLAIN=lanes,sample,propagate OURO_FAST_TOKEN_BUCKETS=12:16
probe new2
probe old2 OURO_FAST_PDL_PLAIN=lanes,sample,propagate OURO_FAST_TOKEN_BUCKETS=12:16
probe pdlonly OURO_FAST_TOKEN_BUCKETS=12:16
timeout -s KILL 200 python3 -P -m pytest -q -x tests/test_runahead.py tests/test_gpu_runner.py tests/test_step_shapes.py \
  tests/test_sample_kernel.py > "$O/tests.log" 2>&1
tail -3 "$O/tests.log"
