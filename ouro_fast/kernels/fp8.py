"""Matmuls with FP8 weights: float8 e4m3 [N, K] with one float32 scale per output channel.

The Triton kernels here keep activations in the model's dtype: each widens its FP8 tiles to that dtype as
it loads them (exactly: every e4m3 value is a bf16, fp16 and fp32 value), multiplies with fp32
accumulation, scales column n by its scale and rounds once. Decode reads half the weight bytes of bf16.
The quantization itself and the PyTorch references of this math are model/quantization.py's.

fp8_linear is the one entry point: up to SKINNY_MAX_M rows the skinny kernel (skinny_gemm.py, with its
scale epilogue). Beyond, with bf16 activations on a GPU where torch.nn.functional.scaled_mm takes a scale
per row (Hopper, a torch that has it) and K and N are multiples of 16: W8A8, each row of x quantized to
e4m3 with its own scale (quantize_rows, one launch), then cuBLASLt's FP8 matmul with the row and column
scales (model/quantization.py's w8a8_reference_linear with one chunk a row). Elsewhere the tiled kernel
below, weight-only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import check_float, check_fp8_weight, interpreting, next_pow2
from .rounding import round_to
from .skinny_gemm import skinny_linear
from .swiglu import silu_and_mul
from .tuning import FP8_GEMM_TILES, SKINNY_MAX_M


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, silu_mul: bool = False,
               out: torch.Tensor | None = None, row_gate: torch.Tensor | None = None,
               ) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ (w * w_scale[:, None]).T -> [M, N] in x's dtype, for w float8_e4m3fn [N, K] and w_scale
    float32 [N], on the Triton kernels (CUDA, or the interpreter).

    silu_mul: x is [M, 2K] (gate then up) and the product's input is silu_and_mul(x). row_gate: see
    skinny_linear (at most SKINNY_MAX_M rows)."""
    if x.shape[0] <= SKINNY_MAX_M:
        return skinny_linear(x, w, out=out, silu_mul=silu_mul, row_gate=row_gate, w_scale=w_scale)
    if row_gate is not None:
        raise ValueError(f"row_gate needs at most {SKINNY_MAX_M} rows, got {x.shape[0]}")
    x = silu_and_mul(x) if silu_mul else x
    if x.dtype == torch.bfloat16 and not (x.shape[1] % 16 or w.shape[0] % 16) and scaled_mm_rowwise(x.device):
        y = scaled_mm_fp8_linear(x, w, w_scale)
        return y if out is None else out.copy_(y)
    return tiled_fp8_linear(x, w, w_scale, out)


@functools.cache
def scaled_mm_rowwise(device: torch.device) -> bool:
    """Whether torch multiplies FP8 matrices with a scale per row and per column here (F.scaled_mm with
    row-wise recipes): CUDA with compute capability 9.0 or newer, checked by one small call (no sync: an
    unsupported call raises)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    if not hasattr(F, "scaled_mm"):
        return False
    a = torch.zeros(16, 16, device=device, dtype=torch.float8_e4m3fn)
    ones = torch.ones(16, 1, device=device, dtype=torch.float32)
    try:
        _rowwise_mm(a, a, ones, ones[:, 0])
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def _rowwise_mm(
    q: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    # (q * x_scale) @ (w * w_scale[:, None]).T in bf16, on cuBLASLt's FP8 matmul.
    rowwise = F.ScalingType.RowWise
    return F.scaled_mm(q, w.t(), x_scale, rowwise, w_scale[None, :], rowwise, output_dtype=torch.bfloat16)


def scaled_mm_fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ (w * w_scale[:, None]).T -> [M, N] bf16, W8A8: x's rows quantized to e4m3 with a scale
    each (quantize_rows), then F.scaled_mm (cuBLASLt) with the row and column scales."""
    check_fp8_weight(w, w_scale)
    q, x_scale = quantize_rows(x)
    return _rowwise_mm(q, w, x_scale, w_scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    # One row: its largest magnitude maps to e4m3's 448.
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + r * K + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    tl.store(s_ptr + r, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K], float32 scales [M, 1]) with x ~ values * scales: each row scaled so
    that its largest magnitude is 448, rounded to nearest (an all-zero row: zeros)."""
    check_float("x", x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_pow2(k)
        _quantize_rows_kernel[(m,)](
            x, q, scale, k, x.stride(0), BLOCK=block, num_warps=8 if block > 2048 else 4
        )
    return q, scale


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, s_ptr, o_ptr, M, N, K, stride_xm, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                  INTERPRETED: tl.constexpr):  # fmt: skip
    # One [BLOCK_M, BLOCK_N] output tile; programs walk the tiles GROUP_M row tiles at a time, so the
    # weight columns they share stay in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
    pid_n = (pid % (GROUP_M * tiles_n)) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows and columns re-read valid ones (stores are masked): loads need only a K mask.
    x_rows = (offs_m % M).to(tl.int64)
    w_rows = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + w_rows[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: w transposed
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = k + offs_k < K
        x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0).to(x.dtype)
        if DOT_UPCAST:
            # The interpreter's numpy dot cannot take bf16; products of 16-bit floats are exact in fp32.
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + w_rows)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    o_ptrs = o_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, round_to(acc, o_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def tiled_fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """fp8_linear for any M (prompt chunks): output tiles of tuning.FP8_GEMM_TILES, fp32 accumulation."""
    check_float("x", x)
    check_fp8_weight(w, w_scale)
    m, k = x.shape
    n = w.shape[0]
    if x.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"need x [M, {w.shape[1]}], got {tuple(x.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with a contiguous last dimension")
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, group_m, warps, stages = _tiles(m)
    interp = interpreting()
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _tiled_kernel[grid](
        x, w, w_scale, out, m, n, k, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interp and x.dtype != torch.float32, INTERPRETED=interp,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _tiles(m: int) -> tuple[int, ...]:
    """The first FP8_GEMM_TILES entry whose row bound holds m (the last one beyond)."""
    for max_rows, tiles in FP8_GEMM_TILES:
        if m <= max_rows:
            return tiles
    return FP8_GEMM_TILES[-1][1]
