"""Run-ahead decode: launch the next loop before reading this loop's exits.

When every scheduled row is a plain decode row (one generated token, no prefill,
nothing waiting, sampling the fused sampler can do on the device), the engine
hands the batch to the device's decode lanes (engine/lanes.py): each launch
decides exits, samples and moves every lane to its next loop on the device. The
host launches step k+1 first and only then reads step k's records, so the GPU
never idles while the host learns the exits, samples or detokenizes.

The host stays the source of truth by replaying each launch into the scheduler
one launch behind: `schedule()` must produce exactly the lanes the device ran
(checked: loop and liveness of every row), then `update()` takes the recorded
exits and ids, and the engine applies stop conditions as usual. Tokens are
therefore identical to the host-driven path (tested). Before each launch the
host gives every live lane the KV blocks its next tokens can reach and kills the
lanes of requests that ended on the host (stop strings, aborts). A new request
ends run-ahead (the in-flight launches are replayed first); the next
`schedule()` then admits it as usual.
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from .lanes import MAX_STOP_IDS, RING
from .runner import StepResult

RUNNING = 2  # LoopScheduler status of a request holding KV


class RunAhead:
    """The host side of decode lanes, owned by the Engine (engine-owner thread only)."""

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
        self.launched = 0  # launches of this run (the first replays the schedule made before start)
        self.replayed = 0
        self.total_launches = 0  # over the engine's life (tests, metrics)
        self.runs = 0

    # ---- entering -----------------------------------------------------------------------

    def eligible(self) -> bool:
        """After schedule(): may the scheduled step start a run-ahead?"""
        e, s = self.engine, self.engine.scheduler
        r = s.num_rows
        if r == 0 or s.num_waiting or r != s.num_running or r > self.lanes.max_lanes:
            return False
        if not s.row_decode[:r].all():
            return False
        if not self.full_depth and not (s.row_exit_lo[:r] < s.row_exit_hi[:r]).any():
            # Full depth: exits are known in advance and the host path never waits on them.
            return False
        for rid in s.row_rid[:r]:
            req = e.by_rid[int(rid)]
            p = req.params
            plain = p.greedy or (p.top_k <= 0 and p.top_p >= 1.0)
            if p.seed is not None or not plain or len(req.eos_ids) > MAX_STOP_IDS:
                return False
        return True

    @torch.inference_mode()
    def start(self) -> bool:
        """Turn the scheduled step into the first launch of the lanes (one lane per row, same order).
        False, changing nothing the host path needs, when the pool cannot hold one token ahead."""
        e, s, runner = self.engine, self.engine.scheduler, self.engine.runner
        r = s.num_rows
        rids = s.row_rid[:r].astype(np.int64)
        self.lane_rids = rids
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
        self.lane_early = s.row_exit_lo[:r] < s.row_exit_hi[:r]
        slots = np.unique(s.row_kv_slot[:r]).astype(np.int64)
        self.lanes.start(lanes, hsrc, slots, e.bt.tables)
        self.lanes.launch()
        self.active, self.launched, self.replayed = True, 1, 0
        self.total_launches += 1
        self.runs += 1
        return True

    # ---- one engine step ------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list:
        """Launch the next step (unless winding down), then replay the oldest launch in flight."""
        live = self._live()
        # Wind down once no live lane can exit early: the host path then never waits either.
        going = (live & (self.lane_early | self.full_depth)).any()
        # Keep `depth` launches queued behind the one replayed now.
        while going and self.launched - self.replayed <= self.depth:
            if not self._reserve(in_flight=self.launched - self.replayed + 1):
                break
            self.lanes.launch_inputs((~live).astype(np.int32), self._changed_slots, self.engine.bt.tables)
            self.lanes.launch()
            self.launched += 1
            self.total_launches += 1
        outputs = self._replay()
        if self.replayed == self.launched:
            self._finish()
        return outputs

    @torch.inference_mode()
    def drain(self) -> list:
        """Replay every launch in flight and hand the batch back to the host-driven path."""
        outputs = []
        while self.active:
            outputs += self._replay()
            if self.replayed == self.launched:
                self._finish()
        return outputs

    # ---- internals --------------------------------------------------------------------------

    def _live(self) -> np.ndarray:
        s = self.engine.scheduler
        return np.array([s.status(int(rid)) == RUNNING for rid in self.lane_rids], dtype=bool)

    def _reserve(self, in_flight: int) -> bool:
        """Blocks for every position a live lane can reach in the launches in flight (one new
        token per launch at most). False, allocating nothing more, when the pool runs dry."""
        s, bt = self.engine.scheduler, self.engine.bt
        changed = []
        counts = bt.num_blocks_of
        for rid in self.lane_rids:
            rid = int(rid)
            if s.status(rid) != RUNNING:
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
        if self.replayed > 0:
            s.schedule()  # the first launch ran the schedule made before start()
        t1 = time.perf_counter()
        rec = self.lanes.result(self.replayed)  # waits for the device: counted as model time
        t2 = time.perf_counter()
        self.replayed += 1
        r = s.num_rows
        if r == 0:
            return []
        lanes = self.lane_of[s.row_rid[:r]]
        ok = (lanes >= 0).all() and s.num_preempted == 0 and s.row_decode[:r].all()
        if not ok or not (rec[lanes, 3] == 1).all() or not (rec[lanes, 0] == s.row_loop[:r]).all():
            raise RuntimeError("run-ahead diverged from the scheduler (a bug): rows and device lanes differ")
        exited = rec[lanes, 1].astype(np.uint8)
        sampled = rec[lanes, 2].astype(np.int32)
        events = s.update(exited, sampled)
        t3 = time.perf_counter()
        outputs = e._apply_events(events, StepResult(exited, sampled))
        t4 = time.perf_counter()
        e.stats.record(s, e.bt, events, t1 - t0 + t3 - t2, t2 - t1, t4 - t3)
        return outputs

    def reset(self) -> None:
        """Forget the lanes without replaying (every request was ended: failure or shutdown)."""
        self.lane_of[:] = -1
        self.lane_rids = np.zeros(0, np.int64)
        self.active = False

    def _finish(self) -> None:
        """Leave run-ahead: the host-driven path continues from the last replayed schedule."""
        s, runner = self.engine.scheduler, self.engine.runner
        r = s.num_rows
        if r:
            # The next schedule() carries rows by their index in the last step: put the lanes there.
            perm = torch.from_numpy(self.lane_of[s.row_rid[:r]].copy()).to(runner.device)
            runner.h_prev[:r] = self.lanes.h[perm]
            runner.ls_prev[:r] = self.lanes.ls[perm]
        self.lane_of[self.lane_rids] = -1
        self.lane_rids = np.zeros(0, np.int64)
        self.active = False
