"""Prefill attention of one layer on the GPU: a step of decode lanes and prompt chunks, as riders run it.

A case is LANES:PROMPTS:LEN:START: LANES decode rows at context --lane-context, and PROMPTS prompt rows of
LEN tokens each at positions START .. START + LEN - 1 (START > 0: a chunk after a cached prefix or an
earlier chunk). The step is padded as the runner pads it (engine/gpu/shapes.step_shape): at least 64 rows,
the longest row the token bucket. Each configuration is captured as a CUDA graph of 24 calls (a loop's
layers) and replayed; the figures are microseconds a call and the prompt's causal TFLOP/s. `default` marks
attention_config's choice. torch's SDPA on the same prompts, contiguous (START 0: causal; otherwise the whole
context unmasked, more work than the case), gives a reference rate.

    python3 -P bench/gpu/prefill_bench.py [--cases 8:1:128:0 8:1:448:3352] [--block-q 16 32 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ouro_fast.engine.gpu.shapes import step_shape
from ouro_fast.kernels import paged_attention
from ouro_fast.kernels.prefill_attention import attention_config

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 16, 16, 128, 16, 24  # Ouro-1.4B's attention; the engine's block size
DEFAULT_CASES = ["8:1:128:0", "8:1:384:0", "8:1:896:0", "8:3:128:1024", "8:1:448:1536", "8:1:448:3352"]


def parse_case(text: str) -> tuple[int, int, int, int]:
    lanes, prompts, length, start = (int(v) for v in text.split(":"))
    return lanes, prompts, length, start


def build(case: tuple[int, int, int, int], lane_context: int, max_model_len: int) -> dict:
    """Inputs of one padded step: lanes first, then the prompt rows; blocks scattered over the cache."""
    lanes, prompts, length, start = case
    tokens = lanes + prompts * length
    rows, n_pad, max_q = step_shape(lanes + prompts, tokens, length, 256, 4096)
    contexts = [lane_context] * lanes + [start + length] * prompts
    need = [-(-c // PAGE) for c in contexts]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(sum(need), generator=g).int()
    tables = torch.zeros(rows, max_model_len // PAGE, dtype=torch.int32)
    q_start = torch.zeros(rows, dtype=torch.int32)
    lens = torch.zeros(rows, dtype=torch.int32)
    tok_off = torch.zeros(rows, dtype=torch.int32)
    used = off = 0
    for r, c in enumerate(contexts):
        tables[r, : need[r]] = perm[used : used + need[r]]
        used += need[r]
        n = 1 if r < lanes else length
        q_start[r], lens[r], tok_off[r] = c - n, n, off
        off += n
    slots = sum(need) * PAGE
    dev = "cuda"
    return dict(
        q=torch.randn(n_pad, HQ, D, generator=g).to(dev, torch.bfloat16),
        k_cache=torch.randn(slots, HKV, D, generator=g).to(dev, torch.bfloat16),
        v_cache=torch.randn(slots, HKV, D, generator=g).to(dev, torch.bfloat16),
        block_tables=tables.to(dev), row_q_start=q_start.to(dev), row_len=lens.to(dev),
        row_tok_off=tok_off.to(dev), block_size=PAGE, max_q_len=max_q,
    )  # fmt: skip


def causal_flops(case: tuple[int, int, int, int], lane_context: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the keys each query sees (prompts and lanes)."""
    lanes, prompts, length, start = case
    keys = prompts * (length * start + length * (length + 1) // 2) + lanes * lane_context
    return 4.0 * HQ * D * keys


def time_us(inputs: dict, cfg: dict | None, replays: int) -> float:
    out = torch.empty_like(inputs["q"])

    def layer_calls():
        for _ in range(LAYERS):
            paged_attention(**inputs, out=out, config=cfg)

    return 1000 * replay_ms(capture(layer_calls), replays, warmup=2) / LAYERS


def sdpa_us(case: tuple[int, int, int, int], replays: int) -> float:
    _, prompts, length, start = case
    q = torch.randn(prompts, HQ, length, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, prompts, HKV, start + length, D, device="cuda", dtype=torch.bfloat16)

    def layer_calls():
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=start == 0)

    return 1000 * replay_ms(capture(layer_calls), replays, warmup=2) / LAYERS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="LANES:PROMPTS:LEN:START")
    ap.add_argument("--lane-context", type=int, default=160)
    ap.add_argument("--block-q", type=int, nargs="+", default=[0], help="query tile (0: attention_config's)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[0], help="key tile (0: attention_config's)")
    ap.add_argument("--warps", type=int, nargs="+", default=[0], help="warps a program (0: the default)")
    ap.add_argument("--stages", type=int, nargs="+", default=[0], help="pipeline stages (0: Triton's)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args(argv)
    for text in a.cases:
        case = parse_case(text)
        inputs = build(case, a.lane_context, a.max_model_len)
        flops = causal_flops(case, a.lane_context)
        base = {"case": text, "bucket": inputs["max_q_len"]}
        ref = sdpa_us(case, a.replays)
        print(json.dumps({**base, "kernel": "sdpa", "us": round(ref, 2)}), flush=True)
        default = attention_config(inputs["max_q_len"], HQ // HKV, D)
        for bq, bn, warps, stages in itertools.product(a.block_q, a.block_n, a.warps, a.stages):
            cfg = {**default, "BLOCK_Q": bq or default["BLOCK_Q"], "BLOCK_N": bn or default["BLOCK_N"],
                   "num_warps": warps or default["num_warps"]}  # fmt: skip
            if stages:
                cfg["num_stages"] = stages
            us = time_us(inputs, cfg, a.replays)
            row = {**base, **{k: v for k, v in cfg.items() if k != "USE_DOT"}}
            row["default"] = cfg == default
            print(json.dumps({**row, "us": round(us, 2), "tflops": round(flops / us / 1e6, 1)}), flush=True)


if __name__ == "__main__":
    main()
