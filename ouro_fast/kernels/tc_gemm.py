"""Tensor-core skinny matmul for decode on Hopper (Gluon): out = x @ w.T for up to 16 rows of x.

Why a second skinny matmul: the Triton one (skinny_gemm.py) streams weights at ~3.2 TB/s and each launch
drains the weight stream at its end (docs/benchmarks.md, fifth to seventh sessions). Here:
- a weight-loader warp streams [64, TC] TMA tiles into a ring in shared memory from the moment the CTA
  starts, before the PDL wait (weights depend on nothing), so while the kernel before it (a norm, the
  attention, the tail of another matmul) still runs, this one's first tiles are already on their way;
- an activation warp lets the next kernel launch (before its wait with pdl.EARLY), waits for the
  predecessor (griddepcontrol.wait) and TMA-loads the x chunk of each tile (rows past M read as zeros);
- with `pace`, the weight loader sleeps 500 x pace ns before each of its first tiles after the first while the
  PDL wait lasts (a flag the activation warp sets in shared memory), so that its burst does not queue ahead of
  the running kernel's own loads;
- one warpgroup runs one wgmma (64 x NTOK x TC, both operands from shared memory) per tile;
- the grid is balanced: each CTA owns one contiguous range of the weight's tiles numbered group-major
  (a group: 64 output features over all of K). A group split between CTAs is summed in a fixed order by
  the last of its contributors to arrive (fp32 partials in a workspace, a counter per group that the last
  resets). With `partial`, each contributor instead stores its fp32 partial product in its own slot of
  the output [S, M, N] (slot j: the group's j-th contributor; the first zero-fills the slots past the
  last), for the consumer (add_rms_norm, the decode attention) to add in slot order: no fences, counters
  or sums at the matmul's tail, which cost microseconds (docs/benchmarks.md, sixteenth and seventeenth
  sessions). Either way results do not depend on scheduling, and each row's result does not depend on the
  others; the slot sum equals the in-kernel sum bit for bit (same order, from zero).
With SILU_MUL, x is a fused gate/up output [M, 2F] and the matmul's input is silu(x[:, :F]) * x[:, F:],
rounded as silu_and_mul rounds it (the down projection). With SWIGLU (gate_up, swiglu_out), w is the fused
[gate; up] weight [2F, K] and the output is silu_and_mul of the product, [M, F]: a tile's 64 rows are gate's
32 rows of a feature block and up's 32 of the same (two TMA loads), and the group's finisher rounds both to
the product's dtype and stores silu(gate) * up as silu_and_mul rounds it, bit for bit what down's SILU_MUL
prologue computes. down then reads a plain input: its SiLU prologue cost ~21 us a loop (twenty-sixth session).

Gluon has no interpreter: on the CPU only the partition helpers are tested; the kernel is tested against
F.linear, and inside the engine, on a Hopper GPU (tests/test_tc_gemm.py). Measured: docs/benchmarks.md,
"Sixteenth session".
"""

from __future__ import annotations

import functools
import os

import torch

from .launch import sm_count
from .pdl import EARLY as PDL_EARLY
from .pdl import pdl_enabled

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
    EARLY_LAUNCH = gl.constexpr(PDL_EARLY)  # pdl.EARLY inside the kernels
except ImportError:  # pragma: no cover - an old triton
    HAVE_GLUON = False

TR = 64  # weight rows per tile: the wgmma's M
# OURO_FAST_TC_GEMM=0 keeps the Triton skinny matmul everywhere (A/B runs); 1 or unset: used where supported.
ENABLED = os.environ.get("OURO_FAST_TC_GEMM", "1") != "0"
# Tile columns, most ring slots and CTAs per SM: (TC, NBUF, CTAS_PER_SM), from OURO_FAST_TC_CONFIG.
CONFIG = tuple(int(v) for v in os.environ.get("OURO_FAST_TC_CONFIG", "256:4:1").split(":"))
# Shared memory a CTA may take: one CTA a SM. Two a SM (112 KB each, the next matmul's CTAs streaming beside
# this one's) measured slower (docs/benchmarks.md, sixteenth session). 160 KB keeps qkv's and o_proj's 4-slot
# ring at up to 8 rows and gives down 3 slots: loop 0.911 / 1.026 ms at 1 / 8 rows against 0.917 / 1.037 with
# 225 KB (H200, two rounds; 113 KB: 0.972 / 1.140; twenty-fourth session).
SMEM_BUDGET = int(os.environ.get("OURO_FAST_TC_SMEM", str(160 * 1024)))
# Weight tiles a CTA may load before its PDL wait (A/B runs; the default, 64, fills the ring).
PREFETCH = int(os.environ.get("OURO_FAST_TC_PREFETCH", "64"))
# Where row groups outnumber SMs (up to twice: gate_up's 176 on 132), a CTA per group, two an SM, each
# with half the ring: no group split between CTAs, so no sums at the tail (H200: loop 1.014 / 1.125 ms
# at 1 / 8 rows against 1.072 / 1.172; docs/benchmarks.md, seventeenth session). OURO_FAST_TC_WHOLE=0: off.
WHOLE = os.environ.get("OURO_FAST_TC_WHOLE", "1") != "0"
WHOLE_SMEM = 113 * 1024  # two CTAs a SM
# gate_up hands down silu(gate) * up (swiglu_out), not its [gate; up] product. OURO_FAST_TC_SWIGLU=0: off.
SWIGLU_OUT = os.environ.get("OURO_FAST_TC_SWIGLU", "1") != "0"
HALF = TR // 2  # a SWIGLU tile's gate (and up) rows


def _per_shape(name: str) -> dict[tuple[int, int], int]:
    # "NxK=value,..." from the environment variable `name`, for A/B runs.
    items = (item.split("=") for item in os.environ.get(name, "").split(",") if item)
    return {tuple(int(v) for v in key.split("x")): int(val) for key, val in items}


# Ring slots per weight shape (OURO_FAST_TC_RING, A/B runs: a smaller ring lets the next kernel's CTAs sit
# beside this one's and start their weight stream earlier); unset: ring_slots, at most the CTA's tiles.
RING = _per_shape("OURO_FAST_TC_RING")
# Pace per weight shape (OURO_FAST_TC_PACE, 0-4, A/B runs): overrides tc_linear's `pace`.
PACE_AT = _per_shape("OURO_FAST_TC_PACE")
# The decode loop's pace for qkv, o_proj and gate_up, whose CTAs start beside a running kernel (the norm or
# down's tail, qkv, the attention): 1000 ns between their first tiles keeps their burst from delaying that
# kernel's loads. H200 loop 0.852 / 0.962 ms at 1 / 8 rows against 0.879 / 0.997 unpaced; down paced was
# slower (docs/benchmarks.md, twenty-seventh session).
PACE_BESIDE = 2
# Pause only while the PDL wait lasts (a flag in shared memory that the x loader sets after it): a CTA that
# starts after its predecessor has finished streams at once. H200 loop 0.846-0.848 / 0.956-0.959 ms at 1 / 8
# rows against 0.848-0.850 / 0.958-0.961 pausing regardless (three rounds, twenty-eighth session).
# OURO_FAST_TC_PACE_UNTIL_GO=0: pause regardless.
PACE_UNTIL_GO = os.environ.get("OURO_FAST_TC_PACE_UNTIL_GO", "1") != "0"
# Registers a thread may take, for 8- and 16-wide token tiles ("A:B", or one value for both). Fewer at 8
# leave room on a SM for the attention's and norms' CTAs beside the matmul's: a loop at 4 / 8 rows took
# 0.991 / 1.038 ms with 112 against 1.054 / 1.078 with 128 (H200, context 160; nineteenth session).
_REGS = [int(v) for v in os.environ.get("OURO_FAST_TC_MAXNREG", "112:128").split(":")]
MAXNREG = {8: _REGS[0], 16: _REGS[-1]}


def owner(t: int, tiles: int, ctas: int) -> int:
    """The CTA whose contiguous range [c * tiles // ctas, (c + 1) * tiles // ctas) holds tile t."""
    return ((t + 1) * ctas - 1) // tiles


def contributors(group: int, kt: int, tiles: int, ctas: int) -> tuple[int, int]:
    """(first CTA, number of CTAs) whose ranges hold a part of row group `group` (kt tiles a group)."""
    first = owner(group * kt, tiles, ctas)
    return first, owner(group * kt + kt - 1, tiles, ctas) - first + 1


def ring_slots(tc: int, ntok: int, silu_mul: bool, most: int, budget: int = SMEM_BUDGET,
               swiglu: bool = False) -> int:  # fmt: skip
    """Ring slots (weight tile + activation chunks each) within the shared-memory budget, 2 at least."""
    nx = 2 if silu_mul else 1
    fixed = ntok * tc * 2 if silu_mul else 0  # the SiLU product's buffer
    fixed += TR * ntok * 2 if swiglu else 0  # the group's gate/up rows, for the SwiGLU epilogue
    return max(2, min(most, (budget - fixed - 1024) // (TR * tc * 2 + nx * ntok * tc * 2)))


def slots_used(n: int, k: int, tc: int, ctas: int, slots: int) -> int:
    """Ring slots a launch allocates: OURO_FAST_TC_RING's for the shape, else `slots` but never more than
    a CTA has tiles (o_proj's CTAs hold 1-2: two more slots would keep the next kernel's CTAs off the SM)."""
    if (n, k) in RING:
        return RING[(n, k)]
    return max(1, min(slots, -(-((n // TR) * (k // tc)) // ctas)))


def grid_ctas(n: int, k: int, tc: int, sms: int, per_sm: int) -> int:
    """CTAs of a launch: one range per CTA, at most one CTA per tile."""
    return min(sms * per_sm, (n // TR) * (k // tc))


def launch_plan(n: int, k: int, tc: int, sms: int, per_sm: int, partial: bool) -> tuple[int, int]:
    """(CTAs, shared-memory budget a CTA): a range of tiles each, or with WHOLE, where the row groups
    outnumber the CTAs but not twice the SMs and no partial output is asked for, a group each."""
    ctas = grid_ctas(n, k, tc, sms, per_sm)
    if WHOLE and not partial and ctas < n // TR <= 2 * sms:
        return n // TR, min(SMEM_BUDGET, WHOLE_SMEM)
    return ctas, SMEM_BUDGET


@functools.cache
def slots_for(n: int, k: int, tc: int, ctas: int) -> int:
    """Slots of a partial output: the most CTAs that share one row group."""
    kt = k // tc
    tiles = (n // TR) * kt
    ctas = min(ctas, tiles)
    return max(contributors(g, kt, tiles, ctas)[1] for g in range(n // TR))


def supported(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, swiglu_out: bool = False) -> bool:
    """True when tc_linear takes this call: CUDA, Hopper, bf16, 1-16 rows, shapes that tile evenly
    (with swiglu_out, w's gate and up halves in blocks of 32 rows)."""
    if swiglu_out and (silu_mul or not SWIGLU_OUT or w.shape[0] % (2 * HALF)):
        return False
    if not (ENABLED and HAVE_GLUON and pdl_enabled(x.device)):  # pdl_enabled: CUDA, sm >= 90, compiled
        return False
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or not 1 <= x.shape[0] <= 16:
        return False
    n, k = w.shape
    tc = CONFIG[0]
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
    def global_timer():
        # The GPU's global timer (ns), comparable across SMs: for timeline stamps.
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)  # fmt: skip

    @gluon.jit
    def _stamp(ts_ptr, k: gl.constexpr, STAMP: gl.constexpr):
        # STAMP: this CTA's time of event k (0 start, 1 PDL wait over, 2 first tile multiplied, 3 done).
        if STAMP:
            gl.store(ts_ptr + gl.program_id(0) * 4 + k, global_timer())

    @gluon.jit
    def _pause(waiting, PACE: gl.constexpr):
        # PACE x 500 ns (1-4) of this warp's time, without a busy loop, where `waiting` (this warp's read of
        # the PDL-wait flag, or 0 to pause regardless) is 0.
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
                 SWIGLU: gl.constexpr, PACE: gl.constexpr, UNTIL_GO: gl.constexpr):  # fmt: skip
        # One warp: the weight tiles, as far ahead as the ring allows; the first PRE before the PDL wait.
        # SWIGLU: a tile is gate's rows [32 g, 32 g + 32) over up's (rows F + those), two loads.
        TC: gl.constexpr = w_desc.block_type.shape[1]
        lo, n = _range(T, G)
        for i in range(n):
            if i == PRE:
                mbarrier.wait(go, 0)
            if PACE > 0:  # noqa: SIM102 (a constexpr branch)
                if (i > 0) & (i < PRE) & (i < NBUF):
                    if UNTIL_GO:  # only while the PDL wait lasts (the x loader sets `gone` after it)
                        _pause(gone.load(_FLAG1), PACE)
                    else:
                        _pause(gl.zeros([1], gl.int32, _FLAG1), PACE)
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
    def _xloader(x_desc, ts_ptr, xring, xready, empty, go, gone, T, G, KT, F, NBUF: gl.constexpr,
                 SILU_MUL: gl.constexpr, STAMP: gl.constexpr):  # fmt: skip
        # One warp: after the PDL wait, each tile's activation chunk (and its up half with SILU_MUL).
        TC: gl.constexpr = x_desc.block_type.shape[1]
        NX: gl.constexpr = 2 if SILU_MUL else 1
        if EARLY_LAUNCH:
            _gdc_launch()
        _gdc_wait()
        gone.store(gl.full([1], 1, gl.int32, _FLAG1))
        mbarrier.arrive(go, count=1)
        _stamp(ts_ptr, 1, STAMP)
        if not EARLY_LAUNCH:
            _gdc_launch()
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
    def _consumer(out_ptr, part_ptr, cnt_ptr, ts_ptr, ring, xring, xs, es, wready, xready, empty, M,
                  stride_out, T, G, KT, S, NBUF: gl.constexpr, NTOK: gl.constexpr, TC: gl.constexpr,
                  SILU_MUL: gl.constexpr, PARTS: gl.constexpr, STAMP: gl.constexpr,
                  SWIGLU: gl.constexpr):  # fmt: skip
        # One warpgroup: a wgmma per tile; a group's sums are finished when its last tile in the range is.
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, NTOK, 16])  # fmt: skip
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        _stamp(ts_ptr, 0, STAMP)
        lo, n = _range(T, G)
        acc = gl.zeros([_TR, NTOK], gl.float32, ACC)
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
                xs.store((act * up).to(xs.dtype))
                fence_async_shared()
                gl.thread_barrier()
                xt = xs.permute((1, 0))
            else:
                xt = xring.index(slot).permute((1, 0))  # [TC, NTOK], K-major
            mbarrier.wait(wready.index(slot), (i // NBUF) & 1)
            fresh = (b == 0) | (i == 0)  # a group's first tile here starts its sum
            acc = warpgroup_mma(ring.index(slot), xt, acc, use_acc=not fresh, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index(slot), count=1)
            if i == 0:
                _stamp(ts_ptr, 2, STAMP)
            if (b == KT - 1) | (i == n - 1):  # the group's last tile here
                if PARTS:
                    _store_slot(acc, out_ptr, g, M, stride_out, T, G, KT, S, ACC, NTOK)
                else:
                    _finish(
                        acc, out_ptr, part_ptr, cnt_ptr, es, g, M, stride_out, T, G, KT, ACC, NTOK, SWIGLU
                    )
        _stamp(ts_ptr, 3, STAMP)

    @gluon.jit
    def _tc_gemm_kernel(w_desc, x_desc, out_ptr, part_ptr, cnt_ptr, ts_ptr, M, stride_out, T, G, KT, S, F,
                        NBUF: gl.constexpr, SILU_MUL: gl.constexpr, PARTS: gl.constexpr,
                        STAMP: gl.constexpr, PRE: gl.constexpr, SWIGLU: gl.constexpr = False,
                        PACE: gl.constexpr = 0, UNTIL_GO: gl.constexpr = False):  # fmt: skip
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
            (_consumer, (out_ptr, part_ptr, cnt_ptr, ts_ptr, ring, xring, xs, es, wready, xready, empty, M,
                         stride_out, T, G, KT, S, NBUF, NTOK, TC, SILU_MUL, PARTS, STAMP, SWIGLU)),
            (_wloader, (w_desc, ring, wready, empty, go, gone, T, G, KT, F, NBUF, PRE, SWIGLU, PACE,
                        UNTIL_GO)),
            (_xloader, (x_desc, ts_ptr, xring, xready, empty, go, gone, T, G, KT, F, NBUF, SILU_MUL, STAMP)),
        ], [1, 1], [40, 40])  # fmt: skip


class _Workspace:
    """Per device: the split groups' fp32 partials and their arrival counters (reset by their last user).

    Allocated on the first call of a shape (the warm-up, outside any graph capture); calls that share it
    run in order on one stream, as the decode loop's do."""

    def __init__(self) -> None:
        self.part: dict[torch.device, torch.Tensor] = {}
        self.cnt: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, part_elems: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        part, cnt = self.part.get(device), self.cnt.get(device)
        if part is None or part.numel() < part_elems or cnt.numel() < groups:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("tc_linear: a shape's first call must run eagerly before graph capture")
            part = self.part[device] = torch.empty(
                max(part_elems, 1 << 21), device=device, dtype=torch.float32
            )
            cnt = self.cnt[device] = torch.zeros(max(groups, 1024), device=device, dtype=torch.int32)
        return part, cnt


_WORKSPACE = _Workspace()


def tc_linear(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, partial: bool = False,
              stamps: torch.Tensor | None = None, swiglu_out: bool = False,
              pace: int = 0) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (M <= 16); with silu_mul, x is [M, 2K] (gate then up).

    swiglu_out: w is [gate; up] and the result silu_and_mul(x @ w.T), [M, N / 2] (not with partial).

    partial: return fp32 partial products [S, M, N] instead (S = slots_for the shape), whose sum in slot
    order is the product (for the consumer to add: no sums between CTAs in the kernel).
    pace: 0-4, 500 * pace ns between the weight tiles loaded before the PDL wait (PACE_BESIDE for a matmul
    whose CTAs start beside a running kernel); OURO_FAST_TC_PACE overrides it per shape.
    stamps: int64 [CTAs, 4] that receives each CTA's global-timer stamps (start, PDL wait over, first
    tile multiplied, done), for the benchmark's timeline.
    Call only where supported(x, w, silu_mul, swiglu_out)."""
    assert not (swiglu_out and (partial or silu_mul))
    tc, nbuf, per_sm = CONFIG
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    ntok = 8 if m <= 8 else 16
    kt = k // tc
    tiles = (n // TR) * kt
    ctas, budget = launch_plan(n, k, tc, sm_count(x.device), per_sm, partial)
    slots = slots_for(n, k, tc, ctas) if partial else 0
    if partial:
        out = torch.empty(slots, m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n // 2 if swiglu_out else n, device=x.device, dtype=x.dtype)
    wrows = HALF if swiglu_out else TR  # a SWIGLU tile is two loads: gate's rows and up's
    wl = gl.NVMMASharedLayout.get_default_for([wrows, tc], gl.bfloat16)
    xl = gl.NVMMASharedLayout.get_default_for([ntok, tc], gl.bfloat16)
    w_desc = TensorDescriptor.from_tensor(w, [wrows, tc], wl)
    x_desc = TensorDescriptor.from_tensor(x, [ntok, tc], xl)
    part, cnt = _WORKSPACE.get(x.device, (n // TR) * kt * TR * ntok, n // TR)
    ts = cnt if stamps is None else stamps
    _tc_gemm_kernel[(ctas,)](
        w_desc, x_desc, out, part, cnt, ts, m, out.shape[-1], tiles, ctas, kt, slots,
        n // 2 if swiglu_out else k,
        NBUF=slots_used(n, k, tc, ctas, ring_slots(tc, ntok, silu_mul, nbuf, budget, swiglu_out)),
        SILU_MUL=silu_mul, PARTS=partial,
        STAMP=stamps is not None, PRE=PREFETCH, PACE=PACE_AT.get((n, k), pace), SWIGLU=swiglu_out,
        UNTIL_GO=PACE_UNTIL_GO,
        num_warps=4, maxnreg=MAXNREG[ntok], launch_pdl=True,
    )  # fmt: skip
    return out
