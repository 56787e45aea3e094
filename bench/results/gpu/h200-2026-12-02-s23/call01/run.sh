#!/usr/bin/env bash
# s23 call01: the folded norm (kernels/tc_fold.py) on the H200. (1) a one-call smoke run (a hang in the
# kernel's barriers ends here, by timeout); (2) its GPU tests and tc_gemm's; (3) the captured loop's GPU
# time with the fold on and off (step_bench, 1-8 rows), alternating.
set -u
cd "$(dirname "$0")/../../../../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
eval "$(bash .device-wheels/install.sh)"
timeout -s KILL 240 python3 -m pip install -q --no-build-isolation --no-deps . > "$O/build.log" 2>&1 || { echo build failed; exit 1; }
timeout -s KILL 90 python3 -P - > "$O/smoke.log" 2>&1 <<'PY'
import torch
from ouro_fast.kernels import add_rms_norm, tc_fold, tc_gemm
g = torch.Generator(device="cuda").manual_seed(0)
h = torch.randn(1, 2048, device="cuda", generator=g).to(torch.bfloat16)
d = 0.3 * torch.randn(5, 1, 2048, device="cuda", generator=g)
w2 = (1 + 0.1 * torch.randn(2048, device="cuda", generator=g)).to(torch.bfloat16)
w = (0.02 * torch.randn(6144, 2048, device="cuda", generator=g)).to(torch.bfloat16)
for partial in (True, False):
    y, hn = tc_fold.tc_fold_linear(h, d, w2, w2, w, 1e-6, partial=partial)
    torch.cuda.synchronize()
    hr, xr = add_rms_norm(h, d, w2, w2, 1e-6)
    yr = tc_gemm.tc_linear(xr, w).float()
    ys = y.sum(0) if partial else y.float()
    print("partial", partial, "y err", float((ys - yr).abs().max()), "of", float(yr.abs().max()),
          "h diff", float((hn.float() - hr.float()).abs().max()))
PY
smoke=$?
cat "$O/smoke.log" | tail -5; echo "smoke rc=$smoke"
[ $smoke -ne 0 ] && exit 2
timeout -s KILL 300 python3 -P -m pytest -q -p no:cacheprovider tests/test_tc_fold.py tests/test_tc_gemm.py \
  > "$O/pytest.log" 2>&1
echo "pytest rc=$?"; tail -25 "$O/pytest.log"
for tag in fold nofold fold2 nofold2; do
  v=1; [ "${tag#nofold}" != "$tag" ] && v=0
  OURO_FAST_TC_FOLD=$v timeout -s KILL 150 python3 -P bench/gpu/step_bench.py --rows 1 2 4 8 --replays 200 \
    --tag "$tag" > "$O/step_$tag.json" 2> "$O/step_$tag.err"
  echo "== $tag rc=$?"; cat "$O/step_$tag.json" | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps(d)[:1500])"
done
