"""RMSNorm and the sandwich layer's fused residual add + RMSNorm, with the model's exact rounding.

RMS(x, w) = w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype): the normalised
value is rounded to the activation dtype BEFORE the weight multiply, whose product is
rounded again (as torch does for two bf16 tensors); every step is replayed here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_float, check_same_dtype, interpreting, next_pow2
from .pdl import pdl_enter, pdl_launch
from .rounding import round_to
from .tuning import NORM_MAX_WARPS, NORM_MIN_WARPS, NORM_ROW_ELEMS_PER_WARP


@triton.jit
def _rms(x, w, H: tl.constexpr, eps, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    # x fp32 [BLOCK] (zero beyond H), w fp32; returns the model's RMS(x, w) in fp32 holding DTYPE values.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = round_to(x * rstd, DTYPE, INTERPRETED).to(tl.float32)
    return round_to(w * normed, DTYPE, INTERPRETED).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    eps,
    stride_x,
    stride_o,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # before the wait: nothing writes it
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = _rms(x, w, H, eps, o_ptr.dtype.element_ty, INTERPRETED)
    tl.store(o_ptr + row * stride_o + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    a_ptr,
    w_a_ptr,
    w_next_ptr,
    h_out_ptr,
    x_out_ptr,
    eps,
    stride_h,
    stride_a,
    stride_ho,
    stride_xo,
    stride_part,
    H: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    dtype = h_out_ptr.dtype.element_ty
    # The weights before the PDL wait (no kernel writes them): off the wait's critical path. After it the
    # loads would queue behind the next matmul's weight stream.
    w_a = tl.load(w_a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w_next = tl.load(w_next_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    # Every load before the first store: one round trip (the compiler keeps loads behind a store).
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):  # a matmul's fp32 partial products, added in order, then rounded
        a += tl.load(a_ptr + p * stride_part + row * stride_a + offs, mask=mask, other=0.0)
    if PARTS > 0:
        a = round_to(a, dtype, INTERPRETED).to(tl.float32)
    h_new = round_to(h + _rms(a, w_a, H, eps, dtype, INTERPRETED), dtype, INTERPRETED)
    tl.store(h_out_ptr + row * stride_ho + offs, h_new, mask=mask)
    x = _rms(h_new.to(tl.float32), w_next, H, eps, dtype, INTERPRETED)
    tl.store(x_out_ptr + row * stride_xo + offs, x.to(x_out_ptr.dtype.element_ty), mask=mask)


def _check_rows(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    check_float(name, x)
    if x.dim() != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"{name} must be [N, H] with weight [H], got {tuple(x.shape)} and {tuple(w.shape)}")
    check_same_dtype(**{name: x, "weight": w})


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMS(x, weight) row by row for x [N, H] (weight [H], same dtype); returns out [N, H]."""
    _check_rows(x, weight, "x")
    out = torch.empty_like(x) if out is None else out
    if x.shape[0]:
        h = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, eps, x.stride(0), out.stride(0),
            H=h, BLOCK=next_pow2(h), INTERPRETED=interpreting(), num_warps=_warps(h),
            **pdl_launch(x.device),
        )  # fmt: skip
    return out


def add_rms_norm(
    h: torch.Tensor,
    a: torch.Tensor,
    weight_a: torch.Tensor,
    weight_next: torch.Tensor,
    eps: float,
    h_out: torch.Tensor | None = None,
    x_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h_new = h + RMS(a, weight_a); x = RMS(h_new, weight_next); returns (h_new, x), each [N, H].

    One pass per row: the sandwich residual (a = a sub-block's output) fused with the
    next norm (the MLP's input norm, the next layer's input norm, or the final norm).
    h_out may be h itself (in place). All tensors share one dtype, except that a may also be
    a matmul's fp32 partial products [P, N, H] (tc_linear's parts): they are added in order
    and rounded to the dtype, as the matmul's own output would be.
    """
    _check_rows(h, weight_a, "h")
    parts = a.shape[0] if a.dim() == 3 else 0
    if parts:
        if a.dtype != torch.float32 or a.shape[1:] != h.shape or a[0].stride(1) != 1:
            raise ValueError(
                f"partials must be fp32 [P, N, H] for h {tuple(h.shape)}, got {a.dtype} {tuple(a.shape)}"
            )
    else:
        _check_rows(a, weight_next, "a")
        if a.shape != h.shape:
            raise ValueError(f"h and a must have one shape, got {tuple(h.shape)} and {tuple(a.shape)}")
        check_same_dtype(h=h, a=a)
    check_same_dtype(h=h, weight_next=weight_next)
    h_out = torch.empty_like(h) if h_out is None else h_out
    x_out = torch.empty_like(h) if x_out is None else x_out
    if h.shape[0]:
        n = h.shape[1]
        _add_rms_norm_kernel[(h.shape[0],)](
            h, a, weight_a, weight_next, h_out, x_out, eps,
            h.stride(0), a.stride(-2), h_out.stride(0), x_out.stride(0), a.stride(0) if parts else 0,
            H=n, PARTS=parts, BLOCK=next_pow2(n), INTERPRETED=interpreting(), num_warps=_warps(n),
            **pdl_launch(h.device),
        )  # fmt: skip
    return h_out, x_out


def _warps(h: int) -> int:
    # One program a row: more warps keep more of a row's loads in flight (tuning.py).
    return max(NORM_MIN_WARPS, min(NORM_MAX_WARPS, next_pow2(h) // NORM_ROW_ELEMS_PER_WARP))
