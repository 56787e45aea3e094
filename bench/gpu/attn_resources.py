"""Registers, spills and shared memory of the fused decode attention, compiled offline for sm_90: no GPU.

The attention's residency beside the matmul's CTAs depends on its registers a thread (docs/benchmarks.md,
nineteenth and twenty-first sessions). This compiles `_fused_decode_kernel` for Hopper with the installed
triton (`triton.compile` with a GPUTarget, then triton's own `cuobjdump --dump-resource-usage`) at the
Ouro-1.4B decode shapes (16 heads of 128, MHA, bf16 cache, qkv as 3 fp32 partial products) and prints one
JSON line per setting. Run it with the GPU machine's triton version (3.6) for the GPU's numbers:

    python3 bench/gpu/attn_resources.py --settings 16:2:1 16:2:0 8:2:1     # BLOCK_N:WARPS:EARLY_KV
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ouro_fast.kernels import decode_attention as fused_decode
from ouro_fast.kernels.launch import interpreting

_STRIDES = ["qn", "qh", "kn", "kh", "vn", "vh", "on", "oh", "kcs", "kch", "vcs", "vch", "t", "bt", "p"]


def signature() -> dict:
    """The kernel's runtime arguments and their types, in order (decode: fp32 partial q/k/v, bf16 cache)."""
    # ts_ptr: without stamps the launch passes the int32 counters there.
    ptrs = dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", o_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16",
                slot_ptr="*i64", pos_ptr="*i64", table_ptr="*fp32", bt_ptr="*i32", q_start_ptr="*i32",
                len_ptr="*i32", tok_off_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32",
                cnt_ptr="*i32", ts_ptr="*i32")  # fmt: skip
    return {**ptrs, "num_pos": "i32", "scale_log2": "fp32", **{f"stride_{s}": "i32" for s in _STRIDES}}


def constants(block_n: int, early: int, splits: int) -> dict:
    """The kernel's compile-time arguments, IN ITS ORDER: ASTSource takes them by position, so one left out
    before another would shift it onto the wrong parameter (a STAMP set by the one after it, say)."""
    return dict(NUM_HEADS=16, NUM_KV_HEADS=16, GROUP=1, GROUP_P2=1, HEAD_DIM=128, D_P2=128, PAGE=16,
                BLOCK_N=block_n, NUM_SPLITS=splits, PARTS=3, INTERPRETED=False, USE_PDL=True,
                EARLY_KV=bool(early), STAMP=False)  # fmt: skip


def resources(block_n: int, warps: int, early: int, splits: int = 8, maxnreg: int | None = None) -> dict:
    """Compile one setting for sm_90; returns its registers a thread, spill stores and shared memory."""
    if interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted, not compiled; unset it")
    const = constants(block_n, early, splits)
    sig = {**signature(), **{k: "constexpr" for k in const}}
    names = list(sig)
    src = ASTSource(fused_decode._fused_decode_kernel, sig, {(names.index(k),): v for k, v in const.items()})
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output: {usage[-300:]}")
    regs, stack, shared = (int(v) for v in found.groups())
    return {"block_n": block_n, "warps": warps, "early_kv": early, "splits": splits,
            "maxnreg": maxnreg, "registers": regs, "stack_bytes": stack, "shared_bytes": shared,
            "registers_per_cta": regs * 32 * warps, "triton": triton.__version__}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="+", default=["16:2:1", "16:2:0"], help="BLOCK_N:WARPS:EARLY_KV")
    ap.add_argument("--maxnreg", type=int, help="registers a thread may take (triton's maxnreg)")
    ap.add_argument("--splits", type=int, default=8, help="NUM_SPLITS (8: the decode default from 8 rows)")
    args = ap.parse_args()
    for setting in args.settings:
        block_n, warps, early = (int(v) for v in setting.split(":"))
        res = resources(block_n, warps, early, args.splits, maxnreg=args.maxnreg)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
