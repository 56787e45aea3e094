"""Compile the Gluon matmul for Hopper on a machine without a GPU: catch compile errors and check register
spills and shared memory before spending device time.

Triton compiles for a target without a device if the active driver only reports one: `MockDriver` says
"cuda, sm_90", and `kernel.warmup(...)` compiles (ptxas included) without launching. Use the GPU machine's
triton (3.6 there; later versions renamed Gluon's TMA calls) in a venv of its own:

    python3 -m venv /tmp/v36 && /tmp/v36/bin/pip install torch==2.13.0 triton==3.6.0 numpy
    /tmp/v36/bin/python bench/gpu/offline_compile.py          # tc_gemm at Ouro-1.4B's four shapes

For each shape it prints the CTAs, ring slots, shared memory and ptxas's registers and spills. Measured use:
the twenty-third session compiled its two Gluon kernels here first (docs/benchmarks.md).

With --paged BQ:BN:WARPS ... it compiles the prompt steps' paged attention (`kernels/attention.py`, bf16,
Ouro-1.4B's 16 heads of 128, block size 16) at those tiles instead: shared memory, registers and spills.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


class MockDriver:
    """The active driver for compiling only: one CUDA device of compute capability 9.0, stream 0."""

    backend = "cuda"

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def install() -> None:
    """Make MockDriver triton's active driver (for this process)."""
    from triton.runtime import driver

    driver.set_active(MockDriver())


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes of a kernel's PTX, from `ptxas -v` (the ptxas triton uses) for the PTX's
    target (sm_90a for the Gluon kernels, sm_90 for plain Triton ones)."""
    from triton.backends.nvidia import compiler

    try:  # the ptxas triton itself would use for sm_90 (newer versions take the arch)
        ptxas = compiler.get_ptxas(90).path
    except TypeError:
        ptxas = compiler.get_ptxas().path
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spill.group(1) if spill else 0),
    }


def compile_tc_gemm(n: int, k: int, m: int, silu_mul: bool, partial: bool, swiglu: bool = False,
                    pace: int = 0) -> dict:  # fmt: skip
    """tc_gemm's kernel at one shape, as tc_linear would launch it on a 132-SM H200."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ouro_fast.kernels import tc_gemm as t

    tc, nbuf, per_sm = t.CONFIG
    ntok = 8 if m <= 8 else 16
    kt, tiles = k // tc, (n // t.TR) * (k // tc)
    ctas, budget = t.launch_plan(n, k, tc, 132, per_sm, partial)
    slots = t.slots_for(n, k, tc, ctas) if partial else 0
    w = torch.empty(n, k, dtype=torch.bfloat16)
    x = torch.empty(m, 2 * k if silu_mul else k, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for
    wrows = t.HALF if swiglu else t.TR
    w_desc = TensorDescriptor.from_tensor(w, [wrows, tc], layout([wrows, tc], gl.bfloat16))
    x_desc = TensorDescriptor.from_tensor(x, [ntok, tc], layout([ntok, tc], gl.bfloat16))
    out = torch.empty(max(slots, 1), m, n)
    cnt = torch.empty(16, dtype=torch.int32)
    ring = t.slots_used(n, k, tc, ctas, t.ring_slots(tc, ntok, silu_mul, nbuf, budget, swiglu))
    kernel = t._tc_gemm_kernel.warmup(
        w_desc, x_desc, out, out, cnt, cnt, m, n // 2 if swiglu else n, tiles, ctas, kt, slots,
        n // 2 if swiglu else k, NBUF=ring, SILU_MUL=silu_mul, PARTS=partial, STAMP=False,
        PRE=t.PREFETCH, SWIGLU=swiglu, PACE=t.PACE_AT.get((n, k), pace), UNTIL_GO=t.PACE_UNTIL_GO,
        num_warps=4,
        maxnreg=t.MAXNREG[ntok], launch_pdl=True, grid=(ctas,),
    )  # fmt: skip
    if os.environ.get("PTX_DIR"):  # PTX_DIR=folder: keep each compile's PTX, to read what it does
        name = f"tc_{n}x{k}_m{m}{'_swiglu' if swiglu else ''}.ptx"
        Path(os.environ["PTX_DIR"], name).write_text(kernel.asm["ptx"])
    return {"n": n, "k": k, "m": m, "swiglu": swiglu, "ctas": ctas, "ring": ring,
            "smem": kernel.metadata.shared, **ptxas_usage(kernel.asm["ptx"])}  # fmt: skip


def compile_paged_attention(block_q: int, block_n: int, warps: int) -> dict:
    """The prompt steps' paged attention at one tile config, as paged_attention launches it (bf16, MHA)."""
    from ouro_fast.kernels import prefill_attention as attention

    q = torch.empty(144, 16, 128, dtype=torch.bfloat16)
    kc = torch.empty(4096, 16, 128, dtype=torch.bfloat16)
    bt, meta = torch.empty(9, 64, dtype=torch.int32), torch.empty(9, dtype=torch.int32)
    strides = (*q.stride()[:2], *q.stride()[:2], *kc.stride()[:2], *kc.stride()[:2], bt.stride(0))
    kernel = attention._paged_attention_kernel.warmup(
        q, q, kc, kc, bt, meta, meta, meta, 0.1, *strides, 9, 128,
        GROUP=1, GROUP_P2=1, HEAD_DIM=128, D_P2=128, PAGE=16, BLOCK_Q=block_q, BLOCK_N=block_n, USE_DOT=True,
        DOT_PRECISION="tf32", DOT_UPCAST=False, R_P2=16, INTERPRETED=False, num_warps=warps, grid=(1,),
    )  # fmt: skip
    return {"block_q": block_q, "block_n": block_n, "warps": warps, "smem": kernel.metadata.shared,
            **ptxas_usage(kernel.asm["ptx"])}  # fmt: skip


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree: no install in this venv
    install()
    if "--paged" in sys.argv:
        for tiles in sys.argv[sys.argv.index("--paged") + 1 :]:
            print(compile_paged_attention(*(int(v) for v in tiles.split(":"))), flush=True)
        return 0
    from ouro_fast.kernels.tuning import TC_PACE_BESIDE as beside

    shapes = [
        (6144, 2048, False, True, False, beside),
        (2048, 2048, False, True, False, beside),
        (11264, 2048, False, False, False, 0),
        (11264, 2048, False, False, True, beside),
        (2048, 5632, True, True, False, 0),
        (2048, 5632, False, True, False, 0),
    ]  # qkv, o_proj, gate_up (plain, swiglu_out), down (silu_mul, plain): (silu_mul, partial, swiglu, pace)
    for n, k, silu, partial, swiglu, pace in shapes:  # paced as fast_loop.run_loop_fused launches them
        for m in (1, 16):
            print(compile_tc_gemm(n, k, m, silu, partial, swiglu, pace), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
