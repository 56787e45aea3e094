"""Tensor-core skinny matmul for decode on Hopper (Gluon): out = x @ w.T for up to 32 rows of x.

Why a second skinny matmul: the Triton one (skinny_gemm.py) streams weights at ~3.2 TB/s and each launch
drains the weight stream at its end. Here:
- a weight-loader warp streams [64, TC] TMA tiles into a ring in shared memory from the moment the CTA
  starts, before the PDL wait (weights depend on nothing), so while the kernel before it (a norm, the
  attention, the tail of another matmul) still runs, this one's first tiles are already on their way;
- an activation warp lets the next kernel launch, waits for the predecessor (griddepcontrol.wait) and
  TMA-loads the x chunk of each tile (rows past M read as zeros);
- with `pace`, the weight loader sleeps 500 x pace ns before each of its first tiles after the first while
  the PDL wait lasts (a flag the activation warp sets in shared memory), so that its burst does not queue
  ahead of the running kernel's own loads; a CTA that starts after its predecessor finished streams at once;
- one warpgroup runs one wgmma (64 x NTOK x TC, both operands from shared memory) per tile;
- the grid is balanced: each CTA owns one contiguous range of the weight's tiles numbered group-major
  (a group: 64 output features over all of K). A group split between CTAs is summed in a fixed order by
  the last of its contributors to arrive (fp32 partials in a workspace, a counter per group that the last
  resets). With `partial`, each contributor instead stores its fp32 partial product in its own slot of
  the output [S, M, N] (slot j: the group's j-th contributor; the first zero-fills the slots past the
  last), for the consumer (add_rms_norm, the decode attention) to add in slot order: no fences, counters
  or sums at the matmul's tail, which cost microseconds. Either way results do not depend on scheduling,
  and each row's result does not depend on the others; the slot sum equals the in-kernel sum bit for bit
  (same order, from zero). Where row groups outnumber the CTAs but not twice the SMs (gate_up), each CTA
  owns one whole group instead, two CTAs an SM: no group is split.
With SILU_MUL, x is a fused gate/up output [M, 2F] and the matmul's input is silu(x[:, :F]) * x[:, F:],
rounded as silu_and_mul rounds it (the down projection). With SWIGLU (gate_up, swiglu_out), w is the fused
[gate; up] weight [2F, K] and the output is silu_and_mul of the product, [M, F]: a tile's 64 rows are gate's
32 rows of a feature block and up's 32 of the same (two TMA loads), and the group's finisher rounds both to
the product's dtype and stores silu(gate) * up as silu_and_mul rounds it, bit for bit what down's SILU_MUL
prologue computes, so that down reads a plain input.

FP8 weights (float8 e4m3 [N, K] with a float32 scale per output row, model/quantization.py) run W8A8: the
loader streams half the bytes; the warpgroup quantizes each tile's activation chunk [NTOK, TC] to e4m3 with a
scale per token (its largest magnitude in the chunk maps to 448), runs an e4m3 x e4m3 wgmma into a fresh
fp32 accumulator, and adds that times the chunk's token scales to the group's sum; each group's sums are
scaled by their rows' weight scales before they are stored (or handed on as partials).
model/quantization.py's w8a8_reference_linear is this math in PyTorch.

Tile sizes, ring, shared memory, prefetch, pace and register caps come from tuning.py. Gluon has no
interpreter: on the CPU only the partition helpers are tested; the kernel is tested against F.linear, and
inside the engine, on a Hopper GPU (tests/test_tc_gemm.py).
"""

from __future__ import annotations

import functools

import torch

from .launch import sm_count
from .pdl import pdl_enabled
from .tuning import (
    TC_CTAS_PER_SM,
    TC_MAX_ROWS,
    TC_MAXNREG,
    TC_PREFETCH_TILES,
    TC_RING_SLOTS,
    TC_SILU_MUL_MAX_ROWS,
    TC_SMEM_BUDGET,
    TC_TILE_COLS,
    TC_TOKEN_TILES,
    TC_WHOLE_GROUP_SMEM,
)

try:  # Gluon ships with triton >= 3.4; the CPU build of the package never calls the kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
    _TR = gl.constexpr(64)  # TR inside the kernels
    _HALF = gl.constexpr(32)  # HALF inside the kernels
    _FLAG1 = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # a one-warp partition's copy of a flag
except ImportError:  # pragma: no cover - an old triton
    HAVE_GLUON = False

TR = 64  # weight rows per tile: the wgmma's M
HALF = TR // 2  # a SWIGLU tile's gate (and up) rows


def owner(t: int, tiles: int, ctas: int) -> int:
    """The CTA whose contiguous range [c * tiles // ctas, (c + 1) * tiles // ctas) holds tile t."""
    return ((t + 1) * ctas - 1) // tiles


def contributors(group: int, kt: int, tiles: int, ctas: int) -> tuple[int, int]:
    """(first CTA, number of CTAs) whose ranges hold a part of row group `group` (kt tiles a group)."""
    first = owner(group * kt, tiles, ctas)
    return first, owner(group * kt + kt - 1, tiles, ctas) - first + 1


def ring_slots(tc: int, ntok: int, silu_mul: bool, most: int, budget: int = TC_SMEM_BUDGET,
               swiglu: bool = False, w_bytes: int = 2) -> int:  # fmt: skip
    """Ring slots (weight tile of w_bytes an element + activation chunks each) within the shared-memory
    budget, 2 at least."""
    nx = 2 if silu_mul else 1
    fixed = ntok * tc * 2 if silu_mul else 0  # the SiLU product's buffer
    fixed += TR * ntok * 2 if swiglu else 0  # the group's gate/up rows, for the SwiGLU epilogue
    return max(2, min(most, (budget - fixed - 1024) // (TR * tc * w_bytes + nx * ntok * tc * 2)))


def slots_used(n: int, k: int, tc: int, ctas: int, slots: int) -> int:
    """Ring slots a launch allocates: `slots`, but never more than a CTA has tiles (o_proj's CTAs hold 1-2:
    two more slots would keep the next kernel's CTAs off the SM)."""
    return max(1, min(slots, -(-((n // TR) * (k // tc)) // ctas)))


def grid_ctas(n: int, k: int, tc: int, sms: int, per_sm: int) -> int:
    """CTAs of a launch: one range per CTA, at most one CTA per tile."""
    return min(sms * per_sm, (n // TR) * (k // tc))


def token_tile(m: int) -> int:
    """The smallest token tile (the wgmma's N) that holds m rows."""
    return next(t for t in TC_TOKEN_TILES if m <= t)


def launch_plan(n: int, k: int, tc: int, sms: int, per_sm: int, partial: bool) -> tuple[int, int]:
    """(CTAs, shared-memory budget a CTA): a range of tiles each, or, where the row groups outnumber the
    CTAs but not twice the SMs and no partial output is asked for, a group each (two CTAs an SM)."""
    ctas = grid_ctas(n, k, tc, sms, per_sm)
    if not partial and ctas < n // TR <= 2 * sms:
        return n // TR, min(TC_SMEM_BUDGET, TC_WHOLE_GROUP_SMEM)
    return ctas, TC_SMEM_BUDGET


@functools.cache
def slots_for(n: int, k: int, tc: int, ctas: int) -> int:
    """Slots of a partial output: the most CTAs that share one row group."""
    kt = k // tc
    tiles = (n // TR) * kt
    ctas = min(ctas, tiles)
    return max(contributors(g, kt, tiles, ctas)[1] for g in range(n // TR))


def supported(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, swiglu_out: bool = False) -> bool:
    """True when tc_linear takes this call: CUDA, Hopper, x bf16, w bf16 or float8 e4m3, 1 to TC_MAX_ROWS
    rows (TC_SILU_MUL_MAX_ROWS with silu_mul), shapes that tile evenly (with swiglu_out, w's gate and up
    halves in blocks of 32 rows)."""
    if swiglu_out and (silu_mul or w.shape[0] % (2 * HALF)):
        return False
    if not (HAVE_GLUON and pdl_enabled(x.device)):  # pdl_enabled: CUDA, sm >= 90, compiled
        return False
    if x.dtype != torch.bfloat16 or w.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or x.dim() != 2:
        return False
    if not 1 <= x.shape[0] <= (TC_SILU_MUL_MAX_ROWS if silu_mul else TC_MAX_ROWS):
        return False
    n, k = w.shape
    tc = TC_TILE_COLS
    kx = x.shape[1] // 2 if silu_mul else x.shape[1]
    aligned = x.stride(1) == 1 and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0
    return kx == k and n % TR == 0 and k % tc == 0 and w.is_contiguous() and aligned


if HAVE_GLUON:

    @gluon.jit
    def _gdc_wait():
        # Block until the kernel before has finished and its writes are visible (a no-op without PDL).
        return gl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                         is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _gdc_launch():
        # Let the next kernel launch (it prefetches its own weights, then waits for this one).
        return gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                         dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def fence_gpu():
        # Order this thread's earlier writes before its later ones, GPU-wide (each thread fences its own).
        return gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                         is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _pause(waiting, PACE: gl.constexpr):
        # PACE x 500 ns (1-4) of this warp's time, without a busy loop, where `waiting` (this warp's read of
        # the PDL-wait flag) is 0.
        ns = gl.full([1], PACE * 500, gl.int32, _FLAG1)
        asm: gl.constexpr = "{ .reg .pred p; setp.eq.s32 p, $1, 0; @p nanosleep.u32 $2; mov.u32 $0, 0; }"
        gl.inline_asm_elementwise(asm, "=r,r,r", [waiting, ns], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _range(T, G):
        # This CTA's tiles: [lo, lo + n).
        c = gl.program_id(0)
        lo = (c * T) // G
        return lo, ((c + 1) * T) // G - lo

    @gluon.jit
    def _wloader(w_desc, ring, wready, empty, go, gone, T, G, KT, F, NBUF: gl.constexpr, PRE: gl.constexpr,
                 SWIGLU: gl.constexpr, PACE: gl.constexpr):  # fmt: skip
        # One warp: the weight tiles, as far ahead as the ring allows; the first PRE before the PDL wait.
        # SWIGLU: a tile is gate's rows [32 g, 32 g + 32) over up's (rows F + those), two loads.
        TC: gl.constexpr = w_desc.block_type.shape[1]
        lo, n = _range(T, G)
        for i in range(n):
            if i == PRE:
                mbarrier.wait(go, 0)
            if PACE > 0:  # noqa: SIM102 (a constexpr branch)
                if (i > 0) & (i < PRE) & (i < NBUF):
                    # Only while the PDL wait lasts (the x loader sets `gone` after it): loop 0.846-0.848 /
                    # 0.956-0.959 ms at 1 / 8 rows against 0.848-0.850 / 0.958-0.961 pausing regardless.
                    _pause(gone.load(_FLAG1), PACE)
            slot = i % NBUF
            mbarrier.wait(empty.index(slot), ((i // NBUF) & 1) ^ 1)  # a fresh barrier passes phase 1
            t = lo + i
            if SWIGLU:
                row = (t // KT) * _HALF
                mbarrier.expect(wready.index(slot), 2 * w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [row, (t % KT) * TC], wready.index(slot),
                                                ring.index(slot).slice(0, _HALF))  # fmt: skip
                tma.async_copy_global_to_shared(w_desc, [F + row, (t % KT) * TC], wready.index(slot),
                                                ring.index(slot).slice(_HALF, _HALF))  # fmt: skip
            else:
                mbarrier.expect(wready.index(slot), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [(t // KT) * _TR, (t % KT) * TC], wready.index(slot),
                                                ring.index(slot))  # fmt: skip

    @gluon.jit
    def _xloader(x_desc, xring, xready, empty, go, gone, T, G, KT, F, NBUF: gl.constexpr,
                 SILU_MUL: gl.constexpr):  # fmt: skip
        # One warp: lets the next kernel launch, then after the PDL wait each tile's activation chunk (and
        # its up half with SILU_MUL).
        TC: gl.constexpr = x_desc.block_type.shape[1]
        NX: gl.constexpr = 2 if SILU_MUL else 1
        _gdc_launch()
        _gdc_wait()
        gone.store(gl.full([1], 1, gl.int32, _FLAG1))
        mbarrier.arrive(go, count=1)
        lo, n = _range(T, G)
        for i in range(n):
            slot = i % NBUF
            mbarrier.wait(empty.index(slot), ((i // NBUF) & 1) ^ 1)
            col = ((lo + i) % KT) * TC
            mbarrier.expect(xready.index(slot), NX * x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [0, col], xready.index(slot), xring.index(NX * slot))
            if SILU_MUL:
                tma.async_copy_global_to_shared(x_desc, [0, F + col], xready.index(slot),
                                                xring.index(2 * slot + 1))  # fmt: skip

    @gluon.jit
    def _owner(t, T, G):
        return ((t + 1) * G - 1) // T

    @gluon.jit
    def _store_group(total, out_ptr, es, g, M, stride_out, ACC: gl.constexpr, NTOK: gl.constexpr,
                     SWIGLU: gl.constexpr):  # fmt: skip
        # Row group g's sums [64, NTOK] into out (out[n, g * 64 + r]), or with SWIGLU its gate rows (0-31)
        # and up rows (32-63), rounded as gate_up's output is, as silu_and_mul's product (out[n, g * 32 + r]).
        if SWIGLU:
            es.store(total.to(es.dtype))  # es has x's dtype, the product's
            gl.thread_barrier()
            EL: gl.constexpr = gl.BlockedLayout([1, 1], [32 // NTOK, NTOK], [4, 1], [1, 0])
            gate = es.slice(0, _HALF).load(EL).to(gl.float32)
            up = es.slice(_HALF, _HALF).load(EL).to(gl.float32)
            act = (gate / (1.0 + gl.exp(-gate))).to(es.dtype).to(gl.float32)
            r = gl.arange(0, _HALF, layout=gl.SliceLayout(1, EL))
            n = gl.arange(0, NTOK, layout=gl.SliceLayout(0, EL))
            out = out_ptr + n[None, :] * stride_out + (g * _HALF + r)[:, None]
            gl.store(out, (act * up).to(es.dtype).to(out_ptr.dtype.element_ty),
                     mask=(n[None, :] < M) & (r[:, None] < _HALF))  # fmt: skip
            gl.thread_barrier()  # es is free for the next group
        else:
            offs_r = gl.arange(0, _TR, layout=gl.SliceLayout(1, ACC))
            offs_n = gl.arange(0, NTOK, layout=gl.SliceLayout(0, ACC))
            out = out_ptr + offs_n[None, :] * stride_out + (g * _TR + offs_r)[:, None]
            gl.store(
                out, total.to(out_ptr.dtype.element_ty), mask=(offs_n[None, :] < M) & (offs_r[:, None] < _TR)
            )

    @gluon.jit
    def _finish(acc, out_ptr, part_ptr, cnt_ptr, es, g, M, stride_out, T, G, KT, ACC: gl.constexpr,
                NTOK: gl.constexpr, SWIGLU: gl.constexpr):  # fmt: skip
        # Row group g's sums from this CTA: stored if the group is whole here, else handed to the last
        # contributor to arrive, which adds every contributor's partial in CTA order and stores the sum.
        offs_r = gl.arange(0, _TR, layout=gl.SliceLayout(1, ACC))
        offs_n = gl.arange(0, NTOK, layout=gl.SliceLayout(0, ACC))
        first = _owner(g * KT, T, G)
        count = _owner(g * KT + KT - 1, T, G) - first + 1
        if count == 1:
            _store_group(acc, out_ptr, es, g, M, stride_out, ACC, NTOK, SWIGLU)
        else:
            tile = offs_r[:, None] * NTOK + offs_n[None, :]
            gl.store(part_ptr + (g * KT + gl.program_id(0) - first) * (_TR * NTOK) + tile, acc)
            fence_gpu()  # each thread's partial before the count below
            gl.thread_barrier()
            if gl.atomic_add(cnt_ptr + g, 1, sem="acq_rel") == count - 1:
                fence_gpu()
                total = gl.zeros([_TR, NTOK], gl.float32, ACC)
                for s in range(count):
                    total += gl.load(part_ptr + (g * KT + s) * (_TR * NTOK) + tile, cache_modifier=".cg")
                _store_group(total, out_ptr, es, g, M, stride_out, ACC, NTOK, SWIGLU)
                gl.atomic_xchg(cnt_ptr + g, 0, sem="relaxed")  # ready for the next call

    @gluon.jit
    def _scaled(acc, s_ptr, g, F, ACC: gl.constexpr, SWIGLU: gl.constexpr):
        # Row group g's sums times their weight rows' scales (FP8); a SWIGLU group's rows 0-31 are gate's
        # rows g * 32 + r, its rows 32-63 up's, F + g * 32 + r - 32.
        r = gl.arange(0, _TR, layout=gl.SliceLayout(1, ACC))
        if SWIGLU:
            rows = gl.where(r < _HALF, g * _HALF + r, F + g * _HALF + r - _HALF)
        else:
            rows = g * _TR + r
        return acc * gl.load(s_ptr + rows)[:, None]

    @gluon.jit
    def _store_slot(acc, out_ptr, g, M, stride_out, T, G, KT, S, ACC: gl.constexpr, NTOK: gl.constexpr):
        # Row group g's partial from this CTA into its slot of out [S, M, N] fp32 (slot j: the group's
        # j-th contributor); the first contributor zero-fills the slots past the last.
        offs_r = gl.arange(0, _TR, layout=gl.SliceLayout(1, ACC))
        offs_n = gl.arange(0, NTOK, layout=gl.SliceLayout(0, ACC))
        out = out_ptr + offs_n[None, :] * stride_out + (g * _TR + offs_r)[:, None]
        mask = (offs_n[None, :] < M) & (offs_r[:, None] < _TR)
        first = _owner(g * KT, T, G)
        slot = gl.program_id(0) - first
        gl.store(out + slot * M * stride_out, acc, mask=mask)
        if slot == 0:
            count = _owner(g * KT + KT - 1, T, G) - first + 1
            for s in range(count, S):
                gl.store(out + s * M * stride_out, gl.zeros_like(acc), mask=mask)

    @gluon.jit
    def _consumer(out_ptr, part_ptr, cnt_ptr, s_ptr, ring, xring, xs, xq, es, wready, xready, empty, M,
                  stride_out, T, G, KT, S, F, NBUF: gl.constexpr, NTOK: gl.constexpr, TC: gl.constexpr,
                  SILU_MUL: gl.constexpr, PARTS: gl.constexpr, SWIGLU: gl.constexpr,
                  W_FP8: gl.constexpr):  # fmt: skip
        # One warpgroup: a wgmma per tile; a group's sums are finished when its last tile in the range is.
        KI: gl.constexpr = 32 if W_FP8 else 16  # the wgmma's K: 32 for e4m3 operands
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, NTOK, KI])  # fmt: skip
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        lo, n = _range(T, G)
        acc = gl.zeros([_TR, NTOK], gl.float32, ACC)
        zero = gl.zeros([_TR, NTOK], gl.float32, ACC)
        for i in range(n):
            slot = i % NBUF
            t = lo + i
            g = t // KT
            b = t - g * KT
            mbarrier.wait(xready.index(slot), (i // NBUF) & 1)
            if SILU_MUL:  # silu(gate) rounded, times up, rounded: as swiglu.silu_mul
                gate = xring.index(2 * slot).load(XL).to(gl.float32)
                up = xring.index(2 * slot + 1).load(XL).to(gl.float32)
                act = (gate / (1.0 + gl.exp(-gate))).to(xs.dtype).to(gl.float32)
                prod = (act * up).to(xs.dtype)
                if not W_FP8:
                    xs.store(prod)
                    fence_async_shared()
                    gl.thread_barrier()
                xt = xs.permute((1, 0))
            else:
                xt = xring.index(slot).permute((1, 0))  # [TC, NTOK], K-major
            if W_FP8:  # the chunk in e4m3, scaled per token to the format's range
                if SILU_MUL:  # noqa: SIM108 (constexpr branches)
                    xv = prod.to(gl.float32)
                else:
                    xv = xring.index(slot).load(XL).to(gl.float32)
                xsc = gl.maximum(gl.max(gl.abs(xv), axis=1), 1e-30) / 448.0
                xq.store((xv / xsc[:, None]).to(xq.dtype))
                fence_async_shared()
                gl.thread_barrier()
                xt = xq.permute((1, 0))
            mbarrier.wait(wready.index(slot), (i // NBUF) & 1)
            fresh = (b == 0) | (i == 0)  # a group's first tile here starts its sum
            if W_FP8:  # e4m3 x e4m3, each tile's product scaled by its chunk's token scales
                prt = warpgroup_mma(ring.index(slot), xt, zero, use_acc=False, is_async=True)
                prt = warpgroup_mma_wait(0, deps=[prt])
                prt = prt * gl.convert_layout(xsc, gl.SliceLayout(0, ACC))[None, :]
                if fresh:
                    acc = prt
                else:
                    acc = acc + prt
            else:
                acc = warpgroup_mma(ring.index(slot), xt, acc, use_acc=not fresh, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index(slot), count=1)
            if (b == KT - 1) | (i == n - 1):  # the group's last tile here
                if W_FP8:
                    acc = _scaled(acc, s_ptr, g, F, ACC, SWIGLU)
                if PARTS:
                    _store_slot(acc, out_ptr, g, M, stride_out, T, G, KT, S, ACC, NTOK)
                else:
                    _finish(
                        acc, out_ptr, part_ptr, cnt_ptr, es, g, M, stride_out, T, G, KT, ACC, NTOK, SWIGLU
                    )

    @gluon.jit
    def _tc_gemm_kernel(w_desc, x_desc, out_ptr, part_ptr, cnt_ptr, s_ptr, M, stride_out, T, G, KT, S, F,
                        NBUF: gl.constexpr, SILU_MUL: gl.constexpr, PARTS: gl.constexpr, PRE: gl.constexpr,
                        SWIGLU: gl.constexpr = False, PACE: gl.constexpr = 0,
                        W_FP8: gl.constexpr = False, XQ_LAYOUT: gl.constexpr = None):  # fmt: skip
        TC: gl.constexpr = w_desc.block_type.shape[1]
        NTOK: gl.constexpr = x_desc.block_type.shape[0]
        NX: gl.constexpr = 2 if SILU_MUL else 1
        ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, _TR, TC], w_desc.layout)
        xring = gl.allocate_shared_memory(x_desc.dtype, [NX * NBUF, NTOK, TC], x_desc.layout)
        xs = gl.allocate_shared_memory(
            x_desc.dtype, [NTOK if SILU_MUL else 1, TC], x_desc.layout
        )  # SiLU product
        es = gl.allocate_shared_memory(
            x_desc.dtype, [_TR if SWIGLU else 1, NTOK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        )  # a SWIGLU group's gate and up rows
        xq = gl.allocate_shared_memory(gl.float8e4nv, [NTOK if W_FP8 else 1, TC], XQ_LAYOUT)  # W8A8's x
        wready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        xready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        go = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the PDL wait is over
        mbarrier.init(go, count=1)
        gone = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # 1: wait over
        gone.store(gl.zeros([1], gl.int32, gl.BlockedLayout([1], [32], [4], [0])))
        for k in gl.static_range(NBUF):
            mbarrier.init(wready.index(k), count=1)
            mbarrier.init(xready.index(k), count=1)
            mbarrier.init(empty.index(k), count=1)
        gl.warp_specialize([
            (_consumer, (out_ptr, part_ptr, cnt_ptr, s_ptr, ring, xring, xs, xq, es, wready, xready, empty, M,
                         stride_out, T, G, KT, S, F, NBUF, NTOK, TC, SILU_MUL, PARTS, SWIGLU, W_FP8)),
            (_wloader, (w_desc, ring, wready, empty, go, gone, T, G, KT, F, NBUF, PRE, SWIGLU, PACE)),
            (_xloader, (x_desc, xring, xready, empty, go, gone, T, G, KT, F, NBUF, SILU_MUL)),
        ], [1, 1], [40, 40])  # fmt: skip


class _Workspace:
    """Per device: the split groups' fp32 partials and their arrival counters (reset by their last user).

    Allocated on the first call of a shape (the warm-up, outside any graph capture); calls that share it
    run in order on one stream, as the decode loop's do. A grown workspace keeps the smaller ones alive:
    graphs captured before still point at them."""

    def __init__(self) -> None:
        self.part: dict[torch.device, torch.Tensor] = {}
        self.cnt: dict[torch.device, torch.Tensor] = {}
        self.outgrown: list[torch.Tensor] = []

    def get(self, device: torch.device, part_elems: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, cnt = self.part.get(device), self.cnt.get(device)
        if part is None or part.numel() < part_elems or cnt.numel() < groups:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("tc_linear: a shape's first call must run eagerly before graph capture")
            self.outgrown += [t for t in (part, cnt) if t is not None]
            part = self.part[device] = torch.empty(
                max(part_elems, 1 << 21), device=device, dtype=torch.float32
            )
            cnt = self.cnt[device] = torch.zeros(max(groups, 1024), device=device, dtype=torch.int32)
        return part, cnt


_WORKSPACE = _Workspace()


def tc_linear(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, partial: bool = False,
              swiglu_out: bool = False, pace: int = 0,
              w_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (M <= 32); with silu_mul, x is [M, 2K] (gate then up).

    w float8 e4m3 needs w_scale, float32 [N]: the product is x @ (w * w_scale[:, None]).T.

    swiglu_out: w is [gate; up] and the result silu_and_mul(x @ w.T), [M, N / 2] (not with partial).

    partial: return fp32 partial products [S, M, N] instead (S = slots_for the shape), whose sum in slot
    order is the product (for the consumer to add: no sums between CTAs in the kernel).
    pace: 0-4, 500 * pace ns between the weight tiles loaded before the PDL wait (tuning.TC_PACE_BESIDE for
    a matmul whose CTAs start beside a running kernel); results do not depend on it.
    Call only where supported(x, w, silu_mul, swiglu_out)."""
    assert not (swiglu_out and (partial or silu_mul))
    fp8 = w.dtype == torch.float8_e4m3fn
    if fp8 != (w_scale is not None):
        raise ValueError("tc_linear: a float8 weight needs its w_scale, a bf16 one none")
    tc, nbuf, per_sm = TC_TILE_COLS, TC_RING_SLOTS, TC_CTAS_PER_SM
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    ntok = token_tile(m)
    kt = k // tc
    tiles = (n // TR) * kt
    ctas, budget = launch_plan(n, k, tc, sm_count(x.device), per_sm, partial)
    slots = slots_for(n, k, tc, ctas) if partial else 0
    if partial:
        out = torch.empty(slots, m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n // 2 if swiglu_out else n, device=x.device, dtype=x.dtype)
    wrows = HALF if swiglu_out else TR  # a SWIGLU tile is two loads: gate's rows and up's
    wl = gl.NVMMASharedLayout.get_default_for([wrows, tc], gl.float8e4nv if fp8 else gl.bfloat16)
    xl = gl.NVMMASharedLayout.get_default_for([ntok, tc], gl.bfloat16)
    w_desc = TensorDescriptor.from_tensor(w, [wrows, tc], wl)
    x_desc = TensorDescriptor.from_tensor(x, [ntok, tc], xl)
    part, cnt = _WORKSPACE.get(x.device, (n // TR) * kt * TR * ntok, n // TR)
    scale = w_scale if fp8 else part  # unread without FP8
    budget -= ntok * tc if fp8 else 0  # the e4m3 x chunk
    ring = ring_slots(tc, ntok, silu_mul, nbuf, budget, swiglu_out, w.element_size())
    _tc_gemm_kernel[(ctas,)](
        w_desc, x_desc, out, part, cnt, scale, m, out.shape[-1], tiles, ctas, kt, slots,
        n // 2 if swiglu_out else k, NBUF=slots_used(n, k, tc, ctas, ring), SILU_MUL=silu_mul, PARTS=partial,
        PRE=TC_PREFETCH_TILES, PACE=pace, SWIGLU=swiglu_out, W_FP8=fp8,
        XQ_LAYOUT=gl.NVMMASharedLayout.get_default_for([ntok, tc], gl.float8e4nv),
        num_warps=4, maxnreg=TC_MAXNREG[ntok], launch_pdl=True,
    )  # fmt: skip
    return out
