#!/usr/bin/env bash
# The GPU checks in one run (about 6-8 minutes): install the carried wheels, build the
# project, run the GPU tests (kernels vs PyTorch, the Triton runner vs the torch runner, grammar masks on
# the device), then bench/gpu/engine_probe.py once per probe setting (by default: run-ahead as served,
# and off), so the step times can be compared on one machine in one call.
#
# On the GPU machine (repo root, with .device-wheels copied there; bench/gpu/device-wheels.sh builds it):  bash bench/gpu/check_gpu.sh
# Writes to $OUT (default bench/results/check-gpu-<UTC time>, git-ignored): check_gpu.log (everything
# printed), pytest.xml and engine_probe_<tag>.json per probe. Settings: TESTS (the test files, or none),
# PROBES ("ahead noahead": run-ahead on, and off; "fullahead": run-ahead at full depth too; or
# "TAG:VAR=VALUE,VAR=VALUE" for a probe with those environment variables), PROBE_CASES (engine_probe's cases; "none" for graph times only),
# PROBE_TRACE=1 (also a torch-profiler trace, trace.json), SKIP_SETUP=1 (wheels and build already done
# in this shell: eval "$(bash .device-wheels/install.sh)" exported).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-bench/results/check-gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/check_gpu.log") 2>&1
TESTS=${TESTS:-tests/test_kernels.py tests/test_decode_attention.py tests/test_skinny_gemm.py tests/test_fp8.py tests/test_batch_fidelity.py tests/test_tc_gemm.py tests/test_exit_gate.py tests/test_sample_kernel.py tests/test_precompile.py tests/test_gpu_runner.py tests/test_runahead.py tests/test_structured.py}
PROBES=${PROBES:-ahead noahead}
echo "start $(date -u +%FT%TZ); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
if [ -z "${SKIP_SETUP:-}" ]; then
  eval "$(bash .device-wheels/install.sh)" || { echo "wheel install failed"; exit 3; }
  python3 -m pip install -q --no-build-isolation --no-deps . || { echo "project build failed"; exit 3; }
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t=$SECONDS
rc=0
if [ "$TESTS" != none ]; then
  # -P: import the installed ouro_fast (with its compiled core), not the source tree.
  # shellcheck disable=SC2086
  python3 -P -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" $TESTS
  rc=$?
  echo "tests: rc=$rc in $((SECONDS - t)) s"
fi
for spec in $PROBES; do
  t=$SECONDS
  tag=${spec%%:*}
  ahead=1
  [ "$tag" = noahead ] && ahead=0
  [ "$tag" = fullahead ] && ahead=full
  extra=()
  [ "$spec" != "$tag" ] && IFS=, read -r -a extra <<< "${spec#*:}"
  env PROBE_RUN_AHEAD=$ahead PROBE_TAG="$tag" "${extra[@]}" python3 bench/gpu/engine_probe.py || rc=1
  echo "probe $tag: $((SECONDS - t)) s"
done
exit $rc
