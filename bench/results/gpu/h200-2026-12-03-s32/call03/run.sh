#!/usr/bin/env bash
# s32 call03: which variants the engine build compiles before, in and after the compile walk, each with an
# empty Triton cache (bench/gpu/compile_trace.py): the walk on 16 threads, then without it.
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
CK=/tmp/serve-ckpt/ouro-1.4b-bfloat16-bias-1-seed0
[ -f $CK/.complete ] || { python3 -P -m ouro_fast.cli make-checkpoint --preset ouro-1.4b --dtype bfloat16 --gate-bias -1 --seed 0 --quiet --out $CK > /dev/null && echo ok > $CK/.complete; }
TRITON_CACHE_DIR=$(mktemp -d) timeout -s KILL 120 python3 -P bench/gpu/compile_trace.py $CK --out "$O/trace_walk.json" 2>&1 | grep -v Warning | tail -30
OURO_FAST_COMPILE_THREADS=1 TRITON_CACHE_DIR=$(mktemp -d) timeout -s KILL 120 python3 -P bench/gpu/compile_trace.py $CK --out "$O/trace_serial.json" 2>&1 | grep -v Warning | tail -30
