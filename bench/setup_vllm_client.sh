#!/usr/bin/env bash
# Build the pinned benchmark client (vLLM 0.33.0, unmodified) in its own virtual
# environment on a CPU machine, without pulling a CUDA torch:
#   1. torch==2.13.0, the CPU build (this machine's pip finds it on disk; elsewhere
#      set TORCH_SPEC to a pip argument list that resolves to a CPU wheel);
#   2. vllm==0.33.0 and bench/client-requirements.txt, all with --no-deps (vLLM's
#      metadata would pull a CUDA torch and ~9 GB of kernels the client never loads).
# Idempotent: an up-to-date venv (same requirements) is only smoke-tested again.
# Prints the venv's path on its last line.
#
# Usage:  bash bench/setup_vllm_client.sh            # venv at $CLIENT_VENV
#         CLIENT_VENV=/somewhere bash bench/setup_vllm_client.sh
# Then:   VLLM_TARGET_DEVICE=cpu $CLIENT_VENV/bin/python -m vllm.entrypoints.cli.main bench serve ...
#
# On the GPU machine (no network) use bench/gpu/device-wheels.sh instead:
# run it here in the repo root, copy .device-wheels/ with the project, and there
#   eval $(bash .device-wheels/install.sh)
#   python3 -m vllm.entrypoints.cli.main bench serve ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
REQS="$here/client-requirements.txt"
CLIENT_VENV=${CLIENT_VENV:-/tmp/ouro_fast-vllm-client}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp="$CLIENT_VENV/.ouro_fast-client-stamp"
want="$(cat "$REQS") | $TORCH_SPEC"

smoke() {
  # The two things the benchmarks import: the serving client's CLI and the v1 scheduler.
  VLLM_TARGET_DEVICE=cpu "$CLIENT_VENV/bin/python" - <<'PY'
import torch
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
import vllm.benchmarks.serve  # noqa: F401
import vllm, sys
assert torch.version.cuda is None, f"the client venv holds a CUDA torch ({torch.__version__})"
assert vllm.__version__ == "0.33.0", vllm.__version__
PY
  VLLM_TARGET_DEVICE=cpu "$CLIENT_VENV/bin/python" -m vllm.entrypoints.cli.main bench serve --help >/dev/null 2>&1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && smoke 2>/dev/null; then
  echo "client venv up to date" >&2
  echo "$CLIENT_VENV"
  exit 0
fi
[ -x "$CLIENT_VENV/bin/python" ] || "$PYTHON" -m venv "$CLIENT_VENV"
pip="$CLIENT_VENV/bin/python -m pip"
# shellcheck disable=SC2086  # TORCH_SPEC may carry several pip arguments
$pip install -q $TORCH_SPEC 2>&1 | grep -v '^WARNING: Location' >&2 || true
$pip install -q --no-deps -r "$REQS" 2>&1 | grep -v '^WARNING: Location' >&2 || true
smoke
echo "$want" > "$stamp"
echo "client venv ready ($("$CLIENT_VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null))" >&2
echo "$CLIENT_VENV"
