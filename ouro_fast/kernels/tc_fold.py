"""A sandwich norm folded into the next tensor-core matmul (Gluon, Hopper): no norm launch between them.

Ouro's layer closes each sub-block with h' = h + RMS(d, w2) and opens the next with x = RMS(h', w_in),
where d is a matmul's output (o_proj or down) that tc_gemm hands out as fp32 partial products. Today a
norm kernel sits between that matmul and the next one (kernels/norm.py, add_rms_norm). By linearity
the next matmul can take h and d itself:

    y = x @ W.T ~= r * (A + s * B),   A = bf16(h * w_in) @ W.T,   B = bf16(d * w2 * w_in) @ W.T

with s = rsqrt(mean(d^2) + eps) and r = rsqrt(mean(h'^2) + eps). A and B need no row statistics, so
each tile's two activation chunks are built as its weight tile streams in; s and r (full rows) are
computed beside the stream and applied in the epilogue, where partial products may still be split
between CTAs (the scale is per row, so it commutes with the slot sums). Numerics against float64:
bench/norm_fold_check.py (the fold's error is no larger than the norm kernel's double rounding).

The kernel also writes h' exactly as add_rms_norm rounds it (each CTA a slice of the columns), so the
residual stream stays the model's. Partitions, on tc_gemm's weight ring and PDL protocol:
- tc_gemm's weight-loader warp (tiles before the PDL wait);
- a builder (4 warps): after the wait, each tile's A and B chunks into the activation ring; after the
  ring's first fill, the row statistics (one row at a time: S partial rows of d, then h') and its
  slice of h';
- the consumer warpgroup: two wgmmas per tile (A and B against one weight tile), and per row group
  r * (accA + s * accB), stored whole or as a slot of partial products (tc_gemm's _finish/_store_slot).

Measured: docs/benchmarks.md, "Twenty-third session". Gluon has no interpreter: the kernel is tested on
a Hopper GPU against the norm kernel + tc_linear (tests/test_tc_fold.py); on the CPU, only its plan.
"""

from __future__ import annotations

import os

import torch

from . import tc_gemm
from ._util import next_pow2, sm_count

# OURO_FAST_TC_FOLD=1 folds the norms (off until measured on the GPU); FOLD_ROWS: the most rows a step
# folds, up to 8 (the row statistics are computed one row at a time, so wide steps may be faster unfolded).
ENABLED = os.environ.get("OURO_FAST_TC_FOLD", "0") != "0"
FOLD_ROWS = int(os.environ.get("OURO_FAST_TC_FOLD_ROWS", "8"))

if tc_gemm.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .tc_gemm import _TR, EARLY_LAUNCH, _finish, _gdc_launch, _gdc_wait, _range, _store_slot, _wloader

    @gluon.jit
    def _parts_sum(d_ptr, offs, mask, stride_p, P: gl.constexpr):
        # d's P fp32 partial products added in slot order, rounded as the matmul rounds its output.
        d = gl.load(d_ptr + offs, mask=mask, other=0.0)
        for p in gl.static_range(1, P):
            d += gl.load(d_ptr + p * stride_p + offs, mask=mask, other=0.0)
        return d.to(gl.bfloat16).to(gl.float32)

    @gluon.jit
    def _build_tile(xring, slot, t, h_ptr, d_ptr, w2_ptr, win_ptr, M, KT, stride_h, stride_d, stride_p,
                    P: gl.constexpr, NTOK: gl.constexpr, TC: gl.constexpr):  # fmt: skip
        # Tile t's activation chunks: A = bf16(h * w_in) and B = bf16(d * w2 * w_in), rows past M zero.
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [2, 1], [1, 0])
        offs_m = gl.arange(0, NTOK, layout=gl.SliceLayout(1, XL))
        offs_k = (t % KT) * TC + gl.arange(0, TC, layout=gl.SliceLayout(0, XL))
        mask = (offs_m[:, None] < M) & (offs_k[None, :] >= 0)
        w_in = gl.load(win_ptr + offs_k).to(gl.float32)
        w2 = gl.load(w2_ptr + offs_k).to(gl.float32)
        h = gl.load(h_ptr + offs_m[:, None] * stride_h + offs_k[None, :], mask=mask, other=0.0).to(gl.float32)
        d = _parts_sum(d_ptr, offs_m[:, None] * stride_d + offs_k[None, :], mask, stride_p, P)
        xring.index(2 * slot).store((h * w_in[None, :]).to(gl.bfloat16))
        xring.index(2 * slot + 1).store((d * w2[None, :] * w_in[None, :]).to(gl.bfloat16))

    @gluon.jit
    def _row_stats(s_sm, r_sm, h_ptr, d_ptr, w2_ptr, hout_ptr, M, H, G, eps, stride_h, stride_d, stride_p,
                   stride_ho, P: gl.constexpr, NTOK: gl.constexpr, HP2: gl.constexpr):  # fmt: skip
        # s and r of each row into s_sm and r_sm [NTOK]; this CTA's columns of h' = bf16(h + RMS(d, w2)),
        # rounded as add_rms_norm rounds it (normed value, weight product and sum each to bf16).
        RL: gl.constexpr = gl.BlockedLayout([4], [32], [2], [0])
        SL: gl.constexpr = gl.BlockedLayout([1], [32], [2], [0])
        offs = gl.arange(0, HP2, layout=RL)
        valid = offs < H
        c = gl.program_id(0)
        mine = (offs >= (c * H) // G) & (offs < ((c + 1) * H) // G)
        w2 = gl.load(w2_ptr + offs, mask=valid, other=0.0).to(gl.float32)
        rows = gl.arange(0, NTOK, layout=SL)
        s_all = gl.zeros([NTOK], gl.float32, SL)
        r_all = gl.zeros([NTOK], gl.float32, SL)
        for m in range(M):
            d = _parts_sum(d_ptr, m * stride_d + offs, valid, stride_p, P)
            h = gl.load(h_ptr + m * stride_h + offs, mask=valid, other=0.0).to(gl.float32)
            s = gl.rsqrt(gl.sum(d * d, axis=0) / H + eps)
            normed = (d * s).to(gl.bfloat16).to(gl.float32)
            hn = (h + (w2 * normed).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)
            gl.store(hout_ptr + m * stride_ho + offs, hn, mask=valid & mine)
            hf = hn.to(gl.float32)
            r = gl.rsqrt(gl.sum(hf * hf, axis=0) / H + eps)
            s_all = gl.where(rows == m, s, s_all)
            r_all = gl.where(rows == m, r, r_all)
        s_sm.store(s_all)
        r_sm.store(r_all)

    @gluon.jit
    def _builder(xring, s_sm, r_sm, xready, sready, empty, go, h_ptr, d_ptr, w2_ptr, win_ptr, hout_ptr, M, H,
                 T, G, KT, eps, stride_h, stride_d, stride_p, stride_ho, NBUF: gl.constexpr, P: gl.constexpr,
                 NTOK: gl.constexpr, TC: gl.constexpr, HP2: gl.constexpr):  # fmt: skip
        # After the PDL wait: the first ring's worth of activation chunks, then the row statistics (the
        # consumer needs them only at a group's end), then the rest of the chunks.
        if EARLY_LAUNCH:
            _gdc_launch()
        _gdc_wait()
        mbarrier.arrive(go, count=1)
        if not EARLY_LAUNCH:
            _gdc_launch()
        lo, n = _range(T, G)
        first = gl.minimum(n, NBUF)
        for i in range(first):  # fresh slots: no wait
            _build_tile(xring, i, lo + i, h_ptr, d_ptr, w2_ptr, win_ptr, M, KT, stride_h, stride_d, stride_p,
                        P, NTOK, TC)  # fmt: skip
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(xready.index(i), count=1)
        _row_stats(s_sm, r_sm, h_ptr, d_ptr, w2_ptr, hout_ptr, M, H, G, eps, stride_h, stride_d, stride_p,
                   stride_ho, P, NTOK, HP2)  # fmt: skip
        gl.thread_barrier()
        mbarrier.arrive(sready, count=1)
        for i in range(first, n):
            slot = i % NBUF
            mbarrier.wait(empty.index(slot), ((i // NBUF) & 1) ^ 1)
            _build_tile(xring, slot, lo + i, h_ptr, d_ptr, w2_ptr, win_ptr, M, KT, stride_h, stride_d,
                        stride_p, P, NTOK, TC)  # fmt: skip
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(xready.index(slot), count=1)

    @gluon.jit
    def _fold_consumer(out_ptr, part_ptr, cnt_ptr, ring, xring, s_sm, r_sm, wready, xready, sready, empty, M,
                       stride_out, T, G, KT, S, NBUF: gl.constexpr, NTOK: gl.constexpr,
                       PARTS: gl.constexpr):  # fmt: skip
        # One warpgroup: per tile, A's and B's wgmma on the same weight tile; per group, r * (A + s * B).
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, NTOK, 16])  # fmt: skip
        lo, n = _range(T, G)
        acc_a = gl.zeros([_TR, NTOK], gl.float32, ACC)
        acc_b = gl.zeros([_TR, NTOK], gl.float32, ACC)
        for i in range(n):
            slot = i % NBUF
            t = lo + i
            g = t // KT
            b = t - g * KT
            mbarrier.wait(xready.index(slot), (i // NBUF) & 1)
            mbarrier.wait(wready.index(slot), (i // NBUF) & 1)
            fresh = (b == 0) | (i == 0)  # a group's first tile here starts its sums
            w = ring.index(slot)
            acc_a = warpgroup_mma(w, xring.index(2 * slot).permute((1, 0)), acc_a, use_acc=not fresh,
                                  is_async=True)  # fmt: skip
            acc_b = warpgroup_mma(w, xring.index(2 * slot + 1).permute((1, 0)), acc_b, use_acc=not fresh,
                                  is_async=True)  # fmt: skip
            acc_a, acc_b = warpgroup_mma_wait(0, deps=[acc_a, acc_b])
            mbarrier.arrive(empty.index(slot), count=1)
            if (b == KT - 1) | (i == n - 1):  # the group's last tile here
                mbarrier.wait(sready, 0)
                s = s_sm.load(gl.SliceLayout(0, ACC))
                r = r_sm.load(gl.SliceLayout(0, ACC))
                acc = r[None, :] * (acc_a + s[None, :] * acc_b)
                if PARTS:
                    _store_slot(acc, out_ptr, g, M, stride_out, T, G, KT, S, ACC, NTOK)
                else:
                    _finish(acc, out_ptr, part_ptr, cnt_ptr, g, M, stride_out, T, G, KT, ACC, NTOK)

    @gluon.jit
    def _tc_fold_kernel(w_desc, out_ptr, part_ptr, cnt_ptr, h_ptr, d_ptr, w2_ptr, win_ptr, hout_ptr, M, H,
                        stride_out, stride_h, stride_d, stride_p, stride_ho, T, G, KT, S, eps,
                        XSL: gl.constexpr, NTOK: gl.constexpr, NBUF: gl.constexpr, P: gl.constexpr,
                        PARTS: gl.constexpr, PRE: gl.constexpr, HP2: gl.constexpr):  # fmt: skip
        TC: gl.constexpr = w_desc.block_type.shape[1]
        ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, _TR, TC], w_desc.layout)
        xring = gl.allocate_shared_memory(gl.bfloat16, [2 * NBUF, NTOK, TC], XSL)
        VL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        s_sm = gl.allocate_shared_memory(gl.float32, [NTOK], VL)  # s per row
        r_sm = gl.allocate_shared_memory(gl.float32, [NTOK], VL)  # r per row
        wready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        xready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        go = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the PDL wait is over
        sready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # s_sm and r_sm are set
        mbarrier.init(go, count=1)
        mbarrier.init(sready, count=1)
        for k in gl.static_range(NBUF):
            mbarrier.init(wready.index(k), count=1)
            mbarrier.init(xready.index(k), count=1)
            mbarrier.init(empty.index(k), count=1)
        gl.warp_specialize([
            (_fold_consumer, (out_ptr, part_ptr, cnt_ptr, ring, xring, s_sm, r_sm, wready, xready, sready,
                              empty, M, stride_out, T, G, KT, S, NBUF, NTOK, PARTS)),
            (_wloader, (w_desc, ring, wready, empty, go, T, G, KT, NBUF, PRE)),
            (_builder, (xring, s_sm, r_sm, xready, sready, empty, go, h_ptr, d_ptr, w2_ptr, win_ptr, hout_ptr,
                        M, H, T, G, KT, eps, stride_h, stride_d, stride_p, stride_ho, NBUF, P, NTOK, TC,
                        HP2)),
        ], [1, 2], [40, 128])  # fmt: skip


def takes_rows(h: torch.Tensor) -> bool:
    """The fold is on and h has at most FOLD_ROWS rows (and 8: the builder's tile)."""
    return ENABLED and 1 <= h.shape[0] <= min(FOLD_ROWS, 8)


def supported(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> bool:
    """True when tc_fold_linear takes this call: takes_rows(h), tc_linear's conditions for h, and d a
    matmul's fp32 partial products [S, M, H] with contiguous rows."""
    if not (takes_rows(h) and tc_gemm.supported(h, w)):
        return False
    return d.dim() == 3 and d.dtype == torch.float32 and d.shape[1:] == h.shape and d.stride(2) == 1


def ring_slots(tc: int, ntok: int, most: int, budget: int) -> int:
    """Ring slots (a weight tile and two activation chunks each) within the shared-memory budget."""
    return max(2, min(most, (budget - 2048) // (tc_gemm.TR * tc * 2 + 2 * ntok * tc * 2)))


def tc_fold_linear(h: torch.Tensor, d: torch.Tensor, w2: torch.Tensor, w_in: torch.Tensor, w: torch.Tensor,
                   eps: float, partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, h_new): h_new = bf16(h + RMS(sum of d's slots, w2)) as add_rms_norm computes it, and
    y ~= RMS(h_new, w_in) @ w.T by the fold (module docstring); y is [M, N] bf16, or with partial tc_linear's
    fp32 partial products [S, M, N]. d: fp32 partial products [P, M, H]. Call only where supported()."""
    tc, nbuf, per_sm = tc_gemm.CONFIG
    m, n, k = h.shape[0], w.shape[0], w.shape[1]
    ntok = 8 if m <= 8 else 16
    kt = k // tc
    tiles = (n // tc_gemm.TR) * kt
    ctas, budget = tc_gemm.launch_plan(n, k, tc, sm_count(h.device), per_sm, partial)
    slots = tc_gemm.slots_for(n, k, tc, ctas) if partial else 0
    if partial:
        out = torch.empty(slots, m, n, device=h.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n, device=h.device, dtype=h.dtype)
    h_new = torch.empty_like(h)
    wl = gl.NVMMASharedLayout.get_default_for([tc_gemm.TR, tc], gl.bfloat16)
    xl = gl.NVMMASharedLayout.get_default_for([ntok, tc], gl.bfloat16)
    w_desc = TensorDescriptor.from_tensor(w, [tc_gemm.TR, tc], wl)
    part, cnt = tc_gemm._WORKSPACE.get(h.device, (n // tc_gemm.TR) * kt * tc_gemm.TR * ntok, n // tc_gemm.TR)
    _tc_fold_kernel[(ctas,)](
        w_desc, out, part, cnt, h, d, w2, w_in, h_new, m, k,
        out.stride(-2), h.stride(0), d.stride(1), d.stride(0), h_new.stride(0), tiles, ctas, kt, slots, eps,
        XSL=xl, NTOK=ntok, NBUF=ring_slots(tc, ntok, nbuf, budget), P=d.shape[0], PARTS=partial,
        PRE=tc_gemm.PREFETCH, HP2=next_pow2(k), num_warps=4, maxnreg=tc_gemm.MAXNREG[ntok], launch_pdl=True,
    )  # fmt: skip
    return out, h_new
