"""The GPU time of one captured decode loop (run_loop_fused), without the engine: for A/B switches.

Builds the ouro-1.4b preset in memory (random bf16 weights; no checkpoint to write), a
paged KV cache with every row at context ~`--context`, and times one loop over all
layers captured in a CUDA graph (CUDA events over `--replays` replays) at each row
count. `--attn-config SPLITS:BLOCK_N ...` times the loop again with the decode attention's split count and
tile width forced (decode_config patched, in this process only). Environment switches (OURO_FAST_PDL,
OURO_FAST_PDL_PLAIN, OURO_FAST_EARLY_WEIGHT, OURO_FAST_FUSED_DECODE, OURO_FAST_EARLY_KV) are read at import:
run one process per setting, e.g.

    for v in "" skinny norm; do OURO_FAST_PDL_PLAIN=$v python3 bench/gpu/step_bench.py --tag "$v"; done
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ouro_fast.kernels import decode_attention
from ouro_fast.model.checkpoints import PRESETS
from ouro_fast.model.fast_loop import run_loop_fused
from ouro_fast.model.ouro import OuroForCausalLM
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--tag", default="")
    ap.add_argument("--attn-config", nargs="*", default=[], help="SPLITS:BLOCK_N settings to time too")
    args = ap.parse_args()
    model = build(args.preset)
    cfg, page, max_blocks = model.config, 16, 64
    weights = sum(
        t.numel() * t.element_size()
        for layer in model.model.layers
        for t in (layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
                  layer.mlp.down_proj.weight)
    )  # fmt: skip
    out = {"tag": args.tag, "context": args.context, "floor_ms_4.8TBs": round(weights / 4.8e9, 4)}
    default = decode_attention.decode_config
    for setting in [""] + args.attn_config:
        decode_attention.decode_config = default if not setting else _forced(default, setting)
        suffix = f"_attn_{setting.replace(':', 'x')}" if setting else ""
        for rows in args.rows:
            slots = rows * max_blocks * page
            shape = (2, cfg.num_hidden_layers, slots, cfg.num_key_value_heads, cfg.head_dim)
            cache = (torch.randn(shape, device="cuda") * 0.5).to(torch.bfloat16)
            attn = TritonPagedAttention(cache, page, cfg.rope_theta, max_blocks * page)
            attn.batch = decode_batch(rows, args.context, page, max_blocks)
            h = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
            with torch.inference_mode():
                step = lambda h=h, attn=attn: run_loop_fused(model, h, attn)  # noqa: E731
                out[f"rows_{rows}{suffix}_ms"] = round(replay_ms(capture(step), args.replays, warmup=1), 4)
            del cache, attn
    decode_attention.decode_config = default
    print(json.dumps(out), flush=True)


def _forced(default, setting: str):
    splits, block_n = (int(v) for v in setting.split(":"))
    return lambda *shape: {**default(*shape), "NUM_SPLITS": splits, "BLOCK_N": block_n}


if __name__ == "__main__":
    main()
