"""Numerics of folding a sandwich norm into the next matmul by linearity (docs/design.md, "Known limits").

Today a layer's norm kernel sums the matmul's partial products d, rounds it, adds RMS(d, w2) to the
residual h, rounds h', and hands x = RMS(h', w_in) in bf16 to the next matmul W. The fold lets the
matmul read h and d itself (built in Gluon in the twenty-third session, 3b36b23, and removed: the loop was
slower, docs/benchmarks.md "Twenty-third session"; this script keeps the numerics for a later design):

    y = r * (A + s * B),  A = bf16(h * w_in) @ W.T,  B = bf16(d * w2 * w_in) @ W.T

with s = rsqrt(mean(d^2) + eps) and r = rsqrt(mean(h'^2) + eps), h' = h + s d w2 unrounded. This
script measures both paths against a float64 truth at Ouro's shapes (the qkv matrix, random weights at
the preset's scales) and prints their errors; CPU only, no kernels:

    python -m bench.norm_fold_check --rows 1 8 --trials 4
"""

from __future__ import annotations

import argparse
import json

import torch

EPS = 1e-6


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def rms(x: torch.Tensor, w: torch.Tensor, rounded: bool) -> torch.Tensor:
    # The model's RMSNorm: normalized (rounded), times the weight (rounded), as kernels/norm.py does.
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return bf16(w * bf16(n)) if rounded else w * n


def reference(h, d, w2, w_in, W, rounded: bool = True) -> torch.Tensor:
    """Today's path: the norm kernel's outputs in bf16, then the matmul (fp32 accumulation)."""
    d = bf16(d) if rounded else d
    h_new = h + rms(d, w2, rounded)
    h_new = bf16(h_new) if rounded else h_new
    y = rms(h_new, w_in, rounded) @ W.T
    return bf16(y) if rounded else y


def folded(h, d, w2, w_in, W, rounded: bool = True) -> torch.Tensor:
    """The fold: two accumulators over the same weight, the row scalars applied at the end."""
    d = bf16(d) if rounded else d
    act = bf16 if rounded else (lambda t: t)
    a = act(h * w_in) @ W.T
    b = act(d * w2 * w_in) @ W.T
    # Two passes over the rows the CTA loaded: s, then h' in fp32 for r (expanding mean(h'^2) into
    # row sums of h and d could cancel).
    s = torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + EPS)
    r = torch.rsqrt((h + s * d * w2).pow(2).mean(-1, keepdim=True) + EPS)
    y = r * (a + s * b)
    return bf16(y) if rounded else y


def inputs(rows: int, hidden: int, out: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = bf16(torch.randn(rows, hidden, generator=g) * 2.0).to(dtype)  # the residual stream (bf16)
    d = (torch.randn(rows, hidden, generator=g) * 0.5).to(dtype)  # down's summed fp32 partials
    w2 = bf16(1.0 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    w_in = bf16(1.0 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    W = bf16(0.02 * torch.randn(out, hidden, generator=g)).to(dtype)
    return h, d, w2, w_in, W


def errors(rows: int, seed: int, hidden: int = 2048, out: int = 6144) -> dict:
    """Max and mean |error| of each path against float64 truth, relative to the truth's RMS."""
    args = inputs(rows, hidden, out, seed)
    truth = reference(*(t.double() for t in args), rounded=False)
    scale = truth.pow(2).mean().sqrt()
    res = {}
    for name, fn in (("reference", reference), ("folded", folded)):
        e = (fn(*args).double() - truth).abs() / scale
        res[name] = {"max": e.max().item(), "mean": e.mean().item()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--trials", type=int, default=4)
    args = ap.parse_args()
    for rows in args.rows:
        runs = [errors(rows, seed) for seed in range(args.trials)]
        out = {"rows": rows}
        for name in ("reference", "folded"):
            out[f"{name}_max"] = max(r[name]["max"] for r in runs)
            out[f"{name}_mean"] = sum(r[name]["mean"] for r in runs) / len(runs)
        rounded = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}
        print(json.dumps(rounded), flush=True)


if __name__ == "__main__":
    main()
