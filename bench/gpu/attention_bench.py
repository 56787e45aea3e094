"""Decode attention of one layer on the GPU, by rows, context and KV splits: the fused kernel the lanes run.

Every row has the same context; its blocks are scattered over the cache as the engine's are. Each case is
captured as a CUDA graph of 24 calls (a loop's layers) and replayed; the figure is microseconds a call and
the K/V bandwidth it reaches. `default` marks the configuration decode_config picks for the shape (block
tables as wide as --max-model-len); --block-n and --warps try other key tiles and warps a program;
--kv-cache-dtype fp8 draws the cache in float8 e4m3 (the K/V bandwidth then counts its one-byte values).

    python3 -P bench/gpu/attention_bench.py [--rows 16 32 128] [--contexts 160 1152] [--splits 1 2 4 8]

With --prefix P, the rows form --groups groups (the loop planes of one shared-prefix class) whose members
share their first P positions' blocks, and each case times the shared-prefix launch plus the decode
(kernels/cascade_attention.py) for every --pre-splits, --pre-block-n and --pre-warps, against the same rows
read one by one. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from ouro_fast.kernels import fused_decode_attention, rope_cos_sin_table
from ouro_fast.kernels.cascade_attention import SharedPrefixes, prefix_config
from ouro_fast.kernels.split_kv_attention import decode_config

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 16, 16, 128, 16, 24  # Ouro-1.4B's attention; the engine's block size


def case(rows: int, context: int, max_model_len: int, dtype=torch.bfloat16, dev: str = "cuda",
         cache_dtype=None) -> dict:  # fmt: skip
    """Inputs of one decode step: row r's token at position context - 1, its K/V slot written; the cache in
    cache_dtype (dtype's by default)."""
    need = -(-context // PAGE)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(rows * need, generator=g)
    tables = torch.full((rows, max_model_len // PAGE), -1, dtype=torch.int32)
    tables[:, :need] = perm.view(rows, need).int()
    pos = context - 1
    slots = tables[:, pos // PAGE].long() * PAGE + pos % PAGE
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=g).to(dev, dtype)
    q, k, v = qkv.split((HQ * D, HKV * D, HKV * D), dim=1)
    cache = rows * need * PAGE
    return dict(
        q=q.view(rows, HQ, D), k=k.view(rows, HKV, D), v=v.view(rows, HKV, D),
        k_cache=torch.randn(cache, HKV, D, generator=g).to(dev, cache_dtype or dtype),
        v_cache=torch.randn(cache, HKV, D, generator=g).to(dev, cache_dtype or dtype),
        slot_mapping=slots.to(dev), positions=torch.full((rows,), pos, dtype=torch.int64, device=dev),
        cos_sin=rope_cos_sin_table(max_model_len, D, 10000.0, dev), block_tables=tables.to(dev),
        row_q_start=torch.full((rows,), pos, dtype=torch.int32, device=dev),
        row_len=torch.ones(rows, dtype=torch.int32, device=dev),
        row_tok_off=torch.arange(rows, dtype=torch.int32, device=dev),
    )  # fmt: skip


def share_prefix(inputs: dict, prefix: int, groups: int, max_groups: int = 8) -> SharedPrefixes:
    """Point the first prefix // PAGE blocks of every row of group g (row % groups) at the blocks of the
    group's first row; the groups' SharedPrefixes (max_groups slots, as the engine's class x loop)."""
    tables, rows = inputs["block_tables"], inputs["block_tables"].shape[0]
    n = prefix // PAGE
    group = torch.arange(rows, device=tables.device) % groups
    tables[:, :n] = tables[group, :n]
    lens = torch.zeros(max_groups, dtype=torch.int32, device=tables.device)
    lens[:groups] = n * PAGE
    return SharedPrefixes(group.int(), lens)


def time_us(
    inputs: dict, cfg: dict | None, replays: int, prefixes=None, pre_cfg: dict | None = None
) -> float:
    out = torch.empty_like(inputs["q"])

    def layer_calls():
        for _ in range(LAYERS):
            fused_decode_attention(**inputs, block_size=PAGE, out=out, config=cfg, prefixes=prefixes,
                                   prefix_config=pre_cfg)  # fmt: skip

    return 1000 * replay_ms(capture(layer_calls), replays, warmup=1) / LAYERS


def prefix_cases(a) -> None:
    """The shared-prefix launch plus the decode against the decode alone, on the same rows and blocks."""
    for rows, context in itertools.product(a.rows, a.contexts):
        inputs = case(rows, context, a.max_model_len)
        prefixes = share_prefix(inputs, a.prefix, a.groups)
        plain = time_us(inputs, None, a.replays)
        default = prefix_config(rows, a.max_model_len)
        base = {"rows": rows, "context": context, "prefix": a.prefix, "groups": a.groups}
        print(json.dumps({**base, "case": "decode alone", "us": round(plain, 2)}), flush=True)
        kv_bytes = 2 * a.groups * a.prefix * HKV * D * 2  # each group's prefix read once
        for splits, block_n, warps in itertools.product(a.pre_splits, a.pre_block_n, a.pre_warps):
            pre = {"PRE_SPLITS": splits or default["PRE_SPLITS"], "BLOCK_N": block_n or default["BLOCK_N"],
                   "num_warps": warps or default["num_warps"]}  # fmt: skip
            us = time_us(inputs, None, a.replays, prefixes, pre)
            row = {
                **base,
                "case": "shared prefix",
                **pre,
                "default": all(default[k] == v for k, v in pre.items()),
            }
            print(json.dumps({**row, "us": round(us, 2), "vs_alone": round(us / plain, 3),
                              "prefix_tb_s": round(kv_bytes / us / 1e6, 2)}), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[160, 1152])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="(0: decode_config's)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[0], help="key tile (0: decode_config's)")
    ap.add_argument("--warps", type=int, nargs="+", default=[0], help="warps a program (0: decode_config's)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16")
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--prefix", type=int, default=0, help="positions shared by a group's rows (0: no groups)")
    ap.add_argument(
        "--groups", type=int, default=4, help="groups of rows sharing a prefix (a class's planes)"
    )
    ap.add_argument("--pre-splits", type=int, nargs="+", default=[0], help="prefix slices (0: the default)")
    ap.add_argument(
        "--pre-block-n", type=int, nargs="+", default=[0], help="prefix key tile (0: the default)"
    )
    ap.add_argument("--pre-warps", type=int, nargs="+", default=[0], help="prefix warps (0: the default)")
    a = ap.parse_args(argv)
    if a.prefix:
        prefix_cases(a)
        return
    for rows in a.rows:
        for context in a.contexts:
            fp8 = a.kv_cache_dtype == "fp8"
            inputs = case(rows, context, a.max_model_len, cache_dtype=torch.float8_e4m3fn if fp8 else None)
            default = decode_config(rows, HKV, HQ // HKV, D, a.max_model_len)
            kv_bytes = 2 * rows * context * HKV * D * (1 if fp8 else 2)
            for splits, block_n, warps in itertools.product(a.splits, a.block_n, a.warps):
                cfg = {
                    "NUM_SPLITS": splits or default["NUM_SPLITS"],
                    "BLOCK_N": block_n or default["BLOCK_N"],
                    "num_warps": warps or default["num_warps"],
                }
                us = time_us(inputs, cfg, a.replays)
                row = {"rows": rows, "context": context, "kv_cache_dtype": a.kv_cache_dtype, **cfg,
                       "default": cfg == default}  # fmt: skip
                tb_s = round(kv_bytes / us / 1e6, 2)
                print(json.dumps({**row, "us": round(us, 2), "kv_tb_s": tb_s}), flush=True)


if __name__ == "__main__":
    main()
