"""One Ouro loop of a decode step (all layers, up to 16 tokens) in ONE persistent launch.

Why: launched kernel by kernel, a loop is 7 launches per layer (168 for Ouro-1.4B),
and each weight-streaming matmul (8-46 MB) pays ~4 us of ramp-up and tail around
6-15 us of streaming: the captured step ran at ~40% of the HBM floor. Here one CTA
per SM runs every phase of every layer, and phases are separated by a grid barrier
(an arrival counter in global memory). Before it waits at a barrier, each CTA
loads its first weight chunk of the next matmul (weights are never written), so
HBM stays busy across the barrier.

Phases of a layer (BLOCK_M = 16 token rows; column tiles of 16):
  QKV   qkv = RMS(h, input_layernorm) @ Wqkv^T  (the norm is applied as x is loaded)
  ATTN  fused_decode's program per (row, KV head, context slice): RoPE, K/V write, attention
  O     a = attn @ Wo^T, and per column tile the sum of a^2 of each row
  N1    h = h + RMS(a, input_layernorm_2)      (per column tile; sums of h^2 again)
  GU    gu = RMS(h, post_attention_layernorm) @ Wgu^T
  D     a = silu_and_mul(gu) @ Wd^T          (SiLU as loaded), sums of a^2
  N2    h = h + RMS(a, post_attention_layernorm_2)
then FINAL: out = RMS(h, model.norm). A norm's mean square is the fixed-order sum of its
per-tile partials, so results are deterministic; they are not the bits of the
add_rms_norm kernel (another summation order): tests compare with run_loop_fused within
bf16 rounding.

All CTAs must be resident at once (grid = SM count, launched plainly: never with PDL,
which could place CTAs behind a running kernel and crowd them onto a few SMs). Under
the CPU interpreter programs run one after another and a barrier would never open:
there (and in tests, `phased=True`) every phase is its own launch of the same code.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._util import ArrivalCounters, interpreting, next_pow2
from .decode_attention import partials_scratch
from .fused_decode import decode_program
from .rounding import round_to
from .skinny_gemm import _dot
from .swiglu import silu_mul

# The persistent loop for decode calls (OURO_FAST_PERSISTENT=0: the launch-per-kernel loop, for A/B runs).
ENABLED = os.environ.get("OURO_FAST_PERSISTENT", "1") != "0"
MAX_ROWS = 16  # token rows per launch: one tl.dot tile
TILE = 16  # output columns per matmul tile and per norm partial
# The phases, in order; a layer's seven are consecutive (step s >= 1 of a loop runs phase 1 + (s - 1) % 7).
PH_N0, PH_QKV, PH_ATTN, PH_O, PH_N1, PH_GU, PH_D, PH_N2, PH_FINAL = (tl.constexpr(p) for p in range(9))
TILE_C = tl.constexpr(TILE)


@dataclass
class LoopWeights:
    """Every layer's weights stacked along a leading layer axis (the layers hold views into them)."""

    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [L, H, Hq D]
    gate_up: torch.Tensor  # [L, 2 I, H]
    down: torch.Tensor  # [L, H, I]
    norms: torch.Tensor  # [L, 4, H]: input, input_2, post_attention, post_attention_2
    final_norm: torch.Tensor  # [H]


def stack_layer_weights(model) -> LoopWeights:
    """Stack a fused model's layer weights and point each layer at its slice (no second copy).

    Cached on the model; call once after OuroForCausalLM.fuse() and before any CUDA-graph capture.
    """
    lw = getattr(model, "_loop_weights", None)
    if lw is not None:
        return lw
    layers = model.model.layers
    if layers[0].self_attn.qkv_weight is None:
        raise ValueError("stack_layer_weights needs a fused model (OuroForCausalLM.fuse())")

    def stack(get, set_):
        out = torch.stack([get(layer) for layer in layers])
        for i, layer in enumerate(layers):
            set_(layer, out[i])
        return out

    def set_param(attr):
        def set_(layer, view):
            mod = layer
            for name in attr.split(".")[:-1]:
                mod = getattr(mod, name)
            getattr(mod, attr.split(".")[-1]).data = view

        return set_

    with torch.no_grad():
        qkv = stack(lambda ly: ly.self_attn.qkv_weight, lambda ly, v: setattr(ly.self_attn, "qkv_weight", v))
        gu = stack(lambda ly: ly.mlp.gate_up_weight, lambda ly, v: setattr(ly.mlp, "gate_up_weight", v))
        o = stack(lambda ly: ly.self_attn.o_proj.weight, set_param("self_attn.o_proj.weight"))
        down = stack(lambda ly: ly.mlp.down_proj.weight, set_param("mlp.down_proj.weight"))
        names = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
        norms = torch.stack([torch.stack([getattr(ly, n).weight for n in names]) for ly in layers])
        for i, layer in enumerate(layers):
            for j, n in enumerate(names):
                getattr(layer, n).weight.data = norms[i, j]
    lw = LoopWeights(qkv, o, gu, down, norms, model.model.norm.weight)
    model._loop_weights = lw
    return lw


# ---- device helpers -----------------------------------------------------------------------------


@triton.jit
def _grid_sync(bar_ptr, target):
    # Every CTA's writes so far are visible to every CTA once all have arrived (count >= target).
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    # Thread 0 alone polls (all threads polling flood the counter's L2 slice); the CTA waits at bar.sync.
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred pnz, pwait;
        .reg .u32 rtid, rseen;
        mov.u32 $0, 0;
        mov.u32 rtid, %tid.x;
        setp.ne.u32 pnz, rtid, 0;
        @pnz bra SYNC_DONE;
        SYNC_SPIN:
        ld.acquire.gpu.global.u32 rseen, [$1];
        setp.lt.s32 pwait, rseen, $2;
        @pwait bra SYNC_SPIN;
        SYNC_DONE:
        }""",
        constraints="=r,l,r",
        args=[bar_ptr, target],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.debug_barrier()


@triton.jit
def _w_rows(w_ptr, pid, G, N, K, k0, ROWS: tl.constexpr, BK: tl.constexpr):
    # CTA pid's weight rows [pid N / G, (pid + 1) N / G) (output columns), K chunk k0: [ROWS, BK].
    start = (pid * N) // G
    offs_r = start + tl.arange(0, ROWS)
    ptrs = w_ptr + offs_r.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, BK))[None, :]
    return tl.load(ptrs, mask=(offs_r < ((pid + 1) * N) // G)[:, None], other=0.0)


@triton.jit
def _rstd(ss_ptr, n_parts, H, eps, PARTS_P2: tl.constexpr):
    # 1 / RMS of each row from its partial sums of squares [n_parts, 16], summed in part order.
    offs_p = tl.arange(0, PARTS_P2)
    offs_m = tl.arange(0, TILE_C)
    s = tl.load(ss_ptr + offs_p[:, None] * TILE_C + offs_m[None, :], mask=(offs_p < n_parts)[:, None], other=0.0,
                cache_modifier=".cg")  # fmt: skip
    return tl.rsqrt(tl.sum(s, axis=0) / H + eps)


@triton.jit
def _x_chunk(in_ptr, stride_in, rows, k0, K, nw_ptr, rstd, MODE: tl.constexpr, BK: tl.constexpr,
             DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # The matmul input chunk, transposed [BK, 16]: MODE 0 as stored, 1 RMS-normed (rstd per row,
    # weight nw), 2 silu(gate) * up of a [rows, 2K] input; rounded as the separate kernels round.
    # .cg: other CTAs wrote it in this launch; read L2, never a stale L1 line.
    offs_k = k0 + tl.arange(0, BK)
    ptrs = in_ptr + rows[None, :] * stride_in + offs_k[:, None]
    if MODE == 2:
        g = tl.load(ptrs, cache_modifier=".cg").to(tl.float32)
        u = tl.load(ptrs + K, cache_modifier=".cg").to(tl.float32)
        x = silu_mul(g, u, DTYPE, INTERPRETED)
    elif MODE == 1:
        normed = round_to(tl.load(ptrs, cache_modifier=".cg").to(tl.float32) * rstd[None, :], DTYPE, INTERPRETED)
        wn = tl.load(nw_ptr + offs_k).to(tl.float32)
        x = round_to(wn[:, None] * normed.to(tl.float32), DTYPE, INTERPRETED)
    else:
        x = tl.load(ptrs, cache_modifier=".cg")
    return x


@triton.jit
def _mm_phase(pid, G, w_ptr, w_first, N, K, in_ptr, stride_in, out_ptr, stride_out, M, nw_ptr, ss_in_ptr, n_in,
              ss_out_ptr, H, eps, MODE: tl.constexpr, SS_OUT: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
              IN_P2: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
              INTERPRETED: tl.constexpr):  # fmt: skip
    # out [M, N] = x [M, K] @ w[N, K]^T. CTA pid owns the contiguous output columns
    # [pid N / G, (pid + 1) N / G) (balanced to one column) and walks K once: one [ROWS, BK] weight tile
    # per step, pipelined. w_first: its chunk 0, loaded before the barrier. With SS_OUT it also stores
    # its columns' sum of squares per row (partial `pid` of the next norm).
    dtype = out_ptr.dtype.element_ty
    rows = tl.minimum(tl.arange(0, TILE_C), M - 1)
    if MODE == 1:
        rstd = _rstd(ss_in_ptr, n_in, H, eps, IN_P2)
    else:
        rstd = tl.zeros([TILE_C], tl.float32)
    xt = _x_chunk(in_ptr, stride_in, rows, 0, K, nw_ptr, rstd, MODE, BK, dtype, INTERPRETED)
    acc = _dot(w_first, xt, tl.zeros([ROWS, TILE_C], tl.float32), DOT_PRECISION, DOT_UPCAST)
    for k0 in range(BK, K, BK):
        w = _w_rows(w_ptr, pid, G, N, K, k0, ROWS, BK)
        xt = _x_chunk(in_ptr, stride_in, rows, k0, K, nw_ptr, rstd, MODE, BK, dtype, INTERPRETED)
        acc = _dot(w, xt, acc, DOT_PRECISION, DOT_UPCAST)
    offs_r = (pid * N) // G + tl.arange(0, ROWS)
    offs_m = tl.arange(0, TILE_C)
    mask = (offs_m[:, None] < M) & (offs_r < ((pid + 1) * N) // G)[None, :]
    val = round_to(tl.trans(acc), dtype, INTERPRETED)
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_r[None, :], val, mask=mask)
    if SS_OUT:
        vf = tl.where(mask, val.to(tl.float32), 0.0)
        tl.store(ss_out_ptr + pid * TILE_C + offs_m, tl.sum(vf * vf, axis=1))


@triton.jit
def _norm_phase(pid, G, h_ptr, stride_h, a_ptr, hb_ptr, wa_ptr, ss_a_ptr, n_a, ss_h_ptr, M, H, eps,
                ADD: tl.constexpr, A_P2: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # Column tiles of 16: hb = h (+ RMS(a, wa) with ADD), rounded as add_rms_norm rounds, and each
    # tile's sums of hb^2 per row (partials of the next norm). a and hb are [M, H] buffers.
    dtype = hb_ptr.dtype.element_ty
    offs_m = tl.arange(0, TILE_C)
    if ADD:
        rstd_a = _rstd(ss_a_ptr, n_a, H, eps, A_P2)
    for t in range(pid, tl.cdiv(H, TILE_C), G):
        offs_n = t * TILE_C + tl.arange(0, TILE_C)
        mask = (offs_m < M)[:, None] & (offs_n < H)[None, :]
        h = tl.load(h_ptr + offs_m[:, None] * stride_h + offs_n[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)  # fmt: skip
        if ADD:
            a = tl.load(a_ptr + offs_m[:, None] * H + offs_n[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)  # fmt: skip
            wa = tl.load(wa_ptr + offs_n, mask=offs_n < H, other=0.0).to(tl.float32)
            normed = round_to(a * rstd_a[:, None], dtype, INTERPRETED).to(tl.float32)
            h = round_to(h + round_to(wa[None, :] * normed, dtype, INTERPRETED).to(tl.float32), dtype,
                         INTERPRETED).to(tl.float32)  # fmt: skip
        tl.store(hb_ptr + offs_m[:, None] * H + offs_n[None, :], h.to(dtype), mask=mask)
        tl.store(ss_h_ptr + t * TILE_C + offs_m, tl.sum(h * h, axis=1))


@triton.jit
def _final_phase(pid, G, hb_ptr, w_ptr, ss_h_ptr, o_ptr, stride_o, M, H, eps, H_P2: tl.constexpr,
                 INTERPRETED: tl.constexpr):  # fmt: skip
    dtype = o_ptr.dtype.element_ty
    offs_m = tl.arange(0, TILE_C)
    n_tiles = tl.cdiv(H, TILE_C)
    rstd = _rstd(ss_h_ptr, n_tiles, H, eps, H_P2)
    for t in range(pid, n_tiles, G):
        offs_n = t * TILE_C + tl.arange(0, TILE_C)
        mask = (offs_m < M)[:, None] & (offs_n < H)[None, :]
        h = tl.load(hb_ptr + offs_m[:, None] * H + offs_n[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + offs_n, mask=offs_n < H, other=0.0).to(tl.float32)
        normed = round_to(h * rstd[:, None], dtype, INTERPRETED).to(tl.float32)
        tl.store(o_ptr + offs_m[:, None] * stride_o + offs_n[None, :], round_to(w[None, :] * normed, dtype,
                 INTERPRETED), mask=mask)  # fmt: skip


@triton.jit
def _attn_phase(pid, G, layer, qkv_ptr, stride_qkv, attn_ptr, stride_attn, kv_ptr, stride_kv0, stride_kvl,
                stride_kcs, stride_kch, slot_ptr, pos_ptr, table_ptr, bt_ptr, q_start_ptr, len_ptr, tok_off_ptr,
                acc_ptr, m_ptr, l_ptr, cnt_ptr, num_pos, scale_log2, stride_t, stride_bt, R,
                NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, PAGE: tl.constexpr,
                ATT_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # Work items (row, KV head, context slice), dealt round-robin: fused_decode's program for each.
    kc_ptr = kv_ptr + layer.to(tl.int64) * stride_kvl
    vc_ptr = kc_ptr + stride_kv0
    k_ptr = qkv_ptr + NUM_HEADS * HEAD_DIM
    v_ptr = k_ptr + NUM_KV_HEADS * HEAD_DIM
    per_row = NUM_KV_HEADS * NUM_SPLITS
    for item in range(pid, R * per_row, G):
        row = item // per_row
        kv_head = (item % per_row) // NUM_SPLITS
        decode_program(row, kv_head, item % NUM_SPLITS, qkv_ptr, k_ptr, v_ptr, attn_ptr, kc_ptr, vc_ptr,
                       slot_ptr, pos_ptr, table_ptr, bt_ptr, q_start_ptr, len_ptr, tok_off_ptr, acc_ptr, m_ptr,
                       l_ptr, cnt_ptr, num_pos, scale_log2, stride_qkv, HEAD_DIM, stride_qkv, HEAD_DIM,
                       stride_qkv, HEAD_DIM, stride_attn, HEAD_DIM, stride_kcs, stride_kch, stride_kcs,
                       stride_kch, stride_t, stride_bt, NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_P2, HEAD_DIM,
                       D_P2, PAGE, ATT_BLOCK, NUM_SPLITS, INTERPRETED, ".cg")  # fmt: skip


@triton.jit
def _on(SKIP: tl.constexpr, PH: tl.constexpr):
    # Whether phase PH runs (SKIP: a bit mask of phases to leave out, for benchmarks only).
    return (SKIP >> PH) % 2 == 0


@triton.jit(do_not_specialize=["M", "R", "layer_arg"])
def _loop_kernel(
    h_in_ptr, out_ptr, hb_ptr, qkv_ptr, attn_ptr, a_ptr, gu_ptr, ss_h_ptr, ss_a_ptr, bar_ptr,
    wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, norms_ptr, final_ptr,
    kv_ptr, slot_ptr, pos_ptr, table_ptr, bt_ptr, q_start_ptr, len_ptr, tok_off_ptr,
    acc_ptr, m_ptr, l_ptr, cnt_ptr,
    M, R, L, H, NQKV, HQD, I, eps, num_pos, scale_log2, layer_arg,
    s_qkv, s_o, s_gu, s_d, stride_h_in, stride_out, stride_kv0, stride_kvl, stride_kcs, stride_kch,
    stride_t, stride_bt,
    PHASE: tl.constexpr, SKIP: tl.constexpr, RQ: tl.constexpr, KQ: tl.constexpr, RO: tl.constexpr,
    KO: tl.constexpr, RG: tl.constexpr, KG: tl.constexpr, RD: tl.constexpr, KD: tl.constexpr,
    H_P2: tl.constexpr, G_P2: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, PAGE: tl.constexpr, ATT_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    # PHASE < 0: the whole loop, a grid barrier between phases; else that one phase of layer_arg.
    # R{Q,O,G,D} / K{Q,O,G,D}: each matmul's weight tile (rows per CTA, padded; K chunk).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_h = tl.cdiv(H, TILE_C)
    I2 = 2 * I
    if PHASE < 0:
        if _on(SKIP, PH_N0):
            _norm_phase(pid, G, h_in_ptr, stride_h_in, a_ptr, hb_ptr, norms_ptr, ss_a_ptr, G, ss_h_ptr, M, H, eps,
                        False, G_P2, INTERPRETED)  # fmt: skip
        wq = _w_rows(wqkv_ptr, pid, G, NQKV, H, 0, RQ, KQ)
        _grid_sync(bar_ptr, G)
        for layer in range(L):
            lw = layer.to(tl.int64)
            nw = norms_ptr + lw * 4 * H
            sync = (1 + 7 * layer) * G
            if _on(SKIP, PH_QKV):
                _mm_phase(pid, G, wqkv_ptr + lw * s_qkv, wq, NQKV, H, hb_ptr, H, qkv_ptr, NQKV, M, nw, ss_h_ptr,
                          n_h, ss_a_ptr, H, eps, 1, False, RQ, KQ, H_P2, DOT_PRECISION, DOT_UPCAST,
                          INTERPRETED)  # fmt: skip
            # Each matmul's first weight tile streams in while the CTA waits at the barrier(s) before it.
            wo = _w_rows(wo_ptr + lw * s_o, pid, G, H, HQD, 0, RO, KO)
            _grid_sync(bar_ptr, sync + G)
            if _on(SKIP, PH_ATTN):
                _attn_phase(pid, G, layer, qkv_ptr, NQKV, attn_ptr, HQD, kv_ptr, stride_kv0, stride_kvl,
                            stride_kcs, stride_kch, slot_ptr, pos_ptr, table_ptr, bt_ptr, q_start_ptr, len_ptr,
                            tok_off_ptr, acc_ptr, m_ptr, l_ptr, cnt_ptr, num_pos, scale_log2, stride_t, stride_bt,
                            R, NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_P2, HEAD_DIM, D_P2, PAGE, ATT_BLOCK,
                            NUM_SPLITS, INTERPRETED)  # fmt: skip
            _grid_sync(bar_ptr, sync + 2 * G)
            if _on(SKIP, PH_O):
                _mm_phase(pid, G, wo_ptr + lw * s_o, wo, H, HQD, attn_ptr, HQD, a_ptr, H, M, nw, ss_h_ptr, n_h,
                          ss_a_ptr, H, eps, 0, True, RO, KO, H_P2, DOT_PRECISION, DOT_UPCAST,
                          INTERPRETED)  # fmt: skip
            wg = _w_rows(wgu_ptr + lw * s_gu, pid, G, I2, H, 0, RG, KG)
            _grid_sync(bar_ptr, sync + 3 * G)
            if _on(SKIP, PH_N1):
                _norm_phase(pid, G, hb_ptr, H, a_ptr, hb_ptr, nw + H, ss_a_ptr, G, ss_h_ptr, M, H, eps, True,
                            G_P2, INTERPRETED)  # fmt: skip
            _grid_sync(bar_ptr, sync + 4 * G)
            if _on(SKIP, PH_GU):
                _mm_phase(pid, G, wgu_ptr + lw * s_gu, wg, I2, H, hb_ptr, H, gu_ptr, I2, M, nw + 2 * H, ss_h_ptr,
                          n_h, ss_a_ptr, H, eps, 1, False, RG, KG, H_P2, DOT_PRECISION, DOT_UPCAST,
                          INTERPRETED)  # fmt: skip
            wd = _w_rows(wd_ptr + lw * s_d, pid, G, H, I, 0, RD, KD)
            _grid_sync(bar_ptr, sync + 5 * G)
            if _on(SKIP, PH_D):
                _mm_phase(pid, G, wd_ptr + lw * s_d, wd, H, I, gu_ptr, I2, a_ptr, H, M, nw, ss_h_ptr, n_h,
                          ss_a_ptr, H, eps, 2, True, RD, KD, H_P2, DOT_PRECISION, DOT_UPCAST,
                          INTERPRETED)  # fmt: skip
            wq = _w_rows(wqkv_ptr + tl.minimum(lw + 1, L - 1) * s_qkv, pid, G, NQKV, H, 0, RQ, KQ)
            _grid_sync(bar_ptr, sync + 6 * G)
            if _on(SKIP, PH_N2):
                _norm_phase(pid, G, hb_ptr, H, a_ptr, hb_ptr, nw + 3 * H, ss_a_ptr, G, ss_h_ptr, M, H, eps, True,
                            G_P2, INTERPRETED)  # fmt: skip
            _grid_sync(bar_ptr, sync + 7 * G)
        if _on(SKIP, PH_FINAL):
            _final_phase(pid, G, hb_ptr, final_ptr, ss_h_ptr, out_ptr, stride_out, M, H, eps, H_P2, INTERPRETED)
        # The last CTA out resets the barrier for the next launch: every CTA has passed its last wait.
        tl.debug_barrier()
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
            tl.atomic_xchg(bar_ptr, 0)
            tl.atomic_xchg(bar_ptr + 1, 0)
    else:
        # One phase per launch (the interpreter, tests): the same phase code, launches for barriers.
        lw = layer_arg.to(tl.int64)
        nw = norms_ptr + lw * 4 * H
        if PHASE == PH_N0:
            _norm_phase(pid, G, h_in_ptr, stride_h_in, a_ptr, hb_ptr, norms_ptr, ss_a_ptr, G, ss_h_ptr, M, H, eps,
                        False, G_P2, INTERPRETED)  # fmt: skip
        elif PHASE == PH_QKV:
            _mm_phase(pid, G, wqkv_ptr + lw * s_qkv, _w_rows(wqkv_ptr + lw * s_qkv, pid, G, NQKV, H, 0, RQ, KQ),
                      NQKV, H, hb_ptr, H, qkv_ptr, NQKV, M, nw, ss_h_ptr, n_h, ss_a_ptr, H, eps, 1, False, RQ, KQ,
                      H_P2, DOT_PRECISION, DOT_UPCAST, INTERPRETED)  # fmt: skip
        elif PHASE == PH_ATTN:
            _attn_phase(pid, G, layer_arg, qkv_ptr, NQKV, attn_ptr, HQD, kv_ptr, stride_kv0, stride_kvl,
                        stride_kcs, stride_kch, slot_ptr, pos_ptr, table_ptr, bt_ptr, q_start_ptr, len_ptr,
                        tok_off_ptr, acc_ptr, m_ptr, l_ptr, cnt_ptr, num_pos, scale_log2, stride_t, stride_bt, R,
                        NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_P2, HEAD_DIM, D_P2, PAGE, ATT_BLOCK, NUM_SPLITS,
                        INTERPRETED)  # fmt: skip
        elif PHASE == PH_O:
            _mm_phase(pid, G, wo_ptr + lw * s_o, _w_rows(wo_ptr + lw * s_o, pid, G, H, HQD, 0, RO, KO), H, HQD,
                      attn_ptr, HQD, a_ptr, H, M, nw, ss_h_ptr, n_h, ss_a_ptr, H, eps, 0, True, RO, KO, H_P2,
                      DOT_PRECISION, DOT_UPCAST, INTERPRETED)  # fmt: skip
        elif PHASE == PH_N1:
            _norm_phase(pid, G, hb_ptr, H, a_ptr, hb_ptr, nw + H, ss_a_ptr, G, ss_h_ptr, M, H, eps, True, G_P2,
                        INTERPRETED)  # fmt: skip
        elif PHASE == PH_GU:
            _mm_phase(pid, G, wgu_ptr + lw * s_gu, _w_rows(wgu_ptr + lw * s_gu, pid, G, I2, H, 0, RG, KG), I2, H,
                      hb_ptr, H, gu_ptr, I2, M, nw + 2 * H, ss_h_ptr, n_h, ss_a_ptr, H, eps, 1, False, RG, KG,
                      H_P2, DOT_PRECISION, DOT_UPCAST, INTERPRETED)  # fmt: skip
        elif PHASE == PH_D:
            _mm_phase(pid, G, wd_ptr + lw * s_d, _w_rows(wd_ptr + lw * s_d, pid, G, H, I, 0, RD, KD), H, I,
                      gu_ptr, I2, a_ptr, H, M, nw, ss_h_ptr, n_h, ss_a_ptr, H, eps, 2, True, RD, KD, H_P2,
                      DOT_PRECISION, DOT_UPCAST, INTERPRETED)  # fmt: skip
        elif PHASE == PH_N2:
            _norm_phase(pid, G, hb_ptr, H, a_ptr, hb_ptr, nw + 3 * H, ss_a_ptr, G, ss_h_ptr, M, H, eps, True, G_P2,
                        INTERPRETED)  # fmt: skip
        else:
            _final_phase(pid, G, hb_ptr, final_ptr, ss_h_ptr, out_ptr, stride_out, M, H, eps, H_P2, INTERPRETED)


# ---- host -----------------------------------------------------------------------------------------

# Per device: [barrier count, CTAs out] (zero between launches), and the attention merge counters.
_BARRIER = ArrivalCounters("persistent_loop barrier", 2)
_ATTN_COUNTERS = ArrivalCounters("persistent_loop attention", 8192)


def attention_splits(rows: int, kv_heads: int, max_context: int, programs: int) -> int:
    """Context slices per (row, KV head): about one work item per CTA, at most 1,024 positions a slice."""
    splits = 1
    while splits < 16 and (rows * kv_heads * splits * 2 <= programs or max_context > 1024 * splits):
        splits *= 2
    return splits


def tile_shape(n: int, k: int, programs: int, budget: int = 16384) -> tuple[int, int]:
    """(rows, K chunk) of a matmul's weight tile: each CTA's share of the n output columns (padded to a
    power of two, at least 16) by the largest power-of-two chunk dividing k within `budget` elements
    (32 KB of bf16: enough bytes in flight per SM, few enough registers), at most 1,024."""
    rows = max(16, next_pow2(triton.cdiv(n, programs)))
    bk = 16
    while bk < 1024 and k % (2 * bk) == 0 and rows * 2 * bk <= budget:
        bk *= 2
    return rows, bk


def loop_eligible(h: torch.Tensor, batch, applies_rope: bool) -> bool:
    """Whether the persistent loop runs this call: decode rows only, at most 16 tokens, 16-bit floats,
    on a CUDA device (or under the interpreter), and OURO_FAST_PERSISTENT not 0."""
    if not ENABLED or not applies_rope or batch.max_q_len != 1 or not 0 < h.shape[0] <= MAX_ROWS:
        return False
    if h.dtype not in (torch.bfloat16, torch.float16) or h.shape[1] % TILE:
        return False
    return h.device.type == "cuda" or interpreting()


def persistent_loop(
    h: torch.Tensor,
    lw: LoopWeights,
    kv_cache: torch.Tensor,
    batch,
    cos_sin: torch.Tensor,
    block_size: int,
    num_heads: int,
    eps: float,
    phased: bool | None = None,
    programs: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """run_loop_fused for a decode call in one launch: h [M <= 16, H] -> the loop's normed output [M, H].

    kv_cache [2, L, slots, Hkv, D] and batch (a TritonBatch with max_q_len 1) as for
    TritonPagedAttention, whose cos_sin table applies RoPE. phased: one launch per phase
    (default under the interpreter); programs: the grid (default: as many CTAs as stay
    resident together, up to config's ctas_per_sm per SM; 3 under the interpreter);
    config: keys of DEFAULT_CONFIG. Counters are allocated on the first call of a device
    (never during CUDA-graph capture).
    """
    interp = interpreting()
    phased = interp if phased is None else phased
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    dims = (h.shape[1], *lw.qkv.shape, lw.o.shape[2], lw.down.shape[2], num_heads, *kv_cache.shape[3:])
    key = (h.device, dims, block_size, tuple(batch.block_tables.shape), tuple(sorted(cfg.items())))

    def plan(grid: int):
        return _plan(h, lw, kv_cache, batch, cos_sin, block_size, num_heads, eps, grid, cfg, interp)

    grid = programs or (3 if interp else _resident_grid(key, plan, cfg))
    args, strides, consts, out = plan(grid)
    if not phased:
        _loop_kernel[(grid,)](*args, 0, *strides, PHASE=-1, **consts)
        return out
    n_layers = lw.qkv.shape[0]
    for step in range(2 + 7 * n_layers):
        phase = 0 if step == 0 else 8 if step == 1 + 7 * n_layers else (step - 1) % 7 + 1  # PH_N0 .. PH_FINAL
        _loop_kernel[(grid,)](*args, max(step - 1, 0) // 7, *strides, PHASE=phase, **consts)
    return out


# num_warps, num_stages: of the kernel; budget: weight-tile elements (tile_shape); ctas_per_sm: the
# most CTAs per SM (fewer if they do not fit); ATT_BLOCK: context positions per attention step;
# SKIP: phases left out (timing experiments only).
DEFAULT_CONFIG = {"num_warps": 4, "num_stages": 3, "budget": 4096, "ctas_per_sm": 4, "ATT_BLOCK": 64, "SKIP": 0}
_GRIDS: dict[tuple, int] = {}


def _plan(h, lw, kv_cache, batch, cos_sin, block_size, num_heads, eps, grid, cfg, interp):
    # The launch's arguments at `grid` CTAs: scratch buffers, strides and compile-time constants.
    m, hidden = h.shape
    n_layers, nqkv, _ = lw.qkv.shape
    hqd, inter = lw.o.shape[2], lw.down.shape[2]
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    r = batch.block_tables.shape[0]
    splits = attention_splits(r, hkv, batch.block_tables.shape[1] * block_size, grid)
    dev, dt = h.device, h.dtype
    bufs = torch.empty(m * (3 * hidden + nqkv + hqd + 2 * inter), dtype=dt, device=dev)
    out, hb, a, qkv, attn, gu = torch.split(bufs, [m * n for n in (hidden, hidden, hidden, nqkv, hqd, 2 * inter)])
    # Partial sums of squares: per column tile of the residual, per CTA of a sub-block's output.
    n_h = triton.cdiv(hidden, TILE)
    ss = torch.empty((n_h + grid) * TILE, dtype=torch.float32, device=dev)
    acc, mx, lsum = partials_scratch(r, num_heads, splits, d, dev)
    bar = _BARRIER.get(dev, 2)
    counters = _ATTN_COUNTERS.get(dev, r * hkv) if splits > 1 else bar
    args = [
        h, out, hb, qkv, attn, a, gu, ss[: n_h * TILE], ss[n_h * TILE :], bar,
        lw.qkv, lw.o, lw.gate_up, lw.down, lw.norms, lw.final_norm,
        kv_cache, batch.slot_mapping, batch.positions, cos_sin, batch.block_tables, batch.row_q_start,
        batch.row_len, batch.row_tok_off, acc, mx, lsum, counters,
        m, r, n_layers, hidden, nqkv, hqd, inter, eps, cos_sin.shape[0], math.log2(math.e) / math.sqrt(d),
    ]  # fmt: skip
    strides = [
        lw.qkv.stride(0), lw.o.stride(0), lw.gate_up.stride(0), lw.down.stride(0), h.stride(0), hidden,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        cos_sin.stride(0), batch.block_tables.stride(0),
    ]  # fmt: skip
    tiles = {}
    shapes = {"Q": (nqkv, hidden), "O": (hidden, hqd), "G": (2 * inter, hidden), "D": (hidden, inter)}
    for name, (n, k) in shapes.items():
        tiles["R" + name], tiles["K" + name] = tile_shape(n, k, grid, cfg["budget"])
    consts = dict(
        SKIP=cfg["SKIP"], **tiles, H_P2=next_pow2(n_h), G_P2=next_pow2(grid), NUM_HEADS=num_heads,
        NUM_KV_HEADS=hkv, GROUP=num_heads // hkv, GROUP_P2=next_pow2(num_heads // hkv), HEAD_DIM=d,
        D_P2=next_pow2(d), PAGE=block_size, ATT_BLOCK=cfg["ATT_BLOCK"], NUM_SPLITS=splits,
        DOT_PRECISION="tf32", DOT_UPCAST=interp, INTERPRETED=interp,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return args, strides, consts, out.view(m, hidden)


def _resident_grid(key: tuple, plan, cfg: dict) -> int:
    """SMs x CTAs per SM, as many as fit together (up to ctas_per_sm): every CTA of the grid must be
    resident at once or a barrier never opens. Compiles the kernel (without launching) to read its
    registers and shared memory; cached per shape and config."""
    grid = _GRIDS.get(key)
    if grid is not None:
        return grid
    device = key[0]
    sms, want = _num_sms(device), cfg["ctas_per_sm"]
    for _ in range(4):
        args, strides, consts, _out = plan(sms * want)
        kernel = _loop_kernel.warmup(*args, 0, *strides, PHASE=-1, **consts, grid=(sms * want,))
        fit = ctas_per_sm(kernel, cfg["num_warps"], device)
        if fit >= want:
            _GRIDS[key] = sms * want
            return sms * want
        want = fit  # the grid changed the tiles: compile again at the smaller grid
    raise RuntimeError(f"persistent_loop: no grid whose CTAs fit together ({cfg})")


def ctas_per_sm(kernel, num_warps: int, device: torch.device) -> int:
    """How many CTAs of a compiled kernel one SM holds at once (registers, shared memory, threads)."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    warp_regs = -(-kernel.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_smem = smem // (kernel.metadata.shared + 1024)  # 1 KB per CTA is reserved
    return max(0, min(regs // (warp_regs * num_warps), by_smem, threads // (32 * num_warps), 32))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
