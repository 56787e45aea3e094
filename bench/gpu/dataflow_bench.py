"""The one-launch dataflow decode loop against run_loop_fused on the ouro-1.4b preset: agreement and GPU time.

Per row count and config: one loop from the same h and KV cache through both (max |difference| of the
outputs and of the K/V they wrote), then each captured in a CUDA graph and replayed. Prints JSON lines.

    python3 bench/gpu/dataflow_bench.py --rows 1 --configs 256:4:2:row 256:4:2:free:row
    python3 bench/gpu/dataflow_bench.py --rows 8 --splits 1 --block-n 64 --configs 128:2:4

The defaults (8 attention slices) fit one token; 8 tokens need fewer programs (second line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ouro_fast.kernels.dataflow import DataflowLoop
from ouro_fast.model.fast_loop import run_loop_fused
from ouro_fast.model.triton_attention import TritonPagedAttention

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, step_bench, next to this file
from replay_timing import capture, replay_ms  # noqa: E402
from step_bench import build, decode_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    config_help = "streamers:tiles an iteration:stages[:free][:row]"
    ap.add_argument("--configs", nargs="+", default=["256:4:2:row"], help=config_help)
    ap.add_argument("--block-n", type=int, default=16, help="attention workers' context block")
    ap.add_argument("--splits", type=int, default=8, help="attention slices per (row, KV head)")
    ap.add_argument("--prefetch-kv", type=int, default=1, help="1: attention prefetches its keys and values")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--replays", type=int, default=100)
    args = ap.parse_args()
    model = build(args.preset)
    cfg, page, max_blocks = model.config, 16, 64
    loops = {}
    for spec in args.configs:
        # Flags after the numbers: "free", the walk alone (no waits, no workers); "row", one_row at 1 token.
        g, t, s, *flags = spec.split(":")
        loops[spec] = DataflowLoop(model, streamers=int(g), tiles=int(t), stages=int(s), free="free" in flags,
                                   one_row="row" in flags, block_n=args.block_n,
                                   splits=args.splits, prefetch_kv=bool(args.prefetch_kv))  # fmt: skip
    for rows in args.rows:
        shape = (2, cfg.num_hidden_layers, rows * max_blocks * page, cfg.num_key_value_heads, cfg.head_dim)
        cache = (torch.randn(shape, device="cuda") * 0.5).to(torch.bfloat16)
        attn = TritonPagedAttention(cache.clone(), page, cfg.rope_theta, max_blocks * page)
        attn.batch = batch = decode_batch(rows, args.context, page, max_blocks)
        h = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        with torch.inference_mode():
            expect = run_loop_fused(model, h.clone(), attn)
            row = {"rows": rows, "context": args.context, "path": "run_loop_fused"}
            graph = capture(lambda h=h, attn=attn: run_loop_fused(model, h.clone(), attn))
            row["ms"] = round(replay_ms(graph, args.replays, 3), 4)
            print(json.dumps(row), flush=True)
            for spec, loop in loops.items():
                got_cache = cache.clone()
                try:
                    got = loop(h, got_cache, attn.cos_sin, batch, page)
                except RuntimeError as e:  # e.g. a grid that cannot be resident: report it, go on
                    failed = {"rows": rows, "path": "dataflow", "config": spec, "error": str(e)}
                    print(json.dumps(failed), flush=True)
                    continue
                torch.cuda.synchronize()
                k = loop.kernel
                kv_diff = got_cache.float() - attn.kv_cache.float()
                row = {"rows": rows, "path": "dataflow", "config": spec,
                       "regs": k.n_regs, "spills": k.n_spills, "smem": k.metadata.shared,
                       "max_diff": float((got.float() - expect.float()).abs().max()),
                       "max_ref": float(expect.float().abs().max()),
                       "frac_diff": float((got != expect).float().mean()),
                       "kv_max_diff": float(kv_diff.abs().max())}  # fmt: skip
                step = lambda loop=loop, c=got_cache, h=h, a=attn, b=batch: loop(h, c, a.cos_sin, b, page)  # noqa: E731
                graph = capture(step)
                row["ms"] = round(replay_ms(graph, args.replays, 3), 4)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
