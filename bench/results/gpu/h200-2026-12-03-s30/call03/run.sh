#!/usr/bin/env bash
# s30 call03: where the decode attention's hop goes, from global-timer stamps inside the captured loop
# (bench/gpu/attn_timeline.py): at 1 / 2 / 8 rows with the defaults, at 1 / 2 rows uncapped, at 8 rows capped at
# 128 registers (the cap's loss there was unexplained). First the fused attention's GPU tests (the stamps among them).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 150 python3 -P -m pytest -q tests/test_decode_attention.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -5
for spec in "default::1 2 8" "uncapped:0:1 2" "capped:128:8"; do
  IFS=: read -r tag regs rows <<< "$spec"
  OURO_FAST_ATTN_MAXNREG=$regs timeout -s KILL 150 python3 -P bench/gpu/attn_timeline.py --rows $rows --tag "$tag" \
    >> "$O/timeline.jsonl" 2>> "$O/timeline.err"
  echo "$tag rc=$?"
done
python3 - "$O/timeline.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
keys = list(lines[0]["per_layer_us"])
print("| event (us) | " + " | ".join(f"{d['tag']} {d['rows']}r" for d in lines) + " |")
print("|---|" + "---|" * len(lines))
print("| loop ms | " + " | ".join(str(d["loop_ms_with_stamps"]) for d in lines) + " |")
for k in keys:
    print(f"| {k} | " + " | ".join(str(d["per_layer_us"][k]) for d in lines) + " |")
PY
