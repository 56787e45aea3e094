#!/usr/bin/env bash
# The serving benchmark on the GPU machine, in one run (about 4-6 minutes, at most ~8):
# install the carried wheels, build the project, then bench/serve_bench.py on the ouro-1.4b preset
# (random bf16 weights, generated into /tmp; not measured) with the vLLM 0.33.0 client from the wheels:
# full depth at concurrency 1 (32 prompts) and 8 (64), a Poisson run at 4 requests/s (64), and
# exit_threshold 0.5 (through --extra-body, same server) at concurrency 1 and 8.
#
# On the GPU machine (repo root, with .device-wheels copied there; bench/gpu/device-wheels.sh builds it):
#   COMMIT=<sha>[+dirty] bash bench/gpu/serve_gpu.sh
# Writes to $OUT (default bench/results/serve-gpu-<UTC time>, git-ignored; few files and at most two
# folder levels, so that the results are easy to copy back): summary.md (the table, and the validation errors if any),
# manifest.json, results.tgz (every raw client JSON, logs, the server log) and serve_gpu.log. Exit
# status: serve_bench's (1 if any run failed validation).
#
# Budget on the H200: the server is ready in ~12 s with Triton's cache warm (~15 s on a fresh machine);
# each `vllm bench serve` call then costs ~21 s of client start on top of its run: one warm-up per depth
# policy, plus one call per run (c=1 with 32 prompts runs ~8.5 s, c=8 with 64 ~2.5 s). The defaults
# (5 runs, 2 warm-ups) need ~5-6 min; one c=8 run alone ~65 s after the server is ready. The first call on
# a machine also generates the checkpoint (~17 s) inside DEADLINE_S.
#
# Settings (environment): PRESET (ouro-1.4b), DTYPE (bfloat16), DEVICE (cuda), RUNNER (auto),
# CONCURRENCY (1:32,8:64), RATE (4:64, '' for none), THRESHOLD (0.5, '' for none), PYTHON and CLIENT_PYTHON
# (python3), DEADLINE_S (450: seconds from the start after which serve_bench is stopped, its
# partial results kept), WORK (/tmp/serve-gpu). SKIP_SETUP=1 skips the wheels and the build: with
# PRESET=tiny DTYPE=float32 DEVICE=cpu RUNNER=torch and the client venv as CLIENT_PYTHON, the same
# script runs on a CPU machine (docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/serve-gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/serve_gpu.log") 2>&1
PRESET=${PRESET:-ouro-1.4b}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
RUNNER=${RUNNER:-auto}
CONCURRENCY=${CONCURRENCY:-1:32,8:64}
RATE=${RATE-4:64}
THRESHOLD=${THRESHOLD-0.5}
PY=${PYTHON:-python3}
CLIENT_PYTHON=${CLIENT_PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-450}
WORK=${WORK:-/tmp/serve-gpu}
COMMIT=${COMMIT:-}  # the tree carried to the GPU machine has no .git: say which commit it is
echo "start $(date -u +%FT%TZ); commit ${COMMIT:-from git}; $(uptime)"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

if [ -z "${SKIP_SETUP:-}" ]; then
  t=$SECONDS
  eval "$(bash .device-wheels/install.sh)" || { echo "wheel install failed"; exit 3; }
  echo "wheels installed in $((SECONDS - t)) s (PYTHONPATH=$PYTHONPATH)"
  t=$SECONDS
  "$PY" -m pip install -q --no-build-isolation --no-deps . || { echo "project build failed"; exit 3; }
  echo "project built in $((SECONDS - t)) s"
fi

rm -rf "$WORK" && mkdir -p "$WORK"
run="$PRESET-$DEVICE-$(date -u +%Y%m%d-%H%M)"
left=$((DEADLINE_S - SECONDS))
echo "serve_bench: $left s left"
timeout -s TERM -k 30 "$left" "$PY" -m bench.serve_bench \
  --preset "$PRESET" --dtype "$DTYPE" --device "$DEVICE" --runner "$RUNNER" \
  --ckpt-dir /tmp/serve-ckpt --client-python "$CLIENT_PYTHON" \
  --concurrency "$CONCURRENCY" --rate "$RATE" ${THRESHOLD:+--exit-threshold "$THRESHOLD"} \
  --startup-timeout 240 --client-timeout 240 ${COMMIT:+--commit "$COMMIT"} --out "$WORK/$run"
rc=$?

# One summary and one tarball: what comes back from $OUT is limited in files and depth.
if [ -f "$WORK/$run/summary.md" ]; then cp "$WORK/$run/summary.md" "$OUT/summary.md"; fi
if [ -f "$WORK/$run/manifest.json" ]; then cp "$WORK/$run/manifest.json" "$OUT/manifest.json"; fi
tar czf "$OUT/results.tgz" -C "$WORK" "$run"
echo "serve_bench exit $rc after $SECONDS s; $(uptime)"
cat "$OUT/summary.md" 2> /dev/null || tail -n 40 "$WORK/$run/server.log"
exit $rc
