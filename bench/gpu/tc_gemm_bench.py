"""The tensor-core skinny matmul (kernels/tc_gemm.py) against the Triton one, on the Ouro-1.4B decode shapes.

Checks tc_linear against F.linear (fp32 math) for each shape and row count, that two calls agree bit for bit,
and that a row's result does not depend on the other rows; then times a loop's 96 matmuls (qkv, o, gate_up,
down with the SiLU fused, 24 layers, each fed the one before's output) captured in one CUDA graph, with the
tensor-core kernel and with the Triton skinny kernel. One JSON line per result.

    python3 -P bench/gpu/tc_gemm_bench.py [--rows 1 8] [--layers 24]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ouro_fast.kernels import tc_gemm
from ouro_fast.kernels.skinny_gemm import skinny_linear

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402

H, FF = 2048, 5632
SHAPES = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * FF, H), "down": (H, FF)}


def reference(x: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    if silu_mul:  # as silu_and_mul rounds: the silu in bf16, then the product in bf16
        f = x.shape[1] // 2
        x = (F.silu(x[:, :f].float()).to(x.dtype).float() * x[:, f:].float()).to(x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


def check(rows: list[int]) -> None:
    for name, (n, k) in SHAPES.items():
        silu = name == "down"
        w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, 2 * k if silu else k, device="cuda").to(torch.bfloat16)
            assert tc_gemm.supported(x, w, silu), (name, m)
            got = tc_gemm.tc_linear(x, w, silu)
            again = tc_gemm.tc_linear(x, w, silu)
            one = tc_gemm.tc_linear(x[:1].contiguous(), w, silu)
            want = reference(x, w, silu)
            err = float((got.float() - want.float()).abs().max())
            print(json.dumps({"check": name, "rows": m, "max_err": err, "max_ref": float(want.float().abs().max()),
                              "repeat_equal": bool(torch.equal(got, again)),
                              "row0_alone_equal": bool(torch.equal(got[:1], one))}), flush=True)  # fmt: skip


def chain(m: int, layers: int, kernel: str, replays: int) -> dict:
    ws = [{name: (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16) for name, (n, k) in SHAPES.items()}
          for _ in range(layers)]  # fmt: skip
    x0 = torch.randn(m, H, device="cuda").to(torch.bfloat16)

    def lin(x, w, silu=False):
        return tc_gemm.tc_linear(x, w, silu) if kernel == "tc" else skinny_linear(x, w, silu_mul=silu)

    def loop():
        x = x0
        for w in ws:
            q = lin(x, w["qkv"])[:, :H].contiguous()
            a = lin(q, w["o"])
            x = lin(lin(a, w["gate_up"]), w["down"], True)
        return x

    ms = replay_ms(capture(loop), replays)
    nbytes = sum(t.numel() * 2 for w in ws for t in w.values())
    return {"chain": kernel, "rows": m, "layers": layers, "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    print(json.dumps({"config": tc_gemm.CONFIG, "smem_budget": tc_gemm.SMEM_BUDGET}), flush=True)
    if not args.skip_check:
        check(sorted({1, 3, 16, *args.rows}))
    for m in args.rows:
        for kernel in ("tc", "skinny"):
            print(json.dumps(chain(m, args.layers, kernel, args.replays)), flush=True)


if __name__ == "__main__":
    main()
