#!/usr/bin/env bash
# s33 call01 (b54bdec, the final code of session 32): every GPU test file, then issue 8's engine report as in
# s26 call05: engine_probe at c=1 and c=8 full depth with the server's run-ahead, closed loops with GPU-only
# traces, captured graph times against the floor, start-up, memory; trace_split on every trace.
# Repo root, .device-wheels carried.
set -u
O=${OUT:?}; mkdir -p "$O/raw"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 200 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
t=$SECONDS
timeout -s KILL 300 python3 -P -m pytest -q -p no:cacheprovider --durations=12 tests/test_kernels.py \
  tests/test_decode_attention.py tests/test_skinny_gemm.py tests/test_tc_gemm.py tests/test_gpu_runner.py \
  tests/test_runahead.py tests/test_precompile.py tests/test_exit_gate.py tests/test_sample_kernel.py \
  tests/test_dataflow.py > "$O/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - t)) s: $(grep -E 'passed|failed' "$O/tests.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$O/tests.log" | head -8
t=$SECONDS
OUT=$O/raw PROBE_TAG=full PROBE_RUN_AHEAD=full PROBE_TRACE=1 PROBE_TRACE_CPU=0 PROBE_CASES=1:1.0/8:1.0 \
  PROBE_CLOSED=1:1.0:16:4/8:1.0:64:16 timeout -s KILL 230 python3 -P bench/gpu/engine_probe.py > "$O/probe.log" 2>&1
echo "probe rc=$? in $((SECONDS - t)) s"
for n in trace closed_1_1.0 closed_8_1.0; do
  [ -f "$O/raw/$n.json" ] || continue
  python3 bench/gpu/trace_split.py "$O/raw/$n.json" --top 30 --json "$O/raw/split_$n.json" > "$O/split_$n.txt" 2>&1
  gzip -f "$O/raw/$n.json"
done
tar -C "$O" -czf "$O/raw.tgz" raw && rm -rf "$O/raw"
grep '^{' "$O/probe.log" | cut -c1-500
head -14 "$O/split_trace.txt" 2>/dev/null
