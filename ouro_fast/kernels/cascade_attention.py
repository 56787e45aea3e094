"""Shared-prefix ("cascade") decode attention: a prefix that many rows share is read once for all of them.

Rows whose block tables begin with the same blocks (prefix-cache hits on one prompt prefix, at one loop
plane) form a group. Without this kernel every row of a decode step reads the group's prefix K/V itself,
so a 1,024-token prefix costs each row 8 MB a layer at Ouro's shape. Here one program reads a tile of the
prefix once and multiplies it with the queries of every row of its group (tl.dot, rows as M), writing one
partial softmax (max, sum, unnormalised P @ V) per row, head and prefix slice into the decode's fp32
scratch. The one-launch decode (decode_attention.py) then attends each row only from the prefix's end to
its own position and merges these partials with its own, as it merges its slices.

Groups come as device tensors: row_group [R] int32, the group of each row (-1: none), and group_len [G]
int32, each group's prefix in positions (0: unused). A group's prefix must be a run of whole blocks that
every member's table holds at the same entries, ending at or before every member's position. The launch
grid depends only on R, G and the longest context, so the launch is CUDA-graph capturable; unused groups'
programs return at once.

Precision: q and K enter the products in the cache dtype (q rounded as the decode rounds it), so each
score's products are exact and only their sum's order differs. P enters P @ V as two cache-dtype parts
(high and low), which keeps it to about fp32's precision; fp32 caches multiply in IEEE fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import interpreting, next_pow2, tl_dtype
from .pdl import pdl_enter, pdl_launch
from .rounding import round_to
from .split_kv_attention import load_kv_tile, slice_bounds
from .tuning import CASCADE_BLOCK_N, CASCADE_ROWS, CASCADE_SPLITS, CASCADE_WARPS, INTERPRETER_MAX_SPLITS


@dataclass
class SharedPrefixes:
    """The shared-prefix groups of one decode call: row_group [R] int32 (-1: none), group_len [G] int32
    (positions; 0: an unused group). Device tensors, so a captured graph reads each step's values."""

    row_group: torch.Tensor
    group_len: torch.Tensor


@triton.jit
def _rows_rotated(q_ptr, tok, member, head, pos_ptr, table_ptr, num_pos, stride_qn, stride_qh, stride_t,
                  stride_p, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
                  DTYPE: tl.constexpr, PARTS: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # Query head `head` of the tokens `tok` [BLOCK_R] rotated at their positions, [BLOCK_R, D_P2] in DTYPE:
    # the decode's expressions (x1*cos - x2*sin, x2*cos + x1*sin in fp32), each row at its own position.
    offs_d = tl.arange(0, D_P2)
    d_valid = offs_d < HEAD_DIM
    mask = member[:, None] & d_valid[None, :]
    pos = tl.load(pos_ptr + tok, mask=member, other=0)
    pos = tl.minimum(tl.maximum(pos, 0), num_pos - 1).to(tl.int64)
    pair = (offs_d % HALF)[None, :]
    cos = tl.load(table_ptr + pos[:, None] * stride_t + pair, mask=mask, other=0.0)
    sin = tl.load(table_ptr + pos[:, None] * stride_t + HALF + pair, mask=mask, other=0.0)
    ptrs = q_ptr + tok[:, None] * stride_qn + head * stride_qh + pair
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 0:  # the qkv matmul's fp32 partial products: added in slot order, rounded as it rounds
        for p in tl.static_range(1, PARTS):
            x1 += tl.load(ptrs + p * stride_p, mask=mask, other=0.0)
            x2 += tl.load(ptrs + HALF + p * stride_p, mask=mask, other=0.0)
        x1 = round_to(x1, DTYPE, INTERPRETED).to(tl.float32)
        x2 = round_to(x2, DTYPE, INTERPRETED).to(tl.float32)
    lo = x1 * cos - x2 * sin
    hi = x2 * cos + x1 * sin
    return round_to(tl.where((offs_d < HALF)[None, :], lo, hi), DTYPE, INTERPRETED)


@triton.jit
def _prefix_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, table_ptr, bt_ptr, len_ptr, tok_off_ptr, grp_ptr,
                   glen_ptr, acc_ptr, m_ptr, l_ptr, R, num_pos, scale_log2, stride_qn, stride_qh, stride_kcs,
                   stride_kch, stride_vcs, stride_vch, stride_t, stride_bt, stride_p, NUM_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr,
                   PRE_SPLITS: tl.constexpr, TOTAL_SPLITS: tl.constexpr, PARTS: tl.constexpr,
                   ROTATED: tl.constexpr, EXACT: tl.constexpr, INTERPRETED: tl.constexpr,
                   USE_PDL: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    # One program: one group's rows in [chunk * BLOCK_R, +BLOCK_R), one query head, one slice of the prefix.
    # DTYPE: the activations' (q's, rotated); an FP8 cache's keys and values widen to it, exactly.
    g = tl.program_id(0) // CHUNKS
    chunk = tl.program_id(0) % CHUNKS
    head = tl.program_id(1)
    split = tl.program_id(2)
    # Every program waits, even one with nothing to do: the next kernel's wait then covers the kernels
    # before this one too (a grid that ended before its predecessor would break the chain).
    pdl_enter(USE_PDL)
    p_len = tl.load(glen_ptr + g)
    if p_len == 0:  # an unused group
        return
    rows = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = rows < R
    member = in_r & (tl.load(grp_ptr + rows, mask=in_r, other=-1) == g)
    member = member & (tl.load(len_ptr + rows, mask=in_r, other=0) > 0)
    first = tl.min(tl.where(member, rows, R))
    if first == R:  # no member in this chunk
        return
    start, end = slice_bounds(p_len - 1, split, PRE_SPLITS, BLOCK_N)
    tok = tl.load(tok_off_ptr + rows, mask=member, other=0).to(tl.int64)
    if ROTATED:  # rope_write_kv rotated q in place already
        offs_d = tl.arange(0, D_P2)
        q = tl.load(q_ptr + tok[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                    mask=member[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    else:
        q = _rows_rotated(q_ptr, tok, member, head, pos_ptr, table_ptr, num_pos, stride_qn, stride_qh,
                          stride_t, stride_p, HEAD_DIM // 2, HEAD_DIM, D_P2, DTYPE, PARTS,
                          INTERPRETED)  # fmt: skip
    # Every member's table holds the prefix's blocks: the first member's serves them all.
    bt_row = bt_ptr + first.to(tl.int64) * stride_bt
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_P2], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, kv_head, n0, end, stride_kcs, stride_kch, stride_vcs,
                            stride_vch, HEAD_DIM, D_P2, PAGE, BLOCK_N, "")  # fmt: skip
        k, v = k.to(DTYPE), v.to(DTYPE)
        if EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        elif INTERPRETED:  # the interpreter multiplies no 16-bit floats: the same exact products in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where((n0 + tl.arange(0, BLOCK_N) < end)[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if EXACT:
            pv = tl.dot(p, v, input_precision="ieee")
        elif INTERPRETED:
            p_hi = p.to(DTYPE).to(tl.float32)
            vf = v.to(tl.float32)
            pv = tl.dot(p_hi, vf, input_precision="ieee")
            pv += tl.dot((p - p_hi).to(DTYPE).to(tl.float32), vf, input_precision="ieee")
        else:
            p_hi = p.to(DTYPE)
            pv = tl.dot(p_hi, v) + tl.dot((p - p_hi.to(tl.float32)).to(DTYPE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # The prefix's partials follow the row's own slices in the scratch (the decode merges them last).
    part = (rows.to(tl.int64) * NUM_HEADS + head) * TOTAL_SPLITS + (TOTAL_SPLITS - PRE_SPLITS) + split
    tl.store(m_ptr + part, m_i, mask=member)
    tl.store(l_ptr + part, l_i, mask=member)
    offs_d = tl.arange(0, D_P2)
    if start < end:  # an empty slice's acc is never read (l = 0)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=member[:, None] & (offs_d < HEAD_DIM)[None, :])  # fmt: skip


def prefix_config(rows: int, max_context: int) -> dict:
    """PRE_SPLITS, BLOCK_N, BLOCK_R and num_warps of a prefix launch: a pure function of fixed shapes. Under
    the CPU interpreter at most tuning.INTERPRETER_MAX_SPLITS slices (every program runs in Python there,
    and most slices of a test's short prefix are empty)."""
    block_n = CASCADE_BLOCK_N
    splits = max(1, min(CASCADE_SPLITS, next_pow2(triton.cdiv(max_context, block_n))))
    if interpreting():
        splits = min(splits, INTERPRETER_MAX_SPLITS)
    return {"PRE_SPLITS": splits, "BLOCK_N": block_n, "BLOCK_R": min(CASCADE_ROWS, next_pow2(max(16, rows))),
            "num_warps": CASCADE_WARPS}  # fmt: skip


def launch_prefix_partials(q, kc, vc, positions, cos_sin, block_tables, row_len, row_tok_off, prefixes,
                           scratch, total_splits: int, block_size: int, scale_log2: float, parts: int,
                           stride_p: int, cfg: dict, dtype: torch.dtype) -> None:  # fmt: skip
    """Write the prefix partials of every grouped row into `scratch` (acc, m, l as partials_scratch gives
    them, TOTAL_SPLITS a row and head, the prefix's last), for the query of each row's first token. q is
    one token's [N, Hq, D] view (slot 0's when `parts` > 0), unrotated, with positions and cos_sin as
    fused_decode_attention takes them; or, with cos_sin None, already rotated (positions unused). dtype: the
    activations' (q's, or what its partial products round to); the cache may be that or FP8."""
    rotated = cos_sin is None
    # Rotated: no RoPE table nor positions is read (any tensor stands in).
    table, num_pos, stride_t = (row_len, 1, 0) if rotated else (cos_sin, cos_sin.shape[0], cos_sin.stride(0))
    positions = row_len if rotated else positions
    r, hq, d = block_tables.shape[0], q.shape[1], q.shape[2]
    groups = prefixes.group_len.shape[0]
    chunks = triton.cdiv(r, cfg["BLOCK_R"])
    acc, m, lsum = scratch
    _prefix_kernel[(groups * chunks, hq, cfg["PRE_SPLITS"])](
        q, kc, vc, positions, table, block_tables, row_len, row_tok_off, prefixes.row_group,
        prefixes.group_len, acc, m, lsum, r, num_pos, scale_log2, q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), stride_t, block_tables.stride(0),
        stride_p, NUM_HEADS=hq, GROUP=hq // kc.shape[1], HEAD_DIM=d, D_P2=next_pow2(d), PAGE=block_size,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"], CHUNKS=chunks, PRE_SPLITS=cfg["PRE_SPLITS"],
        TOTAL_SPLITS=total_splits, PARTS=parts, ROTATED=rotated, EXACT=dtype == torch.float32,
        INTERPRETED=interpreting(), DTYPE=tl_dtype(dtype),
        num_warps=cfg["num_warps"], **pdl_launch(q.device),
    )  # fmt: skip
