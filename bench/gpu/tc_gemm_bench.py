"""The tensor-core skinny matmul (kernels/tc_gemm.py) against the Triton one, on the Ouro-1.4B decode shapes.

Checks tc_linear against F.linear (fp32 math) for each shape and row count, that two calls agree bit for bit,
and that a row's result does not depend on the other rows; then times a loop's 96 matmuls (qkv, o, gate_up,
down with the SiLU fused, 24 layers, each fed the one before's output) captured in one CUDA graph, with the
tensor-core kernel and with the Triton skinny kernel, with the loop's two add + RMSNorm kernels between
them (o and down hand their fp32 partial products to the norm on the tensor-core path). With --timeline,
each tensor-core matmul's per-CTA global-timer stamps, summarized. One JSON line per result.

    python3 -P bench/gpu/tc_gemm_bench.py [--rows 1 8] [--layers 24]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ouro_fast.kernels import add_rms_norm, tc_gemm
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


def run(x: torch.Tensor, w: torch.Tensor, silu: bool, parts: int) -> torch.Tensor:
    y = tc_gemm.tc_linear(x, w, silu, parts=parts)
    return y.sum(0).to(torch.bfloat16) if parts else y


def check(rows: list[int]) -> None:
    for name, (n, k) in SHAPES.items():
        silu = name == "down"
        w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, 2 * k if silu else k, device="cuda").to(torch.bfloat16)
            assert tc_gemm.supported(x, w, silu), (name, m)
            parts = -1 if name in ("o", "down") else 0  # as the loop calls them: partial products

            got, again = run(x, w, silu, parts), run(x, w, silu, parts)
            one = run(x[:1].contiguous(), w, silu, parts)
            want = reference(x, w, silu)
            err = float((got.float() - want.float()).abs().max())
            line = {"check": name, "rows": m, "max_err": err, "max_ref": float(want.float().abs().max())}
            line.update(
                repeat_equal=bool(torch.equal(got, again)), row0_alone_equal=bool(torch.equal(got[:1], one))
            )
            print(json.dumps(line), flush=True)


def chain(m: int, layers: int, kernel: str, replays: int, stamps: torch.Tensor | None = None) -> dict:
    def layer():
        return {
            name: (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
            for name, (n, k) in SHAPES.items()
        }

    ws = [layer() for _ in range(layers)]
    x0 = torch.randn(m, H, device="cuda").to(torch.bfloat16)
    norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16)

    calls = iter(())

    def lin(x, w, silu=False, partial=False):
        if kernel == "tc":
            st = None if stamps is None else stamps[next(calls)]
            return tc_gemm.tc_linear(x, w, silu, parts=-1 if partial else 0, stamps=st)
        return skinny_linear(x, w, silu_mul=silu)

    def loop():  # the decode loop's matmuls and norms, q (a strided view) standing in for attention's output
        nonlocal calls
        calls = iter(range(4 * layers))
        h = x = x0
        for w in ws:
            a = lin(lin(x, w["qkv"])[:, :H], w["o"], partial=True)
            h, m = add_rms_norm(h, a, norm_w, norm_w, 1e-6)
            h, x = add_rms_norm(
                h, lin(lin(m, w["gate_up"]), w["down"], True, partial=True), norm_w, norm_w, 1e-6
            )
        return x

    ms = replay_ms(capture(loop), replays)
    nbytes = sum(t.numel() * 2 for w in ws for t in w.values())
    return {
        "chain": kernel,
        "rows": m,
        "layers": layers,
        "ms": round(ms, 4),
        "tb_s": round(nbytes / ms / 1e9, 3),
    }


def timeline(ts: torch.Tensor) -> dict:
    """Medians over the chain's boundaries (us), from stamps [calls, CTAs, 4] (start, wait over, first tile,
    done; 0 where a CTA did not run): how early the next matmul's CTAs start against the last CTA of the one
    before finishing (negative: before it), when its PDL wait returns, its first tile, and its own spread."""
    ts = ts.double() / 1e3
    ran = ts[..., 0] > 0
    first = {k: torch.where(ran, ts[..., k], float("inf")).min(1).values for k in range(4)}
    last = torch.where(ran, ts[..., 3], -float("inf")).max(1).values
    rows = {
        "start_after_prev_done": first[0][1:] - last[:-1],
        "wait_over_after_prev_done": first[1][1:] - last[:-1],
        "first_tile_after_wait": first[2][1:] - first[1][1:],
        "done_spread": (last - first[3])[1:],
        "duration_wait_to_done": (last - first[1])[1:],
    }
    out = {}
    for name, v in rows.items():
        per = v.view(-1)
        out[name] = {
            kind: round(float(per[i::4].median()), 2)
            for i, kind in enumerate(("o", "gate_up", "down", "qkv"))
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="also the tc chain's per-CTA stamps, summarized")
    args = ap.parse_args()
    print(json.dumps({"config": tc_gemm.CONFIG, "smem_budget": tc_gemm.SMEM_BUDGET}), flush=True)
    if not args.skip_check:
        check(sorted({1, 3, 16, *args.rows}))
    for m in args.rows:
        for kernel in ("tc", "skinny"):
            print(json.dumps(chain(m, args.layers, kernel, args.replays)), flush=True)
        if args.timeline:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            ts = torch.zeros(4 * args.layers, sms * tc_gemm.CONFIG[2], 4, device="cuda", dtype=torch.int64)
            res = chain(m, args.layers, "tc", args.replays, stamps=ts)  # the stamps are the last replay's
            print(json.dumps({**res, "timeline_us": timeline(ts)}), flush=True)


if __name__ == "__main__":
    main()
