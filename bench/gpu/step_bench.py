"""The GPU time of one captured decode loop (run_loop_fused), without the engine.

Builds the ouro-1.4b preset in memory (random bf16 weights; no checkpoint to write), a
paged KV cache with every row at context ~`--context` (row r at context + r, at most 1,024),
and times one loop over all layers captured in a CUDA graph (CUDA events over `--replays` replays) at each row
count (`--quantization fp8`: with FP8 layer weights; `--kv-cache-dtype fp8`: the K/V cache in float8
e4m3). `--prefill-tokens T ...` times a loop over a step that carries a prompt instead: `--prefill-lanes`
decode rows and one `--prompt`-token prompt, padded to T tokens and 64 rows as the runner pads a riders'
step (engine/gpu/riders.py), and the loop's cuBLAS matmuls alone at T rows.
`--attn-config SPLITS:BLOCK_N[:WARPS] ...` times the loop again with the decode attention's split count,
tile width (and warps) forced (decode_config patched, in this process only). `--host-replay` adds each
graph's host time a replay() call takes, the GPU idle and busy (replay_timing.host_replay_us).
`--profile` adds, for each row count and step, the GPU time a loop spends in each kernel (torch profiler
over the replays; under PDL neighbouring kernels overlap, so the sum can exceed the loop's time).
`--tc-max-rows N ...` times every row count again with the tensor-core matmul taking at most N rows
(tc_gemm.TC_MAX_ROWS patched, in this process only; cuBLAS above).
To compare two builds, run each in its own process and alternate them so that machine drift shows:

    python3 -P bench/gpu/step_bench.py --rows 1 2 8 --replays 300 --tag a

Prints one JSON line (loop milliseconds per row count); nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ouro_fast.kernels import split_kv_attention as decode_attention
from ouro_fast.kernels import tc_gemm
from ouro_fast.model.checkpoints import PRESETS
from ouro_fast.model.ouro import OuroForCausalLM
from ouro_fast.model.quantization import Fp8Weight
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention
from ouro_fast.model.triton_loop import linear, run_loop_fused

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, host_replay_us, kernel_us, replay_ms  # noqa: E402

# The engine's block size, and blocks a row: every row's cache slots are its own.
PAGE, MAX_BLOCKS = 16, 64


def build(preset: str) -> OuroForCausalLM:
    with torch.device("cuda"):
        model = OuroForCausalLM(PRESETS[preset]).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.02)
    model.fuse()
    return model


def decode_batch(rows: int, context: int, page: int, max_blocks: int) -> TritonBatch:
    """Row r decodes position context + r through its own blocks."""
    pos = torch.arange(rows, device="cuda", dtype=torch.int64) + context
    tables = torch.arange(rows * max_blocks, device="cuda", dtype=torch.int32).view(rows, max_blocks)
    slots = tables[torch.arange(rows, device="cuda"), pos // page].to(torch.int64) * page + pos % page
    idx = torch.arange(rows, dtype=torch.int32, device="cuda")
    return TritonBatch(slots, pos, tables, pos.to(torch.int32), torch.ones_like(idx), idx, 1)


def prefill_batch(
    lanes: int, prompt: int, tokens: int, rows: int, context: int, page: int, max_blocks: int
) -> TritonBatch:
    """Rows [0, lanes) decode one token each at ~context (decode_batch's layout); row `lanes` runs a
    prompt of `prompt` tokens from position 0 in its own blocks; tokens and rows padded as the runner
    pads them (slot -1, length 0)."""
    d = decode_batch(lanes, context, page, max_blocks)
    i32, i64 = dict(dtype=torch.int32, device="cuda"), dict(dtype=torch.int64, device="cuda")
    tables = torch.full((rows, max_blocks), -1, **i32)
    tables[:lanes] = d.block_tables
    tables[lanes] = torch.arange(max_blocks, **i32) + lanes * max_blocks
    p = torch.arange(prompt, **i64)
    slot, pos = torch.full((tokens,), -1, **i64), torch.zeros(tokens, **i64)
    slot[:lanes], pos[:lanes] = d.slot_mapping, d.positions
    slot[lanes : lanes + prompt] = tables[lanes, p // page].long() * page + p % page
    pos[lanes : lanes + prompt] = p
    q_start, length, tok_off = (torch.zeros(rows, **i32) for _ in range(3))
    q_start[:lanes], length[:lanes], tok_off[:lanes] = d.row_q_start, 1, d.row_tok_off
    length[lanes], tok_off[lanes] = prompt, lanes
    return TritonBatch(slot, pos, tables, q_start, length, tok_off, tokens)


def matmuls(model, x: torch.Tensor, xf: torch.Tensor) -> None:
    """The loop's four matmuls a layer at x's row count, as the prefill path runs them (cuBLAS, or the
    FP8 kernel); xf [rows, intermediate] stands in for down's input."""
    f = linear
    for layer in model.model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        f(x, sa.qkv_weight)
        f(x, sa.o_proj.weight)
        f(x, mlp.gate_up_weight)
        f(xf, mlp.down_proj.weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--tag", default="")
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[], help="padded step tokens to time")
    ap.add_argument("--prefill-lanes", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--attn-config", nargs="*", default=[], help="SPLITS:BLOCK_N[:WARPS] settings to time")
    ap.add_argument("--host-replay", action="store_true", help="also the host time of graph.replay()")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none", help="the layers' weights")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16")
    ap.add_argument("--tc-max-rows", type=int, nargs="*", default=[], help="tensor-core row limits to time")
    ap.add_argument("--profile", action="store_true", help="also the GPU time a loop spends in each kernel")
    args = ap.parse_args()
    if args.context + max(args.rows) > MAX_BLOCKS * PAGE:  # row r decodes position context + r
        ap.error(f"--context plus the most --rows must be at most {MAX_BLOCKS * PAGE} (block tables)")
    model = build(args.preset)
    model.quantize(None if args.quantization == "none" else args.quantization)
    torch.cuda.empty_cache()
    cfg, page, max_blocks = model.config, PAGE, MAX_BLOCKS
    weights = sum(
        t.nbytes if isinstance(t, Fp8Weight) else t.numel() * t.element_size()
        for layer in model.model.layers
        for t in (layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
                  layer.mlp.down_proj.weight)
    )  # fmt: skip
    out = {"tag": args.tag, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
           "context": args.context,
           "floor_ms_4.8TBs": round(weights / 4.8e9, 4)}  # fmt: skip
    default, tc_default = decode_attention.decode_config, tc_gemm.TC_MAX_ROWS
    settings = [("", None)] + [(s, None) for s in args.attn_config] + [("", n) for n in args.tc_max_rows]
    for setting, tc_rows in settings:
        decode_attention.decode_config = default if not setting else _forced(default, setting)
        tc_gemm.TC_MAX_ROWS = tc_default if tc_rows is None else tc_rows
        suffix = f"_attn_{setting.replace(':', 'x')}" if setting else ""
        suffix += "" if tc_rows is None else f"_tc{tc_rows}"
        for rows in args.rows:
            slots = rows * max_blocks * page
            shape = (2, cfg.num_hidden_layers, slots, cfg.num_key_value_heads, cfg.head_dim)
            cache = kv_cache(shape, args.kv_cache_dtype)
            attn = TritonPagedAttention(cache, page, cfg.rope_theta, max_blocks * page, torch.bfloat16)
            attn.batch = decode_batch(rows, args.context, page, max_blocks)
            h = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
            with torch.inference_mode():
                step = lambda h=h, attn=attn: run_loop_fused(model, h, attn)  # noqa: E731
                graph = capture(step)
                out[f"rows_{rows}{suffix}_ms"] = round(replay_ms(graph, args.replays, warmup=1), 4)
                if args.host_replay and not suffix:
                    out[f"rows_{rows}_host_replay_us"] = host_replay_us(graph)
                if args.profile and not suffix:
                    out[f"rows_{rows}_kernels_us"] = kernel_us(graph, 20)
            del cache, attn
    decode_attention.decode_config, tc_gemm.TC_MAX_ROWS = default, tc_default
    for tokens in args.prefill_tokens:
        out.update(prefill_ms(model, args, tokens, page, max_blocks))
    print(json.dumps(out), flush=True)


def prefill_ms(model, args, tokens: int, page: int, max_blocks: int) -> dict:
    """A captured loop over a riders'-style step padded to `tokens`, and its matmuls alone."""
    cfg, rows = model.config, max(64, args.prefill_lanes + 1)
    slots = rows * max_blocks * page
    shape = (2, cfg.num_hidden_layers, slots, cfg.num_key_value_heads, cfg.head_dim)
    cache = kv_cache(shape, args.kv_cache_dtype)
    attn = TritonPagedAttention(cache, page, cfg.rope_theta, max_blocks * page, torch.bfloat16)
    attn.batch = prefill_batch(args.prefill_lanes, args.prompt, tokens, rows, args.context, page, max_blocks)
    h = torch.randn(tokens, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    xf = torch.randn(tokens, cfg.intermediate_size, device="cuda").to(torch.bfloat16)
    tag = f"prefill_{args.prefill_lanes}+{args.prompt}_at_{tokens}"
    with torch.inference_mode():
        graph = capture(lambda: run_loop_fused(model, h, attn))
        loop = replay_ms(graph, args.replays // 4, warmup=1)
        host = {f"{tag}_host_replay_us": host_replay_us(graph)} if args.host_replay else {}
        if args.profile:
            host[f"{tag}_kernels_us"] = kernel_us(graph, 10)
        mm = replay_ms(capture(lambda: matmuls(model, h, xf)), args.replays // 4, warmup=1)
    return {f"{tag}_ms": round(loop, 4), f"{tag}_matmuls_ms": round(mm, 4), **host}


def kv_cache(shape, kv_cache_dtype: str) -> torch.Tensor:
    """A random K/V cache in bf16, or in float8 e4m3 for "fp8"."""
    cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).mul_(0.5)
    return cache.to(torch.float8_e4m3fn) if kv_cache_dtype == "fp8" else cache


def _forced(default, setting: str):
    # SPLITS:BLOCK_N[:WARPS]: a warp count forced too when given.
    vals = [int(v) for v in setting.split(":")]
    forced = dict(zip(("NUM_SPLITS", "BLOCK_N", "num_warps"), vals))
    return lambda *shape: {**default(*shape), **forced}


if __name__ == "__main__":
    main()
