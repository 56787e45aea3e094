"""A whole decode loop (every layer) in ONE persistent launch whose weight stream never drains.

Launched per matrix, each matmul ramps its weight stream up and drains it again: one
layer's weights stream in ~22 us with nothing between the matrices, in ~32 us with a
launch or a grid barrier between them (docs/benchmarks.md, "Seventh session"). Here
the programs stay resident for the whole loop and take one of three roles:

- streamers [0, G): each owns a fixed share of row groups (BR rows) of every matrix
  of every layer and walks them in one flat loop of [BR, BC] weight tiles. The tiles
  are TMA loads that `tl.range` pipelines STAGES deep, across matrix and layer
  boundaries alike: a tile's address depends only on the loop index. Only the
  activation chunk a tile multiplies waits: before the first tile of a matrix the
  streamer polls that matrix's input counter. A group's last tile stores its
  outputs; after its share's last group the streamer counts the share on the
  matrix's done counter (every reader waits for all groups). For one token (ONE_ROW)
  the products run on CUDA cores and are summed across threads once a group.
- attention workers [G, G + rows * Hkv * S): one (row, KV head, slice) each, as
  fused_decode_attention's programs: per layer they read the row's positions and
  prefetch their slice's first keys and values into L1, wait for every qkv group,
  then RoPE, attention over the slice and the K/V write; the last of a head's S
  slices to arrive merges them.
- norm workers [G + rows * Hkv * S, + N): one token each, holding its residual stream h in
  registers: the sandwich add + RMSNorms (norm.py's arithmetic) between the matrices.

Counters per layer (int32, zeroed before each launch): 0 xq ready (N), 1 qkv groups,
2 attention done (rows * Hkv), 3 o_proj groups, 4 xm ready (N), 5 gate_up groups,
6 down groups; then a ticket per layer, row and KV head for the slices. Every program
must be resident at once (they poll each other), so the launch checks the compiled
kernel's occupancy. Under the interpreter (programs
run one after another) one program runs every role in dependency order (SERIAL),
with the same tile walk and arithmetic.

Weights are repacked once into one [layers * rows_per_layer, hidden] bf16 tensor:
qkv, o_proj, gate_up with gate and up interleaved in groups of 8 rows (a group's 16
rows give 8 SiLU outputs), and down cut into column chunks of `hidden`, zero padded.

Status: opt-in since the sixteenth session (EngineConfig.dataflow=True, OURO_FAST_DATAFLOW=1; on by
default only with the tensor-core matmuls switched off, OURO_FAST_TC_GEMM=0): run_loop_fused on the
tensor-core matmuls (kernels/tc_gemm.py) measured as fast at one token, 1.166 against 1.187 ms, without
the second copy of the weights. Where attached, run_loop_fused hands it one-token steps (served TPOT at
concurrency 1 5.05 ms against 5.31 with the Triton skinny matmuls, twelfth session). In the
tests it matches run_loop_fused bit for bit under the interpreter and within bf16 rounding on the
H200. One loop of the ouro-1.4b preset at 1 token takes 1.17 ms against run_loop_fused's 1.24 (the
defaults; docs/benchmarks.md, "Eleventh session"; bench/gpu/dataflow_bench.py): the tile walk alone
(FREE, timing only) 0.77 ms, the attention ~0.11-0.12 ms, the waits and norms the rest. The walk is
bound by each tile's activation load (L2, after the poll): without them it takes 0.63 ms with two
buffers ("Thirteenth session"). At 8 tokens the dot path is still ~3.5x slower.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._util import interpreting
from .decode_attention import attend_slice, slice_bounds, store_normalised, store_partial
from .fused_decode import _cos_sin, _merge_group, _rotated, _write_kv
from .norm import _rms
from .rounding import round_to
from .skinny_gemm import _dot
from .swiglu import silu_mul

ROWS_PER_GROUP = 16  # weight rows per group (the dot's smallest M)
PAD_TOKENS = 16  # activation rows per tile, padded (the dot's smallest N)
SLOTS = 8  # counters per layer
MAX_ROWS = 8  # 2 programs per SM: 128 streamers + 17 workers per row fit 264 slots up to 8 rows
BR = tl.constexpr(ROWS_PER_GROUP)
RP = tl.constexpr(PAD_TOKENS)
_SLOTS = tl.constexpr(SLOTS)
_MAX_ROWS = tl.constexpr(MAX_ROWS)
# Timing switches for bench/gpu/dataflow_bench.py, read once at import (each gives WRONG results): leave out
# the activation loads (DF_NOX), the group stores (DF_NOSTORE), the attention (DF_NOATT) or the norms
# (DF_NONORM); DF_WARPS sets the warps of every program.
_NOX = tl.constexpr(os.environ.get("DF_NOX", "0") == "1")
_NOSTORE = tl.constexpr(os.environ.get("DF_NOSTORE", "0") == "1")
_NOATT = tl.constexpr(os.environ.get("DF_NOATT", "0") == "1")
_NONORM = tl.constexpr(os.environ.get("DF_NONORM", "0") == "1")
_WARPS = int(os.environ.get("DF_WARPS", "4"))


@triton.jit
def _wait(ptr, target, INTERPRETED: tl.constexpr):
    # Thread 0 polls (acquire, backing off) until *ptr >= target, then a CTA barrier releases the others;
    # target <= 0 (uniform) returns at once. Returns 0, so that the loads after it can depend on it (no
    # load is hoisted above the poll). The barrier is inside the asm: tl.debug_barrier in the streamers'
    # loop would stop tl.range from pipelining the weight tiles. (Every thread polling: no faster.)
    if INTERPRETED:  # programs run one at a time: a count short of its target is a bug, marked for the host
        short = (target > 0) & (tl.load(ptr) < target)
        tl.atomic_add(ptr, tl.where(short, -(1 << 24), 0))
        return 0
    return _asm_ptr_int(
        """{
        .reg .pred pw, pz;
        .reg .u32 rs, rt;
        mov.u32 $0, 0;
        setp.le.s32 pw, $2, 0;
        @pw bra DF_DONE;
        mov.u32 rt, %tid.x;
        setp.ne.u32 pz, rt, 0;
        @pz bra DF_SYNC;
        DF_SPIN:
        ld.acquire.gpu.global.u32 rs, [$1];
        setp.lt.s32 pw, rs, $2;
        @!pw bra DF_SYNC;
        nanosleep.u32 32;
        bra DF_SPIN;
        DF_SYNC:
        barrier.sync 0;
        DF_DONE:
        }""",
        ptr,
        target,
    )


@triton.jit
def _asm_ptr_int(asm: tl.constexpr, ptrs, value):
    # Side-effecting PTX per element with $1 = a pointer, $2 = an int32; $0, an int32, is its result.
    return tl.inline_asm_elementwise(
        asm=asm, constraints="=r,l,r", args=[ptrs, value], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _signal(ptr, INTERPRETED: tl.constexpr):
    return _signal_n(ptr, 1, INTERPRETED)


@triton.jit
def _signal_n(ptr, n, INTERPRETED: tl.constexpr):
    # Count n arrivals after every thread's earlier stores; returns the count before them (acquire too: the
    # last of several arrivals reads what the others stored). The CTA barrier is inline asm:
    # tl.debug_barrier inside the streamers' loop would stop tl.range from pipelining it.
    if not INTERPRETED:
        tl.inline_asm_elementwise(
            "bar.sync 0;\n mov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )
    return tl.atomic_add(ptr, n, sem="acq_rel", scope="gpu")


@triton.jit
def _share(n, c, G):
    lo = (c * n) // G
    return lo, ((c + 1) * n) // G - lo


@triton.jit
def _coords(i, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H: tl.constexpr, RPL: tl.constexpr,
            B_O: tl.constexpr, B_GU: tl.constexpr, B_DN: tl.constexpr, NCB: tl.constexpr, DB: tl.constexpr,
            BC: tl.constexpr):  # fmt: skip
    # Tile i of a streamer's walk -> (layer, segment, group, tile in group, its weight row and column,
    # the activation column it multiplies, tiles per group).
    layer = i // P
    j = i - layer * P
    seg = (j >= e1).to(tl.int32) + (j >= e2).to(tl.int32) + (j >= e3).to(tl.int32)
    s = j - tl.where(seg == 0, 0, tl.where(seg == 1, e1, tl.where(seg == 2, e2, e3)))
    bpg = tl.where(seg == 3, DB, NCB)
    gl = s // bpg
    b = s - gl * bpg
    g = gl + tl.where(seg == 0, q_lo, tl.where(seg == 1, o_lo, tl.where(seg == 2, u_lo, d_lo)))
    kcol = b * BC
    base = tl.where(seg == 0, 0, tl.where(seg == 1, B_O, tl.where(seg == 2, B_GU, B_DN)))
    w_row = layer * RPL + base + g * BR + (kcol // H) * H
    return layer, seg, s, g, b, w_row, kcol % H, kcol, bpg


@triton.jit
def _x_region(seg):
    # The scratch region a matrix reads its activation from: xq, attention out, xm, gate_up out.
    return tl.where(seg == 0, 0, tl.where(seg == 1, 2, tl.where(seg == 2, 4, 5)))


@triton.jit
def _x_tile(act_ptr, layer, seg, kcol, N, ok, H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr,
            BC: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # The activation chunk a tile multiplies, transposed: [BC, RP] bf16 (zeros past N rows or K).
    # seg 3 (down) reads silu(gate) * up from the interleaved gate_up output, rounded as silu_and_mul.
    offs_k = kcol + tl.arange(0, BC)
    offs_m = tl.arange(0, RP)
    region = _x_region(seg)
    width = tl.where(seg == 3, 2 * FF, H)
    k_ok = offs_k < tl.where(seg == 3, FF, H)
    mask = (offs_m < N)[None, :] & k_ok[:, None]
    row = (layer * RP + offs_m).to(tl.int64)[None, :] * width
    base = act_ptr + _region_off(region, H, FF, L) + ok
    if seg == 3:
        col = (16 * (offs_k // 8) + offs_k % 8)[:, None]
        gate = tl.load(base + row + col, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(base + row + col + 8, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = silu_mul(gate, up, tl.bfloat16, INTERPRETED)
    else:
        x = tl.load(base + row + offs_k[:, None], mask=mask, other=0.0, cache_modifier=".cg")
    return x


@triton.jit
def _x_chunk(act_ptr, layer, seg, offs_k, ok, H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr,
             INTERPRETED: tl.constexpr):  # fmt: skip
    # ONE_ROW: token 0's activations at columns offs_k (any shape), as _x_tile reads them (bf16, 0 past K).
    k_ok = offs_k < tl.where(seg == 3, FF, H)
    base = act_ptr + _region_off(_x_region(seg), H, FF, L) + ok + layer * RP * tl.where(seg == 3, 2 * FF, H)
    if seg == 3:
        col = 16 * (offs_k // 8) + offs_k % 8
        gate = tl.load(base + col, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        up = tl.load(base + col + 8, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = silu_mul(gate, up, tl.bfloat16, INTERPRETED)
    else:
        x = tl.load(base + offs_k, mask=k_ok, other=0.0, cache_modifier=".cg")
    return x


@triton.jit
def _region_off(region, H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr):
    # Element offset of activation region r in the scratch: 0 xq, 1 qkv, 2 attention out, 3 o_proj out,
    # 4 xm, 5 gate_up out, 6 down out; each [L, RP, width].
    # (qkv is 3 * H wide: only Hq = Hkv, Ouro's plain MHA, is supported.)
    n = (
        tl.where(region > 0, 1, 0)
        + tl.where(region > 1, 3, 0)
        + tl.where(region > 2, 1, 0)
        + tl.where(region > 3, 1, 0)
        + tl.where(region > 4, 1, 0)
    )
    return L * RP * (n * H + tl.where(region > 5, 2 * FF, 0))


@triton.jit
def _store_group(
    act_ptr,
    acc,
    layer,
    seg,
    g,
    N,
    H: tl.constexpr,
    FF: tl.constexpr,
    L: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # acc [BR, RP] (weight rows x tokens) -> the matrix's output columns g*BR.. of each token row.
    region = tl.where(seg == 0, 1, tl.where(seg == 1, 3, tl.where(seg == 2, 5, 6)))
    width = tl.where(seg == 0, 3 * H, tl.where(seg == 2, 2 * FF, H))
    offs_r = tl.arange(0, BR)
    offs_m = tl.arange(0, RP)
    ptrs = (
        act_ptr
        + _region_off(region, H, FF, L)
        + (layer * RP + offs_m).to(tl.int64)[None, :] * width
        + g * BR
        + offs_r[:, None]
    )
    tl.store(ptrs, round_to(acc, act_ptr.dtype.element_ty, INTERPRETED), mask=(offs_m < N)[None, :])


@triton.jit
def _in_slot(seg):
    # The counter a matrix waits for: xq ready, attention done, xm ready, gate_up groups (slots 0, 2, 4, 5);
    # its own groups count on the slot after it (1, 3, 5, 6).
    return 2 * seg - (seg == 3).to(tl.int32)


@triton.jit
def _target(seg, N, rows, NKV: tl.constexpr, NGU: tl.constexpr):
    # What a matrix's first tile waits for: its input counter's final count.
    return tl.where(seg == 0, N, tl.where(seg == 1, rows * NKV, tl.where(seg == 2, N, NGU)))


@triton.jit
def _stream(desc, act_ptr, cnt_ptr, c, G, N, rows, H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr,
            NQ: tl.constexpr, NO: tl.constexpr, NGU: tl.constexpr, ND: tl.constexpr, NKV: tl.constexpr,
            BC: tl.constexpr, STAGES: tl.constexpr, TPI: tl.constexpr, FREE: tl.constexpr,
            ONE_ROW: tl.constexpr, SERIAL: tl.constexpr, LAYER, SEG,
            INTERPRETED: tl.constexpr):  # fmt: skip
    # Streamer c's walk; SERIAL: only its tiles of (LAYER, SEG), every activation loaded when used.
    NCB: tl.constexpr = H // (TPI * BC)
    DB: tl.constexpr = (FF + TPI * BC - 1) // (TPI * BC)
    B_O: tl.constexpr = 3 * H
    B_GU: tl.constexpr = B_O + H
    B_DN: tl.constexpr = B_GU + 2 * FF
    RPL: tl.constexpr = B_DN + ((FF + H - 1) // H) * H
    q_lo, nq = _share(NQ, c, G)
    o_lo, no = _share(NO, c, G)
    u_lo, nu = _share(NGU, c, G)
    d_lo, nd = _share(ND, c, G)
    e1 = nq * NCB
    e2 = e1 + no * NCB
    e3 = e2 + nu * NCB
    P = e3 + nd * DB
    lo = 0
    hi = L * P
    if SERIAL:
        lo = LAYER * P + tl.where(SEG == 0, 0, tl.where(SEG == 1, e1, tl.where(SEG == 2, e2, e3)))
        hi = LAYER * P + tl.where(SEG == 0, e1, tl.where(SEG == 1, e2, tl.where(SEG == 2, e3, P)))
    acc = tl.zeros([BR, RP], tl.float32)
    acc_r = tl.zeros([BR, BC], tl.float32)  # ONE_ROW: products summed elementwise across a group's tiles
    for i in tl.range(lo, hi, num_stages=STAGES):
        layer, seg, s, g, b, w_row, w_col, kcol, bpg = _coords(
            i, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H, RPL, B_O, B_GU, B_DN, NCB, DB, TPI * BC
        )
        # TPI [BR, BC] tiles an iteration: one activation round trip (L2) per TPI * BC columns.
        # Only a matrix's first tile polls: the later ones need nothing more. Within a matrix nothing
        # is loaded ahead: a streamer's own outputs may be what the next matrix waits for.
        tgt = tl.where((s == 0) & (not FREE), _target(seg, N, rows, NKV, NGU), 0)
        ok = _wait(cnt_ptr + layer * _SLOTS + _in_slot(seg), tgt, INTERPRETED)
        if ONE_ROW:
            # One token: products on CUDA cores, summed across threads once a group, not once a tile.
            acc_r = tl.where(b == 0, 0.0, acc_r)
            for t in tl.static_range(TPI):
                w = desc.load([w_row, w_col + t * BC]).to(tl.float32)
                if _NOX:
                    acc_r += w
                else:
                    offs_k = kcol + t * BC + tl.arange(0, BC)
                    x = _x_chunk(act_ptr, layer, seg, offs_k, ok, H, FF, L, INTERPRETED)
                    acc_r += w * x.to(tl.float32)[None, :]
        else:
            acc = tl.where(b == 0, 0.0, acc)
            for t in tl.static_range(TPI):
                w = desc.load([w_row, w_col + t * BC])
                x = _x_tile(act_ptr, layer, seg, kcol + t * BC, N, ok, H, FF, L, BC, INTERPRETED)
                acc = _dot(w, x, acc, "ieee", INTERPRETED)
        if (b == bpg - 1) and (not _NOSTORE):
            if ONE_ROW:  # the group's one cross-thread sum, into token column 0
                acc = tl.where((tl.arange(0, RP) == 0)[None, :], tl.sum(acc_r, axis=1)[:, None], 0.0)
            _store_group(act_ptr, acc, layer, seg, g, N, H, FF, L, INTERPRETED)
            # Every reader waits for all of a matrix's groups: count a share's groups once, after its last
            # (a release per group stalled the walk).
            n_seg = tl.where(seg == 0, nq, tl.where(seg == 1, no, tl.where(seg == 2, nu, nd)))
            if s == n_seg * bpg - 1:
                _signal_n(cnt_ptr + layer * _SLOTS + _in_slot(seg) + 1, n_seg, INTERPRETED)


@triton.jit
def _attend(act_ptr, cnt_ptr, part_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, table_ptr, bt_ptr, q_start_ptr,
            len_ptr, tok_off_ptr, row, kv_head, split, layer, num_pos, scale_log2, stride_kl,
            stride_kcs, stride_kch, stride_t, stride_bt, H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr,
            NQ: tl.constexpr, NKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_N: tl.constexpr, S: tl.constexpr, PKV: tl.constexpr,
            INTERPRETED: tl.constexpr):  # fmt: skip
    # fused_decode_attention's program (row, kv_head, split) for one layer, on the scratch: the last of
    # a head's S slices to arrive merges them, writes the head's output and counts it.
    # What does not depend on this layer's qkv is read before its wait (a padding row reads token 0's).
    n_q = tl.load(len_ptr + row)
    q_pos = tl.load(q_start_ptr + row)
    tok = tl.where(n_q > 0, tl.load(tok_off_ptr + row).to(tl.int64), 0)
    slot = tl.load(slot_ptr + tok)
    start, end = slice_bounds(q_pos, split, S, BLOCK_N)
    cos, sin = _cos_sin(table_ptr, pos_ptr, tok, num_pos, stride_t, HEAD_DIM // 2, HEAD_DIM, HEAD_DIM, "")
    kc = kc_ptr + tl.cast(layer, tl.int64) * stride_kl  # 64-bit: a full pool passes 2**31 by layer 2
    vc = vc_ptr + tl.cast(layer, tl.int64) * stride_kl
    if PKV and not INTERPRETED:
        _prefetch_kv(kc, vc, bt_ptr + row * stride_bt, kv_head, start, tl.where(n_q > 0, end, start),
                     stride_kcs, stride_kch, HEAD_DIM, PAGE, 2 * BLOCK_N)  # fmt: skip
    ok = _wait(cnt_ptr + layer * _SLOTS + 1, NQ, INTERPRETED)
    done = True
    if n_q > 0 and not _NOATT:
        qkv = act_ptr + _region_off(1, H, FF, L) + ok + (layer * RP + tok) * (3 * H)
        one = tl.arange(0, 1)
        q = _rotated(qkv, kv_head + one, one == 0, HEAD_DIM, 0, cos, sin, HEAD_DIM // 2, HEAD_DIM, HEAD_DIM,
                     act_ptr.dtype.element_ty, 0, INTERPRETED).to(tl.float32)  # fmt: skip
        k_new = _rotated(qkv + H, kv_head + one, one == 0, HEAD_DIM, 0, cos, sin, HEAD_DIM // 2, HEAD_DIM,
                         HEAD_DIM, kc_ptr.dtype.element_ty, 0, INTERPRETED)  # fmt: skip
        offs_d = tl.arange(0, HEAD_DIM)[None, :]
        v_new = tl.load(qkv + 2 * H + kv_head * HEAD_DIM + offs_d, cache_modifier=".cg")
        new_pos = tl.where(slot >= 0, q_pos, -1)
        m_i, l_i, acc = attend_slice(q, kc, vc, bt_ptr + row * stride_bt, kv_head, start, end, scale_log2,
                                     stride_kcs, stride_kch, stride_kcs, stride_kch, new_pos, k_new, v_new,
                                     1, HEAD_DIM, HEAD_DIM, PAGE, BLOCK_N, True)  # fmt: skip
        # No slice reads the new slot from the cache (k_new, v_new come from registers): the last writes it.
        if (split == S - 1) & (slot >= 0):
            _write_kv(kc, vc, slot, kv_head, k_new, v_new, stride_kcs, stride_kch, stride_kcs, stride_kch,
                      HEAD_DIM, HEAD_DIM)  # fmt: skip
        out = act_ptr + _region_off(2, H, FF, L) + (layer * RP) * H
        if S == 1:
            store_normalised(out, tok, kv_head + one, one == 0, H, HEAD_DIM, acc, l_i, HEAD_DIM, HEAD_DIM,
                             INTERPRETED)  # fmt: skip
        else:
            # fp32 partials [rows, NKV, S] (acc, then m, then l), reused by every layer: layer + 1's slices
            # start only after this layer's o_proj, which waits for these merges.
            acc_ptr = part_ptr
            m_ptr = part_ptr + _MAX_ROWS * NKV * S * HEAD_DIM
            l_ptr = m_ptr + _MAX_ROWS * NKV * S
            base = (row * NKV + kv_head) * S
            store_partial(acc_ptr, m_ptr, l_ptr, base + split + one, one == 0, m_i, l_i, acc, start < end,
                          HEAD_DIM, HEAD_DIM)  # fmt: skip
            ticket = cnt_ptr + L * _SLOTS + (layer * _MAX_ROWS + row) * NKV + kv_head
            done = _signal(ticket, INTERPRETED) == S - 1
            if done:  # fused_decode's merge: one query head per KV head here (plain MHA)
                _merge_group(out, acc_ptr, m_ptr, l_ptr, row, kv_head, tok, H, HEAD_DIM, NKV, 1, HEAD_DIM,
                             HEAD_DIM, S, INTERPRETED)  # fmt: skip
    if done:
        _signal(cnt_ptr + layer * _SLOTS + 2, INTERPRETED)


@triton.jit
def _prefetch_kv(kc, vc, bt_row_ptr, kv_head, start, end, stride_s, stride_h, HEAD_DIM: tl.constexpr,
                 PAGE: tl.constexpr, NPF: tl.constexpr):  # fmt: skip
    # The first NPF keys and values of the slice [start, end) into this SM's L1, 128-byte lines, while the
    # program waits for qkv: the attention's first tiles then hit L1 instead of HBM.
    offs_n = start + tl.arange(0, NPF)
    valid = offs_n < end
    block = tl.load(bt_row_ptr + offs_n // PAGE, mask=valid, other=0)
    row = block.to(tl.int64) * PAGE + offs_n % PAGE
    LINE: tl.constexpr = 1024 // kc.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
    LINES: tl.constexpr = (HEAD_DIM + LINE - 1) // LINE
    off = (row * stride_s + kv_head * stride_h)[:, None] + (tl.arange(0, LINES) * LINE)[None, :]
    on = tl.broadcast_to(valid[:, None], off.shape).to(tl.int32)
    _prefetch_l1(kc + off, on)
    _prefetch_l1(vc + off, on)


@triton.jit
def _prefetch_l1(ptrs, on):
    # A prefetch into L1 of each line at ptrs where on != 0 (nothing waits for it).
    _asm_ptr_int(
        """{
        .reg .pred p;
        setp.ne.s32 p, $2, 0;
        @p prefetch.global.L1 [$1];
        mov.u32 $0, 0;
        }""",
        ptrs,
        on,
    )


@triton.jit
def _norm_step(act_ptr, cnt_ptr, norm_ptr, h, tok, layer, eps, wait_slot, target, src_region, w_a_idx,
               w_next_ptr, dst_ptr, H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr,
               INTERPRETED: tl.constexpr):  # fmt: skip
    # h += RMS(a, w_a); x = RMS(h, w_next) -> dst (add_rms_norm's arithmetic); returns the new h.
    offs = tl.arange(0, H)
    ok = _wait(cnt_ptr + layer * _SLOTS + wait_slot, target, INTERPRETED)
    if _NONORM:
        return h
    src = act_ptr + _region_off(src_region, H, FF, L) + ok + (layer * RP + tok) * H
    a = tl.load(src + offs, cache_modifier=".cg").to(tl.float32)
    w_a = tl.load(norm_ptr + (layer * 4 + w_a_idx) * H + offs).to(tl.float32)
    h = round_to(h + _rms(a, w_a, H, eps, tl.bfloat16, INTERPRETED), tl.bfloat16, INTERPRETED).to(tl.float32)
    x = _rms(h, tl.load(w_next_ptr + offs).to(tl.float32), H, eps, tl.bfloat16, INTERPRETED)
    tl.store(dst_ptr + offs, x.to(tl.bfloat16))
    return h


@triton.jit
def _norm_first(act_ptr, cnt_ptr, norm_ptr, h_ptr, tok, eps, H: tl.constexpr, INTERPRETED: tl.constexpr):
    # The loop's input h and its first norm (layer 0's input_layernorm) -> xq of layer 0.
    offs = tl.arange(0, H)
    h = tl.load(h_ptr + tok * H + offs).to(tl.float32)
    x = _rms(h, tl.load(norm_ptr + offs).to(tl.float32), H, eps, tl.bfloat16, INTERPRETED)
    tl.store(act_ptr + tok * H + offs, x.to(tl.bfloat16))
    _signal(cnt_ptr, INTERPRETED)
    return h


@triton.jit
def _norm_layer_mid(act_ptr, cnt_ptr, norm_ptr, h, tok, layer, eps, NO: tl.constexpr, H: tl.constexpr,
                    FF: tl.constexpr, L: tl.constexpr,
                    INTERPRETED: tl.constexpr):  # fmt: skip
    # After o_proj: h += RMS(o, input_layernorm_2); xm = RMS(h, post_attention_layernorm).
    dst = act_ptr + _region_off(4, H, FF, L) + (layer * RP + tok) * H
    w_next = norm_ptr + (layer * 4 + 2) * H
    h = _norm_step(act_ptr, cnt_ptr, norm_ptr, h, tok, layer, eps, 3, NO, 3, 1, w_next, dst, H, FF, L,
                   INTERPRETED)  # fmt: skip
    _signal(cnt_ptr + layer * _SLOTS + 4, INTERPRETED)
    return h


@triton.jit
def _norm_layer_end(act_ptr, cnt_ptr, norm_ptr, out_ptr, h, tok, layer, eps, ND: tl.constexpr,
                    H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr,
                    INTERPRETED: tl.constexpr):  # fmt: skip
    # After down: h += RMS(d, post_attention_layernorm_2); x = RMS(h, next input_layernorm or final norm).
    if layer + 1 < L:
        w_next = norm_ptr + ((layer + 1) * 4) * H
        dst = act_ptr + _region_off(0, H, FF, L) + ((layer + 1) * RP + tok) * H
    else:
        w_next = norm_ptr + L * 4 * H
        dst = out_ptr + tok * H
    h = _norm_step(act_ptr, cnt_ptr, norm_ptr, h, tok, layer, eps, 6, ND, 6, 3, w_next, dst, H, FF, L,
                   INTERPRETED)  # fmt: skip
    if layer + 1 < L:
        _signal(cnt_ptr + (layer + 1) * _SLOTS, INTERPRETED)
    return h


@triton.jit
def _dataflow_kernel(desc, act_ptr, cnt_ptr, part_ptr, norm_ptr, h_ptr, out_ptr, kc_ptr, vc_ptr, slot_ptr,
                     pos_ptr, table_ptr, bt_ptr, q_start_ptr, len_ptr, tok_off_ptr, G, N, rows, eps, num_pos,
                     scale_log2, stride_kl, stride_kcs, stride_kch, stride_t, stride_bt,
                     H: tl.constexpr, FF: tl.constexpr, L: tl.constexpr, NKV: tl.constexpr,
                     HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BC: tl.constexpr,
                     STAGES: tl.constexpr, TPI: tl.constexpr, FREE: tl.constexpr, ONE_ROW: tl.constexpr,
                     S: tl.constexpr, PKV: tl.constexpr, SERIAL: tl.constexpr,
                     INTERPRETED: tl.constexpr):  # fmt: skip
    NQ: tl.constexpr = 3 * H // BR
    NO: tl.constexpr = H // BR
    NGU: tl.constexpr = 2 * FF // BR
    ND: tl.constexpr = H // BR
    pid = tl.program_id(0)
    if SERIAL:
        _serial(desc, act_ptr, cnt_ptr, part_ptr, norm_ptr, h_ptr, out_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr,
                table_ptr, bt_ptr, q_start_ptr, len_ptr, tok_off_ptr, G, N, rows, eps, num_pos, scale_log2,
                stride_kl, stride_kcs, stride_kch, stride_t, stride_bt, H, FF, L, NKV, NQ, NO, NGU, ND,
                HEAD_DIM, PAGE, BLOCK_N, BC, STAGES, TPI, ONE_ROW, S, PKV, INTERPRETED)  # fmt: skip
    elif pid < G:
        _stream(desc, act_ptr, cnt_ptr, pid, G, N, rows, H, FF, L, NQ, NO, NGU, ND, NKV, BC, STAGES, TPI,
                FREE, ONE_ROW, False, 0, 0, INTERPRETED)  # fmt: skip
    elif FREE:  # timing of the streamers' walk alone: no worker runs, no streamer waits
        pass
    elif pid < G + rows * NKV * S:
        w = pid - G
        for layer in range(L):
            _attend(act_ptr, cnt_ptr, part_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, table_ptr, bt_ptr,
                    q_start_ptr, len_ptr, tok_off_ptr, w // (NKV * S), (w // S) % NKV, w % S, layer,
                    num_pos, scale_log2, stride_kl, stride_kcs, stride_kch, stride_t, stride_bt, H, FF, L, NQ,
                    NKV, HEAD_DIM, PAGE, BLOCK_N, S, PKV, INTERPRETED)  # fmt: skip
    else:
        tok = pid - G - rows * NKV * S
        h = _norm_first(act_ptr, cnt_ptr, norm_ptr, h_ptr, tok, eps, H, INTERPRETED)
        for layer in range(L):
            h = _norm_layer_mid(act_ptr, cnt_ptr, norm_ptr, h, tok, layer, eps, NO, H, FF, L, INTERPRETED)
            h = _norm_layer_end(act_ptr, cnt_ptr, norm_ptr, out_ptr, h, tok, layer, eps, ND, H, FF, L,
                                INTERPRETED)  # fmt: skip


@triton.jit
def _stream_all(desc, act_ptr, cnt_ptr, G, N, rows, layer, seg, H: tl.constexpr, FF: tl.constexpr,
                L: tl.constexpr, NQ: tl.constexpr, NO: tl.constexpr, NGU: tl.constexpr, ND: tl.constexpr,
                NKV: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr, TPI: tl.constexpr,
                ONE_ROW: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # Every streamer's tiles of one matrix of one layer, streamer by streamer (the serial form).
    for c in range(G):
        _stream(desc, act_ptr, cnt_ptr, c, G, N, rows, H, FF, L, NQ, NO, NGU, ND, NKV, BC, STAGES, TPI, False,
                ONE_ROW, True, layer, seg, INTERPRETED)  # fmt: skip


@triton.jit
def _serial(desc, act_ptr, cnt_ptr, part_ptr, norm_ptr, h_ptr, out_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr,
            table_ptr, bt_ptr, q_start_ptr, len_ptr, tok_off_ptr, G, N, rows, eps, num_pos, scale_log2,
            stride_kl, stride_kcs, stride_kch, stride_t, stride_bt, H: tl.constexpr, FF: tl.constexpr,
            L: tl.constexpr, NKV: tl.constexpr, NQ: tl.constexpr, NO: tl.constexpr, NGU: tl.constexpr,
            ND: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
            BC: tl.constexpr, STAGES: tl.constexpr, TPI: tl.constexpr, ONE_ROW: tl.constexpr, S: tl.constexpr,
            PKV: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # Every role in dependency order, in one program (the interpreter runs programs one at a time).
    # The residual streams live in the out rows between steps (out is written last by the final norm).
    for tok in range(N):
        h = _norm_first(act_ptr, cnt_ptr, norm_ptr, h_ptr, tok, eps, H, INTERPRETED)
        tl.store(out_ptr + tok * H + tl.arange(0, H), h)
    for layer in range(L):
        _stream_all(desc, act_ptr, cnt_ptr, G, N, rows, layer, 0, H, FF, L, NQ, NO, NGU, ND, NKV, BC, STAGES,
                    TPI, ONE_ROW, INTERPRETED)  # fmt: skip
        for w in range(rows * NKV * S):
            _attend(act_ptr, cnt_ptr, part_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, table_ptr, bt_ptr,
                    q_start_ptr, len_ptr, tok_off_ptr, w // (NKV * S), (w // S) % NKV, w % S, layer,
                    num_pos, scale_log2, stride_kl, stride_kcs, stride_kch, stride_t, stride_bt, H, FF, L, NQ,
                    NKV, HEAD_DIM, PAGE, BLOCK_N, S, PKV, INTERPRETED)  # fmt: skip
        _stream_all(desc, act_ptr, cnt_ptr, G, N, rows, layer, 1, H, FF, L, NQ, NO, NGU, ND, NKV, BC, STAGES,
                    TPI, ONE_ROW, INTERPRETED)  # fmt: skip
        for tok in range(N):
            h = tl.load(out_ptr + tok * H + tl.arange(0, H)).to(tl.float32)
            h = _norm_layer_mid(act_ptr, cnt_ptr, norm_ptr, h, tok, layer, eps, NO, H, FF, L, INTERPRETED)
            tl.store(out_ptr + tok * H + tl.arange(0, H), h)
        _stream_all(desc, act_ptr, cnt_ptr, G, N, rows, layer, 2, H, FF, L, NQ, NO, NGU, ND, NKV, BC, STAGES,
                    TPI, ONE_ROW, INTERPRETED)  # fmt: skip
        _stream_all(desc, act_ptr, cnt_ptr, G, N, rows, layer, 3, H, FF, L, NQ, NO, NGU, ND, NKV, BC, STAGES,
                    TPI, ONE_ROW, INTERPRETED)  # fmt: skip
        for tok in range(N):
            h = tl.load(out_ptr + tok * H + tl.arange(0, H)).to(tl.float32)
            h = _norm_layer_end(act_ptr, cnt_ptr, norm_ptr, out_ptr, h, tok, layer, eps, ND, H, FF, L,
                                INTERPRETED)  # fmt: skip
            if layer + 1 < L:
                tl.store(out_ptr + tok * H + tl.arange(0, H), h)


def pack_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's weight layout (module docstring) and the norms [L * 4 + 1, H]: per layer
    input_layernorm, input_layernorm_2, post_attention_layernorm, post_attention_layernorm_2; then
    the final norm. Needs a fused model (qkv_weight, gate_up_weight)."""
    cfg = model.config
    h, inter = cfg.hidden_size, cfg.intermediate_size
    chunks = -(-inter // h)
    rows = []
    for layer in model.model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        gate, up = mlp.gate_up_weight.split(inter)
        gu = torch.stack((gate.view(-1, 8, h), up.view(-1, 8, h)), dim=1).reshape(2 * inter, h)
        down = torch.zeros(h, chunks * h, dtype=gate.dtype, device=gate.device)
        down[:, :inter] = mlp.down_proj.weight
        down = down.view(h, chunks, h).transpose(0, 1).reshape(chunks * h, h)
        rows += [sa.qkv_weight, sa.o_proj.weight, gu, down]
    norms = []
    for layer in model.model.layers:
        norms += [layer.input_layernorm.weight, layer.input_layernorm_2.weight,
                  layer.post_attention_layernorm.weight, layer.post_attention_layernorm_2.weight]  # fmt: skip
    norms.append(model.model.norm.weight)
    return torch.cat(rows).contiguous(), torch.stack(norms).contiguous()


def supported(cfg) -> str | None:
    """Why the dataflow loop cannot run this model's shapes, or None."""
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.num_key_value_heads != cfg.num_attention_heads or cfg.num_attention_heads * d != h:
        return "needs plain MHA with heads * head_dim == hidden"
    if h & (h - 1) or d & (d - 1) or h < 128:
        return "needs power-of-two hidden (>= 128) and head_dim"
    if cfg.intermediate_size % 8:
        return "needs intermediate_size % 8 == 0"
    return None


class DataflowLoop:
    """One decode loop of a fused model in one launch: `loop(h, kv_cache, batch) -> x`, like run_loop_fused.

    Holds the repacked weights (~the model's layer weights again), the activation scratch and the
    counters. Calls are CUDA-graph capturable (grid and scratch depend only on shapes). The defaults are
    the fastest measured for one token on the H200 (1.17 ms a loop against run_loop_fused's 1.24): two
    streamers per SM, 4 tiles an iteration, 2 stages, one_row, attention in 8 slices of 16-key tiles.
    More tokens need fewer programs (e.g. streamers=128, splits=1): a launch that cannot be resident raises.
    """

    def __init__(
        self,
        model,
        streamers: int | None = None,
        stages: int = 2,
        tiles: int = 4,
        block_n: int = 16,
        free: bool = False,
        one_row: bool = True,
        splits: int = 8,
        prefetch_kv: bool = True,
    ):
        cfg = model.config
        why = supported(cfg)
        if why:
            raise ValueError(f"dataflow loop: {why}")
        self.cfg, self.eps = cfg, cfg.rms_norm_eps
        self.h, self.inter, self.layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        self.bc = min(256, self.h // tiles)
        self.weights, self.norms = pack_weights(model)
        self.tpi = tiles
        self.free = free  # benchmarks only: no waits and no workers (wrong results; the walk's own speed)
        # One token: products on CUDA cores, summed across threads once per row group.
        self.one_row = one_row
        self.stages, self.block_n = stages, block_n
        dev = self.weights.device
        if streamers is None:
            streamers = 1 if dev.type != "cuda" else _streamers(dev)
        self.streamers = streamers
        per_layer = PAD_TOKENS * (8 * self.h + 2 * self.inter)
        self.act = torch.zeros(self.layers * per_layer, dtype=self.weights.dtype, device=dev)
        # Per layer: SLOTS counters; then per layer, row and KV head a ticket of the attention slices.
        kv = cfg.num_key_value_heads
        self.counters = torch.zeros(self.layers * (SLOTS + MAX_ROWS * kv), dtype=torch.int32, device=dev)
        self.prefetch_kv = prefetch_kv  # attention: the slice's first keys and values into L1 before the wait
        self.splits = splits  # attention slices per (row, KV head); their fp32 partials (acc, m, l):
        self.partials = torch.empty(MAX_ROWS * kv * splits * (cfg.head_dim + 2), dtype=torch.float32,
                                    device=dev)  # fmt: skip
        self.desc = _descriptor(self.weights, self.bc)
        self.kernel = None  # the compiled kernel, once checked

    def takes(self, h: torch.Tensor, batch) -> bool:
        """Whether a step fits the defaults (one decode token of one row): run_loop_fused asks."""
        return h.shape[0] == 1 and batch.block_tables.shape[0] == 1 and batch.max_q_len == 1

    def __call__(self, h: torch.Tensor, kv_cache: torch.Tensor, cos_sin: torch.Tensor, batch, block_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        n, rows = h.shape[0], batch.block_tables.shape[0]
        if n > MAX_ROWS or rows > MAX_ROWS:
            raise ValueError(f"dataflow loop: at most {MAX_ROWS} tokens and rows, got {n} and {rows}")
        if h.dtype != torch.bfloat16 or not h.is_contiguous():
            raise ValueError("dataflow loop: h must be contiguous bf16")
        out = torch.empty_like(h) if out is None else out
        self.counters.zero_()
        serial = interpreting()
        one_row = n == 1 and self.one_row
        kc, vc = kv_cache[0], kv_cache[1]
        grid = (1,) if serial else (self.streamers + rows * self.cfg.num_key_value_heads * self.splits + n,)
        args = (
            self.desc, self.act, self.counters, self.partials, self.norms, h, out, kc, vc, batch.slot_mapping,
            batch.positions, cos_sin, batch.block_tables, batch.row_q_start, batch.row_len, batch.row_tok_off,
            self.streamers, n, rows, self.eps, cos_sin.shape[0], self.cfg.head_dim**-0.5 * 1.4426950408889634,
            kc.stride(0), kc.stride(1), kc.stride(2), cos_sin.stride(0), batch.block_tables.stride(0),
        )  # fmt: skip
        meta = dict(
            H=self.h, FF=self.inter, L=self.layers, NKV=self.cfg.num_key_value_heads,
            HEAD_DIM=self.cfg.head_dim, PAGE=block_size, BLOCK_N=self.block_n, BC=self.bc, STAGES=self.stages,
            TPI=self.tpi, FREE=self.free, ONE_ROW=one_row, S=self.splits, PKV=self.prefetch_kv, SERIAL=serial,
            INTERPRETED=serial, num_warps=_WARPS, num_stages=1,
        )  # fmt: skip
        if not serial:
            kernel = _dataflow_kernel.warmup(*args, grid=grid, **meta)
            # Inside kernels/precompile.py's walk the compile is a future: wait for it here.
            self._check_resident(grid[0], kernel.result() if hasattr(kernel, "result") else kernel)
        _dataflow_kernel[grid](*args, **meta)
        if serial and bool((self.counters < 0).any()):
            raise RuntimeError("dataflow loop: a wait came before the work it waits for (counters marked)")
        return out

    def _check_resident(self, programs: int, kernel) -> None:
        # The programs poll each other: all must fit on the GPU at once, or the launch never ends.
        if self.kernel is kernel:
            return
        if self.free:  # the workers exit at once: only the streamers need to be resident
            programs = self.streamers
        kernel._init_handles()
        props = torch.cuda.get_device_properties(self.weights.device)
        threads = 32 * kernel.metadata.num_warps
        by_regs = 65536 // max(1, kernel.n_regs * threads)
        per_sm = min(by_regs, (233472 - 1024) // (kernel.metadata.shared + 1024), 32)
        if programs > per_sm * props.multi_processor_count:
            raise RuntimeError(
                f"dataflow loop: {programs} programs cannot all be resident ({per_sm} per SM: "
                f"{kernel.n_regs} registers, {kernel.metadata.shared} bytes of shared memory)"
            )
        self.kernel = kernel


def _descriptor(w: torch.Tensor, bc: int):
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    return TensorDescriptor.from_tensor(w, [ROWS_PER_GROUP, bc])


def _streamers(device: torch.device) -> int:
    # Two a SM (one left the SM's issue slots idle), a power of two: row-group counts (qkv 3H/16, o_proj and
    # down H/16) divide evenly over it.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 2 << (sms.bit_length() - 1)
