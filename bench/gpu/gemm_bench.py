"""Decode matmuls of Ouro-1.4B on the GPU: F.linear (cuBLAS) against skinny_linear's candidate configs.

For each shape (qkv, o_proj, gate_up, down) and each row count M, every config
runs as the engine runs it: CALLS back-to-back calls captured in ONE CUDA graph,
timed over replays with CUDA events (median, per call). The calls cycle through
enough copies of the weight (>= 512 MB) that none is served from L2. Before
timing, each config's eager result is checked against an fp32 reference, and
after timing the graph's own result is checked again (so a split-K counter that
failed to reset shows up as a wrong answer, not a fast one).

Prints a table per shape and M, the per-layer sums, and the best config per
(N, K, M) as a tuple literal for ouro_fast.kernels.skinny_gemm.TUNED_CONFIGS.
Writes every measurement as JSON to --out (default $OUT, else /tmp).

Run on the GPU machine from the repo root: python -m bench.gpu.gemm_bench [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from bench.benchlib import start_run, write_result

SHAPES = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
# Not swept by default: the once-per-token vocabulary projection.
EXTRA_SHAPES = {"lm_head": (49152, 2048)}
HBM_TBPS = 4.221  # measured HBM read bandwidth of the H200 (docs/anchors.md)
LAYERS = 24
FOOTPRINT = 512 << 20  # bytes of weight copies cycled per graph: far above the 50 MB L2


def weight_copies(n: int, k: int, dtype: torch.dtype, calls: int) -> torch.Tensor:
    """[copies, n, k] random weights, enough copies that consecutive calls never hit L2."""
    copies = max(2, min(calls, math.ceil(FOOTPRINT / (n * k * dtype.itemsize))))
    return (torch.randn(copies, n, k, device="cuda", dtype=torch.float32) * 0.02).to(dtype)


def graph_us(calls: list[Callable[[], object]], replays: int) -> tuple[float, float, torch.cuda.CUDAGraph]:
    """(median, min) microseconds per call of `calls` captured in one CUDA graph, and the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(samples), min(samples), graph


def close_to(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Within a bf16 ulp (or finer dtype) of the fp32 reference; returns (ok, max error / scale)."""
    err = (got.float() - ref).abs()
    scale = ref.abs() * 2.0**-7 + 1e-3 * ref.abs().max()
    return bool((err <= scale).all()), float((err / scale).max())


def bench_skinny(x, ws, cfg, calls: int, replays: int, ref0, ref_last) -> dict:
    from ouro_fast.kernels.skinny_gemm import skinny_linear

    out = torch.empty(x.shape[0], ws.shape[1], device="cuda", dtype=x.dtype)
    t0 = time.perf_counter()
    skinny_linear(x, ws[0], out=out, config=cfg)  # compiles
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    ok, err = close_to(out, ref0)
    if not ok:
        return {"ok": False, "err": err, "compile_s": compile_s}
    fns = [lambda i=i: skinny_linear(x, ws[i % ws.shape[0]], out=out, config=cfg) for i in range(calls)]
    med, best, graph = graph_us(fns, replays)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ok_graph, err_graph = close_to(out, ref_last)
    del graph
    return {"ok": ok_graph, "err": max(err, err_graph), "us": med, "us_min": best, "compile_s": compile_s}


def cfg_str(c: dict) -> str:
    kind = "dot" if c["USE_DOT"] else "fma"
    red = "" if c["SPLIT_K"] == 1 else ("/fused" if c["FUSED_REDUCE"] else "/pass")
    return (
        f"{kind} n{c['BLOCK_N']} k{c['BLOCK_K']} s{c['SPLIT_K']}{red} w{c['num_warps']} st{c['num_stages']}"
    )


def run_shape(name: str, n: int, k: int, ms: list[int], args, deadline: float) -> list[dict]:
    from ouro_fast.kernels.skinny_gemm import candidate_configs, default_config

    dtype = getattr(torch, args.dtype)
    ws = weight_copies(n, k, dtype, args.calls)
    wbytes = n * k * dtype.itemsize
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float32).to(dtype)
        ref0 = F.linear(x.float(), ws[0].float())
        ref_last = F.linear(x.float(), ws[(args.calls - 1) % ws.shape[0]].float())
        base, _, graph = graph_us(
            [lambda i=i, x=x: F.linear(x, ws[i % ws.shape[0]]) for i in range(args.calls)], args.replays
        )
        del graph
        cands = [default_config(n, k, m)] if args.quick else candidate_configs(n, k, m)
        results = []
        for cfg in cands:
            if results and time.perf_counter() > deadline:  # the default config always runs
                print(f"  time budget spent: {name} M={m} stopped after {len(results)} configs", flush=True)
                break
            try:
                r = bench_skinny(x, ws, cfg, args.calls, args.replays, ref0, ref_last)
            except Exception as e:  # a config that fails to compile or launch is reported, not fatal
                r = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            results.append({"config": cfg, **r})
        good = [r for r in results if r["ok"]]
        best = min(good, key=lambda r: r["us"]) if good else None
        default = next((r for r in results if r["config"] == cands[0] and r["ok"]), None)
        row = {
            "shape": name,
            "N": n,
            "K": k,
            "M": m,
            "weight_bytes": wbytes,
            "ideal_us": wbytes / HBM_TBPS / 1e6,
            "f_linear_us": base,
            "default_us": default["us"] if default else None,
            "best_us": best["us"] if best else None,
            "best_config": best["config"] if best else None,
            "failed": [r for r in results if not r["ok"]],
            "all": results,
        }
        rows.append(row)
        print_row(row)
    return rows


def tbps(nbytes: int, us: float | None) -> str:
    return f"{nbytes / us / 1e6:5.2f}" if us else "  -  "


def fmt(us: float | None) -> str:
    return f"{us:7.2f}" if us else "     - "


HEADER = "shape      M |  ideal | F.linear us  TB/s | default us  TB/s | best us  TB/s speedup | best config"


def print_row(r: dict) -> None:
    b = r["weight_bytes"]
    timed = " | ".join(f"{fmt(r[key])} {tbps(b, r[key])}" for key in ("f_linear_us", "default_us", "best_us"))
    speed = f"{r['f_linear_us'] / r['best_us']:5.2f}x" if r["best_us"] else "   -  "
    best = cfg_str(r["best_config"]) if r["best_config"] else "none passed"
    failed = f"  ({len(r['failed'])} configs FAILED)" if r["failed"] else ""
    head = f"{r['shape']:8s} {r['M']:3d} | {r['ideal_us']:6.2f}"
    print(f"{head} | {timed} {speed} | {best}{failed}", flush=True)


def print_summary(rows: list[dict]) -> None:
    print("\nPer layer (sum over the shapes measured), microseconds:")
    print("  M | F.linear | best skinny | best of both | saved per loop step (x24 layers)")
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m]
        base = sum(r["f_linear_us"] for r in sel)
        best = sum(r["best_us"] or r["f_linear_us"] for r in sel)
        both = sum(min(r["best_us"] or math.inf, r["f_linear_us"]) for r in sel)
        print(f"{m:3d} | {base:8.2f} | {best:11.2f} | {both:12.2f} | {(base - both) * LAYERS:8.1f}")
    print("\n# Paste into ouro_fast/kernels/skinny_gemm.py (the fastest skinny config of every shape):")
    print("TUNED_CONFIGS = {")
    keys = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_DOT", "FUSED_REDUCE", "num_warps", "num_stages")
    for r in rows:
        if r["best_us"]:
            key, c = f"({r['N']}, {r['K']}, {r['M']})", r["best_config"]
            print(f"    {key}: {tuple(c[k] for k in keys)},  # {r['shape']} {r['best_us']:.2f} us, "
                  f"F.linear {r['f_linear_us']:.2f}")  # fmt: skip
    print("}")
    slower = [f"{r['shape']} M={r['M']}" for r in rows if not (r["best_us"] or math.inf) < r["f_linear_us"]]
    if slower:
        print("# F.linear was faster (or nothing passed) for: " + ", ".join(slower))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--m",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="row counts (32, 64: is a higher SKINNY_MAX_M worth it?)",
    )
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=[*SHAPES, *EXTRA_SHAPES])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--calls", type=int, default=50, help="calls captured per CUDA graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="only the default config")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop sweeping configs after this long")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp", help="folder or .json file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_bench: no CUDA device; run it on the GPU machine (it times CUDA graphs)", file=sys.stderr)
        return 2
    meta = start_run()
    meta["device"] = torch.cuda.get_device_name()
    meta["args"] = vars(args)
    deadline = time.perf_counter() + args.budget_s
    print(f"{meta['device']}, {args.dtype}, {args.calls} calls per graph, median of {args.replays} replays")
    print(HEADER)
    rows = []
    for name in args.shapes:
        rows += run_shape(name, *{**SHAPES, **EXTRA_SHAPES}[name], args.m, args, deadline)
        torch.cuda.empty_cache()
    print_summary(rows)
    path = write_result(meta, rows, args.out, "gemm_bench")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
