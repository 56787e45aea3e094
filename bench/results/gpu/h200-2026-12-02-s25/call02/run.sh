#!/usr/bin/env bash
# s25 call02: served full depth c=8, newcomers aligned (default) against OURO_FAST_RUN_AHEAD_ALIGN=0,
# alternating off / on / off / on on one warm machine (call01 built the project and installed the wheels;
# its off/on2 runs failed: SKIP_SETUP=1 also skipped the wheels' PYTHONPATH). Repo root, .device-wheels carried.
C=${COMMIT:?}
[ -d /tmp/site ] || bash .device-wheels/install.sh > /dev/null
export PYTHONPATH=/tmp/site VLLM_TARGET_DEVICE=cpu
python3 -c "import ouro_fast.core.ring" 2> /dev/null || python3 -m pip install -q --no-build-isolation --no-deps .
OUT0=$OUT
mkdir -p /tmp/s25c2
for run in off1 on1 off2 on2; do
  case $run in off*) a=0 ;; *) a=1 ;; esac
  OUT=/tmp/s25c2/$run OURO_FAST_RUN_AHEAD_ALIGN=$a SKIP_SETUP=1 CONCURRENCY=8:64 COMMIT=$C RATE='' THRESHOLD='' \
    DEADLINE_S=100 timeout -s KILL 115 bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "$run rc=$?"
done
for run in off1 on1 off2 on2; do echo "== $run"; sed -n '/^| run/,$p' /tmp/s25c2/$run/summary.md 2> /dev/null; done > $OUT0/summaries.md
tar czf $OUT0/results.tgz -C /tmp s25c2
cat $OUT0/summaries.md
