"""The dataflow loop's tile walk in Gluon: what a walk over every weight of a loop can stream on the H200.

The thirteenth session found the Triton walk (kernels/dataflow.py with no waits and no workers) at ~3.2 TB/s
and suspected each tile's activation load from L2. Triton's `tl` API cannot keep a shared buffer across
iterations; Gluon can. Three walks over the same packed weights (dataflow.pack_weights: per layer qkv, o,
gate_up, then down's column chunks stacked as rows), each checking every matrix's output against torch:

  ring  one partition, 264 CTAs each a share of every matrix's 16-row groups, [16, 256] TMA tiles in a ring
        of NBUF buffers refilled REFILL at a time after a CTA barrier; CUDA-core products. The activation
        either copied into shared memory once per matrix (x_in_smem) or loaded from L2 per tile.
  ws    the same products, warp-specialized: a loader warp keeps the ring full (ready/empty mbarriers);
        the activation chunk rides in each slot by TMA, or is loaded from L2.
  mma   tensor cores and balanced shares: each matrix's [64, TC] tiles numbered group-major, every CTA one
        contiguous range of them (so a group may be split between CTAs: its sums are added atomically).
        One wgmma (64 x NTOK x TC, both operands straight from shared memory) per tile; a weight-loader
        warp and an activation-loader warp. Options: dependent (1: a matrix's activations wait until every
        CTA has finished the matrix before it: done counters, as in a fused loop; 2: each TC-column chunk
        of the input waits only for the output chunks it is made from, counted per chunk as tiles finish,
        as a loop with the norms folded into the matmuls could; timing only, the inputs being synthetic:
        3 on the matrix two before, 4 only qkv and gate_up on the matrix before, 5 as 1 but the done counter
        released without a fence; 6: outputs added as int64 words, fixed point above a count of the adds,
        so that each input chunk waits for its words' counts, with no fence and no counter; 7: the same,
        only qkv and gate_up waiting; 8: as 1, every thread fencing its own adds before the CTA's
        count; 9: as 4 with 8's release, and only o and down released; 10: as 6, polling only the first
        token's words, as a one-token loop would read), activations built in
        shared memory by each CTA (RMSNorm of an fp32 source at every matrix's start), and finishers
        (FIN): 1 the last CTA to finish a matrix normalizes its output once for everyone; 2 the CTA whose
        tiles complete a row group reads it back, adds its squares to per-token sums and writes it as
        bf16; 3 the same on a finisher warp fed through a queue in shared memory. Also: tile-major
        weights (TM), an L2 prefetch of the tile PF ahead (TM only), a cap on the tiles in flight below the
        ring's depth, and each CTA's global-timer stamps of every matrix, summarized as timeline_us.

Measured on the H200 in the fourteenth session (docs/benchmarks.md): the ring and ws walks are no faster
than the Triton one (1.17 / 0.81 ms against 0.78); the mma walk streams a loop's 2.47 GB in 0.59-0.61 ms
(4.2 TB/s) for 8 or 16 tokens, 0.76 ms with the 96 dependencies of a loop; building activations per CTA
costs +0.38 ms and a single finishing CTA +2.7 ms a loop; finishing every row group where it completes
+0.21 ms (+0.24 on a finisher warp). Fifteenth session: a hop between two matrices is a ~3 us chain (the
last CTA's end to the first CTA's start, 2.9 us of it the release's fence) and costs the walk ~1.8-2.0 us,
whatever the ring's depth or tiles in flight (L2 prefetch made it slower); waiting for the matrix two before
instead 0.629 ms; two hops a layer (DEP=4) 0.712 ms, with every thread fenced (DEP=9) 0.713; no fence (DEP=5,
unordered) 0.686; every thread fenced (DEP=8) 0.798; words that count their adds (DEP=6, 7, 10) 1.48 / 1.14 /
0.869.

Compiled offline for sm_90 (triton 3.6). Gluon has no interpreter: the CPU test checks only the reference.
    python3 -P bench/gpu/gluon_walk_bench.py
        [--mma COLS:BUFFERS:CTAS_PER_SM:DEPENDENT:X_BUILT:FIN[:TILE_MAJOR:PREFETCH:IN_FLIGHT] ...]
        [--tokens 8] [--kernels ring ws] [--buffers 4 8] [--refill 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
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

from ouro_fast.kernels.tc_gemm import fence_gpu, global_timer

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402

TILE_ROWS, TILE_COLS = 16, 256  # a tile: one row group, 256 columns
BR, BC = gl.constexpr(TILE_ROWS), gl.constexpr(TILE_COLS)


@gluon.jit
def _share(n, c, G):
    lo = (c * n) // G
    return lo, ((c + 1) * n) // G - lo


@gluon.jit
def _tile(i, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H: gl.constexpr, RPL: gl.constexpr, NCB: gl.constexpr,
          DB: gl.constexpr):  # fmt: skip
    # Tile i of a streamer's walk -> (layer, matrix, tile in the matrix's share, group, tile in group,
    # tiles per group, weight row, weight column, activation column), as dataflow._coords.
    layer = i // P
    j = i - layer * P
    seg = (j >= e1).to(gl.int32) + (j >= e2).to(gl.int32) + (j >= e3).to(gl.int32)
    start = gl.where(seg == 0, 0, gl.where(seg == 1, e1, gl.where(seg == 2, e2, e3)))
    s = j - start
    bpg = gl.where(seg == 3, DB, NCB)
    b = s % bpg
    g = s // bpg + gl.where(seg == 0, q_lo, gl.where(seg == 1, o_lo, gl.where(seg == 2, u_lo, d_lo)))
    kcol = b * BC
    base = gl.where(seg == 0, 0, gl.where(seg == 1, 3 * H, gl.where(seg == 2, 4 * H, RPL - DB * BC)))
    w_row = layer * RPL + base + g * BR + (kcol // H) * H
    return layer, seg, s, g, b, bpg, w_row, kcol % H, kcol


@gluon.jit
def _walk_setup(G, H: gl.constexpr, FF: gl.constexpr):
    # This CTA's shares of the four matrices' 16-row groups, and its walk's offsets within a layer.
    NCB: gl.constexpr = H // BC
    DB: gl.constexpr = (((FF + H - 1) // H) * H) // BC
    c = gl.program_id(0)
    q_lo, nq = _share(3 * H // BR, c, G)
    o_lo, no = _share(H // BR, c, G)
    u_lo, nu = _share(2 * FF // BR, c, G)
    d_lo, nd = _share(H // BR, c, G)
    e1 = nq * NCB
    e2 = e1 + no * NCB
    e3 = e2 + nu * NCB
    return q_lo, o_lo, u_lo, d_lo, e1, e2, e3, e3 + nd * DB


@gluon.jit
def _walk_kernel(w_desc, x_ptr, y_ptr, G, H: gl.constexpr, FF: gl.constexpr, L: gl.constexpr,
                 XMAX: gl.constexpr, YMAX: gl.constexpr, NBUF: gl.constexpr, REFILL: gl.constexpr,
                 XSMEM: gl.constexpr):  # fmt: skip
    # x [L, 4, XMAX] bf16 (each matrix's activation, zero padded; XMAX // BC a power of two); y [L, 4, YMAX]
    # fp32 (each matrix's outputs). The ring is refilled REFILL tiles at a time (REFILL divides NBUF), after
    # one CTA barrier: the buffers of the REFILL tiles just consumed.
    NCB: gl.constexpr = H // BC
    DB: gl.constexpr = (((FF + H - 1) // H) * H) // BC  # down: chunks of H columns, stacked as rows
    RPL: gl.constexpr = 4 * H + 2 * FF + DB * BC
    TILE: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    XL: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])  # a chunk of the activation, copied in
    q_lo, o_lo, u_lo, d_lo, e1, e2, e3, P = _walk_setup(G, H, FF)
    T = L * P

    ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, BR, BC], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(NBUF):
        mbarrier.init(bars.index(k), count=1)
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [XMAX // BC, BC], x_layout)
    for k in gl.static_range(NBUF - REFILL):  # the ring's first tiles
        _, _, _, _, _, _, r, col, _ = _tile(k, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H, RPL, NCB, DB)
        mbarrier.expect(bars.index(k), w_desc.block_type.nbytes, pred=k < T)
        tma.async_copy_global_to_shared(w_desc, [r, col], bars.index(k), ring.index(k), pred=k < T)

    acc = gl.zeros([BR, BC], gl.float32, TILE)
    offs_r = gl.arange(0, BR, layout=gl.SliceLayout(1, TILE))
    offs_c = gl.arange(0, BC, layout=gl.SliceLayout(0, TILE))
    offs_xc = gl.arange(0, BC, layout=XL)
    for i in range(T):
        if i % REFILL == 0:  # every warp is done with the last REFILL tiles' buffers: refill them
            gl.thread_barrier()
            fence_async_shared()
            for k in gl.static_range(REFILL):
                j = i + NBUF - REFILL + k
                _, _, _, _, _, _, r, col, _ = _tile(j, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H, RPL, NCB, DB)
                mbarrier.expect(bars.index(j % NBUF), w_desc.block_type.nbytes, pred=j < T)
                tma.async_copy_global_to_shared(w_desc, [r, col], bars.index(j % NBUF), ring.index(j % NBUF),
                                                pred=j < T)  # fmt: skip
        tile = _tile(i, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H, RPL, NCB, DB)
        layer, seg, s, g, b, bpg, _, _, kcol = tile
        x_row = x_ptr + (layer * 4 + seg) * XMAX
        if XSMEM:
            if s == 0:  # a new matrix: its whole activation into shared memory, once
                gl.thread_barrier()  # every warp is done with the last matrix's
                for k in gl.static_range(XMAX // BC):
                    x_smem.index(k).store(gl.load(x_row + k * BC + offs_xc))
                gl.thread_barrier()
            xc = x_smem.index(kcol // BC).load(gl.SliceLayout(0, TILE)).to(gl.float32)
        else:
            xc = gl.load(x_row + kcol + offs_c, cache_modifier=".cg").to(gl.float32)
        mbarrier.wait(bars.index(i % NBUF), (i // NBUF) & 1)
        w = ring.index(i % NBUF).load(TILE).to(gl.float32)
        acc = gl.where(b == 0, 0.0, acc) + w * xc[None, :]
        if b == bpg - 1:
            gl.store(y_ptr + (layer * 4 + seg) * YMAX + g * BR + offs_r, gl.sum(acc, axis=1))
    for k in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(k))


@gluon.jit
def _ws_loader(w_desc, x_desc, ring, xring, ready, empty, G, H: gl.constexpr, FF: gl.constexpr,
               L: gl.constexpr, NBUF: gl.constexpr, XTMA: gl.constexpr):  # fmt: skip
    # One warp: waits for a free slot, then TMA-loads the slot's weight tile (and activation chunk).
    NCB: gl.constexpr = H // BC
    DB: gl.constexpr = (((FF + H - 1) // H) * H) // BC
    RPL: gl.constexpr = 4 * H + 2 * FF + DB * BC
    q_lo, o_lo, u_lo, d_lo, e1, e2, e3, P = _walk_setup(G, H, FF)
    for i in range(L * P):
        slot = i % NBUF
        mbarrier.wait(empty.index(slot), ((i // NBUF) & 1) ^ 1)  # a fresh barrier passes phase 1
        tile = _tile(i, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H, RPL, NCB, DB)
        layer, seg, _, _, _, _, r, col, kcol = tile
        if XTMA:
            mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
            xbuf = xring.index(slot)
            tma.async_copy_global_to_shared(x_desc, [layer * 4 + seg, kcol], ready.index(slot), xbuf)
        else:
            mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [r, col], ready.index(slot), ring.index(slot))


@gluon.jit
def _ws_consumer(x_ptr, y_ptr, ring, xring, ready, empty, G, H: gl.constexpr, FF: gl.constexpr,
                 L: gl.constexpr, XMAX: gl.constexpr, YMAX: gl.constexpr, NBUF: gl.constexpr,
                 XTMA: gl.constexpr):  # fmt: skip
    # The default partition's 4 warps: multiply each slot's tile by its activation chunk, free the slot.
    NCB: gl.constexpr = H // BC
    DB: gl.constexpr = (((FF + H - 1) // H) * H) // BC
    RPL: gl.constexpr = 4 * H + 2 * FF + DB * BC
    TILE: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    q_lo, o_lo, u_lo, d_lo, e1, e2, e3, P = _walk_setup(G, H, FF)
    acc = gl.zeros([BR, BC], gl.float32, TILE)
    offs_r = gl.arange(0, BR, layout=gl.SliceLayout(1, TILE))
    offs_c = gl.arange(0, BC, layout=gl.SliceLayout(0, TILE))
    for i in range(L * P):
        slot = i % NBUF
        tile = _tile(i, P, e1, e2, e3, q_lo, o_lo, u_lo, d_lo, H, RPL, NCB, DB)
        layer, seg, _, g, b, bpg, _, _, kcol = tile
        if not XTMA:
            xc = gl.load(x_ptr + (layer * 4 + seg) * XMAX + kcol + offs_c).to(gl.float32)[None, :]
        mbarrier.wait(ready.index(slot), (i // NBUF) & 1)
        w = ring.index(slot).load(TILE).to(gl.float32)
        if XTMA:
            xc = xring.index(slot).load(TILE).to(gl.float32)  # [1, BC]
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        acc = gl.where(b == 0, 0.0, acc) + w * xc
        if b == bpg - 1:
            gl.store(y_ptr + (layer * 4 + seg) * YMAX + g * BR + offs_r, gl.sum(acc, axis=1))


@gluon.jit
def _ws_kernel(w_desc, x_desc, x_ptr, y_ptr, G, H: gl.constexpr, FF: gl.constexpr, L: gl.constexpr,
               XMAX: gl.constexpr, YMAX: gl.constexpr, NBUF: gl.constexpr, XTMA: gl.constexpr,
               LOADER_REGS: gl.constexpr):  # fmt: skip
    # The walk warp-specialized: a loader warp fills a ring of NBUF slots, the 4 default warps consume it.
    # XTMA=1: each slot also carries the tile's activation chunk ([1, BC], by TMA); 0: loaded from L2.
    ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, BR, BC], w_desc.layout)
    xring = gl.allocate_shared_memory(x_desc.dtype, [NBUF, 1, BC], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(NBUF):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    gl.warp_specialize([
        (_ws_consumer, (x_ptr, y_ptr, ring, xring, ready, empty, G, H, FF, L, XMAX, YMAX, NBUF, XTMA)),
        (_ws_loader, (w_desc, x_desc, ring, xring, ready, empty, G, H, FF, L, NBUF, XTMA)),
    ], [1], [LOADER_REGS])  # fmt: skip


@gluon.jit
def _mtile(i, P, e1, e2, e3, lo0, lo1, lo2, lo3, H: gl.constexpr, RPL: gl.constexpr, NCT: gl.constexpr,
           DBT: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr):  # fmt: skip
    # Tile i of a CTA's balanced walk -> (layer, matrix, tile in the CTA's range, group, tile in group,
    # tiles per group, weight row, weight column, activation column). Each matrix's [TR, TC] tiles are
    # numbered group-major; a CTA owns one contiguous range of them (lo.. in every layer).
    layer = i // P
    j = i - layer * P
    seg = (j >= e1).to(gl.int32) + (j >= e2).to(gl.int32) + (j >= e3).to(gl.int32)
    start = gl.where(seg == 0, 0, gl.where(seg == 1, e1, gl.where(seg == 2, e2, e3)))
    s = j - start
    t = s + gl.where(seg == 0, lo0, gl.where(seg == 1, lo1, gl.where(seg == 2, lo2, lo3)))
    bpg = gl.where(seg == 3, DBT, NCT)
    g = t // bpg
    b = t - g * bpg
    kcol = b * TC
    base = gl.where(seg == 0, 0, gl.where(seg == 1, 3 * H, gl.where(seg == 2, 4 * H, RPL - DBT * TC)))
    return layer, seg, s, g, b, bpg, layer * RPL + base + g * TR + (kcol // H) * H, kcol % H, kcol


@gluon.jit
def _mma_walk_setup(G, H: gl.constexpr, FF: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr):
    # This CTA's share of each matrix's tiles (starts lo0..lo3, counts n0..n3) and the offsets of its walk
    # within a layer (e1, e2, e3, P).
    NCT: gl.constexpr = H // TC
    DBT: gl.constexpr = (((FF + H - 1) // H) * H) // TC
    c = gl.program_id(0)
    lo0, n0 = _share(3 * H // TR * NCT, c, G)
    lo1, n1 = _share(H // TR * NCT, c, G)
    lo2, n2 = _share(2 * FF // TR * NCT, c, G)
    lo3, n3 = _share(H // TR * DBT, c, G)
    return lo0, lo1, lo2, lo3, n0, n1, n2, n3, n0, n0 + n1, n0 + n1 + n2, n0 + n1 + n2 + n3


@gluon.jit
def _mma_wloader(w_desc, w_ptr, ring, wready, empty, G, H: gl.constexpr, FF: gl.constexpr, L: gl.constexpr,
                 NBUF: gl.constexpr, TM: gl.constexpr, PF: gl.constexpr, INFLIGHT: gl.constexpr):  # fmt: skip
    # One warp: the weight tiles, as far ahead as the ring allows (weights depend on nothing). TM: the weights
    # are stored tile-major (each [TR, TC] tile one contiguous run); PF > 0 (TM only): also the tile PF
    # further on into L2, one bulk prefetch, so that HBM keeps streaming while a full ring waits. INFLIGHT <
    # NBUF: at most INFLIGHT tiles requested and not yet landed, so that the ring's other slots fill while the
    # consumer waits (a deeper ring alone only queues more requests in the memory system).
    TR: gl.constexpr = w_desc.block_type.shape[0]
    TC: gl.constexpr = w_desc.block_type.shape[1]
    NCT: gl.constexpr = H // TC
    DBT: gl.constexpr = (((FF + H - 1) // H) * H) // TC
    RPL: gl.constexpr = 4 * H + 2 * FF + DBT * TC
    lo0, lo1, lo2, lo3, _, _, _, _, e1, e2, e3, P = _mma_walk_setup(G, H, FF, TR, TC)
    for i in range(L * P):
        slot = i % NBUF
        mbarrier.wait(empty.index(slot), ((i // NBUF) & 1) ^ 1)  # a fresh barrier passes phase 1
        if INFLIGHT < NBUF:  # noqa: SIM102 (a constexpr branch)
            if i >= INFLIGHT:
                mbarrier.wait(wready.index((i - INFLIGHT) % NBUF), ((i - INFLIGHT) // NBUF) & 1)
        _, _, _, _, _, _, r, col, _ = _mtile(i, P, e1, e2, e3, lo0, lo1, lo2, lo3, H, RPL, NCT, DBT, TR, TC)
        mbarrier.expect(wready.index(slot), w_desc.block_type.nbytes)
        if TM:
            tma.async_copy_global_to_shared(w_desc, [_tm_row(r, col, H, TR, TC), 0], wready.index(slot),
                                            ring.index(slot))  # fmt: skip
        else:
            tma.async_copy_global_to_shared(w_desc, [r, col], wready.index(slot), ring.index(slot))
        if PF > 0:  # noqa: SIM102 (a constexpr branch)
            if i + PF < L * P:
                _, _, _, _, _, _, r2, col2, _ = _mtile(
                    i + PF, P, e1, e2, e3, lo0, lo1, lo2, lo3, H, RPL, NCT, DBT, TR, TC
                )
                _prefetch_tile(w_ptr + _tm_row(r2, col2, H, TR, TC).to(gl.int64) * TC)


@gluon.jit
def _tm_row(r, col, H: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr):
    # TM: the first row of tile (r, col) of the packed weights in their tile-major copy ([rows * H / TC, TC]).
    return ((r // TR) * (H // TC) + col // TC) * TR


@gluon.jit
def _prefetch_tile(ptr):
    # A [64, 256] bf16 tile (32 KB, contiguous when tile-major) into L2, no wait.
    return gl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], 32768; mov.u32 $0, 0;", "=r,l", [ptr], dtype=gl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _mma_xloader(x_desc, done_ptr, ts_ptr, y_ptr, ep_ptr, xring, xready, empty, G, H: gl.constexpr,
                 FF: gl.constexpr, YMAX: gl.constexpr,
                 L: gl.constexpr, NBUF: gl.constexpr, DEP: gl.constexpr, XSRC: gl.constexpr,
                 FIN: gl.constexpr):  # fmt: skip
    # One warp: the activation slices (XSRC=0). DEP=1: a matrix's first slice waits until every CTA has
    # finished the matrix before it (done counters), as a matrix's input is its predecessor's output.
    NTOK: gl.constexpr = x_desc.block_type.shape[0]
    TC: gl.constexpr = x_desc.block_type.shape[1]
    TR: gl.constexpr = 64
    NCT: gl.constexpr = H // TC
    DBT: gl.constexpr = (((FF + H - 1) // H) * H) // TC
    RPL: gl.constexpr = 4 * H + 2 * FF + DBT * TC
    lo0, lo1, lo2, lo3, _, _, _, _, e1, e2, e3, P = _mma_walk_setup(G, H, FF, TR, TC)
    seen = 0  # DEP=2, 6, 7, 10: the chunks of this matrix's input already seen complete, a bit each
    for i in range(L * P * (1 - XSRC)):
        slot = i % NBUF
        mbarrier.wait(empty.index(slot), ((i // NBUF) & 1) ^ 1)
        layer, seg, s, _, b, _, _, _, kcol = _mtile(
            i, P, e1, e2, e3, lo0, lo1, lo2, lo3, H, RPL, NCT, DBT, TR, TC
        )
        m = layer * 4 + seg
        if (DEP == 2) | (DEP == 6) | (DEP == 7) | (DEP == 10):  # per input chunk, each waited for once
            seen = gl.where(s == 0, 0, seen)
            hop = (m > 0) & ((DEP != 7) | (seg == 0) | (seg == 2))  # 7: only qkv and gate_up wait
            if hop & (((seen >> b) & 1) == 0):
                if DEP == 2:
                    _chunk_wait(done_ptr + _chunk_base(L, FF) + (m - 1) * (2 * FF // TR), seg, b, NCT, DBT,
                                FF // TC, TC // TR)  # fmt: skip
                else:
                    _words_wait(y_ptr, gl.load(ep_ptr), m - 1, seg, b, G, H, FF, YMAX, NTOK,
                                1 if DEP == 10 else NTOK, TR, TC, NCT, DBT)  # fmt: skip
                seen = seen | (1 << b)
        if (DEP == 1) | (DEP == 5) | (DEP == 8):  # noqa: SIM102 (a constexpr branch)
            if (s == 0) & (m > 0):
                if FIN == 1:  # the last finisher's flag: the next input is written
                    while gl.atomic_add(done_ptr + L * 4 + m - 1, 0, sem="acquire") == 0:
                        pass
                elif FIN >= 2:  # every row group of the matrix before is finished
                    sp = (seg + 3) % 4
                    groups = gl.where(sp == 0, 3 * H, gl.where(sp == 2, 2 * FF, H)) // 64
                    while gl.atomic_add(done_ptr + m - 1, 0, sem="acquire") < groups:
                        pass
                else:
                    while gl.atomic_add(done_ptr + m - 1, 0, sem="acquire") < G:
                        pass
        if DEP == 3:  # noqa: SIM102 (timing only: a matrix waits for the one two before, hiding the hop)
            if (s == 0) & (m > 1):
                while gl.atomic_add(done_ptr + m - 2, 0, sem="acquire") < G:
                    pass
        if (DEP == 4) | (DEP == 9):  # noqa: SIM102 (timing only: two hops a layer, at qkv and gate_up,
            # as a loop whose attention and down read what the same CTAs produced would have)
            if (s == 0) & (m > 0) & ((seg == 0) | (seg == 2)):
                while gl.atomic_add(done_ptr + m - 1, 0, sem="acquire") < G:
                    pass
        if s == 0:  # when the first activation slice of matrix m is asked for
            gl.store(ts_ptr + (m * G + gl.program_id(0)) * 4 + 2, global_timer())
        mbarrier.expect(xready.index(slot), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [m * NTOK, kcol], xready.index(slot), xring.index(slot))


@gluon.jit
def _words_wait(y_ptr, epoch, mp, seg, b, G, H: gl.constexpr, FF: gl.constexpr, YMAX: gl.constexpr,
                NTOK: gl.constexpr, WT: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr, NCT: gl.constexpr,
                DBT: gl.constexpr):  # fmt: skip
    # DEP=6, 4 warps: wait until output rows [b*TC, (b+1)*TC) of matrix mp (its first WT tokens) hold every
    # CTA's sum: each word counts its adds in its low 16 bits, so the data is its own flag (no fence, no
    # counter). A row's adds: one per CTA whose range overlaps its group's tiles, each walk (epoch: walks so
    # far). WT=1 (DEP=10) reads what a one-token loop would.
    WL: gl.constexpr = gl.BlockedLayout([TC // 128, WT], [32, 1], [4, 1], [1, 0])
    rows = b * TC + gl.arange(0, TC, layout=gl.SliceLayout(1, WL))
    toks = gl.arange(0, WT, layout=gl.SliceLayout(0, WL))
    sp = (seg + 3) % 4  # the kind of matrix mp
    bpg = gl.where(sp == 3, DBT, NCT)
    total = gl.where(sp == 0, 3 * H, gl.where(sp == 2, 2 * FF, H)) // TR * bpg
    t0 = (rows // TR) * bpg
    need = ((((t0 + bpg) * G - 1) // total) - (((t0 + 1) * G - 1) // total) + 1) * epoch
    ptrs = y_ptr + ((mp * YMAX + rows) * NTOK)[:, None] + toks[None, :]
    short = 1
    while short > 0:
        counts = (gl.load(ptrs, volatile=True) & 65535).to(gl.int32)
        short = gl.sum(gl.sum((counts < need[:, None]).to(gl.int32), axis=1), axis=0)


@gluon.jit
def _chunk_base(L: gl.constexpr, FF: gl.constexpr):
    # DEP=2: where the chunk counters start in done_ptr (after the matrix counters, flags, group counters).
    return 2 * L * 4 + L * 4 * (2 * FF // 64)


@gluon.jit
def _poll(ptr, need):
    while gl.atomic_add(ptr, 0, sem="acquire") < need:
        pass


@gluon.jit
def _chunk_wait(cnt, seg, b, NCT: gl.constexpr, DBT: gl.constexpr, FFC: gl.constexpr, GPC: gl.constexpr):
    # DEP=2: wait until the input chunk b of a matrix of kind seg is complete, i.e. the output chunks it is
    # made from, of the matrix before (cnt: that matrix's counters of tiles done per TC-row chunk), as in a
    # loop with the norms folded into the matmuls: qkv's chunk b is down's b (plus scalars); o's is the
    # attention of head pair b, from q, k and v chunks b; gate_up's is o's b; down's is gate and up's b.
    if seg == 0:
        _poll(cnt + b, GPC * DBT)
    elif seg == 1:
        _poll(cnt + b, GPC * NCT)
        _poll(cnt + NCT + b, GPC * NCT)
        _poll(cnt + 2 * NCT + b, GPC * NCT)
    elif seg == 2:
        _poll(cnt + b, GPC * NCT)
    elif b < FFC:
        _poll(cnt + b, GPC * NCT)
        _poll(cnt + FFC + b, GPC * NCT)


@gluon.jit
def _build_act(act, m, seg, src_ptr, normw_ptr, down_ptr, H: gl.constexpr, XMAX: gl.constexpr,
               NTOK: gl.constexpr, TC: gl.constexpr):  # fmt: skip
    # XSRC=1: this CTA writes matrix m's whole activation into shared memory itself, as a fused loop
    # would: RMSNorm(src[m]) * normw for q/o/up (fp32 [NTOK, H] in L2), down's bf16 [NTOK, XMAX] as is.
    CH: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, NTOK, layout=gl.SliceLayout(1, CH))
    cols = gl.arange(0, TC, layout=gl.SliceLayout(0, CH))
    if seg == 3:
        for k in gl.static_range(XMAX // TC):
            act.index(k).store(
                gl.load(down_ptr + (m // 4) * NTOK * XMAX + rows[:, None] * XMAX + k * TC + cols[None, :])
            )
    else:
        base = src_ptr + m * NTOK * H + rows[:, None] * H + cols[None, :]
        ss = gl.zeros([NTOK], gl.float32, gl.SliceLayout(1, CH))
        for k in gl.static_range(H // TC):
            v = gl.load(base + k * TC)
            ss += gl.sum(v * v, axis=1)
        inv = gl.rsqrt(ss / H + 1e-6)
        for k in gl.static_range(H // TC):
            wk = gl.load(normw_ptr + k * TC + cols).to(gl.float32)
            act.index(k).store((gl.load(base + k * TC) * inv[:, None] * wk[None, :]).to(gl.bfloat16))


@gluon.jit
def _finalize(y_ptr, fin_ptr, normw_ptr, m, H: gl.constexpr, YMAX: gl.constexpr, NTOK: gl.constexpr,
              TC: gl.constexpr):  # fmt: skip
    # FIN=1: the last CTA to finish matrix m turns its output into the next input, once, for everyone:
    # bf16(RMSNorm(y[m][:H]) * normw) into fin[m] (scratch: the timed walk's inputs stay as they were).
    CH: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, NTOK, layout=gl.SliceLayout(1, CH))
    cols = gl.arange(0, TC, layout=gl.SliceLayout(0, CH))
    src = y_ptr + m * YMAX * NTOK + cols[None, :] * NTOK + rows[:, None]
    ss = gl.zeros([NTOK], gl.float32, gl.SliceLayout(1, CH))
    for k in gl.static_range(H // TC):
        v = gl.load(src + k * TC * NTOK, cache_modifier=".cg")
        ss += gl.sum(v * v, axis=1)
    inv = gl.rsqrt(ss / H + 1e-6)
    dst = fin_ptr + m * NTOK * H + rows[:, None] * H + cols[None, :]
    for k in gl.static_range(H // TC):
        wk = gl.load(normw_ptr + k * TC + cols).to(gl.float32)
        v = gl.load(src + k * TC * NTOK, cache_modifier=".cg")
        gl.store(dst + k * TC, (v * inv[:, None] * wk[None, :]).to(gl.bfloat16))


@gluon.jit
def _group_finish(y_ptr, ss_ptr, xn_ptr, m, g, YMAX: gl.constexpr, NTOK: gl.constexpr, TR: gl.constexpr,
                  GL: gl.constexpr):  # fmt: skip
    # FIN=2, 3: the CTA whose tiles complete row group g of matrix m reads the group's final sums back, adds
    # their squares to per-token totals and writes them as bf16 (scratch), as a fused loop's residual step.
    r = gl.arange(0, TR, layout=gl.SliceLayout(1, GL))
    n = gl.arange(0, NTOK, layout=gl.SliceLayout(0, GL))
    v = gl.load(y_ptr + ((m * YMAX + g * TR + r[:, None]) * NTOK + n[None, :]), cache_modifier=".cg")
    gl.atomic_add(ss_ptr + m * NTOK + n, gl.sum(v * v, axis=0), sem="relaxed")
    gl.store(xn_ptr + (m * NTOK + n[None, :]) * YMAX + g * TR + r[:, None], v.to(gl.bfloat16))


@gluon.jit
def _push(q, qfull, qempty, qi, m, g, tiles, bpg, QN: gl.constexpr):
    # One entry into the finisher warp's queue (a ring of QN slots in shared memory); returns the new count.
    slot = qi % QN
    mbarrier.wait(qempty.index(slot), ((qi // QN) & 1) ^ 1)
    QL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    k = gl.arange(0, 4, layout=QL)
    q.index(slot).store(gl.where(k == 0, m, gl.where(k == 1, g, gl.where(k == 2, tiles, bpg))))
    gl.thread_barrier()
    mbarrier.arrive(qfull.index(slot), count=1)
    return qi + 1


@gluon.jit
def _mma_finisher(y_ptr, done_ptr, ss_ptr, xn_ptr, q, qfull, qempty, FF: gl.constexpr, L: gl.constexpr,
                  YMAX: gl.constexpr, NTOK: gl.constexpr, QN: gl.constexpr, FIN: gl.constexpr):  # fmt: skip
    # FIN=3, one warp: counts each flushed group's tiles and finishes the groups it completes, so the
    # consumer warps go straight on to their next tile.
    TR: gl.constexpr = 64
    GMAX: gl.constexpr = 2 * FF // TR
    QL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    GL1: gl.constexpr = gl.BlockedLayout([4, 4], [16, 2], [1, 1], [0, 1])
    k = gl.arange(0, 4, layout=QL)
    if FIN == 3:  # only FIN=3 has a queue to drain
        qi = 0
        m = 0
        while m >= 0:
            slot = qi % QN
            mbarrier.wait(qfull.index(slot), (qi // QN) & 1)
            e = q.index(slot).load(QL)
            mbarrier.arrive(qempty.index(slot), count=1)
            qi += 1
            m = gl.sum(gl.where(k == 0, e, 0), axis=0)
            g = gl.sum(gl.where(k == 1, e, 0), axis=0)
            tiles = gl.sum(gl.where(k == 2, e, 0), axis=0)
            bpg = gl.sum(gl.where(k == 3, e, 0), axis=0)
            if m >= 0:  # noqa: SIM102 (a scalar tensor, not a Python bool)
                if gl.atomic_add(done_ptr + 2 * L * 4 + m * GMAX + g, tiles, sem="acq_rel") + tiles == bpg:
                    _group_finish(y_ptr, ss_ptr, xn_ptr, m, g, YMAX, NTOK, TR, GL1)
                    gl.atomic_add(done_ptr + m, 1, sem="release")


@gluon.jit
def _mma_consumer(y_ptr, done_ptr, src_ptr, normw_ptr, down_ptr, fin_ptr, ss_ptr, ts_ptr, ring, xring, act,
                  wready, xready, empty, q, qfull, qempty, QN: gl.constexpr, G, H: gl.constexpr,
                  FF: gl.constexpr, L: gl.constexpr, YMAX: gl.constexpr, XMAX: gl.constexpr,
                  NBUF: gl.constexpr, NTOK: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr,
                  DEP: gl.constexpr, XSRC: gl.constexpr, FIN: gl.constexpr):  # fmt: skip
    # 4 warps (one warpgroup): one wgmma per slot, [TR, TC] x [TC, NTOK], straight from shared memory;
    # a group's sum is added into y when its last tile in this CTA's range is done (ranges split groups);
    # after its range of a matrix, the CTA counts itself done with it.
    NCT: gl.constexpr = H // TC
    DBT: gl.constexpr = (((FF + H - 1) // H) * H) // TC
    RPL: gl.constexpr = 4 * H + 2 * FF + DBT * TC
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NTOK, 16]
    )
    GMAX: gl.constexpr = 2 * FF // TR  # group counters a matrix (FIN=2)
    WORDS: gl.constexpr = (DEP == 6) | (DEP == 7) | (DEP == 10)  # outputs as words that count their adds
    lo0, lo1, lo2, lo3, n0, n1, n2, n3, e1, e2, e3, P = _mma_walk_setup(G, H, FF, TR, TC)
    offs_r = gl.arange(0, TR, layout=gl.SliceLayout(1, ACC))
    offs_n = gl.arange(0, NTOK, layout=gl.SliceLayout(0, ACC))
    acc = gl.zeros([TR, NTOK], gl.float32, ACC)
    b0 = 0  # the first tile of the group being summed
    qi = 0  # entries pushed to the finisher warp (FIN=3)
    for i in range(L * P):
        slot = i % NBUF
        tile = _mtile(i, P, e1, e2, e3, lo0, lo1, lo2, lo3, H, RPL, NCT, DBT, TR, TC)
        layer, seg, s, g, b, bpg, _, _, _ = tile
        n = gl.where(seg == 0, n0, gl.where(seg == 1, n1, gl.where(seg == 2, n2, n3)))
        m = layer * 4 + seg
        b0 = gl.where((b == 0) | (s == 0), b, b0)
        if XSRC:
            if s == 0:
                if DEP == 1:  # noqa: SIM102 (a constexpr branch)
                    if m > 0:
                        while gl.atomic_add(done_ptr + m - 1, 0, sem="acquire") < G:
                            pass
                gl.thread_barrier()  # every warp's last wgmma has read the old activation
                _build_act(act, m, seg, src_ptr, normw_ptr, down_ptr, H, XMAX, NTOK, TC)
                fence_async_shared()
                gl.thread_barrier()
            xt = act.index(b).permute((1, 0))  # [TC, NTOK], K-major
        else:
            mbarrier.wait(xready.index(slot), (i // NBUF) & 1)
            xt = xring.index(slot).permute((1, 0))
        mbarrier.wait(wready.index(slot), (i // NBUF) & 1)
        if s == 0:  # when this CTA's first tile of matrix m is ready to multiply
            gl.store(ts_ptr + (m * G + gl.program_id(0)) * 4, global_timer())
        acc = warpgroup_mma(ring.index(slot), xt, acc, use_acc=(b > 0) & (s > 0), is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(slot), count=1)
        if (b == bpg - 1) | (s == n - 1):
            rows = m * YMAX + g * TR + offs_r
            if WORDS:  # fixed point (2**-28) above a count of the adds in the low 16 bits
                word = (acc * 268435456.0).to(gl.int64) * 65536 + 1
                gl.atomic_add(y_ptr + rows[:, None] * NTOK + offs_n[None, :], word, sem="relaxed")
            else:
                gl.atomic_add(y_ptr + rows[:, None] * NTOK + offs_n[None, :], acc, sem="relaxed")
            if DEP == 2:  # count this CTA's tiles of the group into its TC-row chunk, after the adds
                gl.thread_barrier()
                cnt = done_ptr + _chunk_base(L, FF) + m * GMAX + (g * TR) // TC
                gl.atomic_add(cnt, b - b0 + 1, sem="release")
            if FIN == 2:  # count the group's tiles; whoever completes it finishes it
                gl.thread_barrier()
                gcnt = done_ptr + 2 * L * 4 + m * GMAX + g
                if gl.atomic_add(gcnt, b - b0 + 1, sem="acq_rel") + b - b0 + 1 == bpg:
                    GL4: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [4, 1], [0, 1])
                    _group_finish(y_ptr, ss_ptr, fin_ptr, m, g, YMAX, NTOK, TR, GL4)
                    gl.thread_barrier()
                    gl.atomic_add(done_ptr + m, 1, sem="release")
            if FIN == 3:  # hand (m, g, tiles, bpg) to the finisher warp and go on
                qi = _push(q, qfull, qempty, qi, m, g, b - b0 + 1, bpg, QN)
        if s == n - 1:  # when its last tile's sums are added
            gl.store(ts_ptr + (m * G + gl.program_id(0)) * 4 + 1, global_timer())
        releases = (DEP < 6) | (DEP == 8) | ((DEP == 9) & ((seg == 1) | (seg == 3)))  # 9: only o and down
        if (s == n - 1) & (FIN < 2) & releases:
            if (DEP == 8) | (DEP == 9):
                fence_gpu()
            gl.thread_barrier()  # every warp's adds are issued before the release below
            if FIN == 1:
                if gl.atomic_add(done_ptr + m, 1, sem="acq_rel") == G - 1:
                    _finalize(y_ptr, fin_ptr, normw_ptr, m, H, YMAX, NTOK, TC)
                    gl.thread_barrier()
                    gl.atomic_xchg(done_ptr + L * 4 + m, 1, sem="release")
            else:
                if (DEP == 5) | (DEP == 8) | (DEP == 9):  # 5, timing only: no fence, so the adds may land
                    # after the count; 8, 9: every thread fenced its own adds before the barrier above
                    gl.atomic_add(done_ptr + m, 1, sem="relaxed")
                else:
                    gl.atomic_add(done_ptr + m, 1, sem="release")
                gl.store(ts_ptr + (m * G + gl.program_id(0)) * 4 + 3, global_timer())  # its release has left
    if FIN == 3:
        _push(q, qfull, qempty, qi, -1, 0, 0, 0, QN)  # the finisher warp's stop


@gluon.jit
def _mma_kernel(w_desc, w_ptr, x_desc, y_ptr, done_ptr, src_ptr, normw_ptr, down_ptr, fin_ptr, ss_ptr, ts_ptr,
                ep_ptr, G, H: gl.constexpr, FF: gl.constexpr, L: gl.constexpr, YMAX: gl.constexpr,
                XMAX: gl.constexpr, NBUF: gl.constexpr, DEP: gl.constexpr, XSRC: gl.constexpr,
                FIN: gl.constexpr, TM: gl.constexpr, PF: gl.constexpr, INFLIGHT: gl.constexpr,
                XW: gl.constexpr, XREGS: gl.constexpr):  # fmt: skip
    # The walk on tensor cores, balanced: every CTA streams the same number of tiles of every matrix.
    # done_ptr: int32 zeros, L * 4 counters, L * 4 flags (FIN=1), L * 4 * 2FF/64 group counters (FIN=2).
    # XSRC=0: activations by TMA, per tile, from x_desc; 1: built by the CTA in shared memory at each
    # matrix's start (_build_act).
    TR: gl.constexpr = w_desc.block_type.shape[0]
    TC: gl.constexpr = w_desc.block_type.shape[1]
    NTOK: gl.constexpr = x_desc.block_type.shape[0]
    ring = gl.allocate_shared_memory(w_desc.dtype, [NBUF, TR, TC], w_desc.layout)
    xring = gl.allocate_shared_memory(x_desc.dtype, [NBUF * (1 - XSRC) + XSRC, NTOK, TC], x_desc.layout)
    act = gl.allocate_shared_memory(x_desc.dtype, [(XMAX // TC) * XSRC + (1 - XSRC), NTOK, TC], x_desc.layout)
    wready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    xready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    QN: gl.constexpr = 16
    q = gl.allocate_shared_memory(gl.int32, [QN, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    qfull = gl.allocate_shared_memory(gl.int64, [QN, 1], mbarrier.MBarrierLayout())
    qempty = gl.allocate_shared_memory(gl.int64, [QN, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(NBUF):
        mbarrier.init(wready.index(k), count=1)
        mbarrier.init(xready.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    for k in gl.static_range(QN):
        mbarrier.init(qfull.index(k), count=1)
        mbarrier.init(qempty.index(k), count=1)
    gl.warp_specialize([
        (_mma_consumer, (y_ptr, done_ptr, src_ptr, normw_ptr, down_ptr, fin_ptr, ss_ptr, ts_ptr, ring, xring,
                         act, wready, xready, empty, q, qfull, qempty, QN, G, H, FF, L, YMAX, XMAX, NBUF,
                         NTOK, TR, TC, DEP, XSRC, FIN)),
        (_mma_wloader, (w_desc, w_ptr, ring, wready, empty, G, H, FF, L, NBUF, TM, PF, INFLIGHT)),
        (_mma_xloader, (x_desc, done_ptr, ts_ptr, y_ptr, ep_ptr, xring, xready, empty, G, H, FF, YMAX, L,
                        NBUF, DEP, XSRC, FIN)),
        (_mma_finisher, (y_ptr, done_ptr, ss_ptr, fin_ptr, q, qfull, qempty, FF, L, YMAX, NTOK, QN, FIN)),
    ], [1, XW, 1], [40, XREGS, 56])  # fmt: skip


def packed_rows(h: int, ff: int) -> tuple[int, int]:
    """Rows a layer takes in the packed layout, and the down chunks (dataflow.pack_weights)."""
    chunks = -(-ff // h)
    return 4 * h + 2 * ff + chunks * h, chunks


def reference(w: torch.Tensor, x: torch.Tensor, h: int, ff: int, layers: int) -> torch.Tensor:
    """y [L, 4, YMAX] fp32 by torch: each matrix's rows times its activation (down summed over chunks)."""
    rpl, chunks = packed_rows(h, ff)
    y = torch.zeros(layers, 4, max(3 * h, 2 * ff), device=w.device)
    for layer in range(layers):
        lw = w[layer * rpl : (layer + 1) * rpl].float()
        parts = (lw[: 3 * h], lw[3 * h : 4 * h], lw[4 * h : 4 * h + 2 * ff])
        for seg, part in enumerate(parts):
            y[layer, seg, : part.shape[0]] = part @ x[layer, seg, :h].float()
        down = lw[4 * h + 2 * ff :].view(chunks, h, h)
        xd = x[layer, 3, : chunks * h].float().view(chunks, h)
        y[layer, 3, :h] = torch.einsum("crk,ck->r", down, xd)
    return y


def timeline(ts: torch.Tensor) -> dict:
    """Medians over a walk's matrices (us) from each CTA's start, end, first activation request and release
    of each (ts [M, CTAs, 4], ns; the release stamped once its counter's add has left, after the fence):
    how far apart the CTAs finish a matrix, how long each waits between its end of one and its start of
    the next, how long a release takes, when the first activation slices are asked for (after the wait,
    when dependent) and arrive, and how long a matrix takes from the last end before it to its last end."""
    t = (ts - ts[0, :, 0].min()).double() / 1e3
    start, end, ask, released = t[..., 0], t[..., 1], t[..., 2], t[..., 3]
    last = end.max(1).values
    rel = ts[..., 3].all(1)  # the matrices whose done counter every CTA released (DEP 9: o and down)
    out = {
        "end_spread": round(float((last - end.min(1).values).median()), 3),
        "end_spread_p90": round(float((last - end.quantile(0.1, dim=1)).median()), 3),
        "gap_median": round(float((start[1:] - end[:-1]).median()), 3),
        "gap_after_last_end": round(float((start[1:].max(1).values - last[:-1]).median()), 3),
        "first_start_after_last_end": round(float((start[1:].min(1).values - last[:-1]).median()), 3),
        "first_ask_after_last_end": round(float((ask[1:].min(1).values - last[:-1]).median()), 3),
        "released_after_end": round(float((released - end)[rel].median()), 3),
        "first_ask_after_last_release": round(
            float((ask[1:].min(1).values - released[:-1].max(1).values)[rel[:-1]].median()), 3
        ),
        "start_after_ask": round(float((start - ask).median()), 3),
        "matrix": [round(float((last[1:] - last[:-1])[k::4].median()), 3) for k in range(4)],
        "timer_step_ns": int((ts[..., :3].flatten().unique().diff()).min()),
    }
    if not rel[:-1].any():  # nothing released (DEP 6, 7: no counters)
        del out["released_after_end"], out["first_ask_after_last_release"]
    return out


def contributors(h: int, ff: int, cols: int, ctas: int, ymax: int) -> torch.Tensor:
    """[4, ymax] int64: how many CTAs add into each output row of each matrix kind in the balanced walk
    (one per CTA whose contiguous range of tiles overlaps the row's group); 0 past a matrix's rows. Every
    matrix must have at least a tile per CTA (no empty ranges), as _words_wait assumes too."""
    out = torch.zeros(4, ymax, dtype=torch.int64)
    nct = h // cols
    for kind, (rows, bpg) in enumerate([(3 * h, nct), (h, nct), (2 * ff, nct), (h, -(-ff // h) * h // cols)]):
        total = rows // 64 * bpg
        assert total >= ctas, "a CTA without tiles of a matrix"
        t0 = torch.arange(rows // 64) * bpg
        owners = ((t0 + bpg) * ctas - 1) // total - ((t0 + 1) * ctas - 1) // total + 1
        out[kind, :rows] = owners.repeat_interleave(64)
    return out


def mma_walk(
    w, h, ff, layers, cols, nbuf, ctas_per_sm, dep, xsrc, fin, tm, pf, inflight, ntok, replays
) -> dict:
    """Time the balanced tensor-core walk over w for ntok activation rows; check it against torch."""
    rpl, chunks = packed_rows(h, ff)
    xmax, ymax = chunks * h, max(3 * h, 2 * ff)
    x = torch.zeros(layers, 4, ntok, xmax, device="cuda", dtype=torch.bfloat16)
    x[:, :3, :, :h] = torch.randn(layers, 3, ntok, h, device="cuda").to(torch.bfloat16)
    x[:, 3, :, :ff] = torch.randn(layers, ntok, ff, device="cuda").to(torch.bfloat16)
    src = torch.randn(layers, 4, ntok, h, device="cuda")  # xsrc: q/o/up activations are RMSNorm(src) * normw
    normw = (1 + 0.1 * torch.randn(h, device="cuda")).to(torch.bfloat16)
    if xsrc:
        normed = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + 1e-6) * normw.float()
        x[:, :3, :, :h] = normed[:, :3].to(torch.bfloat16)
    expect = torch.stack([reference(w, x[:, :, n], h, ff, layers) for n in range(ntok)], dim=-1)
    down = x[:, 3].contiguous()  # [L, NTOK, XMAX] bf16
    wblock, xblock = [64, cols], [ntok, cols]
    if tm:  # tile-major: tile (row group R, column chunk c) at rows (R * H / cols + c) * 64
        w = w.view(-1, 64, h // cols, cols).transpose(1, 2).contiguous().view(-1, cols)
    w_desc = TensorDescriptor.from_tensor(
        w, wblock, gl.NVMMASharedLayout.get_default_for(wblock, gl.bfloat16)
    )
    x2 = x.view(layers * 4 * ntok, xmax)
    x_desc = TensorDescriptor.from_tensor(
        x2, xblock, gl.NVMMASharedLayout.get_default_for(xblock, gl.bfloat16)
    )
    ctas = torch.cuda.get_device_properties(0).multi_processor_count * ctas_per_sm
    words = dep in (6, 7, 10)  # outputs as int64 words that count their adds
    inflight = inflight or nbuf  # 0: every slot's tile may be in flight
    y = torch.zeros(layers, 4, ymax, ntok, device="cuda", dtype=torch.int64 if words else torch.float32)
    epoch = torch.zeros(1, device="cuda", dtype=torch.int32)  # DEP=6: walks so far (words keep adding)
    assert dep < 2 or (xsrc == 0 and fin == 0), "DEP >= 2: activations by TMA, no finisher"
    assert pf == 0 or (tm and cols == 256), "the L2 prefetch takes a contiguous 32 KB tile"
    assert dep != 2 or (ff % cols == 0 and ((ff + h - 1) // h) * h // cols < 32), "DEP=2: a 32-bit chunk mask"
    done = torch.zeros(layers * 4 * (2 + 4 * ff // 64), device="cuda", dtype=torch.int32)
    fin_out = torch.zeros(layers * 4, ntok, ymax, device="cuda", dtype=torch.bfloat16)
    ss = torch.zeros(layers * 4, ntok, device="cuda")
    ts = torch.zeros(layers * 4, ctas, 4, device="cuda", dtype=torch.int64)  # the timeline's stamps (ns)

    def walk():
        done.zero_()
        epoch.add_(1)
        _mma_kernel[(ctas,)](w_desc, w, x_desc, y, done, src, normw, down, fin_out, ss, ts, epoch, ctas, H=h,
                             FF=ff, L=layers, YMAX=ymax, XMAX=xmax, NBUF=nbuf, DEP=dep, XSRC=xsrc, FIN=fin,
                             TM=tm, PF=pf, INFLIGHT=inflight, XW=4 if words else 1,
                             XREGS=128 if words else 40, num_warps=4, maxnreg=128)  # fmt: skip

    walk()
    torch.cuda.synchronize()
    extra = {}
    sums = y  # the outputs; DEP 6, 7: decoded from the words, each of which must count one add per CTA
    if words:  # whose range overlaps its group (y itself stays the kernel's int64 buffer)
        adds = contributors(h, ff, cols, ctas, ymax).to(y.device).view(1, 4, ymax, 1)
        extra["count_errors"] = int(((y & 65535) != adds).sum())
        sums = (y >> 16).double() / 2**28
    err = float((sums[..., : expect.shape[2], :] - expect).abs().max())
    if fin >= 2:  # the finishers' sums of squares and bf16 copies of every matrix's outputs
        want = expect.pow(2).sum(2).view(layers * 4, ntok)
        extra["ss_rel_err"] = float(((ss - want).abs() / want).max())
        copies = fin_out.view(layers, 4, ntok, ymax).permute(0, 1, 3, 2).float()
        rows = torch.tensor([3 * h, h, 2 * ff, h], device="cuda").view(1, 4, 1, 1)
        written = torch.arange(ymax, device="cuda").view(1, 1, ymax, 1) < rows
        extra["copy_max_err"] = float(((copies - expect).abs() * written).max())
    ms = replay_ms(capture(walk), replays)  # y keeps adding: only the first run is checked
    extra["timeline_us"] = timeline(ts)
    return {
        "kernel": "mma",
        "tile": wblock,
        "buffers": nbuf,
        "ctas": ctas,
        "tokens": ntok,
        "dependent": DEPENDENCIES[dep],
        "x_built_in_smem": bool(xsrc),
        "finisher": ["none", "last CTA of a matrix", "CTA completing each row group", "a finisher warp"][fin],
        "tile_major": bool(tm),
        "l2_prefetch_tiles_ahead": pf,
        "in_flight": inflight,
        "ms": round(ms, 4),
        "tb_s": round(w.numel() * 2 / ms / 1e9, 3),
        "max_err": err,
        "max_ref": float(expect.abs().max()),
        **extra,
    }


DEPENDENCIES = [
    "no",
    "on the matrix before",
    "each input chunk on its chunks",
    "on the matrix two before",
    "qkv and gate_up on the matrix before",
    "on the matrix before, released without a fence",
    "each input chunk on its output words' counts",
    "qkv and gate_up chunks on their output words' counts",
    "on the matrix before, every thread fenced",
    "qkv and gate_up on the matrix before, o and down released with every thread fenced",
    "each input chunk on its output words' counts, token 0's only",
]


def _spec(spec: str) -> list[int]:
    """A --mma spec as ints: the fields left out are 0 (INFLIGHT 0 means NBUF)."""
    values = [int(v) for v in spec.split(":")]
    return values + [0] * (9 - len(values))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--buffers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--refill", type=int, nargs="+", default=[1, 2, 4], help="tiles refilled a CTA barrier")
    ap.add_argument("--ctas-per-sm", type=int, default=2)
    ap.add_argument(
        "--kernels", nargs="*", default=[], choices=["ring", "ws"], help="CUDA-core walks to run too"
    )
    ap.add_argument("--loader-regs", type=int, default=40)
    ap.add_argument("--mma", nargs="*", default=["256:4:1:0:0:0", "256:4:1:1:0:0"],
                    help="tensor-core walks: columns:buffers:CTAs/SM:dependent:x built:finisher")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=8, help="activation rows of the tensor-core walk")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    h, ff, layers = args.hidden, args.intermediate, args.layers
    rpl, chunks = packed_rows(h, ff)
    w = (torch.randn(layers * rpl, h, device="cuda") * 0.02).to(torch.bfloat16)
    xmax = TILE_COLS * triton.next_power_of_2(chunks * h // TILE_COLS)  # a power of two of chunks
    ymax = max(3 * h, 2 * ff)
    x = torch.zeros(layers, 4, xmax, device="cuda", dtype=torch.bfloat16)
    x[:, :3, :h] = torch.randn(layers, 3, h, device="cuda").to(torch.bfloat16)
    x[:, 3, :ff] = torch.randn(layers, ff, device="cuda").to(torch.bfloat16)
    expect = reference(w, x, h, ff, layers)
    block = [TILE_ROWS, TILE_COLS]
    desc = TensorDescriptor.from_tensor(w, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    streamers = torch.cuda.get_device_properties(0).multi_processor_count * args.ctas_per_sm
    y = torch.zeros(layers, 4, ymax, device="cuda")
    x2 = x.view(layers * 4, xmax)
    xblock = [1, TILE_COLS]
    x_layout = gl.NVMMASharedLayout.get_default_for(xblock, gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x2, xblock, x_layout)
    sets = []
    if "ring" in args.kernels:
        pairs = [(n, r) for n in args.buffers for r in args.refill if n % r == 0 and r < n]
        sets += [("ring", n, r, xs) for n, r in pairs for xs in (True, False)]
    if "ws" in args.kernels:
        sets += [("ws", n, 0, xt) for n in args.buffers for xt in (True, False)]
    for kind, nbuf, refill, xsmem in sets:

        def walk(kind=kind, nbuf=nbuf, refill=refill, xsmem=xsmem):
            if kind == "ring":
                _walk_kernel[(streamers,)](desc, x, y, streamers, H=h, FF=ff, L=layers, XMAX=xmax, YMAX=ymax,
                                           NBUF=nbuf, REFILL=refill, XSMEM=xsmem, num_warps=4)  # fmt: skip
            else:
                _ws_kernel[(streamers,)](desc, x_desc, x, y, streamers, H=h, FF=ff, L=layers, XMAX=xmax,
                                         YMAX=ymax, NBUF=nbuf, XTMA=xsmem, LOADER_REGS=args.loader_regs,
                                         num_warps=4, maxnreg=128)  # fmt: skip

        y.zero_()
        walk()
        torch.cuda.synchronize()
        err = float((y - expect).abs().max())
        ms = replay_ms(capture(walk), args.replays)
        row = {"kernel": kind, "buffers": nbuf, "refill": refill, "x_in_smem": xsmem, "streamers": streamers,
               "ms": round(ms, 4), "tb_s": round(w.numel() * 2 / ms / 1e9, 3), "max_err": err,
               "max_ref": float(expect.abs().max())}  # fmt: skip
        print(json.dumps(row), flush=True)
    for spec in args.mma:
        print(
            json.dumps(mma_walk(w, h, ff, layers, *_spec(spec), args.tokens, args.replays)),
            flush=True,
        )


if __name__ == "__main__":
    main()
