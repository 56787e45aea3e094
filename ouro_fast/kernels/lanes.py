"""The bookkeeping of a decode-lane launch in two kernels (engine/lanes.py has the semantics).

lane_prologue: per lane, whether it runs (active and not killed), its K/V slot at its
loop, its block table for that loop, its hidden input (the token's embedding at loop
0, else the carried state) and its Philox seed. lane_exits: per lane, the exit
decision (the rule of model/exit_rule.exit_mask, on the log-survival computed by the
caller), before the lm_head so that a launch where no lane exits can skip it.
lane_epilogue: per lane, the propagation pairs of an exit, the launch record, the stop
check and the next state. One program per lane each; about a hundred tiny PyTorch
launches otherwise, which cost more GPU time than the loop's attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import next_pow2


@triton.jit
def _prologue_kernel(active_ptr, kill_ptr, loop_ptr, pos_ptr, kvrow_ptr, tok_ptr, launches_ptr,
                     tables_ptr, stride_ts, stride_tl, h_lane_ptr, embed_ptr, stride_hl, stride_e,
                     h_out_ptr, bt_out_ptr, slot_out_ptr, qstart_out_ptr, run_out_ptr, seed_out_ptr,
                     MB, HIDDEN, seed_base, BS: tl.constexpr, T: tl.constexpr, BLOCK_MB: tl.constexpr,
                     BLOCK_H: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    run = (tl.load(active_ptr + r) != 0) & (tl.load(kill_ptr + r) == 0)
    loop = tl.load(loop_ptr + r)
    pos = tl.load(pos_ptr + r)
    kv = tl.maximum(tl.load(kvrow_ptr + r), 0)
    table = tables_ptr + kv * stride_ts + tl.minimum(loop, T - 1).to(tl.int64) * stride_tl
    for start in range(0, MB, BLOCK_MB):
        offs = start + tl.arange(0, BLOCK_MB)
        tl.store(bt_out_ptr + r * MB + offs, tl.load(table + offs, mask=offs < MB), mask=offs < MB)
    slot = tl.load(table + pos // BS).to(tl.int64) * BS + pos % BS
    tl.store(slot_out_ptr + r, tl.where(run, slot, -1))
    tl.store(qstart_out_ptr + r, pos.to(tl.int32))
    tl.store(run_out_ptr + r, run.to(tl.int32))
    # Philox key per (launch, lane): odd multipliers below 2**63 spread the two counters apart.
    launch = tl.load(launches_ptr)
    seed = seed_base + launch * 0x2545F4914F6CDD1D + r.to(tl.int64) * 0x5851F42D4C957F2D
    seed = seed & 0x3FFFFFFFFFFFFFFF
    tl.store(seed_out_ptr + r, seed)
    # Loop 0 starts from the token's embedding; later loops from the state the last loop left.
    tok = tl.load(tok_ptr + r)
    for start in range(0, HIDDEN, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        m = offs < HIDDEN
        emb = tl.load(embed_ptr + tok * stride_e + offs, mask=m)
        carried = tl.load(h_lane_ptr + r * stride_hl + offs, mask=m)
        tl.store(h_out_ptr + r * HIDDEN + offs, tl.where(loop == 0, emb, carried), mask=m)


@triton.jit
def _exits_kernel(run_ptr, loop_ptr, log_surv_ptr, lo_ptr, hi_ptr, log1mq_ptr, exits_ptr):
    r = tl.program_id(0)
    run = tl.load(run_ptr + r) != 0
    log_surv = tl.load(log_surv_ptr + r)
    log1mq = tl.load(log1mq_ptr + r)
    # exit_mask, on 1-based loop counts: forced at max_loops, else once survival drops to 1 - q.
    done = tl.load(loop_ptr + r) + 1
    reached = (log1mq > float("-inf")) & (log_surv <= log1mq)
    exits = run & ((done >= tl.load(hi_ptr + r) + 1) | ((done >= tl.load(lo_ptr + r) + 1) & reached))
    tl.store(exits_ptr + r, exits.to(tl.int32))


@triton.jit
def _epilogue_kernel(run_ptr, slot_ptr, log_surv_ptr, exits_ptr, ids_ptr, x_ptr, stride_x,
                     loop_ptr, pos_ptr, kvrow_ptr, tok_ptr, cap_ptr, stop_ptr,
                     ls_ptr, active_ptr, h_lane_ptr, stride_hl, launches_ptr, tables_ptr, stride_ts,
                     stride_tl, record_ptr, src_ptr, dst_ptr, R, HIDDEN, BS: tl.constexpr, T: tl.constexpr,
                     NUM_STOP: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    run = tl.load(run_ptr + r) != 0
    loop = tl.load(loop_ptr + r)
    pos = tl.load(pos_ptr + r)
    log_surv = tl.load(log_surv_ptr + r)
    exits = tl.load(exits_ptr + r) != 0
    token = tl.load(ids_ptr + r)
    # Last-exited propagation: the exit plane's slot into each deeper plane's slot (-1: no pair).
    slot = tl.load(slot_ptr + r)
    kv = tl.maximum(tl.load(kvrow_ptr + r), 0)
    for j in tl.static_range(1, T):
        plane = tl.minimum(loop + j, T - 1).to(tl.int64)
        blk = tl.load(tables_ptr + kv * stride_ts + plane * stride_tl + pos // BS).to(tl.int64)
        dst = blk * BS + pos % BS
        ok = exits & (loop + j < T)
        tl.store(src_ptr + (j - 1) * R + r, tl.where(ok, slot, -1))
        tl.store(dst_ptr + (j - 1) * R + r, tl.where(ok, dst, -1))
    tl.store(record_ptr + r * 4, loop.to(tl.int64))
    tl.store(record_ptr + r * 4 + 1, exits.to(tl.int64))
    tl.store(record_ptr + r * 4 + 2, token)
    tl.store(record_ptr + r * 4 + 3, run.to(tl.int64))
    # The engine's stop rules: a stop id sampled, or the length cap reached by the new token.
    stop = pos + 2 >= tl.load(cap_ptr + r)
    for e in tl.static_range(NUM_STOP):
        stop = stop | (tl.load(stop_ptr + r * NUM_STOP + e) == token)
    tl.store(tok_ptr + r, tl.where(exits, token, tl.load(tok_ptr + r)))
    tl.store(pos_ptr + r, pos + exits.to(tl.int64))
    # Lanes that do not run keep their loop (they never exit, so they would run past the last one).
    tl.store(loop_ptr + r, tl.where(exits, 0, loop + run.to(tl.int32)))
    tl.store(ls_ptr + r, tl.where(exits, 0.0, log_surv))
    tl.store(active_ptr + r, (run & ~(exits & stop)).to(tl.int32))
    for start in range(0, HIDDEN, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        m = offs < HIDDEN
        tl.store(h_lane_ptr + r * stride_hl + offs, tl.load(x_ptr + r * stride_x + offs, mask=m), mask=m)
    if r == 0:
        tl.store(launches_ptr, tl.load(launches_ptr) + 1)


def lane_prologue(lanes, kill: torch.Tensor, embed: torch.Tensor, rows: int, block_size: int):
    """(h_in [rows, hidden], block tables [rows, MB] int32, slot int64, q_start int32, run int32,
    seeds int64) of lanes [0, rows) for this launch; see DecodeLanes for the fields."""
    dev, hidden = lanes.h.device, lanes.h.shape[1]
    t, mb = lanes.tables.shape[1], lanes.tables.shape[2]
    h_in = torch.empty(rows, hidden, dtype=lanes.h.dtype, device=dev)
    bt = torch.empty(rows, mb, dtype=torch.int32, device=dev)
    slot = torch.empty(rows, dtype=torch.int64, device=dev)
    q_start = torch.empty(rows, dtype=torch.int32, device=dev)
    run = torch.empty(rows, dtype=torch.int32, device=dev)
    seeds = torch.empty(rows, dtype=torch.int64, device=dev)
    _prologue_kernel[(rows,)](
        lanes.active, kill, lanes.loop, lanes.pos, lanes.kvrow, lanes.tok, lanes.launches,
        lanes.tables, lanes.tables.stride(0), lanes.tables.stride(1), lanes.h, embed, lanes.h.stride(0),
        embed.stride(0), h_in, bt, slot, q_start, run, seeds, mb, hidden, lanes.seed,
        BS=block_size, T=t, BLOCK_MB=min(1024, next_pow2(mb)), BLOCK_H=min(1024, next_pow2(hidden)),
    )  # fmt: skip
    return h_in, bt, slot, q_start, run, seeds


def lane_exits(lanes, run, log_surv, rows: int) -> torch.Tensor:
    """int32 [rows]: 1 where lane r's token exits at this launch's loop (0 for lanes that do not run)."""
    exits = torch.empty(rows, dtype=torch.int32, device=run.device)
    _exits_kernel[(rows,)](run, lanes.loop, log_surv, lanes.lo, lanes.hi, lanes.log1mq, exits)
    return exits


def lane_epilogue(lanes, run, slot, log_surv, exits, ids, x, rows: int, block_size: int, src, dst) -> None:
    """Record, propagation pairs (src/dst [(T-1) * rows]) and the next state of lanes [0, rows)."""
    hidden = lanes.h.shape[1]
    t, num_stop = lanes.tables.shape[1], lanes.stop_ids.shape[1]
    _epilogue_kernel[(rows,)](
        run, slot, log_surv, exits, ids, x, x.stride(0), lanes.loop, lanes.pos, lanes.kvrow, lanes.tok,
        lanes.cap, lanes.stop_ids, lanes.ls, lanes.active, lanes.h,
        lanes.h.stride(0), lanes.launches, lanes.tables, lanes.tables.stride(0), lanes.tables.stride(1),
        lanes.record, src, dst, rows, hidden,
        BS=block_size, T=t, NUM_STOP=num_stop, BLOCK_H=min(1024, next_pow2(hidden)),
    )  # fmt: skip
