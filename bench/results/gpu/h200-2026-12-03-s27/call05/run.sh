#!/usr/bin/env bash
# s27 call05: gate_up's weight loads before its PDL wait, now that its CTAs start beside o_proj's while the attention
# runs (call04: the attention adds 6.9 us a layer, 5.3 before; the norms 2.6, 3.75 before). Fewer tiles before the
# wait (OURO_FAST_TC_PRE 1 / 2 of 3) or a pause between them (OURO_FAST_TC_PACE 1 / 2: 500 / 1000 ns), so that the
# attention's loads do not queue behind a 12.7 MB burst. Captured loop at 1 and 8 rows (step_bench), two rounds.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
run() {  # tag, then env assignments
  local tag=$1; shift
  env "$@" timeout -s KILL 90 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 300 --tag "$tag" \
    >> "$O/step.jsonl" 2>> "$O/step.err"
  echo "rc=$? $(tail -1 "$O/step.jsonl" | cut -c1-160)"
}
for rep in a b; do
  run "base-$rep" X=1
  run "pre1-$rep" OURO_FAST_TC_PRE=11264x2048=1
  run "pre2-$rep" OURO_FAST_TC_PRE=11264x2048=2
  run "pace1-$rep" OURO_FAST_TC_PACE=11264x2048=1
  run "pace2-$rep" OURO_FAST_TC_PACE=11264x2048=2
done
