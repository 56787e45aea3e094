"""Global-timer stamps for benchmark timelines (bench/gpu/attn_timeline.py, tc_gemm_bench.py): GPU only."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def stamp(addr, STAMP: tl.constexpr):
    """With STAMP, store the global timer (ns) at addr; without it, nothing is compiled."""
    if STAMP:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)  # fmt: skip
        tl.store(addr, now)
