"""Split-KV ("flash-decoding") paged attention for rows of one query token each.

A decode launch has few rows, so one program per (row, KV head) leaves most SMs idle
while each walks the whole context. Here the context of every row is cut into
NUM_SPLITS contiguous slices, one program each; each writes a partial softmax (max,
sum, unnormalised P @ V) in fp32, and a second small kernel merges the slices.
NUM_SPLITS and the scratch shapes depend only on the launch's shapes, so the pair of
launches is CUDA-graph capturable; the slice LENGTH follows each row's context at run
time (short contexts leave trailing slices empty).

With rope_write_kv before it, this is the reference that the one-launch decode_attention
is tested against bit for bit (it shares these device functions), and the decode path of
a backend that does not apply RoPE itself.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import check_float, check_paged_inputs, interpreting, next_pow2
from .pdl import pdl_enter, pdl_launch
from .rounding import round_to
from .tuning import (
    INTERPRETER_MAX_SPLITS,
    SPLIT_KV_BLOCK_N,
    SPLIT_KV_MAX_SPLITS,
    SPLIT_KV_MERGE_ONE_WARP,
    SPLIT_KV_MIN_SPLITS,
    SPLIT_KV_PROGRAMS,
    SPLIT_KV_WARPS,
    SPLIT_KV_WIDE,
    SPLIT_KV_WIDE_FROM,
)


@triton.jit
def slice_bounds(q_pos, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, base=0):
    """Context positions [start, end) of slice `split` of [base, q_pos] for a query at q_pos (empty when
    start >= end); base > 0 where a shared prefix before it is attended apart (cascade_attention.py)."""
    kv_len = q_pos + 1
    # Slices of whole BLOCK_N tiles: only the last tile of a row is partly masked.
    split_len = tl.cdiv(tl.cdiv(kv_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = base + split * split_len
    return start, tl.minimum(start + split_len, kv_len)


@triton.jit
def tile_slots(bt_row_ptr, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    """Cache slots [BLOCK_N] (int64) of positions [n0, n0 + BLOCK_N) through the row's block table (0 at or
    beyond end: a tile wholly beyond it reads no memory)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    block = tl.load(bt_row_ptr + offs_n // PAGE, mask=offs_n < end, other=0, cache_modifier=CACHE)
    return block.to(tl.int64) * PAGE + offs_n % PAGE


@triton.jit
def load_kv_slots(k_ptr, v_ptr, slot, kv_head, n0, end, stride_ks, stride_kh, stride_vs, stride_vh,
                  HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                  CACHE: tl.constexpr):  # fmt: skip
    """Keys and values [BLOCK_N, D_P2] (cache dtype) of positions [n0, n0 + BLOCK_N) below end (zeros beyond)
    at their cache slots (tile_slots')."""
    offs_d = tl.arange(0, D_P2)
    n_valid = n0 + tl.arange(0, BLOCK_N) < end
    kv_mask = n_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_ptrs = k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0, cache_modifier=CACHE)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0, cache_modifier=CACHE)
    return k, v


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_row_ptr, kv_head, n0, end, stride_ks, stride_kh, stride_vs, stride_vh,
                 HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CACHE: tl.constexpr):  # fmt: skip
    """Keys and values [BLOCK_N, D_P2] (cache dtype) of positions [n0, n0 + BLOCK_N) below end (zeros beyond),
    through the row's block table; CACHE is the loads' cache modifier ("" or ".cg")."""
    slot = tile_slots(bt_row_ptr, n0, end, PAGE, BLOCK_N, CACHE)
    return load_kv_slots(k_ptr, v_ptr, slot, kv_head, n0, end, stride_ks, stride_kh, stride_vs, stride_vh,
                         HEAD_DIM, D_P2, BLOCK_N, CACHE)  # fmt: skip


@triton.jit
def attend_tile(q, k, v, n0, end, m_i, l_i, acc, scale_log2, new_pos, k_new, v_new, BLOCK_N: tl.constexpr,
                SUBSTITUTE: tl.constexpr, FP8_TO_FP32: tl.constexpr = False):  # fmt: skip
    """One online-softmax update of (m_i, l_i, acc) by the tile of positions [n0, n0 + BLOCK_N) below end.
    A tile wholly at or beyond end changes nothing (its scores are -inf: alpha 1, p 0).
    FP8_TO_FP32: an FP8 tile widens straight to fp32, not through fp16 (the same values either way)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < end
    if k.dtype == tl.float8e4nv:  # an FP8 cache: widened before any select (bf16 tiles stay as they are)
        # Exact either way (e4m3 lies within fp16's range and mantissa); to fp16 is one packed conversion a
        # pair of values.
        WIDE: tl.constexpr = tl.float32 if FP8_TO_FP32 else tl.float16
        k, v = k.to(WIDE), v.to(WIDE)
        if SUBSTITUTE:
            k_new, v_new = k_new.to(WIDE), v_new.to(WIDE)
    if SUBSTITUTE:  # noqa: SIM102 (without it, new_pos is None: the inner test must not be built)
        # A uniform branch: only the one tile that holds new_pos pays for the selects.
        if (new_pos >= n0) & (new_pos < n0 + BLOCK_N):
            is_new = (offs_n == new_pos)[:, None]
            k = tl.where(is_new, k_new, k)
            v = tl.where(is_new, v_new, v)
    # The query sees every key up to its own position: only the slice end masks.
    s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale_log2
    s = tl.where(n_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit
def attend_slice(q, k_ptr, v_ptr, bt_row_ptr, kv_head, start, end, scale_log2, stride_ks, stride_kh,
                 stride_vs, stride_vh, new_pos, k_new, v_new, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 SUBSTITUTE: tl.constexpr, k0=None, v0=None, SLOTS_AHEAD: tl.constexpr = True,
                 FP8_TO_FP32: tl.constexpr = False):  # fmt: skip
    """Online softmax of q [GROUP_P2, D_P2] (fp32) over positions [start, end); returns (m, l, acc).

    With SUBSTITUTE, the key and value at position new_pos are k_new, v_new [1, D_P2] (cache
    dtype) instead of the cache's: the fused decode writes that slot in the same launch.
    k0, v0: the first tile (positions [start, start + BLOCK_N)) already loaded by load_kv_tile, e.g. before
    a PDL wait; the same updates in the same order as loading it here.
    SLOTS_AHEAD: each tile's cache slots are read in the iteration before (the same arithmetic).
    FP8_TO_FP32: as attend_tile's.
    """
    # Finite stand-in for -inf: an empty slice keeps it, and the merge weighs it exp2(-1e30 - m) = 0.
    m_i = tl.full([GROUP_P2], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
    first = start
    if k0 is not None:
        m_i, l_i, acc = attend_tile(q, k0, v0, start, end, m_i, l_i, acc, scale_log2, new_pos, k_new, v_new,
                                    BLOCK_N, SUBSTITUTE, FP8_TO_FP32)  # fmt: skip
        first = start + BLOCK_N
    # An empty slice (start >= kv_len) runs no iteration and leaves m = -1e30, l = 0.
    if SLOTS_AHEAD:
        # Each tile's slots come from the iteration before, so its K/V loads wait on no table load.
        slot = tile_slots(bt_row_ptr, first, end, PAGE, BLOCK_N, "")
        for n0 in range(first, end, BLOCK_N):
            k, v = load_kv_slots(k_ptr, v_ptr, slot, kv_head, n0, end, stride_ks, stride_kh, stride_vs,
                                 stride_vh, HEAD_DIM, D_P2, BLOCK_N, "")  # fmt: skip
            slot = tile_slots(bt_row_ptr, n0 + BLOCK_N, end, PAGE, BLOCK_N, "")
            m_i, l_i, acc = attend_tile(q, k, v, n0, end, m_i, l_i, acc, scale_log2, new_pos, k_new, v_new,
                                        BLOCK_N, SUBSTITUTE, FP8_TO_FP32)  # fmt: skip
    else:
        for n0 in range(first, end, BLOCK_N):
            k, v = load_kv_tile(k_ptr, v_ptr, bt_row_ptr, kv_head, n0, end, stride_ks, stride_kh, stride_vs,
                                stride_vh, HEAD_DIM, D_P2, PAGE, BLOCK_N, "")  # fmt: skip
            m_i, l_i, acc = attend_tile(q, k, v, n0, end, m_i, l_i, acc, scale_log2, new_pos, k_new, v_new,
                                        BLOCK_N, SUBSTITUTE, FP8_TO_FP32)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def store_normalised(o_ptr, tok, head, g_valid, stride_on, stride_oh, acc, l_i, HEAD_DIM: tl.constexpr,
                     D_P2: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """One slice is the whole context: normalise and write the output rows of `head`."""
    offs_d = tl.arange(0, D_P2)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tok * stride_on + head[:, None] * stride_oh + offs_d[None, :],
        round_to(out, o_ptr.dtype.element_ty, INTERPRETED),
        mask=g_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@triton.jit
def store_partial(acc_ptr, m_ptr, l_ptr, part, g_valid, m_i, l_i, acc, nonempty, HEAD_DIM: tl.constexpr,
                  D_P2: tl.constexpr):  # fmt: skip
    """A slice's partial softmax into the fp32 scratch at indices `part` [GROUP_P2]."""
    offs_d = tl.arange(0, D_P2)
    tl.store(m_ptr + part, m_i, mask=g_valid)
    tl.store(l_ptr + part, l_i, mask=g_valid)
    # An empty slice's acc is never read (the merge masks it by l > 0): skip the store.
    if nonempty:
        tl.store(
            acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=g_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
        )


@triton.jit
def merge_partials(acc_ptr, m_ptr, l_ptr, base, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, CACHE: tl.constexpr, PRE: tl.constexpr = 0,
                   has_pre=False):  # fmt: skip
    """One head's fp32 output [D_P2] from its NUM_SPLITS partials at scratch index `base` on.

    The last PRE of them are a shared prefix's (cascade_attention.py), read only where has_pre (else
    never written: taken as empty).
    Sums split by split in split order: elementwise adds only, so the result's bits depend
    on no register layout (the merge kernel and the fused decode's merge, at different
    num_warps, agree bit for bit). Every load is independent of the others (one round trip).
    """
    offs_d = tl.arange(0, D_P2)
    d_valid = offs_d < HEAD_DIM
    m_max = tl.load(m_ptr + base, cache_modifier=CACHE)
    for s in tl.static_range(1, NUM_SPLITS):
        m_s = tl.load(m_ptr + base + s, cache_modifier=CACHE)
        if s >= NUM_SPLITS - PRE:
            m_s = tl.where(has_pre, m_s, -1.0e30)
        m_max = tl.maximum(m_max, m_s)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([D_P2], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        l_s = tl.load(l_ptr + base + s, cache_modifier=CACHE)
        if s >= NUM_SPLITS - PRE:
            l_s = tl.where(has_pre, l_s, 0.0)
        acc_s = tl.load(acc_ptr + (base + s) * HEAD_DIM + offs_d, mask=d_valid, cache_modifier=CACHE)
        # An empty slice (l = 0) has weight 0 and its unwritten acc is selected away (a product
        # would keep a NaN there).
        w = tl.where(l_s > 0.0, tl.exp2(tl.load(m_ptr + base + s, cache_modifier=CACHE) - m_max), 0.0)
        total += w * l_s
        acc += w * tl.where(l_s > 0.0, acc_s, 0.0)
    return acc / tl.where(total > 0.0, total, 1.0)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    o_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    q_start_ptr,
    len_ptr,
    tok_off_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program: one row, one KV head with its GROUP query heads, one slice of the context.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_enter(USE_PDL)
    # All three loads before the branch: one memory round trip, not two.
    n_q = tl.load(len_ptr + row)
    q_pos = tl.load(q_start_ptr + row)
    tok = tl.load(tok_off_ptr + row).to(tl.int64)
    if n_q == 0:
        return
    start, end = slice_bounds(q_pos, split, NUM_SPLITS, BLOCK_N)

    offs_g = tl.arange(0, GROUP_P2)
    g_valid = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, D_P2)
    q = tl.load(
        q_ptr + tok * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    ).to(tl.float32)
    # SUBSTITUTE False: every key and value comes from the cache (no new_pos, k_new, v_new).
    m_i, l_i, acc = attend_slice(q, k_ptr, v_ptr, bt_ptr + row * stride_bt, kv_head, start, end, scale_log2,
                                 stride_ks, stride_kh, stride_vs, stride_vh, None, None, None, GROUP_P2,
                                 HEAD_DIM, D_P2, PAGE, BLOCK_N, False)  # fmt: skip
    if NUM_SPLITS == 1:
        store_normalised(
            o_ptr, tok, head, g_valid, stride_on, stride_oh, acc, l_i, HEAD_DIM, D_P2, INTERPRETED
        )
    else:
        part = (row * NUM_HEADS + head) * NUM_SPLITS + split
        store_partial(acc_ptr, m_ptr, l_ptr, part, g_valid, m_i, l_i, acc, start < end, HEAD_DIM, D_P2)


@triton.jit
def _decode_merge_kernel(
    o_ptr,
    len_ptr,
    tok_off_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_on,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program: one row, one query head; combines its NUM_SPLITS partial softmaxes.
    row = tl.program_id(0)
    head = tl.program_id(1)
    pdl_enter(USE_PDL)
    # Every load is independent of the others (one round trip); a padding row's are unused garbage.
    n_q = tl.load(len_ptr + row)
    tok = tl.load(tok_off_ptr + row).to(tl.int64)
    out = merge_partials(
        acc_ptr, m_ptr, l_ptr, (row * NUM_HEADS + head) * NUM_SPLITS, HEAD_DIM, D_P2, NUM_SPLITS, ""
    )
    if n_q == 0:
        return
    offs_d = tl.arange(0, D_P2)
    tl.store(
        o_ptr + tok * stride_on + head * stride_oh + offs_d,
        round_to(out, o_ptr.dtype.element_ty, INTERPRETED),
        mask=offs_d < HEAD_DIM,
    )


def decode_config(rows: int, kv_heads: int, group: int, head_dim: int, max_context: int) -> dict:
    """NUM_SPLITS, BLOCK_N and num_warps of a launch: a pure function of fixed shapes, never of contexts.

    Splits aim at about tuning.SPLIT_KV_PROGRAMS programs from rows x KV heads x splits, clamped
    to tuning's range; past the row counts that range was measured at, tuning.SPLIT_KV_WIDE's. They never
    exceed the BLOCK_N tiles of the longest possible context.
    """
    block_n = SPLIT_KV_BLOCK_N
    row_heads = max(1, rows * kv_heads)
    want = next_pow2(triton.cdiv(SPLIT_KV_PROGRAMS, row_heads))
    splits = max(SPLIT_KV_MIN_SPLITS, min(SPLIT_KV_MAX_SPLITS, want))
    if row_heads > SPLIT_KV_WIDE_FROM:
        splits = next(s for limit, s in SPLIT_KV_WIDE if limit is None or row_heads <= limit)
    num_splits = max(1, min(splits, next_pow2(triton.cdiv(max_context, block_n))))
    return {"NUM_SPLITS": num_splits, "BLOCK_N": block_n, "num_warps": SPLIT_KV_WARPS}


def launch_config(rows: int, kv_heads: int, group: int, head_dim: int, max_context: int, config) -> dict:
    """decode_config with the keys of `config` (a dict or None) overriding it; NUM_SPLITS checked.

    Under the CPU interpreter and without a config, at most tuning.INTERPRETER_MAX_SPLITS splits (kernel
    tests pass their configs; the GPU always takes decode_config's)."""
    cfg = decode_config(rows, kv_heads, group, head_dim, max_context)
    if interpreting() and not config:
        cfg["NUM_SPLITS"] = min(cfg["NUM_SPLITS"], INTERPRETER_MAX_SPLITS)
    cfg.update(config or {})
    splits = cfg["NUM_SPLITS"]
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"NUM_SPLITS must be a power of two, got {splits}")
    return cfg


def partials_scratch(rows: int, heads: int, splits: int, head_dim: int, device,
                     always: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """fp32 (acc [R, Hq, S, D], m [R, Hq, S], l [R, Hq, S]) in one allocation; a dummy when S is 1, unless
    `always` (a shared prefix's partials are merged even then)."""
    parts = rows * heads * splits if splits > 1 or always else 0
    scratch = torch.empty(max(1, parts * (head_dim + 2)), dtype=torch.float32, device=device)
    d = head_dim
    return scratch[: parts * d], scratch[parts * d : parts * (d + 1)], scratch[parts * (d + 1) :]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_q_start: torch.Tensor,
    row_len: torch.Tensor,
    row_tok_off: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """paged_attention with max_q_len = 1, split over the context; returns out [N, Hq, D].

    Same tensors and layout as paged_attention: row r's one query token is
    q[row_tok_off[r]] at position row_q_start[r], attending to positions 0 .. that
    position through block_tables[r]. A row with row_len 0 writes nothing (padding);
    a longer row is computed for its first token only. Output rows of no row are
    left untouched. Accumulates in fp32; the merge of the slices is exact up to fp32
    rounding, so results match paged_attention to about 1e-6 relative in fp32.
    config overrides keys of decode_config (NUM_SPLITS a power of two, BLOCK_N,
    num_warps, merge_warps); the default depends on shapes only (rows, heads, and
    max context = block_tables.shape[1] * block_size), so the launches can be
    captured in a CUDA graph. With NUM_SPLITS > 1 it allocates an fp32 scratch of
    R x Hq x NUM_SPLITS x (D + 2) and launches a merge kernel; with 1, a single launch.
    """
    n, hq, d, hkv, r = check_paged_inputs(
        q, k_cache, v_cache, block_tables, row_q_start, row_len, row_tok_off
    )
    if out is None:
        out = torch.empty_like(q)
    check_float("out", out)
    if r == 0 or n == 0:
        return out
    group = hq // hkv
    cfg = launch_config(r, hkv, group, d, block_tables.shape[1] * block_size, config)
    splits = cfg["NUM_SPLITS"]
    merge_warps = cfg.pop("merge_warps", 1 if splits * next_pow2(d) <= SPLIT_KV_MERGE_ONE_WARP else 4)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc, m, lsum = partials_scratch(r, hq, splits, d, q.device)
    interp, pdl = interpreting(), pdl_launch(q.device)
    _decode_split_kernel[(r, hkv, splits)](
        q, out, k_cache, v_cache, block_tables, row_q_start, row_len, row_tok_off, acc, m, lsum,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        NUM_HEADS=hq, GROUP=group, GROUP_P2=next_pow2(group), HEAD_DIM=d, D_P2=next_pow2(d),
        PAGE=block_size, INTERPRETED=interp, **cfg, **pdl,
    )  # fmt: skip
    if splits > 1:
        _decode_merge_kernel[(r, hq)](
            out, row_len, row_tok_off, acc, m, lsum, out.stride(0), out.stride(1),
            NUM_HEADS=hq, HEAD_DIM=d, D_P2=next_pow2(d), NUM_SPLITS=splits, INTERPRETED=interp,
            num_warps=merge_warps, **pdl,
        )  # fmt: skip
    return out
