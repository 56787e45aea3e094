"""A sandwich norm computed in the next tensor-core matmul's prologue (Gluon, Hopper): one launch fewer.

Ouro's layer closes each sub-block with h' = h + RMS(d, w2) and opens the next with x = RMS(h', w_in),
where d is a matmul's output (o_proj or down) that tc_gemm hands out as fp32 partial products. Today a
norm kernel sits between that matmul and the next one (kernels/norm.py, add_rms_norm): its loads wait
behind the next matmul's weight stream, and the matmul then loads x again. Here, for a one-row step,
the next matmul does it: its weight-loader warp fills the ring before the PDL wait as tc_gemm's does,
and after the wait its consumer warpgroup
- loads d's slots and h (one round trip), computes s, h', r and x with add_rms_norm's roundings
  (normed value, weight product and sums each to bf16), writes this CTA's columns of h';
- keeps x in shared memory as the B operand of every tile (the row repeated over the wgmma's 8 columns);
- runs tc_gemm's wgmma loop and epilogue (whole groups stored, split ones summed or handed out as slots).

A first try folded the norm in by linearity instead (two accumulators, r and s applied in the epilogue,
activations built per tile by a builder partition): its per-tile loads paid a round trip each behind
the weight stream, and the loop took 1.107 against 0.919 ms at one row (docs/benchmarks.md,
"Twenty-third session").

Gluon has no interpreter: the kernel is tested on a Hopper GPU against add_rms_norm + tc_linear
(tests/test_tc_norm_gemm.py); on the CPU, only its plan.
"""

from __future__ import annotations

import os

import torch

from . import tc_gemm
from ._util import next_pow2, sm_count

# OURO_FAST_TC_NORM=1 puts the norms in the matmuls' prologues at one row (off until measured on the GPU);
# "qkv" or "gate_up": only that matmul's (A/B runs).
WHERE = os.environ.get("OURO_FAST_TC_NORM", "0")
ENABLED = WHERE != "0"

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
    def _normed_row(act, xs, go, h_ptr, d_ptr, w2_ptr, win_ptr, hout_ptr, H, G, eps, stride_p,
                    P: gl.constexpr, KT: gl.constexpr, NTOK: gl.constexpr, TC: gl.constexpr,
                    HP2: gl.constexpr):  # fmt: skip
        # After the PDL wait: h' and x of the step's row (add_rms_norm's arithmetic), this CTA's columns of
        # h' to memory, x into act [KT, NTOK, TC] (the row in every column of each chunk).
        RL: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        offs = gl.arange(0, HP2, layout=RL)
        valid = offs < H
        w2 = gl.load(w2_ptr + offs, mask=valid, other=0.0).to(gl.float32)  # before the wait: nothing writes
        w_in = gl.load(win_ptr + offs, mask=valid, other=0.0).to(gl.float32)  # the weights
        if EARLY_LAUNCH:
            _gdc_launch()
        _gdc_wait()
        mbarrier.arrive(go, count=1)
        if not EARLY_LAUNCH:
            _gdc_launch()
        d = gl.load(d_ptr + offs, mask=valid, other=0.0)
        for p in gl.static_range(1, P):  # the slots in order, rounded as the matmul rounds its output
            d += gl.load(d_ptr + p * stride_p + offs, mask=valid, other=0.0)
        d = d.to(gl.bfloat16).to(gl.float32)
        h = gl.load(h_ptr + offs, mask=valid, other=0.0).to(gl.float32)
        s = gl.rsqrt(gl.sum(d * d, axis=0) / H + eps)
        normed = (d * s).to(gl.bfloat16).to(gl.float32)
        hn = (h + (w2 * normed).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)
        c = gl.program_id(0)
        mine = (offs >= (c * H) // G) & (offs < ((c + 1) * H) // G)
        gl.store(hout_ptr + offs, hn, mask=valid & mine)
        hf = hn.to(gl.float32)
        r = gl.rsqrt(gl.sum(hf * hf, axis=0) / H + eps)
        xs.store((w_in * (hf * r).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16))
        gl.thread_barrier()
        zero = gl.zeros([NTOK, TC], gl.bfloat16, XL)
        for kc in gl.static_range(KT):
            chunk = xs.slice(kc * TC, TC).load(gl.SliceLayout(0, XL))
            act.index(kc).store(zero + chunk[None, :])
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _norm_consumer(out_ptr, part_ptr, cnt_ptr, ring, act, xs, wready, empty, go, h_ptr, d_ptr, w2_ptr,
                       win_ptr, hout_ptr, H, stride_out, stride_p, T, G, S, eps, NBUF: gl.constexpr,
                       P: gl.constexpr, KT: gl.constexpr, NTOK: gl.constexpr, TC: gl.constexpr,
                       PARTS: gl.constexpr, HP2: gl.constexpr):  # fmt: skip
        # One warpgroup: the normed row, then tc_gemm's wgmma per tile and its per-group epilogue.
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, NTOK, 16])  # fmt: skip
        _normed_row(act, xs, go, h_ptr, d_ptr, w2_ptr, win_ptr, hout_ptr, H, G, eps, stride_p, P, KT, NTOK,
                    TC, HP2)  # fmt: skip
        lo, n = _range(T, G)
        acc = gl.zeros([_TR, NTOK], gl.float32, ACC)
        for i in range(n):
            slot = i % NBUF
            t = lo + i
            g = t // KT
            b = t - g * KT
            mbarrier.wait(wready.index(slot), (i // NBUF) & 1)
            fresh = (b == 0) | (i == 0)  # a group's first tile here starts its sum
            acc = warpgroup_mma(ring.index(slot), act.index(b).permute((1, 0)), acc, use_acc=not fresh,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index(slot), count=1)
            if (b == KT - 1) | (i == n - 1):  # the group's last tile here
                if PARTS:
                    _store_slot(acc, out_ptr, g, 1, stride_out, T, G, KT, S, ACC, NTOK)
                else:
                    _finish(acc, out_ptr, part_ptr, cnt_ptr, g, 1, stride_out, T, G, KT, ACC, NTOK)

    @gluon.jit
    def _tc_norm_kernel(w_desc, out_ptr, part_ptr, cnt_ptr, h_ptr, d_ptr, w2_ptr, win_ptr, hout_ptr, H,
                        stride_out, stride_p, T, G, S, eps, XSL: gl.constexpr, NTOK: gl.constexpr,
                        NBUF: gl.constexpr, KT: gl.constexpr, P: gl.constexpr, PARTS: gl.constexpr,
                        PRE: gl.constexpr, HP2: gl.constexpr):  # fmt: skip
        TC: gl.constexpr = w_desc.block_type.shape[1]
        ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, _TR, TC], w_desc.layout)
        act = gl.allocate_shared_memory(gl.bfloat16, [KT, NTOK, TC], XSL)  # x, chunk by chunk
        xs = gl.allocate_shared_memory(gl.bfloat16, [HP2], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # x's row
        wready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        go = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the PDL wait is over
        mbarrier.init(go, count=1)
        for k in gl.static_range(NBUF):
            mbarrier.init(wready.index(k), count=1)
            mbarrier.init(empty.index(k), count=1)
        gl.warp_specialize([
            (_norm_consumer, (out_ptr, part_ptr, cnt_ptr, ring, act, xs, wready, empty, go, h_ptr, d_ptr,
                              w2_ptr, win_ptr, hout_ptr, H, stride_out, stride_p, T, G, S, eps, NBUF, P, KT,
                              NTOK, TC, PARTS, HP2)),
            (_wloader, (w_desc, ring, wready, empty, go, T, G, KT, NBUF, PRE)),
        ], [1], [40])  # fmt: skip


def takes_rows(h: torch.Tensor) -> bool:
    """The prologue norm is on and the step has one row."""
    return ENABLED and h.shape[0] == 1


def supported(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> bool:
    """True when tc_norm_linear takes this call: takes_rows(h), tc_linear's conditions for h, and d a
    matmul's fp32 partial products [S, 1, H] with contiguous rows."""
    if not (takes_rows(h) and tc_gemm.supported(h, w)):
        return False
    return d.dim() == 3 and d.dtype == torch.float32 and d.shape[1:] == h.shape and d.stride(2) == 1


def smem_fixed(k: int, ntok: int) -> int:
    """Shared memory besides the weight ring: x chunk by chunk, x's row, barriers."""
    return k * ntok * 2 + next_pow2(k) * 2 + 1024


def ring_slots(tc: int, k: int, ntok: int, most: int, budget: int) -> int:
    """Weight-ring slots within the shared-memory budget, 2 at least."""
    return max(2, min(most, (budget - smem_fixed(k, ntok)) // (tc_gemm.TR * tc * 2)))


def tc_norm_linear(h: torch.Tensor, d: torch.Tensor, w2: torch.Tensor, w_in: torch.Tensor, w: torch.Tensor,
                   eps: float, partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, h_new) for a one-row step: h_new, x = add_rms_norm(h, d, w2, w_in, eps) and y = x @ w.T, in one
    launch. y is [1, N] bf16, or with partial tc_linear's fp32 partial products [S, 1, N]; d: fp32
    partial products [P, 1, H]. Call only where supported()."""
    tc, nbuf, per_sm = tc_gemm.CONFIG
    n, k = w.shape
    ntok = 8
    kt = k // tc
    tiles = (n // tc_gemm.TR) * kt
    ctas, budget = tc_gemm.launch_plan(n, k, tc, sm_count(h.device), per_sm, partial)
    slots = tc_gemm.slots_for(n, k, tc, ctas) if partial else 0
    if partial:
        out = torch.empty(slots, 1, n, device=h.device, dtype=torch.float32)
    else:
        out = torch.empty(1, n, device=h.device, dtype=h.dtype)
    h_new = torch.empty_like(h)
    wl = gl.NVMMASharedLayout.get_default_for([tc_gemm.TR, tc], gl.bfloat16)
    xl = gl.NVMMASharedLayout.get_default_for([ntok, tc], gl.bfloat16)
    w_desc = TensorDescriptor.from_tensor(w, [tc_gemm.TR, tc], wl)
    part, cnt = tc_gemm._WORKSPACE.get(h.device, (n // tc_gemm.TR) * kt * tc_gemm.TR * ntok, n // tc_gemm.TR)
    _tc_norm_kernel[(ctas,)](
        w_desc, out, part, cnt, h, d, w2, w_in, h_new, k, n, d.stride(0), tiles, ctas, slots, eps,
        XSL=xl, NTOK=ntok, NBUF=ring_slots(tc, k, ntok, nbuf, budget), KT=kt, P=d.shape[0], PARTS=partial,
        PRE=tc_gemm.PREFETCH, HP2=next_pow2(k), num_warps=4, maxnreg=tc_gemm.MAXNREG[ntok], launch_pdl=True,
    )  # fmt: skip
    return out, h_new
