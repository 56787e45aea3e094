#!/usr/bin/env bash
# s26 call02: what down's SiLU prologue and ring depth cost. Captured loop at 1 and 8 rows (step_bench), two
# rounds, alternating: down with 4 / 5 ring slots (OURO_FAST_TC_DOWN=256:4:168, 256:5:208; the default gives 3
# within 160 KB), and, timing only (wrong results), down without the SiLU product (--down-plain) at 4 slots
# (what 160 KB gives a plain input) and at 3.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
run() {  # tag, step_bench flags ("-" for none), then env assignments
  local tag=$1 flags=$2; shift 2
  [ "$flags" = - ] && flags=""
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" $flags \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" - X=1
  run "down256x4x168-$rep" - OURO_FAST_TC_DOWN=256:4:168
  run "down256x5x208-$rep" - OURO_FAST_TC_DOWN=256:5:208
  run "plain4-$rep" --down-plain X=1
  run "plain3-$rep" --down-plain OURO_FAST_TC_DOWN=256:3:160
done
