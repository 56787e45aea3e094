"""SiLU-and-mul on a fused gate/up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_float, interpreting
from .pdl import pdl_enter, pdl_launch
from .rounding import round_to
from .tuning import SILU_MUL_BLOCK, SMALL_KERNEL_WARPS


@triton.jit
def silu_mul(g, u, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """silu(g) * u of fp32 g, u, rounded as torch's F.silu(gate) * up in DTYPE (silu, then the product)."""
    act = round_to(g / (1.0 + tl.exp(-g)), DTYPE, INTERPRETED).to(tl.float32)
    return round_to(act * u, DTYPE, INTERPRETED)


@triton.jit
def _silu_and_mul_kernel(x_ptr, o_ptr, F, stride_x, stride_o, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
                         USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    dtype = o_ptr.dtype.element_ty
    pdl_enter(USE_PDL)
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + offs, silu_mul(g, u, dtype, INTERPRETED), mask=mask)


def silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, block: int = SILU_MUL_BLOCK
) -> torch.Tensor:
    """silu(x[:, :F]) * x[:, F:] for x [N, 2F] (gate then up, e.g. a fused gate_up matmul); out [N, F].

    Matches torch's F.silu(gate) * up in the same dtype: fp32 math, the silu rounded
    to the dtype before the multiply. Grid (N, cdiv(F, block)).
    """
    check_float("x", x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [N, 2F], got {tuple(x.shape)}")
    n, f = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, f, dtype=x.dtype, device=x.device) if out is None else out
    if n and f:
        _silu_and_mul_kernel[(n, triton.cdiv(f, block))](
            x,
            out,
            f,
            x.stride(0),
            out.stride(0),
            BLOCK=block,
            INTERPRETED=interpreting(),
            num_warps=SMALL_KERNEL_WARPS,
            **pdl_launch(x.device),
        )
    return out
