"""One decode loop step on the GPU: the persistent loop against the launch-per-kernel loop.

Builds the ouro-1.4b preset in memory (random bf16 weights), a paged KV cache with
every row at context ~`--context`, and times one captured loop (CUDA graph replays,
CUDA events) at each row count: run_loop_fused with the persistent loop off, then
persistent_loop at each config. Checks first that the one-launch loop equals the
phase-per-launch loop bit for bit and reports its largest difference from the
launch-per-kernel loop. Prints one JSON object (also written to --out).

    python3 bench/gpu/loop_bench.py --rows 1 8 --out $OUT/loop_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from ouro_fast.kernels import persistent_loop as pl
from ouro_fast.model import fast_loop
from ouro_fast.model.checkpoints import PRESETS
from ouro_fast.model.ouro import OuroForCausalLM
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention

CONFIGS = [
    {"num_warps": 4, "num_stages": 3, "budget": 4096, "ctas_per_sm": 4},
    {"num_warps": 4, "num_stages": 3, "budget": 8192, "ctas_per_sm": 4},
    {"num_warps": 8, "num_stages": 3, "budget": 8192, "ctas_per_sm": 2},
    {"num_warps": 4, "num_stages": 4, "budget": 2048, "ctas_per_sm": 4},
]
# Phases left out (bit masks of kernels/persistent_loop.py's PH_*) to split the step's time: the
# barriers alone, the matmuls alone, the attention alone, the norms alone. Outputs are then garbage.
SKIPS = {"barriers_only": 511, "matmuls_only": 405, "attention_only": 507, "norms_only": 110}


def build(preset: str, layers: int | None = None):
    cfg = PRESETS[preset] if layers is None else dataclasses.replace(PRESETS[preset], num_hidden_layers=layers)
    with torch.device("cuda"):
        model = OuroForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.02)
    model.fuse()
    pl.stack_layer_weights(model)
    return model


def batch_of(rows: int, context: int, page: int, max_blocks: int) -> TritonBatch:
    dev = "cuda"
    pos = torch.arange(rows, device=dev, dtype=torch.int64) + context
    tables = torch.arange(rows * max_blocks, device=dev, dtype=torch.int32).view(rows, max_blocks)
    slots = tables[torch.arange(rows, device=dev), (pos // page)].to(torch.int64) * page + pos % page
    one = torch.ones(rows, dtype=torch.int32, device=dev)
    return TritonBatch(slots, pos, tables, pos.to(torch.int32), one, torch.arange(rows, dtype=torch.int32,
                       device=dev), 1)  # fmt: skip


def kernel_stats(h, lw, attn, page, cfg, config) -> dict:
    # Registers, spills and shared memory of the one-launch kernel at this config.
    full = {**pl.DEFAULT_CONFIG, **config}
    key = next(k for k in pl._GRIDS if k[-1] == tuple(sorted(full.items())))
    args, strides, consts, _ = pl._plan(h, lw, attn.kv_cache, attn.batch, attn.cos_sin, page, cfg.num_attention_heads,
                                        cfg.rms_norm_eps, pl._GRIDS[key], full, False)  # fmt: skip
    k = pl._loop_kernel.warmup(*args, 0, *strides, PHASE=-1, **consts, grid=(1,))
    k._init_handles()
    return {"grid": pl._GRIDS[key], "n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}


def time_graph(fn, replays: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="how many of CONFIGS to time")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (debugging)")
    ap.add_argument("--phased-only", action="store_true", help="run the phase-per-launch loop once and stop")
    ap.add_argument("--config", default=None, help="JSON: time only this config (e.g. from a sweep driver)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = [json.loads(args.config)] if args.config else CONFIGS[: args.configs]
    model = build(args.preset, args.layers)
    cfg, page, max_blocks = model.config, 16, 64
    bytes_per_loop = sum(t.numel() * t.element_size() for t in (model._loop_weights.qkv, model._loop_weights.o,
                         model._loop_weights.gate_up, model._loop_weights.down))  # fmt: skip
    floor_ms = bytes_per_loop / 4.8e12 * 1e3
    result = {"preset": args.preset, "context": args.context, "floor_ms_4.8TBs": round(floor_ms, 4), "rows": []}
    for rows in args.rows:
        shape = (2, cfg.num_hidden_layers, rows * max_blocks * page, cfg.num_key_value_heads, cfg.head_dim)
        kv = (torch.randn(shape, device="cuda") * 0.5).to(torch.bfloat16)
        attn = TritonPagedAttention(kv, page, cfg.rope_theta, max_blocks * page)
        attn.batch = batch_of(rows, args.context, page, max_blocks)
        h = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        lw = model._loop_weights
        run = lambda c=None, phased=False: pl.persistent_loop(  # noqa: E731
            h, lw, attn.kv_cache, attn.batch, attn.cos_sin, page, cfg.num_attention_heads, cfg.rms_norm_eps,
            phased=phased, config=c)  # fmt: skip
        entry: dict = {"rows": rows}
        if args.phased_only:
            run(configs[0], phased=True)
            torch.cuda.synchronize()
            print("phased loop ran", flush=True)
            return
        t0 = time.perf_counter()
        kv0 = kv.clone()
        one = run(configs[0])
        torch.cuda.synchronize()
        entry["first_launch_s"] = round(time.perf_counter() - t0, 2)
        kv_one = kv.clone()
        kv.copy_(kv0)
        if rows == args.rows[0]:  # the phase-per-launch variants compile once per phase: check one row count
            phased = run(configs[0], phased=True)
            entry["one_launch_equals_phased"] = bool(torch.equal(one, phased) and torch.equal(kv_one, kv))
            kv.copy_(kv0)
        pl.ENABLED = False
        ref = fast_loop.run_loop_fused(model, h, attn)
        kv_ref = kv.clone()
        kv.copy_(kv0)
        entry["max_abs_diff_vs_fused"] = (one.float() - ref.float()).abs().max().item()
        entry["max_abs_ref"] = ref.float().abs().max().item()
        entry["kv_max_abs_diff_vs_fused"] = (kv_one.float() - kv_ref.float()).abs().max().item()
        print(json.dumps(entry), flush=True)
        entry["fused_ms"] = round(time_graph(lambda: fast_loop.run_loop_fused(model, h, attn), args.replays), 4)
        pl.ENABLED = True
        entry["persistent"] = []
        for c in configs:
            ms = time_graph(lambda c=c: run(c), args.replays)
            grids = sorted({g for k, g in pl._GRIDS.items() if tuple(sorted({**pl.DEFAULT_CONFIG, **c}.items())) == k[-1]})
            entry["persistent"].append({**c, "grid": grids, "ms": round(ms, 4), "fraction_of_floor": round(floor_ms / ms, 3)})
            print(json.dumps(entry["persistent"][-1]), flush=True)
        if rows == args.rows[0]:
            # The same phases as separate launches (each compiled alone), and the one-launch kernel's resources.
            entry["phased_ms"] = round(time_graph(lambda: run(configs[0], phased=True), args.replays), 4)
            entry["kernel"] = kernel_stats(h, lw, attn, page, cfg, configs[0])
            print(json.dumps({"phased_ms": entry["phased_ms"], "kernel": entry["kernel"]}), flush=True)
            entry["skip_study"] = {k: round(time_graph(lambda m=m: run({**configs[0], "SKIP": m}), args.replays), 4)
                                   for k, m in SKIPS.items()}  # fmt: skip
        result["rows"].append(entry)
        print(json.dumps(entry), flush=True)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
