#!/usr/bin/env bash
# s32 call02: server start-up, Triton's cache cold then warm (a fresh TRITON_CACHE_DIR per setting): the parallel
# compile walk (16 threads, twice), each variant compiled at its first launch (OURO_FAST_COMPILE_THREADS=1),
# and the walk on 4 and 8 threads. call01's startup_bench launched the source tree's package (no compiled core).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
CK=/tmp/serve-ckpt/ouro-1.4b-bfloat16-bias-1-seed0
[ -f $CK/.complete ] || { python3 -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --dtype bfloat16 --gate-bias -1 --seed 0 --quiet --out $CK > /dev/null && echo ok > $CK/.complete; }
timeout -s KILL 300 python3 -P bench/gpu/startup_bench.py --model $CK --out "$O/startup.jsonl" walk "serial OURO_FAST_COMPILE_THREADS=1" walk2 "t4 OURO_FAST_COMPILE_THREADS=4" "t8 OURO_FAST_COMPILE_THREADS=8" > /dev/null 2>&1
echo "startup rc=$?"
python3 -c "
import json
for l in open('$O/startup.jsonl'): r = json.loads(l); print(r['setting'].split()[0], r['cache'], r['ready_s'], r['rc'], *r['log'], sep=' | ')"
tar czf "$O/startup_logs.tgz" -C "$O" startup 2> /dev/null; rm -rf "$O/startup"
