"""The bookkeeping of a decode-lane launch in a few small kernels (lanes.py has the semantics).

lane_prologue: per lane, whether it runs (active and not killed), its K/V slot at its
loop, its block table for that loop, its hidden input (the token's embedding at loop
0, else the carried state) and its Philox seed. lane_exits: per lane, the gate's
log-survival (kernels/exit_gate.py) and the exit decision (the rule of
model/exit_rule.exit_mask), before the lm_head so that a launch where no lane exits can skip it.
lane_epilogue: per lane, the propagation pairs of an exit, the launch record, the stop
check and the next state. One program per lane each; about a hundred tiny PyTorch
launches otherwise, which cost more GPU time than the loop's attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels.exit_gate import log_survival
from ...kernels.launch import interpreting, next_pow2
from ...kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _lane_head(r, active_ptr, kill_ptr, loop_ptr, pos_ptr, kvrow_ptr, tables_ptr, stride_ts, stride_tl,
               bt_out_ptr, MB, BS: tl.constexpr, T: tl.constexpr, BLOCK_MB: tl.constexpr):  # fmt: skip
    # Lane r: whether it runs, its loop and position, its block table for that loop (copied to row r
    # of bt_out) and its K/V slot at its position (-1 when it does not run).
    run = (tl.load(active_ptr + r) != 0) & (tl.load(kill_ptr + r) == 0)
    loop = tl.load(loop_ptr + r)
    pos = tl.load(pos_ptr + r)
    kv = tl.maximum(tl.load(kvrow_ptr + r), 0)
    table = tables_ptr + kv * stride_ts + tl.minimum(loop, T - 1).to(tl.int64) * stride_tl
    for start in range(0, MB, BLOCK_MB):
        offs = start + tl.arange(0, BLOCK_MB)
        tl.store(bt_out_ptr + r * MB + offs, tl.load(table + offs, mask=offs < MB), mask=offs < MB)
    slot = tl.load(table + pos // BS).to(tl.int64) * BS + pos % BS
    return run, loop, pos, tl.where(run, slot, -1)


@triton.jit
def _prologue_kernel(active_ptr, kill_ptr, loop_ptr, pos_ptr, kvrow_ptr, tok_ptr, launches_ptr,
                     tables_ptr, stride_ts, stride_tl, h_lane_ptr, embed_ptr, stride_hl, stride_e,
                     h_out_ptr, bt_out_ptr, slot_out_ptr, qstart_out_ptr, run_out_ptr, seed_out_ptr,
                     cls_ptr, grp_out_ptr, MB, HIDDEN, seed_base, BS: tl.constexpr, T: tl.constexpr,
                     BLOCK_MB: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    # A plain launch, done before the loop's PDL chain starts: the decode attention reads its
    # block tables and slots before its wait (kernels/decode_attention.py, EARLY_KV).
    r = tl.program_id(0)
    run, loop, pos, slot = _lane_head(r, active_ptr, kill_ptr, loop_ptr, pos_ptr, kvrow_ptr, tables_ptr,
                                      stride_ts, stride_tl, bt_out_ptr, MB, BS, T, BLOCK_MB)  # fmt: skip
    tl.store(slot_out_ptr + r, slot)
    tl.store(qstart_out_ptr + r, pos.to(tl.int32))
    tl.store(run_out_ptr + r, run.to(tl.int32))
    # The lane's shared-prefix group: its class's prefix at its loop's plane (class * T + loop), if it runs.
    cls = tl.load(cls_ptr + r)
    tl.store(grp_out_ptr + r, tl.where(run & (cls >= 0), cls * T + loop, -1))
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
def _exits_kernel(run_ptr, loop_ptr, ls_ptr, x_ptr, stride_x, w_ptr, b_ptr, lo_ptr, hi_ptr, log1mq_ptr,
                  exits_ptr, log_surv_ptr, HIDDEN, BLOCK_H: tl.constexpr,
                  INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_enter(USE_PDL)  # x is the loop's last norm's output
    r = tl.program_id(0)
    run = tl.load(run_ptr + r) != 0
    loop = tl.load(loop_ptr + r)
    # The gate on this loop's output; loop 0 starts from survival 1, later loops carry the lane's value.
    carried = tl.where(loop == 0, 0.0, tl.load(ls_ptr + r))
    log_surv = log_survival(x_ptr + r.to(tl.int64) * stride_x, w_ptr, b_ptr, carried, HIDDEN, BLOCK_H,
                            INTERPRETED)  # fmt: skip
    tl.store(log_surv_ptr + r, log_surv)
    log1mq = tl.load(log1mq_ptr + r)
    # exit_mask, on 1-based loop counts: forced at max_loops, else once survival drops to 1 - q.
    done = loop + 1
    reached = (log1mq > float("-inf")) & (log_surv <= log1mq)
    exits = run & ((done >= tl.load(hi_ptr + r) + 1) | ((done >= tl.load(lo_ptr + r) + 1) & reached))
    tl.store(exits_ptr + r, exits.to(tl.int32))


@triton.jit
def _epilogue_kernel(run_ptr, slot_ptr, log_surv_ptr, exits_ptr, ids_ptr, x_ptr, stride_x,
                     loop_ptr, pos_ptr, kvrow_ptr, tok_ptr, cap_ptr, stop_ptr,
                     ls_ptr, active_ptr, h_lane_ptr, stride_hl, launches_ptr, tables_ptr, stride_ts,
                     stride_tl, record_ptr, src_ptr, dst_ptr, R, HIDDEN, BS: tl.constexpr, T: tl.constexpr,
                     NUM_STOP: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_enter(USE_PDL)  # ids are the sampler's output
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


def lane_prologue(lanes, kill: torch.Tensor, classes: torch.Tensor, embed: torch.Tensor, rows: int,
                  block_size: int):  # fmt: skip
    """(h_in [rows, hidden], block tables [rows, MB] int32, slot int64, q_start int32, run int32,
    seeds int64, group int32) of lanes [0, rows) for this launch; see DecodeLanes for the fields. classes
    [rows] int32: each lane's shared-prefix class (-1: none); group: class * loops + loop where the lane
    runs in a class, else -1 (the decode attention's row_group)."""
    dev, hidden = lanes.h.device, lanes.h.shape[1]
    t, mb = lanes.tables.shape[1], lanes.tables.shape[2]
    h_in = torch.empty(rows, hidden, dtype=lanes.h.dtype, device=dev)
    bt = torch.empty(rows, mb, dtype=torch.int32, device=dev)
    slot = torch.empty(rows, dtype=torch.int64, device=dev)
    q_start = torch.empty(rows, dtype=torch.int32, device=dev)
    run = torch.empty(rows, dtype=torch.int32, device=dev)
    seeds = torch.empty(rows, dtype=torch.int64, device=dev)
    group = torch.empty(rows, dtype=torch.int32, device=dev)
    _prologue_kernel[(rows,)](
        lanes.active, kill, lanes.loop, lanes.pos, lanes.kvrow, lanes.tok, lanes.launches,
        lanes.tables, lanes.tables.stride(0), lanes.tables.stride(1), lanes.h, embed, lanes.h.stride(0),
        embed.stride(0), h_in, bt, slot, q_start, run, seeds, classes, group, mb, hidden, lanes.seed,
        BS=block_size, T=t, BLOCK_MB=min(1024, next_pow2(mb)), BLOCK_H=min(1024, next_pow2(hidden)),
    )  # fmt: skip
    return h_in, bt, slot, q_start, run, seeds, group


def lane_exits(lanes, run, x, gate, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_surv float32 [rows], exits int32 [rows]) of lanes [0, rows) after this launch's loop: the
    gate Linear `gate` on x [rows, hidden] (kernels/exit_gate.log_survival, the host-driven step's
    bits), and 1 where the lane's token exits (0 for lanes that do not run)."""
    exits = torch.empty(rows, dtype=torch.int32, device=run.device)
    log_surv = torch.empty(rows, dtype=torch.float32, device=run.device)
    hidden = x.shape[1]
    _exits_kernel[(rows,)](
        run, lanes.loop, lanes.ls, x, x.stride(0), gate.weight, gate.bias, lanes.lo, lanes.hi, lanes.log1mq,
        exits, log_surv, hidden, BLOCK_H=min(2048, next_pow2(hidden)), INTERPRETED=interpreting(),
        num_warps=4, **pdl_launch(run.device),
    )  # fmt: skip
    return log_surv, exits


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
        **pdl_launch(run.device),
    )  # fmt: skip


@triton.jit
def _publish_kernel(record_ptr, host_ptr, emitted_ptr, n, stride_slot, RING: tl.constexpr,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_enter(USE_PDL)  # the records are the epilogues' output
    count = tl.load(emitted_ptr)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(host_ptr + (count % RING) * stride_slot + offs, tl.load(record_ptr + offs, mask=m), mask=m)
    tl.store(emitted_ptr, count + 1)


def publish_records(lanes, rows: int) -> None:
    """The launch's records [rows, 4] into the host ring's slot (launches since start() mod RING): stored
    by the launch's last kernel into pinned memory the device can address, so no copy waits on the stream
    between two lane graphs (the host reads the slot after the launch's event)."""
    ring = lanes.host_records
    _publish_kernel[(1,)](
        lanes.record, ring, lanes.emitted, rows * 4, ring.stride(0), RING=ring.shape[0],
        BLOCK=next_pow2(ring.shape[1] * 4), **pdl_launch(lanes.device),
    )  # fmt: skip


# ---- prompts riding in the lanes' launches (engine/riders.py) -----------------------------------------


# R (the lane count) is not specialised: one compiled variant for every lane count, warmed at start-up.
@triton.jit(do_not_specialize=["R"])
def _pack_kernel(active_ptr, kill_ptr, loop_ptr, pos_ptr, kvrow_ptr, tok_ptr, launches_ptr, lo_ptr, hi_ptr,
                 log1mq_ptr, ls_ptr, temp_ptr, ploop_ptr, pdone_ptr, rider_ptr, tables_ptr, stride_ts,
                 stride_tl, h_lane_ptr, stride_hl, ids_ptr, spos_ptr, sslot_ptr, hsrc_ptr, last_ptr,
                 prev_last_ptr, store_ptr, qstart_ptr, len_ptr, tokoff_ptr, sloop_ptr, slo_ptr, shi_ptr,
                 slog1mq_ptr, bt_ptr, h_prev_ptr, stride_hp, ls_prev_ptr, run_out_ptr, slot_out_ptr,
                 seed_out_ptr, temp_out_ptr, cls_ptr, grp_ptr, R, MB, HIDDEN, seed_base, BS: tl.constexpr,
                 T: tl.constexpr,
                 BLOCK_MB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    # Programs [0, R): lane r writes its row r and token r of the step's input buffers (the rows past
    # R were staged by the host). Programs R + i: rider i's row, which the host staged, loses its
    # tokens if the rider stopped on the device, and its exit bounds once its first token is out.
    p = tl.program_id(0)
    launch = tl.load(launches_ptr)
    if p < R:
        r = p
        run, loop, pos, slot = _lane_head(r, active_ptr, kill_ptr, loop_ptr, pos_ptr, kvrow_ptr, tables_ptr,
                                          stride_ts, stride_tl, bt_ptr, MB, BS, T, BLOCK_MB)  # fmt: skip
        carried = loop > 0
        tl.store(ids_ptr + r, tl.load(tok_ptr + r))
        tl.store(spos_ptr + r, pos)
        tl.store(sslot_ptr + r, slot)
        tl.store(hsrc_ptr + r, tl.where(carried, r, -1).to(tl.int64))
        tl.store(last_ptr + r, r.to(tl.int64))
        tl.store(prev_last_ptr + r, tl.where(carried, r, -1).to(tl.int64))
        tl.store(store_ptr + r, r.to(tl.int64))
        tl.store(qstart_ptr + r, pos.to(tl.int32))
        tl.store(len_ptr + r, run.to(tl.int32))
        tl.store(tokoff_ptr + r, r)
        tl.store(sloop_ptr + r, loop)
        # Lanes that do not run never exit (the host path's padding rows: NO_EXIT).
        tl.store(slo_ptr + r, tl.where(run, tl.load(lo_ptr + r), 127))
        tl.store(shi_ptr + r, tl.where(run, tl.load(hi_ptr + r), 127))
        tl.store(slog1mq_ptr + r, tl.load(log1mq_ptr + r).to(tl.int32, bitcast=True))
        for start in range(0, HIDDEN, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            m = offs < HIDDEN
            h = tl.load(h_lane_ptr + r * stride_hl + offs, mask=m)
            tl.store(h_prev_ptr + r * stride_hp + offs, h, mask=m)
        tl.store(ls_prev_ptr + r, tl.load(ls_ptr + r))
        tl.store(run_out_ptr + r, run.to(tl.int32))
        tl.store(slot_out_ptr + r, slot)
        # The lane's shared-prefix group, as in the lane prologue (the riders' rows have none).
        cls = tl.load(cls_ptr + r)
        tl.store(grp_ptr + r, tl.where(run & (cls >= 0), cls * T + loop, -1))
        j = r
    else:
        j = tl.load(rider_ptr + p - R)
        dead = (tl.load(kill_ptr + j) != 0) | (tl.load(ploop_ptr + j) < 0)
        done = tl.load(pdone_ptr + j) != 0
        if dead:
            off = tl.load(tokoff_ptr + p)
            n = tl.load(len_ptr + p)
            for start in range(0, n, BLOCK_T):
                offs = start + tl.arange(0, BLOCK_T)
                tl.store(sslot_ptr + off + offs, tl.full([BLOCK_T], -1, tl.int64), mask=offs < n)
            tl.store(len_ptr + p, 0)
        # The first token samples once: later loops of the prompt never exit (NO_EXIT).
        no_exit = dead | done
        tl.store(slo_ptr + p, tl.where(no_exit, 127, tl.load(lo_ptr + j)))
        tl.store(shi_ptr + p, tl.where(no_exit, 127, tl.load(hi_ptr + j)))
        tl.store(slog1mq_ptr + p, tl.load(log1mq_ptr + j).to(tl.int32, bitcast=True))
    # Philox key per (launch, lane), as in the lane prologue: a rider samples with its lane's key.
    seed = seed_base + launch * 0x2545F4914F6CDD1D + j.to(tl.int64) * 0x5851F42D4C957F2D
    tl.store(seed_out_ptr + p, seed & 0x3FFFFFFFFFFFFFFF)
    tl.store(temp_out_ptr + p, tl.load(temp_ptr + j))


@triton.jit(do_not_specialize=["R"])
def _rider_epilogue_kernel(rider_ptr, len_ptr, exits_ptr, ids_ptr, ploop_ptr, pdone_ptr, tok_ptr, pos_ptr,
                           cap_ptr, stop_ptr, loop_ptr, active_ptr, ls_ptr, record_ptr, R,
                           T: tl.constexpr, NUM_STOP: tl.constexpr):  # fmt: skip
    # Rider i (step row R + i, lane j): its record, its first token, and its next loop; after the
    # prompt's last loop the lane starts decoding the first token (unless that token stops it).
    i = tl.program_id(0)
    row = R + i
    j = tl.load(rider_ptr + i)
    live = tl.load(len_ptr + row) > 0
    exits = live & (tl.load(exits_ptr + row) != 0)
    token = tl.load(ids_ptr + row)
    loop = tl.load(ploop_ptr + j)
    tl.store(record_ptr + j * 4, loop.to(tl.int64))
    tl.store(record_ptr + j * 4 + 1, exits.to(tl.int64))
    tl.store(record_ptr + j * 4 + 2, token)
    tl.store(record_ptr + j * 4 + 3, live.to(tl.int64))
    if live:
        # The lanes' stop rules for the first token (at position pos - 1 of the prompt's last token).
        stop = exits & (tl.load(pos_ptr + j) + 1 >= tl.load(cap_ptr + j))
        for e in tl.static_range(NUM_STOP):
            stop = stop | (exits & (tl.load(stop_ptr + j * NUM_STOP + e) == token))
        done = exits | (tl.load(pdone_ptr + j) != 0)
        if exits:
            tl.store(tok_ptr + j, token)
            tl.store(pdone_ptr + j, 1)
        last = loop + 1 >= T
        tl.store(ploop_ptr + j, tl.where(stop | last, -1, loop + 1))
        if last & done & ~stop:
            tl.store(loop_ptr + j, 0)
            tl.store(ls_ptr + j, 0.0)
            tl.store(active_ptr + j, 1)


def pack_lane_step(lanes, runner, kill, riders, rows: int, block_size: int):
    """Write lanes [0, rows)'s rows and tokens into the runner's step buffers (the rows of the riders
    `riders` [K] int32 lane indices follow, staged by the host) and return the per-row (run, slot,
    seeds, temperature) of rows [0, rows + K) for the sampler and the epilogues."""
    dev, hidden = lanes.h.device, lanes.h.shape[1]
    t, mb = lanes.tables.shape[1], lanes.tables.shape[2]
    k = riders.shape[0]
    a, b = runner.i64.dev, runner.i32.dev
    run = torch.zeros(rows, dtype=torch.int32, device=dev)
    slot = torch.empty(rows, dtype=torch.int64, device=dev)
    seeds = torch.empty(rows + k, dtype=torch.int64, device=dev)
    temp = torch.empty(rows + k, dtype=torch.float32, device=dev)
    bt = b["bt"]
    _pack_kernel[(rows + k,)](
        lanes.active, kill, lanes.loop, lanes.pos, lanes.kvrow, lanes.tok, lanes.launches, lanes.lo, lanes.hi,
        lanes.log1mq, lanes.ls, lanes.temp, lanes.ploop, lanes.pdone, riders, lanes.tables,
        lanes.tables.stride(0), lanes.tables.stride(1), lanes.h, lanes.h.stride(0), a["ids"], a["pos"],
        a["slot"], a["hsrc"], a["last"], a["prev_last"], a["store"], b["q_start"], b["len"], b["tok_off"],
        b["loop"], b["lo"], b["hi"], b["log1mq"], bt, runner.h_prev, runner.h_prev.stride(0),
        runner.ls_prev, run, slot, seeds, temp, lanes.inputs.dev["cls"], b["grp"], rows, bt.shape[1], hidden,
        lanes.seed,
        BS=block_size, T=t, BLOCK_MB=min(1024, next_pow2(mb)), BLOCK_H=min(1024, next_pow2(hidden)),
        BLOCK_T=128,
    )  # fmt: skip
    return run, slot, seeds, temp


def rider_epilogue(lanes, runner, riders, exits, ids, rows: int) -> None:
    """Records and next state of the riders (step rows rows + i); after the lane epilogue."""
    t, num_stop = lanes.tables.shape[1], lanes.stop_ids.shape[1]
    _rider_epilogue_kernel[(riders.shape[0],)](
        riders, runner.i32.dev["len"], exits, ids, lanes.ploop, lanes.pdone, lanes.tok, lanes.pos, lanes.cap,
        lanes.stop_ids, lanes.loop, lanes.active, lanes.ls, lanes.record, rows, T=t, NUM_STOP=num_stop,
    )  # fmt: skip
