"""Run-ahead decode: launch the next loop before reading this loop's exits.

When every scheduled row is a plain decode row (one generated token, no prefill,
nothing waiting, sampling the fused sampler can do on the device), the engine
hands the batch to the device's decode lanes (engine/lanes.py): each launch
decides exits, samples and moves every lane to its next loop on the device. The
host launches step k+1 first and only then reads step k's records, so the GPU
never idles while the host learns the exits, samples or detokenizes.

A new request does not end the run: its prompt rides in a free lane until its
last loop (engine/riders.py: how newcomers are seated, and when they are not).

The host stays the source of truth by replaying each launch into the scheduler
one launch behind: `schedule()` must produce exactly the lanes the device ran
(checked: loop and liveness of every row), then `update()` takes the recorded
exits and ids, and the engine applies stop conditions as usual. Tokens are
therefore identical to the host-driven path (tested). Before each launch the
host gives every live lane the KV blocks its next tokens can reach and kills the
lanes of requests that ended on the host (stop strings, aborts).
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from .lanes import MAX_STOP_IDS, RING
from .riders import RUNNING, Rider, Seating, rider_rows
from .runner import StepResult


class RunAhead(Seating):
    """The host side of decode lanes, owned by the Engine (engine-owner thread only); newcomers' seats
    come from Seating (engine/riders.py)."""

    def __init__(self, engine):
        # A weak reference: an engine dropped by its owner frees its KV pool without waiting for the GC.
        self.engine = weakref.proxy(engine)
        self.lanes = engine.runner.lanes
        self.active = False
        self.lane_rids = np.zeros(0, np.int64)
        self.lane_early = np.zeros(0, bool)  # lanes whose exit window allows an early exit
        self.full_depth = engine.config.run_ahead_full_depth  # run lanes that cannot exit early too
        self.depth = engine.config.run_ahead_depth  # launches queued beyond the one being replayed
        if not 1 <= self.depth < RING:
            raise ValueError(f"run_ahead_depth must be 1..{RING - 1}, got {self.depth}")
        self.lane_of = np.full(engine.scheduler_capacity, -1, np.int64)  # rid -> lane
        self.launched = 0  # launches of this run
        self.replayed = 0
        self.presched = 0  # the launch whose schedule was made before it ran (start, join): not redone
        self.riders: list[Rider] = []  # prompts riding in lanes, with loops still to run
        n = self.lanes.max_lanes
        self.span = np.full((n, 2), -1, np.int64)  # per lane: first and last launch of its rider
        self.rider_off = np.zeros(n, np.int64)  # per lane: its rider's first token in the last step
        self.handed_back = False  # the run ended with a schedule the host-driven path must execute
        self.arrivals: list[int] = []  # rids added during the run, held in the scheduler, not seated yet
        self.release: dict[int, list] = {}  # launch -> (rid, request) whose prompt row starts there
        self._new_slots: list[int] = []  # KV slots of seated riders: their tables go with the next launch
        self.total_launches = 0  # over the engine's life (tests, metrics)
        self.runs = 0
        self.total_riders = 0  # prompts that rode in lanes
        self.hand_backs = 0  # runs ended by a newcomer that could not ride
        self.catch_ups = 0  # arrivals that made the host replay every launch in flight first
        self.exit_launches = 0  # replayed launches where a row exited: those that streamed the lm_head

    # ---- entering -----------------------------------------------------------------------

    def eligible(self) -> bool:
        """After schedule(): may the scheduled step start a run-ahead?"""
        s = self.engine.scheduler
        r = s.num_rows
        if r == 0 or s.num_waiting or r != s.num_running or r > self.lanes.max_lanes:
            return False
        if not s.row_decode[:r].all():
            return False
        if not self.full_depth and not (s.row_exit_lo[:r] < s.row_exit_hi[:r]).any():
            # Full depth: exits are known in advance and the host path never waits on them.
            return False
        return all(self._plain(int(rid)) for rid in s.row_rid[:r])

    def _plain(self, rid: int) -> bool:
        # Sampling the device does alone: greedy or plain temperature, unseeded, few stop ids.
        req = self.engine.by_rid[rid]
        p = req.params
        plain = p.greedy or (p.top_k <= 0 and p.top_p >= 1.0)
        return p.seed is None and plain and len(req.eos_ids) <= MAX_STOP_IDS

    @torch.inference_mode()
    def start(self) -> bool:
        """Turn the scheduled step into the first launch of the lanes (one lane per row, same order).
        False, changing nothing the host path needs, when the pool cannot hold one token ahead."""
        e, s, runner = self.engine, self.engine.scheduler, self.engine.runner
        r = s.num_rows
        rids = s.row_rid[:r].astype(np.int64)
        self.lane_rids = np.full(self.lanes.max_lanes, -1, np.int64)
        self.lane_rids[:r] = rids
        if not self._reserve(in_flight=1):
            self.lane_rids = np.zeros(0, np.int64)
            return False
        if s.num_prop:
            runner.propagate(s)  # owed by the last host-driven step's exits
        stop_ids = np.full((r, MAX_STOP_IDS), -1, np.int64)
        for k, rid in enumerate(rids):
            ids = sorted(e.by_rid[int(rid)].eos_ids)
            stop_ids[k, : len(ids)] = ids
        lanes = {
            "tok": s.token_ids[:r], "pos": s.positions[:r], "kvrow": s.row_kv_slot[:r],
            "cap": np.array([s.cap(int(rid)) for rid in rids]), "stop_ids": stop_ids,
            "loop": s.row_loop[:r], "lo": s.row_exit_lo[:r], "hi": s.row_exit_hi[:r],
            "log1mq": s.row_log1mq[:r], "temp": e.sampling.temperature[rids],
        }  # fmt: skip
        hsrc = torch.from_numpy(s.hidden_src[:r].copy()).to(runner.device)
        self.lane_of[rids] = np.arange(r)
        self.lane_early = np.zeros(self.lanes.max_lanes, bool)
        self.lane_early[:r] = s.row_exit_lo[:r] < s.row_exit_hi[:r]
        slots = np.unique(s.row_kv_slot[:r]).astype(np.int64)
        self.riders, self.span[:] = [], -1
        self.lanes.start(lanes, hsrc, slots, e.bt.tables)
        self.lanes.launch()
        self.active, self.launched, self.replayed, self.presched = True, 1, 0, 0
        self.total_launches += 1
        self.runs += 1
        return True

    # ---- one engine step ------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list:
        """Launch the next step (unless winding down), then replay the oldest launch in flight.
        An arrival rides from the next launch on, or the host catches up and schedules it."""
        if self.arrivals and not self._seat_arrivals():
            outputs = self.catch_up()  # before the release: the replayed schedules must not admit it
            self.catch_ups += 1
            self._release_arrivals()
            return outputs + self._join()
        live = self._live()
        # Wind down once no live lane can exit early: the host path then never waits either.
        going = (live & (self.lane_early | self.full_depth)).any() or bool(self.riders)
        # Keep `depth` launches queued behind the one replayed now.
        while going and self.launched - self.replayed <= self.depth:
            if not self._reserve(in_flight=self.launched - self.replayed + 1):
                break
            self._launch(live)
        outputs = self._replay()
        if self.replayed == self.launched:
            self._finish()
        return outputs

    @torch.inference_mode()
    def catch_up(self) -> list:
        """Replay every launch in flight (before a new request reaches the scheduler, whose
        replayed schedules must not admit it); the lanes stay on the device."""
        outputs = []
        while self.replayed < self.launched:
            outputs += self._replay()
        return outputs

    def _launch(self, live: np.ndarray) -> None:
        """The next launch: the lanes alone, or with the riders that have loops left."""
        e = self.engine
        rows = rider_rows(self, self.launched)
        for rd in rows:
            self.rider_off[rd.lane] = rd.off
        kill = (~live).astype(np.int32)
        slots = np.union1d(self._changed_slots, self._new_slots).astype(np.int64)
        self._new_slots = []
        self.lanes.launch_inputs(kill, slots, e.bt.tables, [rd.lane for rd in rows])
        if rows:
            self.lanes.launch_with_riders(rows, e.bt.tables)
        else:
            self.lanes.launch()
        self.launched += 1
        self.total_launches += 1

    # ---- internals --------------------------------------------------------------------------

    def _live(self) -> np.ndarray:
        s = self.engine.scheduler
        return np.array([rid >= 0 and s.status(int(rid)) == RUNNING for rid in self.lane_rids], dtype=bool)

    def _reserve(self, in_flight: int) -> bool:
        """Blocks for every position a live lane can reach in the launches in flight (one new
        token per launch at most). False, allocating nothing more, when the pool runs dry."""
        s, bt = self.engine.scheduler, self.engine.bt
        changed = []
        counts = bt.num_blocks_of
        for rid in self.lane_rids:
            rid = int(rid)
            if rid < 0 or s.status(rid) != RUNNING:
                continue
            slot = s.kv_slot(rid)
            before = int(counts[slot])
            end = min(s.num_tokens(rid) + in_flight, s.cap(rid))
            if not bt.allocate(slot, end):
                self._changed_slots = np.array(changed, np.int64)
                return False
            if int(counts[slot]) != before:
                changed.append(slot)
        self._changed_slots = np.array(changed, np.int64)
        return True

    def _replay(self) -> list:
        """Apply the oldest unreplayed launch to the scheduler and the engine, as a host step would."""
        e, s = self.engine, self.engine.scheduler
        t0 = time.perf_counter()
        launch = self.replayed
        for rid, req in self.release.pop(launch, ()):
            if e.by_rid.get(rid) is req:  # not ended meanwhile (its rid may be a newcomer's now)
                s.hold(rid, False)  # its prompt row starts in this schedule, as it did on the device
        if launch != self.presched:
            s.schedule()  # the run's first launch and a join's ran a schedule made before them
        t1 = time.perf_counter()
        rec = self.lanes.result(launch)  # waits for the device: counted as model time
        t2 = time.perf_counter()
        self.replayed += 1
        r = s.num_rows
        if r == 0:
            return []
        lanes = self.lane_of[s.row_rid[:r]]
        ok = (lanes >= 0).all() and s.num_preempted == 0
        # Rows other than plain decode rows are prompts riding in their lanes at this launch.
        ok = ok and all(self._riding(j, launch) for j in lanes[s.row_decode[:r] == 0])
        if not ok or not (rec[lanes, 3] == 1).all() or not (rec[lanes, 0] == s.row_loop[:r]).all():
            raise RuntimeError("run-ahead diverged from the scheduler (a bug): rows and device lanes differ")
        exited = rec[lanes, 1].astype(np.uint8)
        sampled = rec[lanes, 2].astype(np.int32)
        self.exit_launches += bool(exited.any())
        events = s.update(exited, sampled)
        t3 = time.perf_counter()
        outputs = e._apply_events(events, StepResult(exited, sampled))
        t4 = time.perf_counter()
        e.stats.record(s, e.bt, events, t1 - t0 + t3 - t2, t2 - t1, t4 - t3)
        return outputs

    def reset(self) -> None:
        """Forget the lanes without replaying (every request was ended: failure or shutdown)."""
        self.lane_of[:] = -1
        self._end()

    def _finish(self) -> None:
        """Leave run-ahead: the host-driven path continues from the last replayed schedule."""
        s = self.engine.scheduler
        r = s.num_rows
        self._place(s.row_rid[:r], s.row_tok_off[:r], s.row_len[:r], s.row_decode[:r])
        self._end()

    def _place(self, rids, tok_off, lens, decode) -> None:
        """Put the carried state of a replayed schedule's rows where the next host-driven schedule()
        looks for it: hidden states by token index, log-survival at each row's last token."""
        if len(rids) == 0:
            return
        runner, lanes = self.engine.runner, self.lanes
        n_h, n_ls = lanes.h.shape[0], lanes.ls.shape[0]
        h_src = np.zeros(int((tok_off + lens).max()), np.int64)
        ls_src, ls_dst = np.zeros(len(rids), np.int64), (tok_off + lens - 1).astype(np.int64)
        for k, j in enumerate(self.lane_of[rids]):
            o, n = int(tok_off[k]), int(lens[k])
            if decode[k]:
                h_src[o], ls_src[k] = j, j
            else:  # a rider: its prompt's states are the runner's, at its tokens in the last step
                off = int(self.rider_off[j])
                h_src[o : o + n] = n_h + off + np.arange(n)
                ls_src[k] = n_ls + off + n - 1
        dev = runner.device
        h_all = torch.cat([lanes.h, runner.h_prev])
        runner.h_prev[: len(h_src)] = h_all[torch.from_numpy(h_src).to(dev)]
        ls_all = torch.cat([lanes.ls, runner.ls_prev])
        runner.ls_prev[torch.from_numpy(ls_dst).to(dev)] = ls_all[torch.from_numpy(ls_src).to(dev)]

    def _end(self) -> None:
        self.lane_of[self.lane_rids[self.lane_rids >= 0]] = -1
        self.lane_rids = np.zeros(0, np.int64)
        self.riders, self.span[:] = [], -1
        self._release_arrivals()
        # Seated riders whose launch never ran (the pool ran dry first): the host path starts them.
        e = self.engine
        for rid, req in (x for pending in self.release.values() for x in pending):
            if e.by_rid.get(rid) is req:
                e.scheduler.hold(rid, False)
        self.release, self._new_slots = {}, []
        self.active = False
