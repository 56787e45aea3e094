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

Holding for a start. On the host path a run starts only when a step is plain decode rows with
nothing waiting, and prompts that keep arriving would keep the batch there (each takes a host step
per loop). So while the last host step had decode rows that the lanes could take, the host holds
the newcomers that could ride (at most 2 x loops + 1 steps): the prompts in flight finish, the run
starts, and the held ones ride from its next launch as arrivals. A hold that starts no run, or
whose requests then cannot ride, is released and not tried again for a prompt's loops of steps.

The host knows every rider's loop in advance (a prompt runs every loop, one per
launch), so it stages the riders' rows and tokens itself; only the lanes' state
and a rider's first-token stop live on the device.

Seating (RunAhead's Seating half). The scheduler holds an arrival (no replayed
schedule may admit it); the next step gives it KV at once and seats it in the
next launch, and the replay of that launch releases it, so that schedule() starts
its prompt row there, as the device did. A newcomer that cannot ride so (no free
lane, sampling the device cannot do, no room in the step) makes the host catch
up: every launch in flight is replayed, the next schedule() admits the waiting
requests, and the lanes take that step if it is the lanes plus whole fresh
prompts (doubling the lanes if need be), or the host-driven path takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import StepPlan
from ..scheduler import RUNNING, WAITING
from .lanes import MAX_STOP_IDS, filters
from .shapes import pow2


@dataclass
class Rider:
    """A prompt riding in a lane (host view): it joined at launch `first`, one loop per launch."""

    rid: int
    lane: int
    ids: np.ndarray  # the prompt's token ids it computes (int64): those after its prefix-cache hits
    kv: int  # its KV slot (block-table row)
    first: int
    start: int = 0  # the position of ids[0]: the prompt tokens taken from the prefix cache
    prev_off: int = -1  # its first token's index in the last step (hidden states carry from there)


@dataclass
class RiderRow:
    """A rider's row in one launch (GpuRunner.fill_rider_step)."""

    lane: int
    ids: np.ndarray
    kv: int
    loop: int
    off: int  # its first token's index in this step
    prev_off: int
    start: int = 0  # ids[0]'s position


def rider_rows(ahead, launch: int) -> list[RiderRow]:
    """The rows of launch `launch`'s riders, after the lanes' tokens; riders whose requests ended or
    whose prompts ran their last loop leave the list."""
    s, loops = ahead.core, ahead.lanes.num_loops
    off, rows, keep = ahead.lanes.rows, [], []
    for rd in ahead.riders:
        loop = launch - rd.first
        if loop >= loops or s.status(rd.rid) != RUNNING:
            continue
        rows.append(RiderRow(rd.lane, rd.ids, rd.kv, loop, off, rd.prev_off, rd.start))
        rd.prev_off = off
        off += len(rd.ids)
        if loop + 1 < loops:
            keep.append(rd)
    ahead.riders = keep
    return rows


class Seating:
    """How newcomers get a lane: RunAhead's half that seats arrivals, joins them after a catch-up,
    or hands the batch back (engine-owner thread only; the state lives on RunAhead)."""

    def arrive(self, rid: int) -> None:
        """A request added during the run: held in the scheduler until a step seats it."""
        self.core.hold(rid, True)
        self.arrivals.append(rid)

    def _seat_arrivals(self) -> bool:
        """Seat arrivals, in order, in free lanes from the next launch on, without waiting for the
        launches in flight: KV now, each prompt row released at that launch's replay. An arrival
        that fits once the prompts riding now are done waits (at most a prompt's loops); False,
        with none seated, if the first cannot ride so (the caller catches up instead)."""
        s = self.core
        self.arrivals = [rid for rid in self.arrivals if s.status(rid) == WAITING]  # drop aborted ones
        self._forget_ended_lanes()
        seated = 0
        while self.arrivals:
            verdict = self._try_seat(self.arrivals[0])
            if verdict == "wait" or (verdict == "no" and seated):
                return True  # held for a later step (after this step's launch, catching up is safe)
            if verdict == "no":
                return False
            self.arrivals.pop(0)
            seated += 1
        self.from_hold = False
        return True

    def note_host_step(self, plan: StepPlan) -> None:
        """A host-driven step was scheduled: could its decode rows become lanes (for hold_for_start)?"""
        rids = plan.rid.astype(np.int64)
        early = self.full_depth or bool((plan.exit_lo < plan.exit_hi).any())
        self._lanes_could_take = (
            bool(plan.decode.any()) and early and all(self._plain(int(rid), starting=True) for rid in rids)
        )

    def hold_for_start(self) -> None:
        """Host path, before schedule(): hold the waiting requests while the last step's decode rows
        could start a run once the prompts in flight finish, if every one of them can ride in that run
        (a free lane each, its prompt within the step beside the lanes). At most 2 x loops + 1 steps;
        then the hold is released and not tried again for a prompt's loops of steps."""
        s = self.core
        self.holding = self._still_held()
        if self.hold_steps < 0:  # backing off after a hold that started no run
            self.hold_steps += 1
            return
        # A prompt admitted by the last step in two chunks (one filled the step's budget) runs its last loop
        # 2 x loops steps later; the step after that may start the run.
        window = 2 * self.lanes.num_loops + 1
        waiting = [rid for rid in self.requests if s.status(rid) == WAITING]
        if self.hold_steps >= window or not waiting or not self._can_hold(waiting):
            self.release_holds(back_off=self.hold_steps >= window)
            return
        for rid in waiting:
            s.hold(rid, True)
        self.holding = [(rid, self.requests[rid]) for rid in waiting]
        self.hold_steps += 1

    def _still_held(self) -> list[tuple[int, object]]:
        # Held requests still waiting (an ended one's rid may be a newcomer's now: that one is not held).
        s = self.core
        return [
            (rid, req)
            for rid, req in self.holding
            if self.requests.get(rid) is req and s.status(rid) == WAITING
        ]

    def _can_hold(self, waiting: list[int]) -> bool:
        if not self._lanes_could_take:
            return False
        s, runner = self.core, self.runner
        lanes = min(pow2(max(s.num_running, 1)), self.lanes.max_lanes)
        if lanes - s.num_running < len(waiting):
            return False
        room = runner.max_tokens - lanes
        return all(self._plain(rid) and s.num_tokens(rid) - s.cached_now(rid) <= room for rid in waiting)

    def release_holds(self, back_off: bool = False) -> bool:
        """Let the scheduler admit the held requests; True if any was held."""
        held = self._still_held()
        for rid, _ in held:
            self.core.hold(rid, False)
        self.holding = []
        self.hold_steps = -self.lanes.num_loops if back_off else 0
        return bool(held)

    def _take_holds(self) -> None:
        """A run started: the held requests are its arrivals (seated from its next launch)."""
        self.arrivals = [rid for rid, _ in self._still_held()]
        self.holding, self.hold_steps = [], 0
        self.from_hold = bool(self.arrivals)  # until they are seated: a hand-back first backs off

    def _try_seat(self, rid: int) -> str:
        """'seated', 'wait' (the step is full of riding prompts) or 'no'."""
        s = self.core
        free = [j for j in range(self.lanes.rows) if self.lane_rids[j] < 0]
        if not free or not self._plain(rid):
            return "no"
        # The step: the lanes' tokens and every rider's prompt (those seated before ride this launch too),
        # this one's from its prefix-cache hits on.
        need = s.num_tokens(rid) - s.cached_now(rid)
        tokens = self.lanes.rows + sum(len(rd.ids) for rd in self.riders) + need
        rows = self.lanes.rows + len(self.riders) + 1
        if tokens > self.runner.max_tokens or rows > self.runner.max_rows:
            return "wait" if self.riders else "no"
        if not s.admit_now(rid):
            return "no"
        self._seat(rid, free[0], s.num_computed(rid))
        self.release.setdefault(self.launched, []).append((rid, self.requests[rid]))
        return "seated"

    def _release_arrivals(self) -> None:
        s = self.core
        for rid in self.arrivals:
            if s.status(rid) == WAITING:
                s.hold(rid, False)
        self.arrivals = []

    def _join(self):
        """Schedule the next step with the waiting requests; run it as the lanes plus riders if it is
        exactly that (whole fresh prompts, free lanes, within the step's buffers). Otherwise the run
        ends and the schedule is returned for the host path to execute (None: nothing to run)."""
        p = self.plan
        empty = np.zeros(0, np.int32)
        last = (p.rid.copy(), p.tok_off.copy(), p.length.copy(), p.decode.copy()) if p else (empty,) * 4
        self._forget_ended_lanes()
        plan = self.plan = self.scheduler.schedule()
        seating = self._seats(plan) if plan is not None else None
        if seating is not None:
            seats, self.lanes.rows = seating
            for k, j in seats:
                self._seat(int(plan.rid[k]), j, int(plan.start[k]))
            if self._reserve(in_flight=1):
                self.presched = self.launched
                self._launch(self._live())
                return None
        self._place(*last)
        self._end()
        self.hand_backs += 1
        if self.from_hold:  # the held requests could not ride after all: do not hold again soon
            self.hold_steps, self.from_hold = -self.lanes.num_loops, False
        return plan

    def _forget_ended_lanes(self) -> None:
        # Lanes of requests that ended on the host are free (their rids may come back for newcomers).
        s = self.core
        for j, rid in enumerate(self.lane_rids):
            if rid >= 0 and s.status(int(rid)) != RUNNING:
                self.lane_of[rid] = -1
                self.lane_rids[j] = -1
        self.riders = [rd for rd in self.riders if self.lane_rids[rd.lane] == rd.rid]

    def _seats(self, plan) -> tuple[list, int] | None:
        """([(row, free lane)] for the plan's new rows, the lane count to run at), or None if
        the plan is not the lanes plus riders."""
        s = self.core
        if s.num_waiting or plan.num_preempted:
            return None
        lanes_n = self.lanes.rows
        rids = plan.rid.astype(np.int64)
        lanes = self.lane_of[rids]
        new = np.flatnonzero(lanes < 0)
        free = [j for j in range(lanes_n) if self.lane_rids[j] < 0]
        # More lanes (the next power of two) when none is free: only with no rider in flight, whose
        # hidden states sit right after the lanes' tokens.
        while len(new) > len(free) and lanes_n < self.lanes.max_lanes and not self.riders:
            lanes_n = min(2 * lanes_n, self.lanes.max_lanes)
            free = [j for j in range(lanes_n) if self.lane_rids[j] < 0]
        rows, tokens = lanes_n, lanes_n
        for k in np.flatnonzero(plan.decode == 0):
            rid, j = int(rids[k]), lanes[k]
            if j >= 0 and not self._riding(j, self.launched):
                return None
            # A newcomer rides only with the rest of its prompt after its cache hits (not a chunk, not a
            # recomputation).
            n = s.num_tokens(rid)
            whole = (
                plan.loop[k] == 0
                and plan.start[k] == s.num_computed(rid)
                and plan.start[k] + plan.length[k] == n
            )
            if j < 0 and not (whole and self._plain(rid) and n == len(self.requests[rid].prompt_ids)):
                return None
            rows, tokens = rows + 1, tokens + int(plan.length[k])
        runner = self.runner
        if (plan.decode[new] != 0).any() or len(new) > len(free):
            return None
        if rows > runner.max_rows or tokens > runner.max_tokens:
            return None
        return list(zip(new.tolist(), free)), lanes_n

    def _riding(self, lane: int, launch: int) -> bool:
        return self.span[lane, 0] <= launch <= self.span[lane, 1]

    def _seat(self, rid: int, j: int, start: int) -> None:
        """Request rid (admitted, its prompt not started; `start` prompt tokens cached) rides in lane j
        from the next launch on."""
        s = self.core
        req = self.requests[rid]
        n = len(req.prompt_ids)
        stop_ids = np.full((1, MAX_STOP_IDS), -1, np.int64)
        stop_ids[0, : len(req.eos_ids)] = sorted(req.eos_ids)
        lo, hi, log1mq = req.exit_window
        sp = self.scheduler.sampling
        fields = {
            "tok": [0], "pos": [n], "kvrow": [s.kv_slot(rid)], "cap": [s.cap(rid)], "stop_ids": stop_ids,
            "loop": [0], "lo": [lo], "hi": [hi], "log1mq": np.array([log1mq], np.float32),
            "temp": sp.temperature[rid : rid + 1], "top_k": sp.top_k[rid : rid + 1],
            "top_p": sp.top_p[rid : rid + 1], "min_p": sp.min_p[rid : rid + 1],
        }  # fmt: skip
        self.lanes.seat(np.array([j], np.int64), fields)
        self.lane_rids[j], self.lane_of[rid] = rid, j
        self.forget_classes()  # a reused rid in the same lane would look unchanged
        self.lane_early[j] = lo < hi
        self.lane_lp[j] = req.params.logprobs is not None
        self.lane_filter[j] = filters(req.params)
        self.lane_gram[j] = req.params.structured is not None
        if self.lane_gram[j] or self.mask_set[j]:
            self._mask_dirty.add(j)  # its bitmask (its first token's) goes with its first launch
        self.span[j] = self.launched, self.launched + self.lanes.num_loops - 1
        ids = np.asarray(req.prompt_ids[start:], np.int64)
        self.riders.append(
            Rider(rid=rid, lane=j, ids=ids, kv=s.kv_slot(rid), first=self.launched, start=start)
        )
        self.total_riders += 1
        self._new_slots.append(s.kv_slot(rid))  # its block table goes to the device with the launch
