#!/usr/bin/env bash
# s32 call04: the compile walk's threads now also build each kernel's launcher and load its binary (call03:
# no compile left after the walk, so the capture's extra seconds were the launchers' gcc builds). Server
# start-up with the walk and without it (Triton's cache cold, then warm); the walk's and runner's GPU tests.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/tests.log" 2>&1 || { echo build failed; exit 1; }
CK=/tmp/serve-ckpt/ouro-1.4b-bfloat16-bias-1-seed0
[ -f $CK/.complete ] || { python3 -P -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --dtype bfloat16 --gate-bias -1 --seed 0 --quiet --out $CK > /dev/null && echo ok > $CK/.complete; }
timeout -s KILL 200 python3 -P bench/gpu/startup_bench.py --model $CK --out "$O/startup.jsonl" walk "serial OURO_FAST_COMPILE_THREADS=1" walk2 > /dev/null 2>&1
echo "startup rc=$?"
python3 -c "
import json
for l in open('$O/startup.jsonl'): r = json.loads(l); print(r['setting'].split()[0], r['cache'], round(r['ready_s'] or -1, 1), r['rc'], *[x[:70] for x in r['log']], sep=' | ')"
tar czf "$O/startup_logs.tgz" -C "$O" startup 2> /dev/null; rm -rf "$O/startup"
timeout -s KILL 150 python3 -P -m pytest -q tests/test_precompile.py tests/test_gpu_runner.py >> "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -8
