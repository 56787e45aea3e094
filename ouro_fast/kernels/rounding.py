"""Rounding fp32 to the storage dtype, exactly as the GPU does, also under the CPU interpreter.

Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even;
kernels that must replay torch's roundings call round_to with INTERPRETED set by
`interpreting()`, which is False on the GPU (a plain cast there). A K/V cache in float8
e4m3 holds each value saturated to +-448 and rounded to nearest even (as_cached), the rule
of model/attention.to_cache_dtype.
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


FP8_MAX = tl.constexpr(448.0)  # float8 e4m3's largest finite value


@triton.jit
def as_cached(x, CACHE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x (the activations' dtype) as a cache of dtype CACHE holds it: x itself, or for float8 e4m3 x
    saturated to +-448 and rounded to nearest even (the interpreter's own cast misrounds ties and carries)."""
    if CACHE == tl.float8e4nv:  # noqa: SIM300 (CACHE is a parameter)
        y = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX)
        if INTERPRETED:
            # Normal range: keep 3 of fp32's 23 mantissa bits, to nearest even; below 2**-6: multiples of
            # 2**-9.
            # Rounded as magnitudes; the sign bit goes back on after (so -0 stays -0).
            bits = y.to(tl.uint32, bitcast=True)
            sign = bits & 0x80000000
            mag = bits ^ sign
            normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) << 20
            a = mag.to(tl.float32, bitcast=True)
            sub = (((a * 512.0 + 12582912.0) - 12582912.0) / 512.0).to(tl.uint32, bitcast=True)
            y = (tl.where(a < 0.015625, sub, normal) | sign).to(tl.float32, bitcast=True)
        return y.to(CACHE)
    else:
        return x
