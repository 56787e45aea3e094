"""How fast can the H200 stream one Ouro-1.4B layer's weights? A bound for a persistent decode loop.

A layer's matmuls read 102.8 MB (qkv 25.2, o_proj 8.4, gate_up 46.1, down 23.1). This
streams buffers of those sizes and reports TB/s:
  separate  one launch per matrix (four launches per layer, captured in a CUDA graph),
            as the launch-per-kernel loop does, but with no arithmetic;
  resident  one launch for all layers: a grid that stays resident, each CTA streaming a
            contiguous share of every matrix, with a grid barrier between matrices
            (thread 0 polls an arrival counter), as a persistent loop would;
  continuous the resident launch without the barriers: a CTA done with its share of one
            matrix starts on its share of the next, the bound for a dataflow-style
            persistent loop whose weight loads never wait on dependencies;
  prefetch  the resident launch, but at each barrier every CTA first issues plain loads of the first
            PREF blocks of its share of the next matrix (held in registers), so HBM has them in flight
            while it waits: does that hide the barrier? prefetch_split issues them after the CTA's
            arrival, before its poll: the arrival's release fence could wait for loads issued before it.
            Settings whose CTAs cannot all be resident at once (registers) are skipped: they would hang.
Each CTA sums what it reads (fp32) so no load is optimised away. With --tma all modes
also run on tensor-memory-accelerator (TMA) block loads through tensor descriptors, which
Triton pipelines as bulk asynchronous copies (Hopper), instead of per-thread pointer loads.
--continuous-only runs just the continuous mode, on pointer and TMA loads; --prefetch-only just the
prefetch modes (pointer loads only: a TMA load is waited on right after issue, before the barrier).
Prints one JSON line per setting.
Usage: python3 bench/gpu/stream_bench.py [--layers 24] [--tma | --tma-only] [--continuous-only]
       [--prefetch-only] [--tma-rows 32 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import capture, replay_ms  # noqa: E402

SIZES_MB = (25.2, 8.4, 46.1, 23.1)  # qkv, o_proj, gate_up, down of one layer


@triton.jit
def _grid_arrive(bar_ptr):
    # This CTA's arrival, released after its threads' earlier writes; apart from _grid_wait for prefetch.
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _grid_wait(bar_ptr, target):
    # All CTAs' arrivals counted (count >= target) before any goes on; thread 0 alone polls.
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
def _grid_sync(bar_ptr, target):
    _grid_arrive(bar_ptr)
    _grid_wait(bar_ptr, target)


@triton.jit
def _stream_share(w_ptr, n, pid, G, BLOCK: tl.constexpr):
    # CTA pid's contiguous share of w[0:n] (n a multiple of BLOCK), summed.
    blocks = n // BLOCK
    lo = (pid * blocks) // G
    hi = ((pid + 1) * blocks) // G
    acc = tl.zeros([BLOCK], tl.float32)
    for b in range(lo, hi):
        acc += tl.load(w_ptr + b * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)  # n < 2**31
    return tl.sum(acc)


@triton.jit
def _stream_kernel(w_ptr, n, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, _stream_share(w_ptr, n, pid, tl.num_programs(0), BLOCK))


@triton.jit
def _resident_kernel(w0, w1, w2, w3, n0, n1, n2, n3, ls0, ls1, ls2, ls3, L, out_ptr, bar_ptr,
                     BLOCK: tl.constexpr, SYNC: tl.constexpr):  # fmt: skip
    # ls0..ls3: each matrix's layer stride. SYNC=False is the continuous mode: no barriers.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    total = 0.0
    for layer in range(L):
        lw = tl.cast(layer, tl.int64)  # not layer.to: the interpreter's range gives Python ints
        total += _stream_share(w0 + lw * ls0, n0, pid, G, BLOCK)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 1) * G)
        total += _stream_share(w1 + lw * ls1, n1, pid, G, BLOCK)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 2) * G)
        total += _stream_share(w2 + lw * ls2, n2, pid, G, BLOCK)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 3) * G)
        total += _stream_share(w3 + lw * ls3, n3, pid, G, BLOCK)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 4) * G)
    tl.store(out_ptr + pid, total)


@triton.jit
def _share_head(w_ptr, n, pid, G, BLOCK: tl.constexpr, PREF: tl.constexpr):
    # The first PREF blocks of CTA pid's share of w[0:n] as one [PREF, BLOCK] load, zeros past the share.
    blocks = n // BLOCK
    lo = (pid * blocks) // G
    hi = ((pid + 1) * blocks) // G
    b = lo + tl.arange(0, PREF)
    offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return tl.load(w_ptr + offs, mask=(b < hi)[:, None], other=0.0)


@triton.jit
def _stream_rest(w_ptr, n, pid, G, head, BLOCK: tl.constexpr, PREF: tl.constexpr):
    # _stream_share with its first PREF blocks already in head (loaded by _share_head).
    blocks = n // BLOCK
    lo = (pid * blocks) // G
    hi = ((pid + 1) * blocks) // G
    acc = tl.sum(head.to(tl.float32), axis=0)  # its loads waited on here, or earlier if ptxas hoists this
    for b in range(lo + PREF, hi):
        acc += tl.load(w_ptr + b * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    return tl.sum(acc)


@triton.jit
def _head_sync(w_ptr, n, pid, G, live, bar_ptr, target, BLOCK: tl.constexpr, PREF: tl.constexpr,
               SYNC: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    # The barrier, with the loads of w's first share blocks issued before it (SPLIT: after the arrival, whose
    # release fence would wait for them, before the poll). Zeros if not live (no next matrix).
    if SYNC and SPLIT:
        _grid_arrive(bar_ptr)
    head = tl.zeros([PREF, BLOCK], w_ptr.dtype.element_ty)
    if live:
        head = _share_head(w_ptr, n, pid, G, BLOCK, PREF)
    if SYNC and SPLIT:
        _grid_wait(bar_ptr, target)
    elif SYNC:
        _grid_sync(bar_ptr, target)
    return head


@triton.jit
def _prefetch_kernel(w0, w1, w2, w3, n0, n1, n2, n3, ls0, ls1, ls2, ls3, L, out_ptr, bar_ptr,
                     BLOCK: tl.constexpr, PREF: tl.constexpr, SYNC: tl.constexpr,
                     SPLIT: tl.constexpr):  # fmt: skip
    # The resident kernel, but each CTA issues the loads of its next share's first PREF blocks before each
    # barrier's poll, so HBM has them in flight while it waits. SYNC=False only for the interpreter tests.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    total = 0.0
    head = _share_head(w0, n0, pid, G, BLOCK, PREF)
    for layer in range(L):
        lw = tl.cast(layer, tl.int64)
        t = 4 * layer * G
        total += _stream_rest(w0 + lw * ls0, n0, pid, G, head, BLOCK, PREF)
        head = _head_sync(w1 + lw * ls1, n1, pid, G, True, bar_ptr, t + G, BLOCK, PREF, SYNC, SPLIT)
        total += _stream_rest(w1 + lw * ls1, n1, pid, G, head, BLOCK, PREF)
        head = _head_sync(w2 + lw * ls2, n2, pid, G, True, bar_ptr, t + 2 * G, BLOCK, PREF, SYNC, SPLIT)
        total += _stream_rest(w2 + lw * ls2, n2, pid, G, head, BLOCK, PREF)
        head = _head_sync(w3 + lw * ls3, n3, pid, G, True, bar_ptr, t + 3 * G, BLOCK, PREF, SYNC, SPLIT)
        total += _stream_rest(w3 + lw * ls3, n3, pid, G, head, BLOCK, PREF)
        nxt = w0 + (lw + 1) * ls0  # the next layer's; none after the last
        head = _head_sync(nxt, n0, pid, G, layer + 1 < L, bar_ptr, t + 4 * G, BLOCK, PREF, SYNC, SPLIT)
    tl.store(out_ptr + pid, total)


@triton.jit
def _tma_share(desc, row0, rows, pid, G, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    # CTA pid's contiguous share of rows [row0, row0 + rows) of a [*, BC] descriptor, BR rows a copy, summed;
    # STAGES copies in flight (tl.range pipelines loads that feed no dot, too).
    blocks = rows // BR
    lo = (pid * blocks) // G
    hi = ((pid + 1) * blocks) // G
    acc = tl.zeros([BR, BC], tl.float32)
    for b in tl.range(lo, hi, num_stages=STAGES):
        acc += desc.load([row0 + b * BR, 0]).to(tl.float32)
    return tl.sum(acc)


@triton.jit
def _stream_tma_kernel(desc, row0, rows, out_ptr, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, _tma_share(desc, row0, rows, pid, tl.num_programs(0), BR, BC, STAGES))


@triton.jit
def _resident_tma_kernel(d0, d1, d2, d3, r0, r1, r2, r3, L, out_ptr, bar_ptr, BR: tl.constexpr,
                         BC: tl.constexpr, STAGES: tl.constexpr, SYNC: tl.constexpr):  # fmt: skip
    # r0..r3: each matrix's rows per layer (its descriptor spans all layers). SYNC as above.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    total = 0.0
    for layer in range(L):
        total += _tma_share(d0, layer * r0, r0, pid, G, BR, BC, STAGES)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 1) * G)
        total += _tma_share(d1, layer * r1, r1, pid, G, BR, BC, STAGES)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 2) * G)
        total += _tma_share(d2, layer * r2, r2, pid, G, BR, BC, STAGES)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 3) * G)
        total += _tma_share(d3, layer * r3, r3, pid, G, BR, BC, STAGES)
        if SYNC:
            _grid_sync(bar_ptr, (4 * layer + 4) * G)
    tl.store(out_ptr + pid, total)


def run_tma(mats, sizes, layers: int, out, layer_bytes: int, sms: int, modes, block_rows=(32, 64)) -> None:
    """`modes` on TMA block loads: matrices viewed as [layers * n / BC, BC], blocks of BR rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    bc = 256
    rows = [n // bc for n in sizes]
    for br in block_rows:
        descs = [TensorDescriptor.from_tensor(m.view(-1, bc), [br, bc]) for m in mats]
        for stages in (3, 4):
            for ctas in (1, 2):
                grid = sms * ctas

                def separate(br=br, descs=descs, stages=stages, grid=grid):
                    for layer in range(layers):
                        for d, r in zip(descs, rows):
                            _stream_tma_kernel[(grid,)](d, layer * r, r, out, BR=br, BC=bc, STAGES=stages,
                                                        num_warps=4)  # fmt: skip

                bar = torch.zeros(2, dtype=torch.int32, device="cuda")

                def resident(br=br, descs=descs, stages=stages, grid=grid, bar=bar, sync=True):
                    bar.zero_()
                    _resident_tma_kernel[(grid,)](*descs, *rows, layers, out, bar, BR=br, BC=bc,
                                                  STAGES=stages, SYNC=sync, num_warps=4)  # fmt: skip

                continuous = lambda resident=resident: resident(sync=False)
                for mode, fn in (("separate", separate), ("resident", resident), ("continuous", continuous)):
                    if mode not in modes:
                        continue
                    ms = replay_ms(capture(fn), 20, warmup=0)
                    row = {"mode": mode + "_tma", "block": [br, bc], "stages": stages, "ctas_per_sm": ctas,
                           "us_per_layer": round(1000 * ms / layers, 2),
                           "tb_s": round(layer_bytes * layers / ms / 1e9, 3)}  # fmt: skip
                    print(json.dumps(row), flush=True)


def run_prefetch(mats, sizes, layers: int, out, layer_bytes: int, sms: int) -> None:
    """The prefetch modes on pointer loads, skipping settings whose CTAs cannot all be resident (hang)."""
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    modes = (("prefetch", False), ("prefetch_split", True))
    settings = itertools.product((2048, 8192), (4, 8), (1, 2, 4), (2, 4), modes)
    for block, warps, pref, ctas, (mode, split) in settings:

        def launch(block=block, warps=warps, pref=pref, grid=sms * ctas, split=split):
            strides = (m.stride(0) for m in mats)
            return _prefetch_kernel[(grid,)](*mats, *sizes, *strides, layers, out, bar, BLOCK=block,
                                             PREF=pref, SYNC=True, SPLIT=split, num_warps=warps,
                                             num_stages=3)  # fmt: skip

        bar.fill_(1 << 30)  # every poll passes at once: compiles, and cannot hang
        regs = launch().n_regs
        row = {"mode": mode, "block": block, "warps": warps, "pref": pref, "ctas_per_sm": ctas, "regs": regs}
        if -(-regs // 8) * 8 * 32 * warps * ctas > 65536:  # registers are allocated per warp, by 8s
            print(json.dumps({**row, "skipped": "not all CTAs resident"}), flush=True)
            continue

        def resident(launch=launch):
            bar.zero_()
            launch()

        ms = replay_ms(capture(resident), 20, warmup=0)
        row |= {"us_per_layer": round(1000 * ms / layers, 2),
                "tb_s": round(layer_bytes * layers / ms / 1e9, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tma", action="store_true", help="also the TMA (tensor descriptor) variants")
    ap.add_argument("--tma-only", action="store_true")
    ap.add_argument("--continuous-only", action="store_true", help="continuous mode only, pointer and TMA")
    ap.add_argument("--prefetch-only", action="store_true", help="the prefetch modes only")
    ap.add_argument("--tma-rows", type=int, nargs="+", default=[32, 64], help="TMA block heights (x 256)")
    args = ap.parse_args()
    modes = ("continuous",) if args.continuous_only else ("separate", "resident", "continuous")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_align = 16384
    sizes = [int(mb * 1e6 / 2) // block_align * block_align for mb in SIZES_MB]  # bf16 elements
    mats = [torch.randn(args.layers, n, device="cuda").to(torch.bfloat16) for n in sizes]
    layer_bytes = 2 * sum(sizes)
    out = torch.empty(sms * 16, device="cuda")
    if args.prefetch_only:
        run_prefetch(mats, sizes, args.layers, out, layer_bytes, sms)
        return
    if args.tma or args.tma_only or args.continuous_only:
        run_tma(mats, sizes, args.layers, out, layer_bytes, sms, modes, args.tma_rows)
    if args.tma_only:
        return
    if "separate" in modes:
        for block in (2048, 8192):
            for warps in (4, 8):
                for ctas in (2, 4, 8):
                    grid = sms * ctas

                    def separate(block=block, warps=warps, grid=grid):
                        for layer in range(args.layers):
                            for m, n in zip(mats, sizes):
                                _stream_kernel[(grid,)](m[layer], n, out, BLOCK=block, num_warps=warps,
                                                        num_stages=3)  # fmt: skip

                    ms = replay_ms(capture(separate), 20, warmup=0)
                    row = {"mode": "separate", "block": block, "warps": warps, "ctas_per_sm": ctas,
                           "us_per_layer": round(1000 * ms / args.layers, 2),
                           "tb_s": round(layer_bytes * args.layers / ms / 1e9, 3)}  # fmt: skip
                    print(json.dumps(row), flush=True)
    for block in (2048, 8192):
        for warps in (4, 8):
            for ctas in (1, 2, 4):
                grid = sms * ctas  # resident together: these kernels use few registers and no shared memory
                bar = torch.zeros(2, dtype=torch.int32, device="cuda")

                for mode, sync in (("resident", True), ("continuous", False)):
                    if mode not in modes:
                        continue

                    def resident(block=block, warps=warps, grid=grid, bar=bar, sync=sync):
                        bar.zero_()
                        strides = (m.stride(0) for m in mats)
                        _resident_kernel[(grid,)](*mats, *sizes, *strides, args.layers, out, bar, BLOCK=block,
                                                  SYNC=sync, num_warps=warps, num_stages=3)  # fmt: skip

                    ms = replay_ms(capture(resident), 20, warmup=0)
                    row = {"mode": mode, "block": block, "warps": warps, "ctas_per_sm": ctas,
                           "us_per_layer": round(1000 * ms / args.layers, 2),
                           "tb_s": round(layer_bytes * args.layers / ms / 1e9, 3)}  # fmt: skip
                    print(json.dumps(row), flush=True)
    if "resident" in modes:
        run_prefetch(mats, sizes, args.layers, out, layer_bytes, sms)


if __name__ == "__main__":
    main()
