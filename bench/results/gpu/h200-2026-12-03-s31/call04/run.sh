#!/usr/bin/env bash
# s31 call04 (724a83f's tree: the session's final code): the GPU runner's and run-ahead's GPU tests, with what
# was left of the device budget.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 80 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 60 python3 -P -m pytest -q -x tests/test_gpu_runner.py tests/test_runahead.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -5
