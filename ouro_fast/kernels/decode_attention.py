"""Decode attention of a layer in ONE launch: RoPE, the K/V write, split-KV attention and the merge.

The reference path is three launches (rope_write_kv, then split_kv_attention's split and
merge kernels), a launch each per layer and loop step. Here every program of the split-KV
grid (rows, KV heads, NUM_SPLITS) rotates its own row's query heads and K in registers,
exactly as rope_write_kv does; the key and value at the query's own position come from
those registers, since the cache slot is written in the same launch (by the last split's
program). The merge is fused as in skinny_gemm's FUSED_REDUCE: each program stores its
partial softmax, counts its arrival on a per-(row, KV head) int32 counter, and the last to
arrive merges the partials in split order and resets the counter. The arithmetic is the
three launches', operation for operation, so results and the cache are bit-identical to
them (tested under the interpreter and on the H200).

PDL: the kernel waits and releases its successor as every decode kernel does. While rows
x KV heads fit twice the SMs (pdl_launch_ok) it is launched with the PDL attribute, and then
loads the metadata and each slice's first key/value tile before its wait (EARLY_KV), so those
reads overlap the qkv matmul: only q, k and v need the wait. A larger grid launched early
would crowd onto the SMs the matmul frees first; it launches plainly, on an idle GPU.
Up to a few rows the registers a thread are capped (maxnreg). Both choices are in tuning.py.

q, k and v may also come as the qkv matmul's fp32 partial products (tc_linear with partial,
[S, N, H, D] views): each program adds a value's S slots in order and rounds it to the cache
dtype, as the matmul would have, before the RoPE.

Launch grid and scratch depend only on shapes, so calls are CUDA-graph capturable;
the counters are allocated on the first eager call (warm-up), never during capture.
Calls that share the counters must be ordered (one stream).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cascade_attention
from .cascade_attention import SharedPrefixes
from .launch import (
    FP8_CACHE,
    ArrivalCounters,
    check_cache,
    check_float,
    check_paged_inputs,
    check_same_dtype,
    interpreting,
    next_pow2,
    sm_count,
)
from .pdl import pdl_enabled, pdl_enter
from .rounding import as_cached, round_to
from .split_kv_attention import (
    attend_slice,
    launch_config,
    load_kv_tile,
    merge_partials,
    partials_scratch,
    slice_bounds,
    store_normalised,
    store_partial,
)
from .tuning import (
    DECODE_ATTN_FP8_TO_FP32_ROWS,
    DECODE_ATTN_MAXNREG,
    DECODE_ATTN_MAXNREG_ROWS,
    DECODE_ATTN_PDL_ROW_HEADS_PER_SM,
)

# One counter per (row, KV head); 8192 covers 512 rows of 16 KV heads without growing.
_MIN_COUNTERS = 8192


@triton.jit
def _cos_sin(table_ptr, pos_ptr, tok, num_pos, stride_t, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
             D_P2: tl.constexpr, CACHE: tl.constexpr = ""):  # fmt: skip
    # cos and sin of each lane's split-half pair (d mod HALF), [D_P2]; rope_write_kv's clamped lookup.
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + tok, cache_modifier=CACHE), 0), num_pos - 1).to(tl.int64)
    offs_d = tl.arange(0, D_P2)
    pair = offs_d % HALF
    d_valid = offs_d < HEAD_DIM
    cos = tl.load(table_ptr + pos * stride_t + pair, mask=d_valid, other=0.0, cache_modifier=CACHE)
    sin = tl.load(table_ptr + pos * stride_t + HALF + pair, mask=d_valid, other=0.0, cache_modifier=CACHE)
    return cos, sin


@triton.jit
def _value(ptrs, mask, stride_p, PARTS: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    # A projection's values in fp32: loaded, or (PARTS > 0) its PARTS fp32 partial products added in slot
    # order and rounded to DTYPE, as the matmul rounds its output.
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 0:
        for p in tl.static_range(1, PARTS):
            x += tl.load(ptrs + p * stride_p, mask=mask, other=0.0)
        x = round_to(x, DTYPE, INTERPRETED).to(tl.float32)
    return x


@triton.jit
def _rotated(x_row_ptr, heads, h_valid, stride_h, stride_p, cos, sin, HALF: tl.constexpr,
             HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, DTYPE: tl.constexpr, PARTS: tl.constexpr,
             INTERPRETED: tl.constexpr):  # fmt: skip
    # Heads [H] of one token rotated, [H, D_P2] in DTYPE: every lane computes its pair with
    # rope_write_kv's expressions (x1*cos - x2*sin, x2*cos + x1*sin in fp32) and keeps its half.
    offs_d = tl.arange(0, D_P2)
    mask = h_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptrs = x_row_ptr + heads[:, None] * stride_h + (offs_d % HALF)[None, :]
    x1 = _value(ptrs, mask, stride_p, PARTS, DTYPE, INTERPRETED)
    x2 = _value(ptrs + HALF, mask, stride_p, PARTS, DTYPE, INTERPRETED)
    lo = x1 * cos[None, :] - x2 * sin[None, :]
    hi = x2 * cos[None, :] + x1 * sin[None, :]
    return round_to(tl.where((offs_d < HALF)[None, :], lo, hi), DTYPE, INTERPRETED)


@triton.jit
def _write_kv(kc_ptr, vc_ptr, slot, kv_head, k_new, v_new, stride_kcs, stride_kch, stride_vcs, stride_vch,
              HEAD_DIM: tl.constexpr, D_P2: tl.constexpr):  # fmt: skip
    offs_d = tl.arange(0, D_P2)[None, :]
    mask = offs_d < HEAD_DIM
    slot = slot.to(tl.int64)
    tl.store(kc_ptr + slot * stride_kcs + kv_head * stride_kch + offs_d, k_new, mask=mask)
    tl.store(vc_ptr + slot * stride_vcs + kv_head * stride_vch + offs_d, v_new, mask=mask)


@triton.jit
def _merge_group(o_ptr, acc_ptr, m_ptr, l_ptr, row, kv_head, tok, stride_on, stride_oh,
                 NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                 TOTAL: tl.constexpr, PRE: tl.constexpr, has_pre, INTERPRETED: tl.constexpr):  # fmt: skip
    # _decode_merge_kernel for each of the GROUP heads (TOTAL partials, the last PRE a shared prefix's);
    # .cg loads read L2, never a stale L1 line.
    offs_d = tl.arange(0, D_P2)
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        base = (row * NUM_HEADS + head) * TOTAL
        out = merge_partials(acc_ptr, m_ptr, l_ptr, base, HEAD_DIM, D_P2, TOTAL, ".cg", PRE, has_pre)
        tl.store(
            o_ptr + tok * stride_on + head * stride_oh + offs_d,
            round_to(out, o_ptr.dtype.element_ty, INTERPRETED),
            mask=offs_d < HEAD_DIM,
        )


@triton.jit
def _fused_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    pos_ptr,
    table_ptr,
    bt_ptr,
    q_start_ptr,
    len_ptr,
    tok_off_ptr,
    grp_ptr,
    glen_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    cnt_ptr,
    num_pos,
    scale_log2,
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
    stride_bt,
    stride_p,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRE_SPLITS: tl.constexpr,
    PARTS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY_KV: tl.constexpr,
    SLOTS_AHEAD: tl.constexpr,
    FP8_TO_FP32: tl.constexpr,
):
    # One program: one row, one KV head with its GROUP query heads, one slice of the context.
    # PARTS > 0: q, k, v are fp32 partial products, slot p at + p * stride_p (their own dtype: out's).
    # SLOTS_AHEAD: each key tile's cache slots are read in the iteration before (attend_slice).
    # FP8_TO_FP32: an FP8 cache's tiles widen straight to fp32 (attend_tile).
    # PRE_SPLITS > 0: a row of a shared-prefix group attends from the prefix's end on, and its merge takes
    # the PRE_SPLITS partials that cascade_attention's launch before this one wrote for the prefix.
    DTYPE: tl.constexpr = o_ptr.dtype.element_ty  # the activations'; the cache may be FP8
    CACHE: tl.constexpr = kc_ptr.dtype.element_ty
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait (EARLY_KV): the step's metadata and this slice's first key/value tile, off the
    # critical path behind qkv. No kernel of the PDL chain writes them: the host's copies, the lanes'
    # prologue (a plain launch, done before the chain's first kernel starts) and earlier launches did.
    # .cg reads them from L2. Only q, k, v (qkv's output) need the wait.
    PRE: tl.constexpr = ".cg" if EARLY_KV else ""
    if not EARLY_KV:
        pdl_enter(USE_PDL)
    n_q = tl.load(len_ptr + row, cache_modifier=PRE)
    q_pos = tl.load(q_start_ptr + row, cache_modifier=PRE)
    tok = tl.load(tok_off_ptr + row, cache_modifier=PRE).to(tl.int64)
    if n_q == 0:
        return
    slot = tl.load(slot_ptr + tok, cache_modifier=PRE)
    pre_len = 0
    if PRE_SPLITS > 0:
        grp = tl.load(grp_ptr + row, cache_modifier=PRE)
        pre_len = tl.where(grp >= 0, tl.load(glen_ptr + tl.maximum(grp, 0), cache_modifier=PRE), 0)
    start, end = slice_bounds(q_pos, split, NUM_SPLITS, BLOCK_N, pre_len)
    cos, sin = _cos_sin(table_ptr, pos_ptr, tok, num_pos, stride_t, HEAD_DIM // 2, HEAD_DIM, D_P2, PRE)
    bt_row = bt_ptr + row * stride_bt
    k0, v0 = None, None  # without EARLY_KV, attend_slice loads the first tile itself
    if EARLY_KV:
        k0, v0 = load_kv_tile(kc_ptr, vc_ptr, bt_row, kv_head, start, end, stride_kcs, stride_kch, stride_vcs,
                              stride_vch, HEAD_DIM, D_P2, PAGE, BLOCK_N, PRE)  # fmt: skip
        pdl_enter(USE_PDL)

    offs_g = tl.arange(0, GROUP_P2)
    g_valid = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    # The rotated q as rope_write_kv would store it, then read back as paged_decode_attention does.
    q = _rotated(q_ptr + tok * stride_qn, head, g_valid, stride_qh, stride_p, cos, sin, HEAD_DIM // 2,
                 HEAD_DIM, D_P2, DTYPE, PARTS, INTERPRETED).to(tl.float32)  # fmt: skip
    one = tl.arange(0, 1)
    k_new = _rotated(k_ptr + tok * stride_kn, kv_head + one, one == 0, stride_kh, stride_p, cos, sin,
                     HEAD_DIM // 2, HEAD_DIM, D_P2, DTYPE, PARTS, INTERPRETED)  # fmt: skip
    offs_d = tl.arange(0, D_P2)[None, :]
    v_ptrs = v_ptr + tok * stride_vn + kv_head * stride_vh + offs_d
    v_new = _value(v_ptrs, offs_d < HEAD_DIM, stride_p, PARTS, DTYPE, INTERPRETED).to(DTYPE)
    # The slot's key and value as the cache holds them: what a later launch reads back.
    k_new, v_new = as_cached(k_new, CACHE, INTERPRETED), as_cached(v_new, CACHE, INTERPRETED)
    # slot < 0 writes nothing: the key and value at q_pos are the cache's, as in the three launches.
    new_pos = tl.where(slot >= 0, q_pos, -1)
    m_i, l_i, acc = attend_slice(q, kc_ptr, vc_ptr, bt_row, kv_head, start, end, scale_log2, stride_kcs,
                                 stride_kch, stride_vcs, stride_vch, new_pos, k_new, v_new, GROUP_P2,
                                 HEAD_DIM, D_P2, PAGE, BLOCK_N, True, k0, v0, SLOTS_AHEAD,
                                 FP8_TO_FP32)  # fmt: skip
    # No program reads the slot back (k_new, v_new come from registers), so any one may write it:
    # the last split, after its loop, so that under the interpreter (programs run in grid order)
    # every read of the launch precedes the write and the tests prove that none depends on it.
    if (split == NUM_SPLITS - 1) & (slot >= 0):
        _write_kv(kc_ptr, vc_ptr, slot, kv_head, k_new, v_new, stride_kcs, stride_kch, stride_vcs, stride_vch,
                  HEAD_DIM, D_P2)  # fmt: skip
    TOTAL: tl.constexpr = NUM_SPLITS + PRE_SPLITS
    if TOTAL == 1:
        store_normalised(
            o_ptr, tok, head, g_valid, stride_on, stride_oh, acc, l_i, HEAD_DIM, D_P2, INTERPRETED
        )
    else:
        part = (row * NUM_HEADS + head) * TOTAL + split
        store_partial(acc_ptr, m_ptr, l_ptr, part, g_valid, m_i, l_i, acc, start < end, HEAD_DIM, D_P2)
        # Every thread's partial is stored before the (release) arrival is counted.
        tl.debug_barrier()
        counter = cnt_ptr + row * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            _merge_group(o_ptr, acc_ptr, m_ptr, l_ptr, row, kv_head, tok, stride_on, stride_oh, NUM_HEADS,
                         GROUP, HEAD_DIM, D_P2, TOTAL, PRE_SPLITS, pre_len > 0, INTERPRETED)  # fmt: skip
            # Ready for the next launch: every program of this (row, KV head) has arrived. Relaxed: the
            # launch's end orders it before the next launch's arrivals, and an acq_rel exchange would first
            # wait for the merged stores above (~0.5 us on the chain).
            tl.atomic_xchg(counter, 0, sem="relaxed")


def fused_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    block_tables: torch.Tensor,
    row_q_start: torch.Tensor,
    row_len: torch.Tensor,
    row_tok_off: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    prefixes: SharedPrefixes | None = None,
    prefix_config: dict | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """rope_write_kv then paged_decode_attention in one launch, bit for bit; returns out [N, Hq, D].

    q [N, Hq, D], k, v [N, Hkv, D]: UNROTATED projections (any row and head strides,
    contiguous last dimension: column views of one qkv output work); or each [S, N, H, D] fp32, the
    qkv matmul's partial products (views of one tc_linear(partial=True) output, one slot stride),
    added in slot order and rounded to the activations' dtype before use; slot_mapping,
    positions [N] and cos_sin (rope_cos_sin_table) as for rope_write_kv; the paged
    metadata, scale, out and config (keys of decode_config) as for
    paged_decode_attention. Only each row's token is rotated and written: row r's
    token row_tok_off[r] writes its K/V to slot_mapping of it (none when < 0), which
    must be row r's slot of position row_q_start[r]; a token with a slot >= 0 must
    belong to a row, and no row may read a slot another row writes. The engine's
    decode calls meet all three. q itself is left unrotated, and output rows of no
    row untouched. With NUM_SPLITS > 1 it uses the same fp32 scratch as
    paged_decode_attention plus per-device arrival counters (allocated on the first
    call of a shape; never during CUDA-graph capture).

    dtype: the activations' dtype (out's, and what q, k, v round to): q's by default, or with partial
    products the cache's; needed with partial products and an FP8 cache (k_cache float8 e4m3, which holds
    each key and value as rounding.as_cached gives them).

    prefixes (SharedPrefixes): rows of a group attend to its shared prefix through
    cascade_attention's launch, before this one, which reads the prefix once for all of them
    (prefix_config overrides keys of its launch config); the results then match the
    ungrouped call's to fp32 rounding, not bit for bit.
    """
    parts, stride_p = (q.shape[0], q.stride(0)) if q.dim() == 4 else (0, 0)
    if parts:
        _check_partials(q, k, v)
        q, k, v = q[0], k[0], v[0]  # slot 0's views: a token's and a head's strides
    dt = dtype or (k_cache.dtype if parts else q.dtype)
    if dt == FP8_CACHE:
        raise ValueError("partial q, k, v with an FP8 cache need dtype (the activations' dtype)")
    n, hq, d, hkv, r = check_paged_inputs(
        _typed(q, dt), k_cache, v_cache, block_tables, row_q_start, row_len, row_tok_off
    )
    _check_rope_kv(_typed(k, dt), _typed(v, dt), k_cache, slot_mapping, positions, cos_sin, n, hkv, d)
    if out is None:
        out = torch.empty(q.shape, dtype=dt, device=q.device)
    check_float("out", out)
    if out.dtype != dt:  # the kernel rounds to out's dtype
        raise ValueError(f"out must be {dt}, got {out.dtype}")
    if out.shape != (n, hq, d):  # the kernel writes rows of q's shape through out's strides
        raise ValueError(f"out must be [{n}, {hq}, {d}], got {tuple(out.shape)}")
    if r == 0 or n == 0:
        return out
    group = hq // hkv
    cfg = launch_config(r, hkv, group, d, block_tables.shape[1] * block_size, config)
    cfg.pop("merge_warps", None)  # no merge launch
    splits = cfg["NUM_SPLITS"]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pre_cfg = None
    if prefixes is not None:
        pre_cfg = cascade_attention.prefix_config(r, block_tables.shape[1] * block_size)
        pre_cfg.update(prefix_config or {})
    pre_splits = pre_cfg["PRE_SPLITS"] if pre_cfg else 0
    scratch = partials_scratch(r, hq, splits + pre_splits, d, q.device)
    acc, m, lsum = scratch
    counters = _COUNTERS.get(q.device, r * hkv) if splits + pre_splits > 1 else acc
    early = pdl_launch_ok(q.device, r * hkv)
    grp, glen = (prefixes.row_group, prefixes.group_len) if prefixes is not None else (row_len, row_len)
    if prefixes is not None:
        _check_prefixes(prefixes, r)
        cascade_attention.launch_prefix_partials(
            q, k_cache, v_cache, positions, cos_sin, block_tables, row_len, row_tok_off, prefixes, scratch,
            splits + pre_splits, block_size, scale * math.log2(math.e), parts, stride_p, pre_cfg, dt,
        )  # fmt: skip
    _fused_decode_kernel[(r, hkv, splits)](
        q, k, v, out, k_cache, v_cache, slot_mapping, positions, cos_sin, block_tables,
        row_q_start, row_len, row_tok_off, grp, glen, acc, m, lsum, counters,
        cos_sin.shape[0], scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin.stride(0), block_tables.stride(0), stride_p,
        NUM_HEADS=hq, NUM_KV_HEADS=hkv, GROUP=group, GROUP_P2=next_pow2(group), HEAD_DIM=d,
        D_P2=next_pow2(d), PAGE=block_size, PRE_SPLITS=pre_splits, PARTS=parts, INTERPRETED=interpreting(),
        **cfg,
        USE_PDL=pdl_enabled(q.device), launch_pdl=early, EARLY_KV=early, **maxnreg(r),
        # Slots a tile ahead: loop at 32 rows 1.701 against 1.722 ms on an H100, at 8 rows (early loads,
        # a tile or two after the wait) 1.200 against 1.157.
        SLOTS_AHEAD=not early,
        FP8_TO_FP32=r <= DECODE_ATTN_FP8_TO_FP32_ROWS,
    )  # fmt: skip
    return out


def _check_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not (k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype == torch.float32):
        raise ValueError("partial q, k and v must each be float32 [S, N, H, D]")
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.stride(0) == k.stride(0) == v.stride(0)):
        raise ValueError("partial q, k and v must be views of one partial output (one slot count and stride)")


def _check_prefixes(prefixes: SharedPrefixes, rows: int) -> None:
    grp, glen = prefixes.row_group, prefixes.group_len
    if grp.dtype != torch.int32 or glen.dtype != torch.int32 or grp.dim() != 1 or glen.dim() != 1:
        raise ValueError("row_group and group_len must be int32 vectors")
    if grp.shape[0] < rows or glen.shape[0] < 1:
        raise ValueError(f"row_group must cover the {rows} rows and group_len at least one group")


def _typed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # t itself, or a storage-less stand-in of its shape in dtype (for the shape and dtype checks).
    return t if t.dtype == dtype else torch.empty(t.shape, dtype=dtype, device="meta")


def _check_rope_kv(k, v, k_cache, slot_mapping, positions, cos_sin, n: int, hkv: int, d: int) -> None:
    check_float("k", k)
    check_float("v", v)
    check_same_dtype(k=k, v=v)
    check_cache("k_cache", k_cache, k.dtype)
    if k.shape != (n, hkv, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be [{n}, {hkv}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (n,) or positions.shape != (n,):
        raise ValueError(
            f"slot_mapping and positions must be [{n}], "
            f"got {tuple(slot_mapping.shape)} and {tuple(positions.shape)}"
        )
    if d % 2 or cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError("RoPE needs an even head_dim and cos_sin float32 [max_positions, head_dim]")


def pdl_launch_ok(device: torch.device, row_heads: int) -> bool:
    """Launch with the PDL attribute and the early loads (EARLY_KV): PDL on, and rows x KV heads at most
    tuning.DECODE_ATTN_PDL_ROW_HEADS_PER_SM times the SMs."""
    return pdl_enabled(device) and row_heads <= sm_count(device) * DECODE_ATTN_PDL_ROW_HEADS_PER_SM


def maxnreg(rows: int) -> dict:
    """The launch's `maxnreg` keyword for a decode of `rows` rows: the cap up to tuning's row count, else {}
    (the compiler's choice; also under the interpreter, which has no registers)."""
    if rows > DECODE_ATTN_MAXNREG_ROWS or interpreting():
        return {}
    return {"maxnreg": DECODE_ATTN_MAXNREG}


# Per device: the arrival counters (all zero between launches).
_COUNTERS = ArrivalCounters("fused_decode_attention", _MIN_COUNTERS)
