"""The riders' matmuls on the GPU: cuBLAS at 129-264 rows, by BLAS library, row padding and weight layout.

A launch with a newcomer's prompt (engine/riders.py) runs the step graph over the lanes' tokens and the
prompt: 129 rows at concurrency 1, 136 at 8 with a 128-token prompt. Its matmuls are F.linear (cuBLAS),
which took ~2.2x their weights' streaming time there (docs/benchmarks.md, twenty-fourth session). This
asks which cheap change picks better kernels, per (shape, M), each timed as gemm_bench times them (CALLS
calls in one CUDA graph, cycling weight copies past L2, median of replays):
- `linear`: F.linear(x, w) as the runner calls it, with torch's preferred BLAS library (--blas);
- `pad<P>`: x padded to P rows (a multiple of 16 or 64), the padding's outputs dropped;
- `nn`: x @ wt with a pre-transposed contiguous weight (the other operand layout);
- `splitk<S>` (o_proj and down, whose outputs the norms take as fp32 partial products): one batched
  matmul over S slices of K, fp32 out (torch.bmm(out_dtype=float32)), the [S, M, N] partials unsummed.
Each result is checked against an fp32 reference (bf16 tolerance) before it is timed.

Run on the GPU machine from the repo root: python -m bench.gpu.rider_gemm_bench [--blas cublaslt]
(CUBLASLT_WORKSPACE_SIZE, in KiB, sets cuBLASLt's workspace for the process). Prints one line per
(shape, M, variant) and writes the rows as JSON to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from bench.benchlib import start_run, write_result
from bench.gpu.gemm_bench import HBM_TBPS, SHAPES, close_to, graph_us, weight_copies


def variants(shape: str, m: int, pads: list[int], splits: list[int]) -> list[str]:
    """The variants timed at M rows: pads strictly above M only, K splits where partials are taken."""
    split = [f"splitk{s}" for s in splits] if shape in ("o_proj", "down") else []
    return ["linear", "nn", *(f"pad{p}" for p in pads if p > m), *split]


def split_views(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], w [N, K] -> views [S, M, K/S], [S, K/S, N] (no copy) whose bmm sums over S to x @ w.T."""
    (m, k), n = x.shape, w.shape[0]
    return x.view(m, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0)


def run_variant(name: str, x: torch.Tensor, ws: torch.Tensor, wts: torch.Tensor | None, args) -> dict:
    m = x.shape[0]
    if name.startswith("pad"):
        xp = torch.zeros(int(name[3:]), x.shape[1], device=x.device, dtype=x.dtype)
        xp[:m] = x

        def call(i):
            return F.linear(xp, ws[i % ws.shape[0]])[:m]
    elif name.startswith("splitk"):
        s = int(name[6:])

        def call(i):
            return torch.bmm(*split_views(x, ws[i % ws.shape[0]], s), out_dtype=torch.float32)
    elif name == "nn":

        def call(i):
            return x @ wts[i % wts.shape[0]]
    else:

        def call(i):
            return F.linear(x, ws[i % ws.shape[0]])

    ref = x.float() @ ws[0].float().t()
    got = call(0)
    ok, err = close_to(got.sum(0) if got.dim() == 3 else got, ref)
    if not ok:
        return {"ok": False, "err": err}
    med, best, graph = graph_us([lambda i=i: call(i) for i in range(args.calls)], args.replays)
    del graph
    return {"ok": True, "err": err, "us": med, "us_min": best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", type=int, nargs="+", default=[129, 136, 144, 200, 264])
    p.add_argument("--pads", type=int, nargs="+", default=[144, 192, 256])
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--blas", default="default", choices=["default", "cublas", "cublaslt"])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--replays", type=int, default=15)
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp", help="folder or .json file")
    args = p.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    run = start_run()
    rows = []
    ws_env = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    print(f"blas {args.blas} CUBLASLT_WORKSPACE_SIZE={ws_env or 'unset'}")
    for shape, (n, k) in SHAPES.items():
        ws = weight_copies(n, k, torch.bfloat16, args.calls)
        wts = ws.transpose(1, 2).contiguous()
        floor_us = n * k * 2 / (HBM_TBPS * 1e12) * 1e6
        for m in args.ms:
            x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.bfloat16)
            for v in variants(shape, m, args.pads, args.splits):
                r = run_variant(v, x, ws, wts, args)
                r.update(shape=shape, n=n, k=k, m=m, variant=v, blas=args.blas, workspace_kib=ws_env)
                rows.append(r)
                us = r.get("us")
                got = f"{us:7.2f} us  {floor_us / us:5.1%} of the floor" if us else f"WRONG {r['err']:.2f}"
                print(f"{shape:8s} M={m:4d} {v:8s} {got}", flush=True)
        del ws, wts
        torch.cuda.empty_cache()
    write_result(run, {"rows": rows}, args.out, f"rider_gemm_{args.blas}_{ws_env or 'ws-default'}")


if __name__ == "__main__":
    main()
