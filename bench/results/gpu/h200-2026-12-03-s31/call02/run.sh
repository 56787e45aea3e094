#!/usr/bin/env bash
# s31 call02 (2fc890d's code): a lane launch's epilogue stores the records into the host ring itself (no publish
# kernel) against the publish kernel (OURO_FAST_RECORDS_KERNEL=1): the run-ahead GPU tests, the captured lane graph
# at 1 and 8 rows (engine_probe's graph_loop_step, one process each, alternating), then served: full depth and
# threshold 0.5 at c=1 and c=8 (no rate runs: the device budget).
set -u
O=${OUT:?}
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 100 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 120 python3 -P -m pytest -q tests/test_runahead.py > "$O/tests.log" 2>&1
echo "tests rc=$? $(tail -1 "$O/tests.log")"
grep -E "^FAILED|^E " "$O/tests.log" | head -5
for tag in epi-a kernel-a epi-b; do
  env=""; case $tag in kernel*) env="OURO_FAST_RECORDS_KERNEL=1";; esac
  env $env PROBE_CASES=none PROBE_PROFILE=0 PROBE_TAG=$tag OUT=$O timeout -s KILL 90 python3 -P bench/gpu/engine_probe.py \
    > "$O/probe_$tag.log" 2>&1
  echo "$tag rc=$? $(grep -o '"graph_loop_step".*' "$O/probe_$tag.log" | tr -d '{}"' | sed 's/graph_loop_step: //')"
done
mkdir -p "$O/serve"
OUT=$O/serve COMMIT=2fc890dc71076c76f94e7e8c79f5f41d9633fcef RATE='' SKIP_SETUP=1 DEADLINE_S=240 \
  timeout -s KILL 270 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
echo "serve rc=$?"
cat "$O/serve/summary.md"
