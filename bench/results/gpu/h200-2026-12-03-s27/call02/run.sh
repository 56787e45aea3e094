#!/usr/bin/env bash
# s27 call02: deeper rings for qkv and down (OURO_FAST_TC_RING), at the new default (o_proj 2 slots, 3b1a775):
# qkv at 3 slots was slower in call01 (0.928 / 1.120 ms), so 5 and 6 (181 / 217 KB: o_proj then starts only
# once qkv exits), and down at 5; and fewer registers for the 8-wide matmuls (OURO_FAST_TC_MAXNREG 80 / 56 / 48,
# no spills offline): at 56 or less, five attention programs (2 warps x 168 registers) fit beside a qkv CTA instead
# of four. Captured loop at 1, 8 and 16 rows (step_bench), two rounds, alternating.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows ${ROWS:-1 8 16} --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=1
  run "q5-$rep" OURO_FAST_TC_RING=6144x2048=5
  ROWS="1 8" run "q6-$rep" OURO_FAST_TC_RING=6144x2048=6  # 6 x 40 KB: too much at 16 rows
  run "d5-$rep" OURO_FAST_TC_RING=2048x5632=5
  run "q5d5-$rep" OURO_FAST_TC_RING=6144x2048=5,2048x5632=5
  ROWS="1 8" run "mr80-$rep" OURO_FAST_TC_MAXNREG=80:128
  ROWS="1 8" run "mr56-$rep" OURO_FAST_TC_MAXNREG=56:128
  ROWS="1 8" run "mr48-$rep" OURO_FAST_TC_MAXNREG=48:128
done
