"""Last-exited propagation: copy tokens' K/V of every layer from their exit plane to deeper planes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FLOAT_DTYPES, FP8_CACHE, next_pow2
from .pdl import pdl_enter, pdl_launch
from .tuning import PROPAGATE_BLOCK, SMALL_KERNEL_WARPS


@triton.jit
def _propagate_kernel(
    cache_ptr,
    src_ptr,
    dst_ptr,
    count_ptr,
    num_layers,
    stride_kv,
    stride_layer,
    stride_slot,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)  # the pairs (and the cache rows) come from earlier kernels
    # One program: one (src, dst) pair, one (K or V, layer) plane row.
    i = tl.program_id(0)
    # int64: a 1.4B cache's (K/V, layer) offsets pass 2**31 elements.
    plane = tl.program_id(1).to(tl.int64)
    # Nested so that without a count the load is compiled away.
    if HAS_COUNT:  # noqa: SIM102
        if i >= tl.load(count_ptr):
            return
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    if (src < 0) | (dst < 0):
        return
    base = cache_ptr + (plane // num_layers) * stride_kv + (plane % num_layers) * stride_layer
    for off in range(0, ROW, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < ROW
        row = tl.load(base + src * stride_slot + offs, mask=mask)
        tl.store(base + dst * stride_slot + offs, row, mask=mask)


def propagate_kv(
    kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor | None = None
) -> None:
    """kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]] for every valid pair i, in one launch.

    kv_cache [2, L, num_slots, Hkv, D] with each slot's [Hkv, D] contiguous; src, dst
    [P] integer slots. Pair i is skipped when i >= count[0] (count: int32/int64 [1] on
    the device, so P may be a fixed padded size inside a CUDA graph) or when src[i] or
    dst[i] is negative. P may be 0. The dst slots must be distinct and never a src.
    """
    if kv_cache.dtype not in (*FLOAT_DTYPES, FP8_CACHE):
        raise ValueError(f"kv_cache must be a float or float8 e4m3 tensor, got {kv_cache.dtype}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, L, num_slots, Hkv, D], got {tuple(kv_cache.shape)}")
    two, layers, _, hkv, d = kv_cache.shape
    if kv_cache.stride(3) != d:
        raise ValueError("each slot's [Hkv, D] must be contiguous")
    p = src.shape[0]
    if src.shape != (p,) or dst.shape != (p,):
        raise ValueError(f"src and dst must be [P], got {tuple(src.shape)} and {tuple(dst.shape)}")
    if count is not None and count.numel() != 1:
        raise ValueError(f"count must hold one element, got {tuple(count.shape)}")
    if p == 0:
        return
    row = hkv * d
    _propagate_kernel[(p, two * layers)](
        kv_cache, src, dst, src if count is None else count,
        layers, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        ROW=row, BLOCK=min(next_pow2(row), PROPAGATE_BLOCK), HAS_COUNT=count is not None,
        num_warps=SMALL_KERNEL_WARPS,
        **pdl_launch(kv_cache.device),
    )  # fmt: skip
