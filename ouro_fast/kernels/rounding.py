"""Rounding fp32 to the storage dtype, exactly as the GPU does, also under the CPU interpreter.

Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even;
kernels that must replay torch's roundings call round_to with INTERPRETED set by
`interpreting()`, which is False on the GPU (a plain cast there).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x (fp32) rounded to nearest even in DTYPE; NaN payloads aside, the GPU cast's result."""
    if INTERPRETED and DTYPE == tl.bfloat16:  # noqa: SIM300 (DTYPE is a parameter)
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return x.to(DTYPE)
