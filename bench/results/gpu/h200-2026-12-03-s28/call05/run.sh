#!/usr/bin/env bash
# s28 call05 (and a first try with 10 splits, which launch_config refuses: splits are powers of two): the decode
# attention's launch settings against the defaults (16 splits of 16-wide tiles on 2 warps at one row, 8 from 8 rows),
# captured loop at 1 and 8 rows, one round. Repo root, .device-wheels carried.
mkdir -p $OUT; eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > $OUT/build.log 2>&1
timeout -s KILL 150 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag attn \
  --attn-config 16:16:1 16:16:4 8:16:2 32:16:1 > $OUT/step.jsonl 2> $OUT/step.err
echo rc=$?; cat $OUT/step.jsonl; tail -3 $OUT/step.err
