"""Riders: a newcomer's prompt carried by a free decode lane (run-ahead keeps going).

Without riders, a request arriving during run-ahead ended the run: its prompt
then took host-driven steps, each waiting for the exit flags and the sampled ids
(on the H200, ~3.6 ms per loop against ~1.5 ms per lane launch). With them, the
prompt's loops run inside the lanes' launches: such a launch is the runner's step
graph over the lanes' tokens (rows [0, lanes)) and each rider's prompt (one row
each, after them), packed on the device (kernels/lanes.pack_lane_step), so the
weights are streamed once for both. The last prompt token's exit and first token
come back in the rider lane's record; after the prompt's last loop the lane
decodes that token, as the host path's refill would start it.

The host knows every rider's loop in advance (a prompt runs every loop, one per
launch), so it stages the riders' rows and tokens itself; only the lanes' state
and a rider's first-token stop live on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WAITING, RUNNING = 1, 2  # LoopScheduler statuses: queued, holding KV


@dataclass
class Rider:
    """A prompt riding in a lane (host view): it joined at launch `first`, one loop per launch."""

    rid: int
    lane: int
    ids: np.ndarray  # the prompt's token ids (int64)
    kv: int  # its KV slot (block-table row)
    first: int
    prev_off: int = -1  # its first token's index in the last step (hidden states carry from there)


@dataclass
class RiderRow:
    """A rider's row in one launch (GpuModelRunner.fill_rider_step)."""

    lane: int
    ids: np.ndarray
    kv: int
    loop: int
    off: int  # its first token's index in this step
    prev_off: int


def rider_rows(ahead, launch: int) -> list[RiderRow]:
    """The rows of launch `launch`'s riders, after the lanes' tokens; riders whose requests ended or
    whose prompts ran their last loop leave the list."""
    s, loops = ahead.engine.scheduler, ahead.lanes.num_loops
    off, rows, keep = ahead.lanes.rows, [], []
    for rd in ahead.riders:
        loop = launch - rd.first
        if loop >= loops or s.status(rd.rid) != RUNNING:
            continue
        rows.append(RiderRow(rd.lane, rd.ids, rd.kv, loop, off, rd.prev_off))
        rd.prev_off = off
        off += len(rd.ids)
        if loop + 1 < loops:
            keep.append(rd)
    ahead.riders = keep
    return rows
