#!/usr/bin/env bash
# The AIPerf scenarios on the GPU machine in one run (about 5 minutes, at most ~8): install the
# carried wheels (Sanic from .device-wheels into /tmp/site; AIPerf from .aiperf-wheels into
# /tmp/aiperf-site, run through a launcher that sees only that folder and the image), then
# bench/aiperf/run.py on the ouro-1.4b preset (random bf16 weights generated into /tmp/serve-ckpt, shared
# with bench/gpu/serve_gpu.sh; not measured): every scenario at full depth with each scenario's request
# count x SCALE, then EXIT_SCENARIOS again at exit_threshold THRESHOLD. Every run is validated.
#
# On the GPU machine, from the repo root, after `python3 -m pip install --no-build-isolation --no-deps .`,
# with .device-wheels (bench/gpu/device-wheels.sh) and .aiperf-wheels (bench/aiperf/device-wheels.sh) copied there:
#   COMMIT=<sha>[+dirty] bash bench/aiperf/run_gpu.sh
# Writes to $OUT (default bench/results/aiperf-gpu-<UTC time>, git-ignored): aiperf.tgz (both results
# folders: manifests, AIPerf's summaries and records, server logs) and, in aiperf/, summary-full.md,
# manifest-full.json, summary-exit<T>.md, manifest-exit<T>.json and run_gpu.log; prints the summaries last. Exit status 1 if a pass failed
# validation, 3 if the set-up failed.
#
# Settings (environment): PRESET (ouro-1.4b), DTYPE (bfloat16), DEVICE (cuda), RUNNER (auto), SCALE (4),
# THRESHOLD (0.5), FULL_SCENARIOS (smoke,all), EXIT_SCENARIOS (latency_c1,batch_c4; '' for none), DEADLINE_S (450: seconds from the
# start after which a pass is stopped, its partial results kept), WORK (/tmp/aiperf-gpu), CKPT_DIR
# (/tmp/serve-ckpt), PYTHON (python3: runs the wrapper and the server), AIPERF_PYTHON (python3). SKIP_SETUP=1 skips the wheels and uses AIPERF (an AIPerf
# command); with PRESET=tiny DTYPE=float32 DEVICE=cpu RUNNER=torch SCALE=1 the same script runs on a CPU
# machine (docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/aiperf-gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/aiperf"
exec > >(tee -a "$OUT/aiperf/run_gpu.log") 2>&1
PRESET=${PRESET:-ouro-1.4b}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
RUNNER=${RUNNER:-auto}
SCALE=${SCALE:-4}
THRESHOLD=${THRESHOLD:-0.5}
EXIT_SCENARIOS=${EXIT_SCENARIOS-latency_c1,batch_c4}
FULL_SCENARIOS=${FULL_SCENARIOS:-smoke,all}
DEADLINE_S=${DEADLINE_S:-450}
WORK=${WORK:-/tmp/aiperf-gpu}
CKPT_DIR=${CKPT_DIR:-/tmp/serve-ckpt}
PY=${PYTHON:-python3}
AIPERF_PY=${AIPERF_PYTHON:-python3}  # the interpreter AIPerf runs on (the image's python3 there)
COMMIT=${COMMIT:-}  # the tree carried to the GPU machine has no .git: say which commit it is
echo "start $(date -u +%FT%TZ); commit ${COMMIT:-from git}; $(uptime)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

if [ -z "${SKIP_SETUP:-}" ]; then
  t=$SECONDS
  case ":${PYTHONPATH:-}:" in
    *:/tmp/site:*) ;;
    *) eval "$(bash .device-wheels/install.sh)" || { echo "server wheels failed"; exit 3; } ;;
  esac
  AIPERF_SITE=/tmp/aiperf-site PYTHON=$AIPERF_PY bash .aiperf-wheels/install.sh || {
    echo "AIPerf wheels failed"
    exit 3
  }
  mkdir -p /tmp/aiperf-bin
  # AIPerf sees the image and its own folder only, not /tmp/site (the vLLM client's pins).
  printf '#!/bin/sh\nPYTHONPATH=/tmp/aiperf-site exec %s -m aiperf "$@"\n' "$AIPERF_PY" > /tmp/aiperf-bin/aiperf
  chmod +x /tmp/aiperf-bin/aiperf
  AIPERF=/tmp/aiperf-bin/aiperf
  echo "wheels installed in $((SECONDS - t)) s"
fi
: "${AIPERF:?with SKIP_SETUP, set AIPERF to an AIPerf command}"

rm -rf "$WORK" && mkdir -p "$WORK"
rc=0
pass() {  # pass NAME THRESHOLD SCENARIO...: one wrapper run into $WORK/NAME under the deadline
  local name=$1 thr=$2 left=$((DEADLINE_S - SECONDS))
  shift 2
  if [ "$left" -lt 60 ]; then
    echo "$name: skipped, $left s left"
    rc=1
    return
  fi
  echo "$name: $left s left"
  timeout -s TERM -k 30 "$left" "$PY" -m bench.aiperf.run "$@" --preset "$PRESET" --dtype "$DTYPE" \
    --device "$DEVICE" --runner "$RUNNER" --exit-threshold "$thr" --requests-scale "$SCALE" \
    --ckpt-dir "$CKPT_DIR" --aiperf "$AIPERF" --startup-timeout 240 --aiperf-timeout 240 \
    ${COMMIT:+--commit "$COMMIT"} --out "$WORK/$name" || rc=1
  [ -f "$WORK/$name/summary.md" ] && cp "$WORK/$name/summary.md" "$OUT/aiperf/summary-$name.md"
  [ -f "$WORK/$name/manifest.json" ] && cp "$WORK/$name/manifest.json" "$OUT/aiperf/manifest-$name.json"
}
pass full 1.0 --scenario "$FULL_SCENARIOS"
[ -n "$EXIT_SCENARIOS" ] && pass "exit$THRESHOLD" "$THRESHOLD" --scenario "$EXIT_SCENARIOS"

# One tarball: only a few files come back from $OUT.
tar czf "$OUT/aiperf.tgz" -C "$WORK" .
echo "run_gpu exit $rc after $SECONDS s; $(uptime)"
cat "$OUT"/aiperf/summary-*.md 2> /dev/null
exit $rc
