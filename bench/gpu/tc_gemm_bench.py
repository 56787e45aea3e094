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


def run(x: torch.Tensor, w: torch.Tensor, silu: bool, partial: bool) -> torch.Tensor:
    y = tc_gemm.tc_linear(x, w, silu, partial=partial)
    return y.sum(0).to(torch.bfloat16) if partial else y


def check(rows: list[int]) -> None:
    for name, (n, k) in SHAPES.items():
        silu = name == "down"
        w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, 2 * k if silu else k, device="cuda").to(torch.bfloat16)
            assert tc_gemm.supported(x, w, silu), (name, m)
            parts = name != "gate_up"  # as the loop calls them: partial products

            got, again = run(x, w, silu, parts), run(x, w, silu, parts)
            one = run(x[:1].contiguous(), w, silu, parts)
            want = reference(x, w, silu)
            err = float((got.float() - want.float()).abs().max())
            line = {"check": name, "rows": m, "max_err": err, "max_ref": float(want.float().abs().max())}
            line.update(
                repeat_equal=bool(torch.equal(got, again)), row0_alone_equal=bool(torch.equal(got[:1], one))
            )
            print(json.dumps(line), flush=True)


def chain(m: int, layers: int, kernel: str, replays: int, stamps: torch.Tensor | None = None,
          mode: str = "loop", norm_stamps: torch.Tensor | None = None) -> dict:  # fmt: skip
    """mode "loop": as the decode loop runs them (qkv, o and down hand out partial products; a fixed input
    stands in for the attention's output). For upper bounds (timing only, the values are not the loop's):
    "parts" also makes gate_up hand out partial products (a fixed input stands in for down's), "bare" is
    "parts" without the norms."""

    def layer():
        return {
            name: (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
            for name, (n, k) in SHAPES.items()
        }

    ws = [layer() for _ in range(layers)]
    x0 = torch.randn(m, H, device="cuda").to(torch.bfloat16)
    norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    stub_gu = torch.randn(m, 2 * FF, device="cuda").to(torch.bfloat16)
    split = mode != "loop"

    calls, norms = iter(()), iter(())

    def lin(x, w, silu=False, partial=False):
        if kernel == "tc":
            st = None if stamps is None else stamps[next(calls)]
            return tc_gemm.tc_linear(x, w, silu, partial=partial, stamps=st)
        return skinny_linear(x, w, silu_mul=silu)

    def norm(h, a):
        st = None if norm_stamps is None else norm_stamps[next(norms)][: h.shape[0]]
        return add_rms_norm(h, a, norm_w, norm_w, 1e-6, stamps=st)

    def loop():  # the decode loop's matmuls and norms
        nonlocal calls, norms
        calls, norms = iter(range(4 * layers)), iter(range(2 * layers))
        h = x = x0
        for w in ws:
            lin(x, w["qkv"], partial=True)  # for the attention (not in the chain)
            a = lin(x0, w["o"], partial=True)
            h, m = (h, x0) if mode == "bare" else norm(h, a)
            gu = lin(m, w["gate_up"], partial=split)
            d = lin(stub_gu if split else gu, w["down"], True, partial=True)
            h, x = (h, x0) if mode == "bare" else norm(h, d)
        return x

    ms = replay_ms(capture(loop), replays)
    nbytes = sum(t.numel() * 2 for w in ws for t in w.values())
    return {
        "chain": kernel,
        "mode": mode,
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


def norm_timeline(ts: torch.Tensor, nts: torch.Tensor) -> dict:
    """Medians (us) for the norms after o (n1) and after down (n2), from the matmuls' stamps [4 * layers,
    CTAs, 4] and the norms' [2 * layers, rows, 4] (start, wait over, done): the norm's first start, wait
    over and last done against the matmul before it finishing, and the next matmul's wait over after it."""
    ts, nts = ts.double() / 1e3, nts.double() / 1e3
    ran, nran = ts[..., 0] > 0, nts[..., 0] > 0
    m_done = torch.where(ran, ts[..., 3], -float("inf")).max(1).values
    m_wait = torch.where(ran, ts[..., 1], float("inf")).min(1).values
    n_first = {k: torch.where(nran, nts[..., k], float("inf")).min(1).values for k in range(2)}
    n_done = torch.where(nran, nts[..., 2], -float("inf")).max(1).values
    out = {}
    for j, (name, before) in enumerate((("n1", 1), ("n2", 3))):
        prev = m_done[before::4]  # o or down of each layer
        nxt = m_wait[before + 1 :: 4]  # gate_up, or the next layer's qkv
        n = len(nxt)
        rows = {
            "start_after_prev_done": n_first[0][j::2] - prev,
            "wait_over_after_prev_done": n_first[1][j::2] - prev,
            "done_after_prev_done": n_done[j::2] - prev,
            "next_wait_over_after_done": nxt - n_done[j::2][:n],
        }
        out[name] = {k: round(float(v.median()), 2) for k, v in rows.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="also the tc chain's per-CTA stamps, summarized")
    ap.add_argument("--modes", nargs="+", default=["loop"], choices=["loop", "parts", "bare"],
                    help="chain modes (parts, bare: upper bounds, see chain())")  # fmt: skip
    args = ap.parse_args()
    print(json.dumps({"config": tc_gemm.CONFIG, "smem_budget": tc_gemm.SMEM_BUDGET}), flush=True)
    if not args.skip_check:
        check(sorted({1, 3, 16, *args.rows}))
    ctas = torch.cuda.get_device_properties(0).multi_processor_count * tc_gemm.CONFIG[2]
    for m in args.rows:
        for mode in args.modes:
            for kernel in ("tc", "skinny") if mode == "loop" else ("tc",):
                print(json.dumps(chain(m, args.layers, kernel, args.replays, mode=mode)), flush=True)
            if args.timeline:
                ts = torch.zeros(4 * args.layers, ctas, 4, device="cuda", dtype=torch.int64)
                nts = torch.zeros(2 * args.layers, 16, 4, device="cuda", dtype=torch.int64)
                res = chain(m, args.layers, "tc", args.replays, stamps=ts, mode=mode, norm_stamps=nts)
                line = {**res, "timeline_us": timeline(ts)}  # the stamps are the last replay's
                if mode != "bare":
                    line["norms_us"] = norm_timeline(ts, nts)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
