#!/usr/bin/env bash
# s23 call02: the sandwich norm in the matmul's prologue (kernels/tc_norm_gemm.py) on the H200. (1) a
# one-call smoke run (a hang ends here, by timeout); (2) its GPU tests and the runner's; (3) the captured
# loop's GPU time with it on and off (step_bench, 1 and 8 rows), alternating; (4) served full depth at
# concurrency 1 with it on and off, one server each.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 90 python3 -P - > "$O/smoke.log" 2>&1 <<'PY'
import torch
from ouro_fast.kernels import add_rms_norm, tc_gemm, tc_norm_gemm
g = torch.Generator(device="cuda").manual_seed(0)
h = torch.randn(1, 2048, device="cuda", generator=g).to(torch.bfloat16)
d = 0.3 * torch.randn(5, 1, 2048, device="cuda", generator=g)
w2 = (1 + 0.1 * torch.randn(2048, device="cuda", generator=g)).to(torch.bfloat16)
for n, partial in ((6144, True), (11264, False)):
    w = (0.02 * torch.randn(n, 2048, device="cuda", generator=g)).to(torch.bfloat16)
    y, hn = tc_norm_gemm.tc_norm_linear(h, d, w2, w2, w, 1e-6, partial=partial)
    torch.cuda.synchronize()
    hr, xr = add_rms_norm(h, d, w2, w2, 1e-6)
    yr = tc_gemm.tc_linear(xr, w).float()
    ys = y.sum(0) if partial else y.float()
    print(n, "partial", partial, "y err", float((ys - yr).abs().max()), "of", float(yr.abs().max()),
          "h diff", float((hn.float() - hr.float()).abs().max()))
PY
smoke=$?
tail -5 "$O/smoke.log"; echo "smoke rc=$smoke"
[ $smoke -ne 0 ] && exit 2
timeout -s KILL 200 python3 -P -m pytest -q -p no:cacheprovider tests/test_tc_norm_gemm.py tests/test_gpu_runner.py \
  > "$O/pytest.log" 2>&1
echo "pytest rc=$?"; tail -15 "$O/pytest.log"
for tag in norm nonorm norm2 nonorm2; do
  v=1; [ "${tag#nonorm}" != "$tag" ] && v=0
  OURO_FAST_TC_NORM=$v timeout -s KILL 120 python3 -P bench/gpu/step_bench.py --rows 1 8 --replays 200 \
    --tag "$tag" > "$O/step_$tag.json" 2> "$O/step_$tag.err"
  echo "== $tag rc=$?"; cat "$O/step_$tag.json"
done
serve() {  # tag, env...
  local tag=$1; shift
  env "$@" OUT="$O/$tag" SKIP_SETUP=1 CONCURRENCY=1:32 RATE='' THRESHOLD='' COMMIT="${COMMIT:-}" DEADLINE_S=110 \
    bash bench/gpu/serve_gpu.sh > /dev/null 2>&1
  echo "== $tag"; grep -E 'ready|-c1' "$O/$tag/summary.md"
}
serve s_norm OURO_FAST_TC_NORM=1
serve s_nonorm OURO_FAST_TC_NORM=0
cd "$O" && for t in s_norm s_nonorm; do cp $t/summary.md $t.md 2>/dev/null; done
tar czf all.tgz s_norm s_nonorm build.log step_*.err pytest.log smoke.log 2>/dev/null; rm -rf s_norm s_nonorm build.log step_*.err; ls
