"""Paged causal attention over loop planes for a mixed batch of decode rows and prefill chunks.

A "row" is a run of consecutive tokens of one request at one loop depth: a decode
row has one query token, a prefill chunk many. Each row reads the K/V of ITS loop
plane through its own block table, so rows at different depths share one launch.

One-token rows of a shared-prefix group (kernels/cascade_attention.py) attend from the
prefix's end on and merge the prefix's partial softmaxes, which the launch before wrote.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import cascade_attention
from .launch import check_float, check_paged_inputs, interpreting, next_pow2
from .rounding import round_to
from .split_kv_attention import partials_scratch, tile_slots
from .tuning import (
    PREFILL_BLOCK_N,
    PREFILL_BLOCK_N_WIDE_HEADS,
    PREFILL_DOT_M,
    PREFILL_FMA_BLOCK_N,
    PREFILL_FMA_MAX_M,
    PREFILL_FMA_TILE,
    PREFILL_TILES_PER_ROW,
    PREFILL_WARPS,
)


@triton.jit
def _tile_row(len_ptr, R, MAX_Q, t, BLOCK_Q: tl.constexpr, R_P2: tl.constexpr):
    # (row, tile within the row) of tile t, rows taking cdiv(min(len, MAX_Q), BLOCK_Q) tiles in order;
    # row R when t is past the last tile.
    offs_r = tl.arange(0, R_P2)
    lens = tl.minimum(tl.load(len_ptr + offs_r, mask=offs_r < R, other=0), MAX_Q)
    tiles = (lens + BLOCK_Q - 1) // BLOCK_Q
    ends = tl.cumsum(tiles, axis=0)
    row = tl.sum((ends <= t).to(tl.int32), axis=0)
    first = tl.sum(tl.where(offs_r == row, ends - tiles, 0), axis=0)
    return row, t - first


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    o_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    q_start_ptr,
    len_ptr,
    tok_off_ptr,
    grp_ptr,
    glen_ptr,
    pacc_ptr,
    pm_ptr,
    pl_ptr,
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
    R,
    MAX_Q,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    R_P2: tl.constexpr,
    PRE_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # One program: one tile of BLOCK_Q query tokens of one row, one KV head with its GROUP query heads.
    # Tiles are numbered across the rows that have tokens, so no program is spent on padding rows.
    kv_head = tl.program_id(1)
    row, q_tile = _tile_row(len_ptr, R, MAX_Q, tl.program_id(0), BLOCK_Q, R_P2)
    if row >= R:
        return
    n_q = tl.minimum(tl.load(len_ptr + row), MAX_Q)
    q0 = tl.load(q_start_ptr + row)
    tok0 = tl.load(tok_off_ptr + row)

    # The M axis packs (token, query head of the group): GQA heads share every K/V load.
    offs_m = tl.arange(0, BLOCK_Q * GROUP_P2)
    t_idx = q_tile * BLOCK_Q + offs_m // GROUP_P2
    g_idx = offs_m % GROUP_P2
    m_valid = (t_idx < n_q) & (g_idx < GROUP)
    head = kv_head * GROUP + g_idx
    tok = (tok0 + t_idx).to(tl.int64)
    q_pos = q0 + t_idx
    offs_d = tl.arange(0, D_P2)
    d_valid = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    # Finite start so fully masked (padding) lanes never compute inf - inf.
    m_i = tl.full([BLOCK_Q * GROUP_P2], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, D_P2], tl.float32)

    # Keys this tile can see: positions 0 .. (its last valid query position); a one-token row of a
    # shared-prefix group from the prefix's end on.
    kv_end = q0 + tl.minimum(n_q, (q_tile + 1) * BLOCK_Q)
    pre_len = 0
    if PRE_SPLITS > 0:
        grp = tl.load(grp_ptr + row)
        pre_len = tl.where((grp >= 0) & (n_q == 1), tl.load(glen_ptr + tl.maximum(grp, 0)), 0)
    # Whole key tiles before the tile's first query position are visible to every query: no mask.
    free_end = pre_len + tl.maximum(q0 + q_tile * BLOCK_Q - pre_len, 0) // BLOCK_N * BLOCK_N
    k_base, v_base = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + row * stride_bt
    for masked in tl.static_range(2):
        lo = free_end if masked == 1 else pre_len
        hi = kv_end if masked == 1 else free_end
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_base, v_base, bt_row, stride_ks, stride_vs, q_pos, lo, hi,
                                kv_end, scale_log2, offs_d, d_valid, PAGE, BLOCK_N, masked == 1, USE_DOT,
                                DOT_PRECISION, DOT_UPCAST, INTERPRETED)  # fmt: skip

    if PRE_SPLITS > 0:
        has = m_valid & (t_idx * 0 + pre_len > 0)  # a vector test: the interpreter masks with no scalar bool
        m_i, l_i, acc = _merge_prefix(pacc_ptr, pm_ptr, pl_ptr, row, head, has, m_i, l_i, acc, NUM_HEADS,
                                      HEAD_DIM, D_P2, PRE_SPLITS)  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
        round_to(out, o_ptr.dtype.element_ty, INTERPRETED),
        mask=m_valid[:, None] & d_valid[None, :],
    )


@triton.jit
def _attend(q, m_i, l_i, acc, k_base, v_base, bt_row, stride_ks, stride_vs, q_pos, lo, hi, kv_end, scale_log2,
            offs_d, d_valid, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
            INTERPRETED: tl.constexpr):  # fmt: skip
    # The online softmax (m_i, l_i, acc) over keys lo .. hi in BLOCK_N tiles; MASKED applies the causal
    # mask and the end (kv_end), which tiles wholly before the queries need not.
    # Each tile's cache slots come from the iteration before, so its K/V loads wait on no table load.
    slot = tile_slots(bt_row, lo, kv_end, PAGE, BLOCK_N, "")
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        kv_mask = d_valid[None, :]
        if MASKED:
            kv_mask = n_valid[:, None] & kv_mask
        # An FP8 cache's keys and values widen to q's dtype exactly.
        k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if DOT_UPCAST:
            # The interpreter's numpy dot cannot multiply bf16; bf16 products are exact in fp32.
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = s * scale_log2
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_UPCAST:
            pv = tl.dot(
                round_to(p, v.dtype, INTERPRETED).to(tl.float32), v.to(tl.float32), input_precision="ieee"
            )
        elif USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        slot = tile_slots(bt_row, start + BLOCK_N, kv_end, PAGE, BLOCK_N, "")
    return m_i, l_i, acc


@triton.jit
def _merge_prefix(acc_ptr, m_ptr, l_ptr, row, head, has, m_i, l_i, acc, NUM_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, PRE_SPLITS: tl.constexpr):  # fmt: skip
    # (m, l, acc) of each M lane merged with its row's and head's PRE_SPLITS prefix partials where `has`
    # (scratch index (row * NUM_HEADS + head) * PRE_SPLITS + split); an empty partial (l = 0) weighs 0.
    base = (row * NUM_HEADS + head).to(tl.int64) * PRE_SPLITS
    offs_d = tl.arange(0, D_P2)
    m_all = m_i
    for s in tl.static_range(PRE_SPLITS):
        m_all = tl.maximum(m_all, tl.load(m_ptr + base + s, mask=has, other=-1.0e30))
    alpha = tl.exp2(m_i - m_all)
    l_i = l_i * alpha
    acc = acc * alpha[:, None]
    for s in tl.static_range(PRE_SPLITS):
        l_s = tl.load(l_ptr + base + s, mask=has, other=0.0)
        w = tl.where(l_s > 0.0, tl.exp2(tl.load(m_ptr + base + s, mask=has, other=-1.0e30) - m_all), 0.0)
        take = (has & (l_s > 0.0))[:, None] & (offs_d < HEAD_DIM)[None, :]
        acc_s = tl.load(acc_ptr + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=take, other=0.0)
        l_i += w * l_s
        acc += w[:, None] * acc_s
    return m_all, l_i, acc


def attention_config(max_q_len: int, group: int, head_dim: int) -> dict:
    """Tile sizes and warps for a launch: a pure function of the fixed bounds, never of per-step values.

    Small M (decode with few query heads per KV head) reduces on CUDA cores; otherwise
    tl.dot with M = tokens x group heads padded to at least 16, as tensor cores need.
    The sizes are tuning.py's PREFILL_* values.
    """
    group_p2, d_p2 = next_pow2(group), next_pow2(head_dim)
    q_p2 = next_pow2(max_q_len)
    if q_p2 * group_p2 <= PREFILL_FMA_MAX_M:
        least, most = PREFILL_FMA_BLOCK_N
        block_n = min(most, max(least, PREFILL_FMA_TILE // (q_p2 * group_p2 * d_p2)))
        return {"BLOCK_Q": q_p2, "BLOCK_N": block_n, "USE_DOT": False, "num_warps": PREFILL_WARPS}
    # About PREFILL_TILES_PER_ROW tiles per longest row (more programs for short prompts), M in PREFILL_DOT_M.
    m_least, m_most = PREFILL_DOT_M
    block_q = max(min(q_p2 // PREFILL_TILES_PER_ROW, max(1, m_most // group_p2)), max(1, m_least // group_p2))
    return {
        "BLOCK_Q": block_q,
        "BLOCK_N": PREFILL_BLOCK_N if d_p2 <= 128 else PREFILL_BLOCK_N_WIDE_HEADS,
        "USE_DOT": True,
        "num_warps": PREFILL_WARPS,
    }


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_q_start: torch.Tensor,
    row_len: torch.Tensor,
    row_tok_off: torch.Tensor,
    block_size: int,
    max_q_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    prefixes=None,
    prefix_config: dict | None = None,
) -> torch.Tensor:
    """Causal attention of each row's query tokens over its own paged K/V; returns out [N, Hq, D].

    q [N, Hq, D]; k_cache, v_cache [num_slots, Hkv, D] (one layer of one cache, any
    slot/head strides), Hq a multiple of Hkv (query head h reads KV head h // (Hq/Hkv)).
    block_tables [R, MB] int32: row r's position p lives at slot
    block_tables[r, p // block_size] * block_size + p % block_size.
    row_q_start, row_len, row_tok_off [R] int32: row r's query tokens are
    q[tok_off : tok_off + len] at positions q_start .. q_start + len - 1; each attends
    to positions 0 .. its own position (so K/V of the row's own tokens must already
    be in the cache). A row with len 0 does nothing, so R may be padded.
    max_q_len: a FIXED upper bound on row_len (e.g. 1 for decode-only launches, the
    chunk size for prefill); it sets the grid, so it must not vary per step inside a
    CUDA graph. Rows longer than it are computed only up to it.
    scale defaults to 1/sqrt(D). Output rows not covered by any row are left untouched.
    Softmax and both products accumulate in fp32; with fp32 inputs tl.dot runs in IEEE fp32.
    config: attention_config's dict (BLOCK_Q, BLOCK_N, USE_DOT, num_warps, optionally num_stages)
    instead of the default for these bounds (benchmarks).
    prefixes (cascade_attention.SharedPrefixes): one-token rows of a group attend to its shared
    prefix through cascade_attention's launch before this one, which reads the prefix once for all
    of them (q must be rotated already); prefix_config overrides keys of that launch's config.
    """
    n, hq, d, hkv, r = check_paged_inputs(
        q, k_cache, v_cache, block_tables, row_q_start, row_len, row_tok_off
    )
    if max_q_len < 1:
        raise ValueError(f"max_q_len must be >= 1, got {max_q_len}")
    if out is None:
        out = torch.empty_like(q)
    check_float("out", out)
    if r == 0 or n == 0:
        return out
    group = hq // hkv
    cfg = attention_config(max_q_len, group, d) if config is None else config
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # At most cdiv(len, BLOCK_Q) tiles a row, which sum to at most N / BLOCK_Q + (rows with tokens).
    tiles = min(r * triton.cdiv(max_q_len, cfg["BLOCK_Q"]), triton.cdiv(n, cfg["BLOCK_Q"]) + min(r, n))
    grid = (tiles, hkv)
    pre_splits, grp, glen, (pacc, pm, pl) = 0, row_len, row_len, (out, out, out)  # no prefixes: never read
    if prefixes is not None:
        pre_cfg = cascade_attention.prefix_config(r, block_tables.shape[1] * block_size)
        pre_cfg.update(prefix_config or {})
        pre_splits, grp, glen = pre_cfg["PRE_SPLITS"], prefixes.row_group, prefixes.group_len
        pacc, pm, pl = scratch = partials_scratch(r, hq, pre_splits, d, q.device, always=True)
        cascade_attention.launch_prefix_partials(
            q, k_cache, v_cache, None, None, block_tables, row_len, row_tok_off, prefixes, scratch,
            pre_splits, block_size, scale * math.log2(math.e), 0, 0, pre_cfg, q.dtype,
        )  # fmt: skip
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, block_tables, row_q_start, row_len, row_tok_off, grp, glen, pacc, pm, pl,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), r, max_q_len,
        GROUP=group, GROUP_P2=next_pow2(group), HEAD_DIM=d, D_P2=next_pow2(d), PAGE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=cfg["USE_DOT"] and q.dtype == torch.bfloat16 and interpreting(),
        INTERPRETED=interpreting(), R_P2=next_pow2(r), PRE_SPLITS=pre_splits, NUM_HEADS=hq,
        **cfg,
    )  # fmt: skip
    return out
