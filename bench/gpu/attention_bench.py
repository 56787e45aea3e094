"""Decode attention launches on the GPU: paged_attention (max_q_len 1) vs the split-KV paged_decode_attention.

Ouro-1.4B's attention shape (16 query = 16 KV heads, head_dim 128, bf16, block size
16). For each row count and context, every row is one decode token at that context
(positions 0 .. context-1 in shuffled blocks, block tables as wide as
--max-model-len); launch i reads cache layer i % --layers (default 24, as in the
model), so L2 holds the K/V only as far as it would in the engine. Each variant is
timed the way the engine runs it: --launches back-to-back launches captured in ONE
torch.cuda.CUDAGraph, graph.replay() timed with CUDA events, so host launch
overhead is excluded; reported in microseconds per launch (for the split kernel,
per split + merge pair). "floor" is a one-program
Triton kernel that stores one value: the per-node cost of a graph on this GPU.
Every variant's output (the graph's last launch, and an eager launch) is checked
against paged_attention's: max |diff|, MISMATCH beyond 2e-2 or NaN.

Run on a CUDA machine, from the repository root:
    python bench/gpu/attention_bench.py [--rows 1,8,32] [--contexts 192,1024] [--splits 1,2,4,8,16,32]
        [--tiles 16x2,32x2,32x4,64x4] [--out DIR]
Writes DIR/attention_bench.json (DIR: --out, else $OUT, else /tmp) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 16, 128, 16
DEVICE = "cuda"


def make_case(rows: int, context: int, max_model_len: int, layers: int, seed: int = 0) -> dict:
    """q, caches [layers, slots, H, D] and decode metadata: each row one token at position context - 1."""
    g = torch.Generator().manual_seed(seed)
    per_row = -(-context // BLOCK_SIZE)
    mb = max(per_row, max_model_len // BLOCK_SIZE)
    num_blocks = rows * per_row + 1
    tables = torch.full((rows, mb), -1, dtype=torch.int32)
    tables[:, :per_row] = torch.randperm(num_blocks, generator=g)[: rows * per_row].view(rows, per_row)
    slots = num_blocks * BLOCK_SIZE
    dev = DEVICE
    # Drawn on the device: 24 layers of caches at 32 rows x 1024 positions are ~6 GB of bf16.
    g_dev = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g_dev, device=dev, dtype=torch.bfloat16)

    return {
        "q": randn(rows, HEADS, HEAD_DIM),
        "k_cache": randn(layers, slots, HEADS, HEAD_DIM),
        "v_cache": randn(layers, slots, HEADS, HEAD_DIM),
        "block_tables": tables.to(dev),
        "row_q_start": torch.full((rows,), context - 1, dtype=torch.int32, device=dev),
        "row_len": torch.ones(rows, dtype=torch.int32, device=dev),
        "row_tok_off": torch.arange(rows, dtype=torch.int32, device=dev),
    }


def time_in_graph(fn, launches: int, reps: int) -> float:
    """Median over `reps` replays of microseconds per launch of fn(i), i = 0 .. launches-1 in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / launches)
    samples.sort()
    return samples[len(samples) // 2]


@triton.jit
def _store_one(ptr):
    tl.store(ptr, 1.0)


def floor_fn():
    """A one-program Triton kernel storing one value: the cost of a graph node with nothing to do."""
    buf = torch.zeros(1, device=DEVICE)
    return lambda i: _store_one[(1,)](buf)


def variants(args) -> list[tuple[str, dict | None]]:
    """(label, config) of the split kernel: the default (None) first, then splits x tiles."""
    out: list[tuple[str, dict | None]] = [("auto", None)]
    for splits in args.splits:
        for tile in args.tiles:
            block_n, warps = (int(x) for x in tile.split("x"))
            out.append(
                (
                    f"S{splits} N{block_n} w{warps}",
                    {"NUM_SPLITS": splits, "BLOCK_N": block_n, "num_warps": warps},
                )
            )
    return out


def bench_case(rows: int, context: int, args) -> list[dict]:
    from ouro_fast.kernels import paged_attention, paged_decode_attention
    from ouro_fast.kernels.prefill_attention import attention_config
    from ouro_fast.kernels.split_kv_attention import decode_config

    case = make_case(rows, context, args.max_model_len, args.layers)
    meta = [case[k] for k in ("block_tables", "row_q_start", "row_len", "row_tok_off")]
    q, kc, vc = case["q"], case["k_cache"], case["v_cache"]
    ref, ref_last, out = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    kv = lambda i: (kc[i % args.layers], vc[i % args.layers])
    # Launch i reads layer i % layers, as the engine walks its layers (L2 holds only some of them).
    old = lambda i, o=ref: paged_attention(q, *kv(i), *meta, BLOCK_SIZE, 1, out=o)
    results = [{"kernel": "paged_attention", "config": attention_config(1, 1, HEAD_DIM)}]
    results[0]["us"] = time_in_graph(old, args.launches, args.reps)
    results[0]["max_err"] = 0.0
    old(0)
    old(args.launches - 1, ref_last)
    torch.cuda.synchronize()
    for label, cfg in variants(args):
        fn = lambda i, cfg=cfg: paged_decode_attention(q, *kv(i), *meta, BLOCK_SIZE, out=out, config=cfg)
        out.fill_(float("nan"))
        us = time_in_graph(fn, args.launches, args.reps)
        from_graph = out.clone()
        out.fill_(float("nan"))
        fn(0)
        # Both the graph's last launch and an eager launch must match paged_attention (NaN propagates).
        diff = torch.stack([from_graph.float() - ref_last.float(), out.float() - ref.float()])
        err = diff.abs().max().item()
        shown = cfg or decode_config(rows, HEADS, 1, HEAD_DIM, meta[0].shape[1] * BLOCK_SIZE)
        results.append({"kernel": f"decode {label}", "config": shown, "us": us, "max_err": err})
    for r in results:
        r.update(rows=rows, context=context)
    return results


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=ints, default=[1, 8, 32])
    p.add_argument("--contexts", type=ints, default=[192, 1024])
    p.add_argument("--splits", type=ints, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--tiles", type=lambda s: s.split(","), default=["16x2", "32x2", "32x4", "64x4"])
    p.add_argument("--max-model-len", type=int, default=4096, help="block-table width x block size")
    p.add_argument("--launches", type=int, default=100, help="launches captured in one graph")
    p.add_argument("--layers", type=int, default=24, help="distinct caches cycled through (Ouro: 24 layers)")
    p.add_argument("--reps", type=int, default=20, help="timed replays (the median is reported)")
    p.add_argument("--out", default=None, help="result folder (default $OUT, else /tmp)")
    return p.parse_args(argv)


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "attention_bench needs a CUDA GPU (it times kernels inside CUDA graphs); none found.",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(0)
    t0 = time.time()
    floor = time_in_graph(floor_fn(), args.launches, args.reps)
    rows_out = []
    print(f"{torch.cuda.get_device_name()}  graph-node floor {floor:.2f} us")
    print(f"{'R':>3} {'ctx':>5}  {'kernel':<24} {'us/launch':>9} {'max_err':>8}")
    for rows in args.rows:
        for context in args.contexts:
            results = bench_case(rows, context, args)
            best = min(r["us"] for r in results[1:])
            for r in results:
                mark = " *" if r["us"] == best else ""
                bad = "  MISMATCH" if not r["max_err"] <= 2e-2 else ""  # NaN included
                cells = f"{rows:>3} {context:>5}  {r['kernel']:<24} {r['us']:>9.2f} {r['max_err']:>8.1e}"
                print(cells + mark + bad)
            rows_out += results
    record = {
        "bench": "attention_bench",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "argv": sys.argv,
        "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
        "launches_per_graph": args.launches,
        "floor_us": floor,
        "results": rows_out,
        "wall_s": round(time.time() - t0, 1),
    }
    folder = Path(args.out or os.environ.get("OUT") or "/tmp")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "attention_bench.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
