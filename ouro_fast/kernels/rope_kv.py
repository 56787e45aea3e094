"""Fused rotary embedding (split-half) of q and k plus the K/V write into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_cache, check_float, check_same_dtype, interpreting, next_pow2
from .pdl import pdl_enter, pdl_launch
from .rounding import as_cached, round_to
from .tuning import SMALL_KERNEL_WARPS


def rope_cos_sin_table(max_positions: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos in [:, :head_dim/2], sin in [:, head_dim/2:].

    The same operations as the model's rope_cos_sin (model/ouro.py) over positions
    0 .. max_positions - 1, so the kernel rotates bit for bit with the angles of
    OuroForCausalLM.run_loop (tests/test_kernels.py checks the two agree).
    """
    pos = torch.arange(max_positions, device=device)
    exponents = torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    # cos and sin of the duplicated angles, as rope_cos_sin takes them, then one half of each.
    emb = torch.cat((freqs, freqs), dim=-1)
    half = head_dim // 2
    return torch.cat((emb.cos()[:, :half], emb.sin()[:, :half]), dim=1).contiguous()


@triton.jit
def _rotated_halves(x_ptr, row, stride_h, cos, sin, H: tl.constexpr, H_P2: tl.constexpr, HALF: tl.constexpr,
                    HALF_P2: tl.constexpr):  # fmt: skip
    # Both halves of every head of one token, rotated in fp32: (x1*cos - x2*sin, x2*cos + x1*sin).
    offs_h = tl.arange(0, H_P2)
    offs_d = tl.arange(0, HALF_P2)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
    base = x_ptr + row + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _store_halves(x_ptr, row, stride_h, lo, hi, H: tl.constexpr, H_P2: tl.constexpr, HALF: tl.constexpr,
                  HALF_P2: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # Rounded to DTYPE (the activations'), then stored as x_ptr's dtype holds it (an FP8 cache: as_cached).
    offs_h = tl.arange(0, H_P2)
    offs_d = tl.arange(0, HALF_P2)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
    base = x_ptr + row + offs_h[:, None] * stride_h + offs_d[None, :]
    X: tl.constexpr = x_ptr.dtype.element_ty
    tl.store(base, as_cached(round_to(lo, DTYPE, INTERPRETED), X, INTERPRETED), mask=mask)
    tl.store(base + HALF, as_cached(round_to(hi, DTYPE, INTERPRETED), X, INTERPRETED), mask=mask)


@triton.jit
def _copy_heads(src_ptr, src_row, src_stride_h, dst_ptr, dst_row, dst_stride_h, H: tl.constexpr,
                H_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                INTERPRETED: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, H_P2)
    offs_d = tl.arange(0, D_P2)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    x = tl.load(src_ptr + src_row + offs_h[:, None] * src_stride_h + offs_d[None, :], mask=mask)
    x = as_cached(x, dst_ptr.dtype.element_ty, INTERPRETED)
    tl.store(dst_ptr + dst_row + offs_h[:, None] * dst_stride_h + offs_d[None, :], x, mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    pos_ptr,
    table_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    num_pos,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_t,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HQ_P2: tl.constexpr,
    HKV_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per token: all its heads.
    tok = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    slot = tl.load(slot_ptr + tok)
    if APPLY_ROPE:
        # Clamped so padding tokens with junk positions never read out of bounds.
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr + tok), 0), num_pos - 1).to(tl.int64)
        offs_c = tl.arange(0, HALF_P2)
        cos = tl.load(table_ptr + pos * stride_t + offs_c, mask=offs_c < HALF, other=0.0)
        sin = tl.load(table_ptr + pos * stride_t + HALF + offs_c, mask=offs_c < HALF, other=0.0)
        q1, q2 = _rotated_halves(q_ptr, tok * stride_qn, stride_qh, cos, sin, HQ, HQ_P2, HALF, HALF_P2)
        _store_halves(q_out_ptr, tok * stride_on, stride_oh, q1, q2, HQ, HQ_P2, HALF, HALF_P2,
                      q_out_ptr.dtype.element_ty, INTERPRETED)  # fmt: skip
    if slot >= 0:
        kc_row = slot.to(tl.int64) * stride_kcs
        if APPLY_ROPE:
            k1, k2 = _rotated_halves(k_ptr, tok * stride_kn, stride_kh, cos, sin, HKV, HKV_P2, HALF, HALF_P2)
            _store_halves(kc_ptr, kc_row, stride_kch, k1, k2, HKV, HKV_P2, HALF, HALF_P2,
                          k_ptr.dtype.element_ty, INTERPRETED)  # fmt: skip
        else:
            _copy_heads(k_ptr, tok * stride_kn, stride_kh, kc_ptr, kc_row, stride_kch, HKV, HKV_P2, HEAD_DIM,
                        D_P2, INTERPRETED)  # fmt: skip
        vc_row = slot.to(tl.int64) * stride_vcs
        _copy_heads(v_ptr, tok * stride_vn, stride_vh, vc_ptr, vc_row, stride_vch, HKV, HKV_P2, HEAD_DIM,
                    D_P2, INTERPRETED)  # fmt: skip


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by position (when positions is given) and write k, v into the cache; returns q.

    q [N, Hq, D]; k, v [N, Hkv, D]; k_cache, v_cache [num_slots, Hkv, D] (one layer);
    slot_mapping [N] int64: token i's K/V go to slot slot_mapping[i], and a slot < 0
    writes nothing (padding, or K/V already present).
    With positions [N] (int32/int64) and cos_sin from rope_cos_sin_table: split-half
    rotation in fp32, x1*cos - x2*sin and x2*cos + x1*sin, rounded once to the output
    dtype; the rotated q goes to q_out (new tensor when None; may be q itself for in
    place) and the rotated k to the cache. A float8 e4m3 cache holds k and v as
    rounding.as_cached gives them. Positions are clamped into the table, so
    padding tokens may carry any position. Without positions, k and v are written as
    they are and q is returned unchanged. The grid is (N,).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
    check_same_dtype(k=k, v=v)
    check_cache("k_cache", k_cache, k.dtype)
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    n, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (n, hkv, d) or v.shape != k.shape or k_cache.shape[1:] != (hkv, d):
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}")  # fmt: skip
    if v_cache.shape != k_cache.shape or slot_mapping.shape != (n,):
        raise ValueError(
            f"bad shapes: v_cache {tuple(v_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    rope = positions is not None
    if rope:
        if cos_sin is None or cos_sin.dtype != torch.float32 or cos_sin.shape[1] != d or d % 2:
            raise ValueError("RoPE needs an even head_dim and cos_sin float32 [max_positions, head_dim]")
        if positions.shape != (n,):
            raise ValueError(f"positions must be [{n}], got {tuple(positions.shape)}")
        q_out = torch.empty_like(q) if q_out is None else q_out
        check_float("q_out", q_out)
    else:
        positions, cos_sin, q_out = slot_mapping, k_cache, q
    if n == 0:
        return q_out
    _rope_write_kv_kernel[(n,)](
        q, k, v, q_out, positions, cos_sin, slot_mapping, k_cache, v_cache,
        cos_sin.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin.stride(0),
        HQ=hq, HKV=hkv, HQ_P2=next_pow2(hq), HKV_P2=next_pow2(hkv), HALF=d // 2, HALF_P2=next_pow2(d // 2),
        HEAD_DIM=d, D_P2=next_pow2(d), APPLY_ROPE=rope, num_warps=SMALL_KERNEL_WARPS,
        INTERPRETED=interpreting(), **pdl_launch(q.device),
    )  # fmt: skip
    return q_out
