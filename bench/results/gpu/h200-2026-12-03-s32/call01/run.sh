#!/usr/bin/env bash
# s32 call01: server start-up with the parallel compile walk (kernels/precompile.py) against compiling each
# variant at its first launch (OURO_FAST_COMPILE_THREADS=1), Triton's cache cold then warm; the GPU tests of
# the walk, the runner and the run-ahead lanes; then served full depth at c=1 and c=8.
set -u
O=${OUT:?}
SHA=${1:?commit}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/tests.log" 2>&1 || { echo build failed; exit 1; }
CK=/tmp/serve-ckpt/ouro-1.4b-bfloat16-bias-1-seed0
t=$SECONDS
python3 -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --dtype bfloat16 --gate-bias -1 --seed 0 --quiet --out $CK > /dev/null && echo ok > $CK/.complete
echo "checkpoint in $((SECONDS - t)) s; nproc $(nproc)"
timeout -s KILL 200 python3 -P bench/gpu/startup_bench.py --model $CK --out "$O/startup.jsonl" walk "serial OURO_FAST_COMPILE_THREADS=1" walk2 > /dev/null 2>&1
echo "startup rc=$?"
python3 -c "
import json
for l in open('$O/startup.jsonl'): r = json.loads(l); print(r['setting'].split()[0], r['cache'], r['ready_s'], r['rc'], *r['log'][:2], sep=' | ')"
tar czf "$O/startup_logs.tgz" -C "$O" startup 2> /dev/null; rm -rf "$O/startup"
timeout -s KILL 240 python3 -P -m pytest -q tests/test_precompile.py tests/test_gpu_runner.py tests/test_runahead.py >> "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -8
OUT=$O COMMIT=$SHA RATE='' THRESHOLD='' SKIP_SETUP=1 DEADLINE_S=200 timeout -s KILL 230 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$?"
cat "$O/summary.md"
