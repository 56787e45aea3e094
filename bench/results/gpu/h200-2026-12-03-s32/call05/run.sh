#!/usr/bin/env bash
# s32 call05: the walk over one layer (every layer launches the same variants). What compiles outside the
# walk on ouro-1.4b (compile_trace, empty cache), server start-up with and without the walk, the GPU tests.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/tests.log" 2>&1 || { echo build failed; exit 1; }
CK=/tmp/serve-ckpt/ouro-1.4b-bfloat16-bias-1-seed0
[ -f $CK/.complete ] || { python3 -P -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --dtype bfloat16 --gate-bias -1 --seed 0 --quiet --out $CK > /dev/null && echo ok > $CK/.complete; }
TRITON_CACHE_DIR=$(mktemp -d) timeout -s KILL 100 python3 -P bench/gpu/compile_trace.py $CK --out "$O/trace_walk.json" 2>&1 | grep -v Warning | tail -8
timeout -s KILL 150 python3 -P bench/gpu/startup_bench.py --model $CK --out "$O/startup.jsonl" walk "serial OURO_FAST_COMPILE_THREADS=1" walk2 > /dev/null 2>&1
echo "startup rc=$?"
python3 -c "
import json
for l in open('$O/startup.jsonl'): r = json.loads(l); print(r['setting'].split()[0], r['cache'], round(r['ready_s'] or -1, 1), r['rc'], *[x[:60] for x in r['log'][:3]], sep=' | ')"
tar czf "$O/startup_logs.tgz" -C "$O" startup 2> /dev/null; rm -rf "$O/startup"
timeout -s KILL 90 python3 -P -m pytest -q tests/test_precompile.py >> "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -8
