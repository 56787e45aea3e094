#!/usr/bin/env bash
# s21 call02: the lanes' records stored into the pinned host ring by the launch's last kernel (publish)
# against the copy after the graph (OURO_FAST_RECORDS_COPY=1): GPU tests, engine-only A/B (alternating, each
# setting its own process), and a GPU-only trace of the gap between lane graphs.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; tail -20 "$O/build.log"; exit 1; }
timeout -s KILL 200 python3 -P -m pytest -q -x tests/test_runahead.py tests/test_gpu_runner.py > "$O/tests.log" 2>&1
tail -2 "$O/tests.log"
export PROBE_PROFILE=0 PROBE_RUN_AHEAD=full PROBE_CASES=1:1.0/8:1.0 PROBE_CLOSED=1:1.0:16/8:1.0:64 OUT=$O
probe() {  # tag, env...
  local tag=$1; shift
  env "$@" PROBE_TAG=$tag timeout -s KILL 100 python3 -P bench/gpu/engine_probe.py > "$O/probe_$tag.log" 2>&1
  echo "== $tag"; grep -E '"closed|conc|graph_loop|tok_s' "$O/probe_$tag.log" | tr -d ' \n' | cut -c1-600; echo
}
probe new1
probe old1 OURO_FAST_RECORDS_COPY=1
probe new2
probe old2 OURO_FAST_RECORDS_COPY=1
PROBE_CASES=none PROBE_TRACE_CPU=0 PROBE_CLOSED=1:1.0:8:3/8:1.0:40:12 PROBE_TAG=trace timeout -s KILL 100 \
  python3 -P bench/gpu/engine_probe.py > "$O/probe_trace.log" 2>&1
cd "$O" && gzip -f closed_*.json; tar czf logs.tgz *.log && rm -f *.log; ls
