"""Run-ahead decode: launch the next loop before reading this loop's exits.

When every scheduled row is a plain decode row (one generated token, no prefill,
nothing waiting, sampling the device can do: greedy or temperature with top_k, top_p
and min_p, unseeded, log-probabilities included, a grammar too where the token cannot exit before
its mask can be on the device), the engine
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

Grammars (structured output): the host learns a token one launch behind and advances the request's
matcher; a worker thread fills the next token's bitmask meanwhile. The host uploads it with the first
launch after the fill ends, and waits for the fill only before the launch where the lane's next token may
sample first (loop `lo` of the next token: `lo + 1` launches after the one that sampled). That is `depth`
launches away at the soonest, so a lane with a grammar rides only if its token cannot exit before its loop
`depth` (0-based): at full depth the host has three launches to fill it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..plan import StepPlan, StepResult, TokenLogprobs
from ..scheduler import RUNNING, Scheduler
from .lanes import MAX_STOP_IDS, RING, filters
from .prefix_groups import MAX_CLASSES, prefix_classes
from .riders import Seating, rider_rows
from .runner import GpuRunner

# The engine's step application: (plan, result, host seconds so far, device seconds); it queues the outputs.
Apply = Callable[[StepPlan, StepResult, float, float], None]


class RunAhead(Seating):
    """The host side of decode lanes (engine-owner thread only); newcomers' seats come from Seating
    (riders.py). The engine drives it through `eligible`, `start`, `step`, `arrive` and `reset`."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: GpuRunner,
        requests: Mapping[int, Any],
        full_depth: bool = True,
        depth: int = 1,
    ):
        """requests: the engine's live rid -> Request map (read only). full_depth: run lanes that
        cannot exit early too; depth: launches queued beyond the one being replayed."""
        self.scheduler, self.core, self.blocks = scheduler, scheduler.core, scheduler.blocks
        self.runner, self.requests = runner, requests
        self.lanes = runner.lanes
        self.active = False
        self.lane_rids = np.zeros(0, np.int64)
        self.lane_early = np.zeros(0, bool)  # lanes whose exit window allows an early exit
        self.lane_lp = np.zeros(runner.lanes.max_lanes, bool)  # lanes whose requests want log-probabilities
        self.lane_filter = np.zeros(runner.lanes.max_lanes, bool)  # lanes that sample with top_k/top_p/min_p
        self.lane_gram = np.zeros(runner.lanes.max_lanes, bool)  # lanes whose requests follow a grammar
        self.mask_set = np.zeros(runner.lanes.max_lanes, bool)  # lanes whose device bitmask is not all ones
        self._mask_dirty: set[int] = set()  # lanes seated since the last launch: their bitmasks go with it
        self._mask_due: dict[int, int] = {}  # lane -> the launch its next bitmask, being filled, must reach
        self.full_depth = full_depth
        self.depth = depth
        if not 1 <= self.depth < RING:
            raise ValueError(f"run_ahead_depth must be 1..{RING - 1}, got {self.depth}")
        self.lane_of = np.full(scheduler.capacity, -1, np.int64)  # rid -> lane
        self.launched = 0  # launches of this run
        self.replayed = 0
        self.presched = 0  # the launch whose schedule was made before it ran (start, join): not redone
        self.plan: StepPlan | None = None  # the last schedule made (replayed, or made for a join)
        self.riders = []  # Rider: prompts riding in lanes, with loops still to run
        n = self.lanes.max_lanes
        self.span = np.full((n, 2), -1, np.int64)  # per lane: first and last launch of its rider
        self.rider_off = np.zeros(n, np.int64)  # per lane: its rider's first token in the last step
        self.arrivals: list[int] = []  # rids added during the run, held in the scheduler, not seated yet
        self.release: dict[int, list] = {}  # launch -> (rid, request) whose prompt row starts there
        self._new_slots: list[int] = []  # KV slots of seated riders: their tables go with the next launch
        self._changed_slots = np.zeros(0, np.int64)
        self.total_launches = 0  # over the engine's life (tests, metrics)
        self.runs = 0
        self.total_riders = 0  # prompts that rode in lanes
        self.hand_backs = 0  # runs ended by a newcomer that could not ride
        self.catch_ups = 0  # arrivals that made the host replay every launch in flight first
        self.exit_launches = 0  # replayed launches where a row exited: those that streamed the lm_head
        self.rider_launches = 0  # launches that carried riders (the runner's step graph)
        self._classes_key, self._classes_now = b"", None  # the lanes' prefix classes, and what they are of
        self.holding: list[tuple[int, Any]] = []  # (rid, request) held on the host path for a run's start
        self.hold_steps = 0  # host steps held so far, or (negative) steps left backing off
        self._lanes_could_take = False  # the last host step's decode rows could become lanes
        self.from_hold = False  # the run's arrivals were held for its start and are not seated yet

    # ---- entering -----------------------------------------------------------------------

    def eligible(self, plan: StepPlan) -> bool:
        """May this freshly scheduled step start a run-ahead?"""
        self.note_host_step(plan)
        r = plan.num_rows
        held = len(self._still_held())  # waiting only because they are held for this start
        if self.core.num_waiting > held or r != self.core.num_running or r > self.lanes.max_lanes:
            return False
        # Decode rows only, each one plain, and (unless full depth, where exits are known in advance and the
        # host path never waits on them) some row that may exit early: what note_host_step found.
        return bool(plan.decode.all()) and self._lanes_could_take

    def _plain(self, rid: int, starting: bool = False) -> bool:
        # Sampling the device does alone: greedy or temperature with top_k/top_p/min_p, unseeded, few stop
        # ids, no logits processors, a grammar only if no token can exit before its bitmask is uploaded. A
        # shared prompt's prefix is not an engine request: it never rides. A newcomer that needs launches of
        # a variant not captured yet (log-probabilities, filtering, masking) waits for a run's start, which
        # captures them.
        req = self.requests.get(rid)
        if req is None:
            return False
        p = req.params
        processed = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 or p.logit_bias
        processed = processed or p.min_tokens
        gram = p.structured is not None
        lanes = self.lanes
        lp, filt = lanes.logprobs or p.logprobs is not None, lanes.filtering or filters(p)
        variant = (lp, filt, lanes.masking or gram)
        return (
            p.seed is None
            and len(req.eos_ids) <= MAX_STOP_IDS
            and (starting or lanes.ready(*variant))
            and (not gram or req.exit_window[0] >= self.depth)
            and not processed
        )

    @torch.inference_mode()
    def start(self, plan: StepPlan) -> bool:
        """Turn the scheduled step into the first launch of the lanes (one lane per row, same order).
        False, changing nothing the host path needs, when the pool cannot hold one token ahead."""
        s, runner = self.core, self.runner
        r = plan.num_rows
        rids = plan.rid.astype(np.int64)
        sp = plan.sampling
        self.lane_rids = np.full(self.lanes.max_lanes, -1, np.int64)
        self.lane_rids[:r] = rids
        self.forget_classes()  # the same rids may hold other blocks than in the last run
        self.lane_lp[:], self.lane_filter[:], self.lane_gram[:] = False, False, False
        self.lane_lp[:r] = sp.logprobs[rids] >= 0
        self.lane_filter[:r] = [filters(self.requests[int(rid)].params) for rid in rids]
        self.lane_gram[:r] = [self.requests[int(rid)].params.structured is not None for rid in rids]
        self.lanes.prepare(*self._variant())  # before the lanes' state loads
        if not self._reserve(in_flight=1):
            self.lane_rids = np.zeros(0, np.int64)
            self.release_holds()
            return False
        self._take_holds()
        if plan.num_prop:
            runner.propagate(plan.prop_src, plan.prop_dst)  # owed by the last host-driven step's exits
        stop_ids = np.full((r, MAX_STOP_IDS), -1, np.int64)
        for k, rid in enumerate(rids):
            ids = sorted(self.requests[int(rid)].eos_ids)
            stop_ids[k, : len(ids)] = ids
        lanes = {
            "tok": plan.token_ids, "pos": plan.positions, "kvrow": plan.kv_slot,
            "cap": np.array([s.cap(int(rid)) for rid in rids]), "stop_ids": stop_ids,
            "loop": plan.loop, "lo": plan.exit_lo, "hi": plan.exit_hi,
            "log1mq": plan.log1mq, "temp": sp.temperature[rids], "top_k": sp.top_k[rids],
            "top_p": sp.top_p[rids], "min_p": sp.min_p[rids],
        }  # fmt: skip
        hsrc = torch.from_numpy(plan.hidden_src.copy()).to(runner.device)
        self.lane_of[rids] = np.arange(r)
        self.lane_early = np.zeros(self.lanes.max_lanes, bool)
        self.lane_early[:r] = plan.exit_lo < plan.exit_hi
        slots = np.unique(plan.kv_slot).astype(np.int64)
        self.riders, self.span[:] = [], -1
        self.lanes.start(lanes, hsrc, slots, self.blocks.tables)
        self._mask_dirty = set(np.flatnonzero((self.lane_gram | self.mask_set)[:r]).tolist())
        self._masks()
        self.lanes.logprobs, self.lanes.filtering, self.lanes.masking = self._variant()
        self.lanes.launch()
        self.plan = plan
        self.active, self.launched, self.replayed, self.presched = True, 1, 0, 0
        self.total_launches += 1
        self.runs += 1
        return True

    # ---- one engine step ------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, apply: Apply) -> StepPlan | None:
        """Launch the next step (unless winding down), then replay the oldest launch in flight, handing
        its result to `apply`. An arrival rides from the next launch on, or the host catches up and
        schedules it. Returns, when the run ended with a schedule that the host path must execute,
        that plan."""
        if self.arrivals and not self._seat_arrivals():
            self.catch_up(apply)  # before the release: the replayed schedules must not admit it
            self.catch_ups += 1
            self._release_arrivals()
            return self._join()
        live = self._live()
        # Wind down once no live lane can exit early: the host path then never waits either.
        going = (live & (self.lane_early | self.full_depth)).any() or bool(self.riders)
        # Keep `depth` launches queued behind the one replayed now.
        while going and self.launched - self.replayed <= self.depth:
            if not self._reserve(in_flight=self.launched - self.replayed + 1):
                break
            self._launch(live)
        self._replay(apply)
        if self.replayed == self.launched:
            self._finish()
        return None

    @torch.inference_mode()
    def catch_up(self, apply: Apply) -> None:
        """Replay every launch in flight (before a new request reaches the scheduler, whose
        replayed schedules must not admit it); the lanes stay on the device."""
        while self.replayed < self.launched:
            self._replay(apply)

    def _launch(self, live: np.ndarray) -> None:
        """The next launch: the lanes alone, or with the riders that have loops left."""
        rows = rider_rows(self, self.launched)
        for rd in rows:
            self.rider_off[rd.lane] = rd.off
        kill = (~live).astype(np.int32)
        slots = np.union1d(self._changed_slots, self._new_slots).astype(np.int64)
        self._new_slots = []
        tables = self.blocks.tables
        self.lanes.launch_inputs(kill, slots, tables, [rd.lane for rd in rows], self._classes(live))
        self._masks()
        self.lanes.logprobs, self.lanes.filtering, self.lanes.masking = self._variant()
        if rows:
            self.lanes.launch_with_riders(rows, tables)
            self.rider_launches += 1
        else:
            self.lanes.launch()
        self.launched += 1
        self.total_launches += 1

    # ---- internals --------------------------------------------------------------------------

    def forget_classes(self) -> None:
        """Recompute the prefix classes before the next launch (a lane got a request, or a run starts)."""
        self._classes_key = b""

    def _classes(self, live: np.ndarray):
        """The live lanes' shared-prefix classes (prefix_groups.prefix_classes), recomputed only when the
        lanes or their liveness changed, or after forget_classes() (a class's leading blocks never change
        while its lanes live)."""
        if not self.lanes.cascade_ok:
            return None
        key = self.lane_rids.tobytes() + live.tobytes()
        if key != self._classes_key:
            s, bs = self.core, self.blocks.block_size
            idx = np.flatnonzero(live[: len(self.lane_rids)])
            rids = [int(rid) for rid in self.lane_rids[idx]]
            slots = np.array([s.kv_slot(rid) for rid in rids], np.int64)
            positions = np.array([s.num_tokens(rid) - 1 for rid in rids], np.int64)  # a bound: lanes advance
            cls = np.full(len(self.lane_rids), -1, np.int32)
            lens = np.zeros(MAX_CLASSES, np.int32)
            if len(idx) >= 2:
                cols = int(positions.max()) // bs + 1  # no prefix reaches past the furthest position
                cls[idx], lens = prefix_classes(self.blocks.tables[slots, :, :cols], np.ones(len(idx), bool),
                                                positions, bs)  # fmt: skip
            self._classes_key, self._classes_now = key, (cls, lens)
        return self._classes_now

    def _variant(self) -> tuple[bool, bool, bool]:
        """Whether the launches must compute log-probabilities, filter, and mask: some held lane asks."""
        held = self.lane_rids >= 0
        n = len(held)
        flags = (self.lane_lp, self.lane_filter, self.lane_gram)
        return tuple(bool((f[:n] & held).any()) for f in flags)

    def _masks(self) -> None:
        """Before a launch: upload the grammar bitmasks that are filled, waiting for the fill only where a
        lane may sample in this launch, and those of lanes seated since the last launch (all ones for a lane
        without a grammar whose bitmask was not). No lane samples between its token's replay and its due
        launch (_plain), so a bitmask may reach the device anywhere in between."""
        g = self.scheduler.sampling.grammars
        dirty = self._mask_dirty
        self._mask_dirty = set()
        if g is not None:
            g.start_fill()  # first rows of requests added since
            due = self._mask_due
            seated = any(self.lane_gram[j] for j in dirty)  # their first rows may still be filling
            if due and (seated or g.fill_done() or min(due.values()) <= self.launched):
                g.wait_fill()
                dirty.update(due)
                due.clear()
            elif seated:
                g.wait_fill()
        if not dirty:
            return
        idx = np.array(sorted(dirty), np.int64)
        rows = np.full((len(idx), self.lanes.words), -1, np.int32)
        gram = self.lane_gram[idx]
        if gram.any():
            words = g.bitmask.numpy()[self.lane_rids[idx[gram]]]
            w = min(words.shape[1], rows.shape[1])
            rows[gram, :w] = words[:, :w]
        self.lanes.masks(idx, rows)
        self.mask_set[idx] = gram

    def _expect_masks(self, launch: int) -> None:
        """After replaying `launch`: the lanes whose requests accepted a token there get their next bitmask
        by the launch where that token's successor may sample first."""
        g = self.scheduler.sampling.grammars
        if g is None:
            return
        n = len(self.lane_rids)
        for rid in g.filling | g.stale:
            j = int(self.lane_of[rid])
            if 0 <= j < n and self.lane_gram[j] and j not in self._mask_due:
                self._mask_due[j] = launch + 1 + self.requests[int(rid)].exit_window[0]

    def _live(self) -> np.ndarray:
        s = self.core
        return np.array([rid >= 0 and s.status(int(rid)) == RUNNING for rid in self.lane_rids], dtype=bool)

    def _reserve(self, in_flight: int) -> bool:
        """Blocks for every position a live lane can reach in the launches in flight (one new
        token per launch at most). False, allocating nothing more, when the pool runs dry."""
        s, bt = self.core, self.blocks
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

    def _replay(self, apply: Apply) -> None:
        """Hand the oldest unreplayed launch to the scheduler and the engine, as a host step would."""
        s = self.core
        t0 = time.perf_counter()
        launch = self.replayed
        for rid, req in self.release.pop(launch, ()):
            if self.requests.get(rid) is req:  # not ended meanwhile (its rid may be a newcomer's now)
                s.hold(rid, False)  # its prompt row starts in this schedule, as it did on the device
        if launch != self.presched:
            self.plan = self.scheduler.schedule()  # the run's first launch and a join's were made before
        t1 = time.perf_counter()
        rec = self.lanes.result(launch)  # waits for the device: counted as model time
        t2 = time.perf_counter()
        self.replayed += 1
        plan = self.plan
        if plan is None:
            return
        lanes = self.lane_of[plan.rid]
        ok = (lanes >= 0).all() and plan.num_preempted == 0
        # Rows other than plain decode rows are prompts riding in their lanes at this launch.
        ok = ok and all(self._riding(j, launch) for j in lanes[plan.decode == 0])
        if not ok or not (rec[lanes, 3] == 1).all() or not (rec[lanes, 0] == plan.loop).all():
            raise RuntimeError("run-ahead diverged from the scheduler (a bug): rows and device lanes differ")
        exited = rec[lanes, 1].astype(np.uint8)
        sampled = rec[lanes, 2].astype(np.int32)
        self.exit_launches += bool(exited.any())
        logprobs = self._logprobs(plan, launch, lanes, exited)
        apply(plan, StepResult(exited, sampled, None, logprobs), t1 - t0, t2 - t1)
        self._expect_masks(launch)

    def _logprobs(self, plan: StepPlan, launch: int, lanes: np.ndarray, exited: np.ndarray):
        """rid -> TokenLogprobs of the replayed launch's samples whose requests want them (None: none)."""
        wanted = plan.sampling.logprobs[plan.rid]
        rows = np.flatnonzero(exited.astype(bool) & (wanted >= 0))
        if not rows.size:
            return None
        got = self.lanes.logprobs_result(launch)
        if got is None:
            raise RuntimeError("run-ahead diverged from the scheduler (a bug): a launch sampled for a "
                               "request that wants log-probabilities without computing them")  # fmt: skip
        vals, ids = got
        out = {}
        for r in rows:
            j, n = lanes[r], int(wanted[r])
            out[int(plan.rid[r])] = TokenLogprobs(
                float(vals[j, 0]), int(vals[j, 1]), ids[j, :n].tolist(), vals[j, 2 : 2 + n].tolist()
            )
        return out

    def reset(self) -> None:
        """Forget the lanes without replaying (every request was ended: failure or shutdown)."""
        self.lane_of[:] = -1
        self._end()

    def _finish(self) -> None:
        """Leave run-ahead: the host-driven path continues from the last replayed schedule."""
        p = self.plan
        if p is not None:
            self._place(p.rid, p.tok_off, p.length, p.decode)
        self._end()

    def _place(self, rids, tok_off, lens, decode) -> None:
        """Put the carried state of a replayed schedule's rows where the next host-driven schedule()
        looks for it: hidden states by token index, log-survival at each row's last token."""
        if len(rids) == 0:
            return
        runner, lanes = self.runner, self.lanes
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
        for rid, req in (x for pending in self.release.values() for x in pending):
            if self.requests.get(rid) is req:
                self.core.hold(rid, False)
        self.release, self._new_slots = {}, []
        self._mask_due = {}
        self.plan = None
        self.active = False
