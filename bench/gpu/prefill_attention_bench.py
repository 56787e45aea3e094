"""Prompt-step attention on the GPU: paged_attention's tile configs on the riders' and prompt steps' shapes.

A step with a newcomer's prompt (a rider at concurrency 1 or 8, or a host-driven prompt step) runs
paged_attention over every row: the lanes' decode rows and the prompt's tokens, max_q_len the step's
bucket. In the twenty-fourth session's c=1 trace it took ~9.7 us a layer for a 128-token prompt. Cases
(Ouro-1.4B: 16 heads, MHA, head_dim 128, bf16, block size 16): `c1` one decode row at context 160 and a
128-token prompt; `c8` eight decode rows at 160 and the prompt; `p512` a 512-token prompt alone. Each
config runs --launches launches cycling --layers caches in ONE CUDA graph (median of replays, us per
launch) and is checked against the default config's output (max |diff|, MISMATCH beyond 2e-2).

Run on the GPU machine from the repo root: python -m bench.gpu.prefill_attention_bench [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.benchlib import start_run, write_result
from bench.gpu.attention_bench import BLOCK_SIZE, HEAD_DIM, HEADS, time_in_graph

CASES = {"c1": (1, 128), "c8": (8, 128), "p512": (0, 512)}  # (decode rows at context 160, prompt tokens)
CONTEXT = 160


def make_case(decode_rows: int, prompt: int, layers: int, seed: int = 0) -> dict:
    """q [N, H, D], caches [layers, slots, H, D] and row metadata: decode rows first, then the prompt
    (positions 0 .. prompt-1), each row its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    lens = [CONTEXT] * decode_rows + [prompt]
    per_row = [-(-n // BLOCK_SIZE) for n in lens]
    mb, total = max(per_row), sum(per_row)
    perm = torch.randperm(total + 1, generator=g)
    tables = torch.full((len(lens), mb), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(per_row):
        tables[r, :n] = perm[at : at + n]
        at += n
    dev = "cuda"
    gd = torch.Generator(device=dev).manual_seed(seed)
    slots = (total + 1) * BLOCK_SIZE
    randn = lambda *shape: torch.randn(*shape, generator=gd, device=dev, dtype=torch.bfloat16)  # noqa: E731
    q_len = [1] * decode_rows + [prompt]
    n = sum(q_len)
    return {
        "q": randn(n, HEADS, HEAD_DIM),
        "k": randn(layers, slots, HEADS, HEAD_DIM),
        "v": randn(layers, slots, HEADS, HEAD_DIM),
        "meta": (
            tables.to(dev),
            torch.tensor([CONTEXT - 1] * decode_rows + [0], dtype=torch.int32, device=dev),
            torch.tensor(q_len, dtype=torch.int32, device=dev),
            torch.tensor([0, *itertools.accumulate(q_len)][:-1], dtype=torch.int32, device=dev),
        ),
        "max_q_len": prompt,
    }


def configs(args) -> list[dict | None]:
    out: list[dict | None] = [None]
    for bq, bn, w, st in itertools.product(args.block_q, args.block_n, args.warps, args.stages):
        out.append({"BLOCK_Q": bq, "BLOCK_N": bn, "USE_DOT": True, "num_warps": w, "num_stages": st})
    return out


def label(cfg: dict | None) -> str:
    if cfg is None:
        return "default"
    return f"q{cfg['BLOCK_Q']} n{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def bench_case(name: str, args) -> list[dict]:
    from ouro_fast.kernels import paged_attention
    from ouro_fast.kernels.prefill_attention import attention_config

    c = make_case(*CASES[name], args.layers)
    q, out, ref = c["q"], torch.empty_like(c["q"]), torch.empty_like(c["q"])
    rows = []
    for cfg in configs(args):
        o = ref if cfg is None else out

        def fn(i, cfg=cfg, o=o):
            j = i % args.layers
            return paged_attention(
                q, c["k"][j], c["v"][j], *c["meta"], BLOCK_SIZE, c["max_q_len"], out=o, config=cfg
            )

        try:
            us = time_in_graph(fn, args.launches, args.reps)
        except Exception as e:  # a config the compiler rejects (shared memory): reported, not fatal
            rows.append({"case": name, "config": label(cfg), "error": str(e)[:200]})
            print(f"{name:5s} {label(cfg):20s} FAILED {str(e)[:80]}", flush=True)
            continue
        fn(0)
        torch.cuda.synchronize()
        err = 0.0 if cfg is None else (out.float() - ref.float()).abs().max().item()
        shown = cfg or attention_config(c["max_q_len"], 1, HEAD_DIM)
        rows.append({"case": name, "config": label(cfg), "cfg": shown, "us": us, "max_err": err})
        flag = "" if err <= 2e-2 else "  MISMATCH"
        print(f"{name:5s} {label(cfg):20s} {us:7.2f} us  err {err:.1e}{flag}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--block-q", type=ints, default=[16, 32, 64])
    p.add_argument("--block-n", type=ints, default=[32, 64, 128])
    p.add_argument("--warps", type=ints, default=[4, 8])
    p.add_argument("--stages", type=ints, default=[2])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--launches", type=int, default=48)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp", help="folder or .json file")
    args = p.parse_args()
    run = start_run()
    rows = [r for name in args.cases for r in bench_case(name, args)]
    write_result(run, {"rows": rows}, args.out, "prefill_attention_bench")


if __name__ == "__main__":
    main()
