#!/usr/bin/env bash
# Build AIPerf's own environment (a venv outside the repo, never the server's) and print its path on the
# last line. Idempotent: a venv that already answers `aiperf --version` with the wanted version is kept.
#
#   AIPERF_VENV   where (default /tmp/ouro_fast-aiperf); the wrapper finds it there too
#   AIPERF_VERSION (default 0.13.0)    PYTHON: the interpreter to build it from (3.11-3.13; default python3)
#
# About 1.2 GB, from PyPI; no torch. Then: python -m bench.aiperf.run --scenario smoke --preset tiny ...
set -euo pipefail
VENV=${AIPERF_VENV:-/tmp/ouro_fast-aiperf}
VERSION=${AIPERF_VERSION:-0.13.0}
PY=${PYTHON:-python3}
have=$("$VENV/bin/aiperf" --version 2> /dev/null | tail -n 1 || true)
if [ "$have" = "$VERSION" ]; then
  echo "AIPerf $VERSION already in $VENV" >&2
else
  "$PY" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 14), "AIPerf needs Python 3.11-3.13"'
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "aiperf==$VERSION"
  have=$("$VENV/bin/aiperf" --version | tail -n 1)
  [ "$have" = "$VERSION" ] || { echo "installed AIPerf reports '$have', want $VERSION" >&2; exit 1; }
  echo "AIPerf $VERSION installed in $VENV" >&2
fi
echo "$VENV"
