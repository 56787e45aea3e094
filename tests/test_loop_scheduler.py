"""LoopScheduler under random traffic, driven by a fake runner (no model).

A small reference model of every request (its tokens, per-token depths, how
far it is computed, its row in flight, its place in the queues) predicts what
each schedule() and update() must show; every step checks the public outputs
and the block table against it. The compiled core and the uncompiled twin are
driven in lockstep on the same traces and must agree on every output array.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ouro_fast.core.block_table as bt_c
import ouro_fast.core.loop_scheduler as ls_c
import ouro_fast.core_py.block_table as bt_py
import ouro_fast.core_py.loop_scheduler as ls_py

T = 4
NO_EXIT = 127
FREE, WAITING, RUNNING = 0, 1, 2
COMPILED = ((bt_c, ls_c),)
BOTH = ((bt_c, ls_c), (bt_py, ls_py))

ROW_ARRAYS = ("row_rid", "row_kv_slot", "row_loop", "row_start", "row_len", "row_tok_off")
ROW_ARRAYS += ("row_exit_lo", "row_exit_hi", "row_log1mq", "row_new")
TOKEN_ARRAYS = ("token_ids", "positions", "slot_mapping", "hidden_src")
COUNTERS = ("num_rows", "num_step_tokens", "num_cont_tokens", "num_prop", "num_events")
COUNTERS += ("num_preempted", "num_refills", "num_running", "num_waiting")
EVENT_ARRAYS = ("ev_rid", "ev_token", "ev_loop", "ev_finished")


@dataclass(frozen=True)
class Spec:
    """One request of a trace: when it arrives and what it asks for."""

    arrival: int
    prompt_len: int
    max_new: int
    min_loops: int
    max_loops: int
    log1mq: float


@dataclass(frozen=True)
class Trace:
    block_size: int
    num_blocks: int
    max_rows: int
    max_tokens: int
    max_requests: int
    refill: bool
    specs: tuple[Spec, ...]
    seed: int
    p_exit: float  # chance that a row allowed (not forced) to exit does
    p_abort: float  # chance per step of finish() on a random live request
    caching: bool = False  # a prefix-caching block table, and prompts cut from two shared texts


@dataclass
class Row:
    """A row in flight: its loop at the next step, and its offset in the last batch."""

    loop: int
    start: int
    length: int
    live: bool
    off: int


@dataclass
class Req:
    """The reference model of one request."""

    rid: int
    spec: Spec
    arrival: int
    cap: int
    tokens: list[int]
    depth: list[int]  # T for prompt tokens, exit loop + 1 once a generated token exited, 0 before
    status: int = WAITING
    done: int = 0  # tokens [0, done) are computed to their depth
    slot: int = -1
    row: Row | None = None
    epoch: int = 0  # bumped when it loses its KV: propagation queued before is void
    sampled: list[int] = field(default_factory=list)

    @property
    def num_prompt(self) -> int:
        return self.spec.prompt_len


def phys(tables: np.ndarray, bs: int, slot: int, loop: int, pos: int) -> int:
    block = int(tables[slot, loop, pos // bs])
    assert block >= 0, f"slot {slot} loop {loop} position {pos} has no block"
    return block * bs + pos % bs


class Sim:
    """Drives one or more (BlockTable, LoopScheduler) pairs in lockstep and checks them every step."""

    def __init__(self, trace: Trace, impls=COMPILED, seniority: bool = False):
        self.tr = trace
        self.seniority = seniority  # also check the preemption policy: by arrival, youngest idle first
        max_cap = max(s.prompt_len + s.max_new for s in trace.specs)
        self.max_bps = -(-max_cap // trace.block_size)
        self.bts, self.scheds = [], []
        for bt_mod, ls_mod in impls:
            bt = bt_mod.BlockTable(
                trace.num_blocks, trace.block_size, T, trace.max_rows, self.max_bps, trace.caching
            )
            self.bts.append(bt)
            self.scheds.append(
                ls_mod.LoopScheduler(bt, trace.max_requests, trace.max_rows, trace.max_tokens, trace.refill)
            )
        self.rng = random.Random(trace.seed)
        self.todo = sorted(trace.specs, key=lambda s: s.arrival)
        self.reqs: dict[int, Req] = {}  # live requests by rid
        self.running: list[Req] = []
        # The waiting queue as groups in queue order; the requests preempted at one step form one
        # group, whose inner order (oldest first) only the seniority checks assume.
        self.queue: list[list[Req]] = []
        self.prev_rows: list[Req] = []
        self.pend: list[tuple[Req, int, int, int]] = []  # (request, position, exit loop, epoch), last update
        self.arrivals = 0
        self.steps = 0
        self.preemptions = 0
        self.done: list[Req] = []
        self.texts = [[self.rng.randrange(50_000) for _ in range(40)] for _ in range(2)]
        self.content: dict[
            int, tuple
        ] = {}  # physical slot -> (the token prefix, loop) its K/V was written for
        self.hits = 0  # prompt tokens admissions took from the cache

    @property
    def s(self):
        return self.scheds[0]

    @property
    def bt(self):
        return self.bts[0]

    # ---- the driver --------------------------------------------------------------

    def run(self, max_steps: int) -> None:
        while self.todo or self.reqs:
            assert self.steps < max_steps, (
                f"no progress: {len(self.reqs)} requests left after {self.steps} steps"
            )
            self.step()
        self.check_idle()

    def step(self) -> None:
        self.maybe_abort()  # before arrivals, so a freed rid can be reused at once
        self.arrive()
        if self.schedule():
            self.update()
        self.steps += 1

    def arrive(self) -> None:
        while self.todo and self.todo[0].arrival <= self.steps:
            spec = self.todo[0]
            prompt = [self.rng.randrange(50_000) for _ in range(spec.prompt_len)]
            if self.tr.caching:  # a prefix of one of two texts, its last token its own
                prompt = self.rng.choice(self.texts)[: spec.prompt_len - 1] + prompt[-1:]
            cap = spec.prompt_len + spec.max_new
            args = (np.array(prompt, np.int32), cap, spec.min_loops, spec.max_loops, spec.log1mq)
            if len(self.reqs) == self.tr.max_requests:
                for s in self.scheds:
                    with pytest.raises(OverflowError):
                        s.add(*args)
                return  # it arrives again once a request leaves
            rids = {s.add(*args) for s in self.scheds}
            assert len(rids) == 1, "the twins handed out different rids"
            rid = rids.pop()
            assert rid not in self.reqs and 0 <= rid < self.tr.max_requests
            req = Req(rid, spec, self.arrivals, cap, list(prompt), [T] * spec.prompt_len)
            self.arrivals += 1
            self.reqs[rid] = req
            self.queue.append([req])
            self.todo.pop(0)

    def maybe_abort(self) -> None:
        if self.rng.random() >= self.tr.p_abort:
            return
        if self.reqs:
            self.drop(self.reqs[self.rng.choice(sorted(self.reqs))])
        free = [r for r in range(self.tr.max_requests) if r not in self.reqs]
        if free:  # finish() of an unused rid is a no-op
            for s in self.scheds:
                s.finish(self.rng.choice(free))
        self.check_requests()
        self.check_pool()

    def drop(self, req: Req) -> None:
        for s in self.scheds:
            s.finish(req.rid)
        for s in self.scheds:
            assert s.status(req.rid) == FREE
        self.forget(req)

    def forget(self, req: Req) -> None:
        req.status = FREE
        del self.reqs[req.rid]
        if req in self.running:
            self.running.remove(req)
        self.queue = [[r for r in g if r is not req] for g in self.queue]
        self.queue = [g for g in self.queue if g]
        self.done.append(req)

    @property
    def waiting(self) -> list[Req]:
        return [r for g in self.queue for r in g]

    # ---- schedule ----------------------------------------------------------------

    def schedule(self) -> int:
        covered = self.bt.num_blocks_of.copy() * self.tr.block_size
        self.epochs = {r.rid: self.s.kv_epoch(r.rid) for r in self.running}
        counts = [s.schedule() for s in self.scheds]
        self.compare_twins(())
        n = counts[0]
        assert n == self.s.num_rows
        if n == 0:
            assert not self.reqs, "schedule() chose no row while requests wait: nothing would ever change"
        self.check_budgets()
        cont = self.check_continuing()
        self.apply_preemptions(covered)
        self.check_new_rows(cont)
        self.check_rows()
        self.check_propagation()
        self.check_requests()
        self.check_pool()
        self.prev_rows = [self.reqs[int(rid)] for rid in self.s.row_rid[:n]]
        return n

    def check_budgets(self) -> None:
        s, tr = self.s, self.tr
        n = s.num_rows
        assert n <= tr.max_rows and s.num_step_tokens <= tr.max_tokens
        rids = s.row_rid[:n].tolist()
        assert len(set(rids)) == n, "a request has two rows in one step"
        lens = s.row_len[:n].tolist()
        assert all(x >= 1 for x in lens)
        assert s.row_tok_off[:n].tolist() == np.cumsum([0, *lens])[:n].tolist(), "rows are not contiguous"
        assert sum(lens) == s.num_step_tokens
        loops = s.row_loop[:n].tolist()
        c = next((k for k, t in enumerate(loops) if t == 0), n)
        assert all(t == 0 for t in loops[c:]), "a continuing row follows a new row"
        assert all(0 < t < T for t in loops[:c])
        assert s.num_cont_tokens == sum(lens[:c])
        assert s.row_new[:n].tolist() == [0] * c + [1] * (n - c)
        assert s.num_refills == (n - c if c else 0)
        if not tr.refill and c > 0:
            assert n == c, "refill=False started a new row while others are mid-loop"

    def check_continuing(self) -> int:
        """Rows in flight continue first, in last-step order, at the next loop with the same tokens."""
        s = self.s
        expected = [r for r in self.prev_rows if r.status == RUNNING and r.row is not None]
        c = len(expected)
        assert c <= s.num_rows, "a row in flight was dropped"
        assert s.row_loop[:c].tolist() == [r.row.loop for r in expected]
        assert c == s.num_rows or s.row_loop[c] == 0, "an unexpected row continues"
        for k, req in enumerate(expected):
            row, off = req.row, int(s.row_tok_off[k])
            assert int(s.row_rid[k]) == req.rid
            assert (int(s.row_start[k]), int(s.row_len[k])) == (row.start, row.length)
            assert int(s.row_kv_slot[k]) == req.slot
            hs = s.hidden_src[off : off + row.length].tolist()
            assert hs == list(range(row.off, row.off + row.length)), "hidden_src misses the row's own tokens"
            row.off = off
        return c

    def apply_preemptions(self, covered: np.ndarray) -> None:
        """Find the requests this schedule preempted: never one with a row in flight."""
        s = self.s
        n = s.num_rows
        # A running request that lost its KV (its epoch moved) was preempted, and maybe readmitted.
        restarted = {
            int(s.row_rid[k])
            for k in range(n)
            if s.kv_epoch(int(s.row_rid[k])) != self.epochs.get(int(s.row_rid[k]))
        }
        preempted = []
        for req in self.running:
            st_now = s.status(req.rid)
            assert st_now in (WAITING, RUNNING)
            assert req.row is not None or req.done > 0
            if st_now == WAITING or (req.row is None and req.rid in restarted):
                assert req.row is None, "a request with a row in flight was preempted"
                preempted.append(req)
        assert s.num_preempted == len(preempted)
        if self.seniority:
            self.check_victims(preempted, covered)
        for v in preempted:
            self.running.remove(v)
            v.status, v.done, v.slot = WAITING, 0, -1
            v.epoch += 1
        if preempted:
            self.queue.insert(0, sorted(preempted, key=lambda r: r.arrival))
        self.preemptions += len(preempted)

    def check_victims(self, preempted: list[Req], covered: np.ndarray) -> None:
        """Victims are the youngest idle requests (by arrival); the oldest is never a younger one's victim."""
        with_rows = {int(r) for r in self.s.row_rid[: self.s.num_rows]}
        for v in preempted:
            for w in self.running:
                if w.arrival > v.arrival and w not in preempted:
                    assert w.rid in with_rows, "preempted an older request while a younger one sat idle"
        oldest = min(self.running, key=lambda r: r.arrival, default=None)
        # Needing no block itself, the oldest cannot have preempted itself: a younger request did.
        assert not (oldest in preempted and covered[oldest.slot] >= len(oldest.tokens)), (
            f"the oldest running request (rid {oldest.rid}) was preempted by a younger one"
        )

    def check_new_rows(self, c: int) -> None:
        """New loop-0 rows: decode tokens, then prefill chunks, then admissions in queue order."""
        s, tr = self.s, self.tr
        last_key = (-1, -1)
        admitted = 0
        for k in range(c, s.num_rows):
            req = self.reqs[int(s.row_rid[k])]
            start, length = int(s.row_start[k]), int(s.row_len[k])
            if req.status == WAITING:
                head = self.queue[0]
                assert req in head, "admission out of queue order"
                assert not self.seniority or req is head[0], "preempted requests readmitted out of age order"
                head.remove(req)
                if not head:
                    self.queue.pop(0)
                admitted += 1
                slot = int(s.row_kv_slot[k])
                assert 0 <= slot < tr.max_rows and all(r.slot != slot for r in self.running)
                req.status, req.slot = RUNNING, slot
                self.running.append(req)
                key = (2, admitted)
            else:
                assert req.row is None and int(s.row_kv_slot[k]) == req.slot
                left = len(req.tokens) - req.done
                # Running requests take their turns oldest first (seniority) or in any fixed order.
                key = (0 if left == 1 else 1, req.arrival if self.seniority else 0)
            assert key >= last_key, "new rows out of decode / prefill / admission order"
            last_key = key
            if key[0] == 2 and start:
                self.check_hit(req, start)
            assert start == req.done, "a new row does not start at the first uncomputed token"
            budget = tr.max_tokens - int(s.row_tok_off[k])
            assert length == min(len(req.tokens) - start, budget), "a chunk is shorter than the budget allows"
            req.row = Row(0, start, length, start + length == len(req.tokens), int(s.row_tok_off[k]))
        for req in self.waiting:
            assert s.status(req.rid) == WAITING
        for req in self.running:
            assert s.status(req.rid) == RUNNING
        assert s.num_waiting == len(self.waiting) and s.num_running == len(self.running)
        assert len(self.running) <= tr.max_rows

    def check_hit(self, req: Req, start: int) -> None:
        """An admission that starts past 0 took cache hits: whole prompt blocks short of the last prompt
        token, whose K/V at every loop was computed for exactly this prefix."""
        bs = self.tr.block_size
        assert self.tr.caching and start % bs == 0 and start <= (req.num_prompt - 1) // bs * bs
        for pos in range(start):
            for t in range(T):
                got = self.content.get(phys(self.bt.tables, bs, req.slot, t, pos))
                assert got == (tuple(req.tokens[: pos + 1]), t), "a cache hit holds another prefix's K/V"
        req.done = start
        self.hits += start

    def check_rows(self) -> None:
        """Per row and token: exit window, positions, ids, hidden_src, and where K/V is written."""
        s, bs = self.s, self.tr.block_size
        tables = self.bt.tables
        written = []
        for k in range(s.num_rows):
            req = self.reqs[int(s.row_rid[k])]
            row, loop = req.row, int(s.row_loop[k])
            lo, hi = int(s.row_exit_lo[k]), int(s.row_exit_hi[k])
            if row.live:
                assert (lo, hi) == (req.spec.min_loops - 1, req.spec.max_loops - 1)
            else:
                assert lo == hi == NO_EXIT
            assert s.row_log1mq[k] == np.float32(req.spec.log1mq) or np.isnan(req.spec.log1mq)
            off, end = int(s.row_tok_off[k]), row.start + row.length
            assert s.positions[off : off + row.length].tolist() == list(range(row.start, end))
            assert s.token_ids[off : off + row.length].tolist() == req.tokens[row.start : end]
            if loop == 0:
                assert (s.hidden_src[off : off + row.length] == -1).all()
            for i, pos in enumerate(range(row.start, end)):
                got = int(s.slot_mapping[off + i])
                d = req.depth[pos]
                if d != 0 and d <= loop:
                    assert got == -1, "a token past its depth overwrites its propagated K/V"
                else:
                    assert got == phys(tables, bs, req.slot, loop, pos)
                    written.append(got)
                    self.content[got] = (tuple(req.tokens[: pos + 1]), loop)
        assert len(written) == len(set(written)), "two tokens write one physical slot"
        assert (self.bt.cached[np.array(written, np.int64) // bs] == -1).all(), (
            "a write lands in a cached block"
        )
        self.written = set(written)

    def check_propagation(self) -> None:
        """Pairs copy each token that stopped at loop e last step into planes e+1..T-1, same position."""
        s, bs = self.s, self.tr.block_size
        tables = self.bt.tables
        expected = []
        for req, pos, e, epoch in self.pend:
            if req.status == RUNNING and req.epoch == epoch:
                src = phys(tables, bs, req.slot, e, pos)
                expected += [(src, phys(tables, bs, req.slot, j, pos)) for j in range(e + 1, T)]
        n = s.num_prop
        got = list(zip(s.prop_src[:n].tolist(), s.prop_dst[:n].tolist()))
        assert sorted(got) == sorted(expected)
        dst = [d for _, d in got]
        assert len(dst) == len(set(dst))
        assert not self.written.intersection(dst), "this step overwrites a propagated copy"
        assert (self.bt.cached[np.array(dst, np.int64) // bs] == -1).all(), "a copy lands in a cached block"
        for src, d in got:
            self.content[d] = ("copy", self.content.get(src))
        self.pend = []

    # ---- update ------------------------------------------------------------------

    def update(self) -> None:
        s, rng = self.s, self.rng
        n = s.num_rows
        exited = np.zeros(n, np.uint8)
        sampled = np.array([rng.randrange(50_000) for _ in range(n)], np.int32)
        for k in range(n):
            loop, lo, hi = int(s.row_loop[k]), int(s.row_exit_lo[k]), int(s.row_exit_hi[k])
            if lo == NO_EXIT:
                continue
            exited[k] = loop >= hi or (loop >= lo and rng.random() < self.tr.p_exit)
        counts = [sc.update(exited, sampled) for sc in self.scheds]
        self.compare_twins(EVENT_ARRAYS)
        expected = self.apply_update(exited, sampled)
        assert counts[0] == s.num_events == len(expected)
        got = list(zip(*(getattr(s, a)[: s.num_events].tolist() for a in EVENT_ARRAYS)))
        assert got == expected
        self.check_requests()
        self.check_pool()

    def apply_update(self, exited: np.ndarray, sampled: np.ndarray) -> list[tuple]:
        events = []
        for k, req in enumerate(self.prev_rows):
            row = req.row
            if row.live and exited[k]:
                last = row.start + row.length - 1
                if req.depth[last] == 0:
                    req.depth[last] = row.loop + 1
                tok = int(sampled[k])
                req.tokens.append(tok)
                req.depth.append(0)
                req.sampled.append(tok)
                row.live = False
                finished = len(req.tokens) >= req.cap
                events.append((req.rid, tok, row.loop, int(finished)))
                if finished:
                    assert len(req.sampled) == req.spec.max_new
                    self.forget(req)
                    continue
            self.advance(req)
        return events

    def advance(self, req: Req) -> None:
        row = req.row
        end = row.start + row.length
        if row.loop + 1 < T:
            for pos in range(max(row.start, req.num_prompt), end):
                if req.depth[pos] == row.loop + 1:
                    self.pend.append((req, pos, row.loop, req.epoch))
        assert not (row.live and row.loop + 1 >= T), "the live token never exited"
        if not row.live and max(req.depth[row.start : end]) <= row.loop + 1:
            req.done, req.row = end, None
        else:
            row.loop += 1

    # ---- state checks ------------------------------------------------------------

    def check_requests(self) -> None:
        for s in self.scheds:
            assert s.num_running == len(self.running) and s.num_waiting == len(self.waiting)
            for req in self.reqs.values():
                assert s.status(req.rid) == req.status
                assert s.kv_slot(req.rid) == req.slot
                assert s.tokens(req.rid).tolist() == req.tokens, "tokens lost or duplicated"
                assert s.depths(req.rid).tolist() == req.depth
            for req in self.done[-8:]:
                if req.rid not in self.reqs:
                    assert s.status(req.rid) == FREE

    def check_pool(self) -> None:
        bt = self.bt
        counts = bt.num_blocks_of
        owned = np.concatenate([bt.tables[q, :, : counts[q]].ravel() for q in range(self.tr.max_rows)])
        assert ((owned >= 0) & (owned < self.tr.num_blocks)).all()
        holders = np.bincount(owned, minlength=self.tr.num_blocks)
        assert (bt.refs == holders).all() and (bt.refs >= 0).all()
        # Only cache hits share blocks: two tables hold one block only if it is a cache entry.
        assert ((holders <= 1) | (bt.cached >= 0)).all(), "a block is owned twice"
        assert int((holders > 0).sum()) + bt.num_free_blocks == self.tr.num_blocks
        assert int((bt.tables >= 0).sum()) == len(owned)
        held = {r.slot for r in self.running}
        assert {q for q in range(self.tr.max_rows) if counts[q]} <= held, (
            "a slot without a request holds blocks"
        )
        for req in self.running:
            row_end = req.row.start + req.row.length if req.row else 0
            assert counts[req.slot] * self.tr.block_size >= max(req.done, row_end)

    def check_idle(self) -> None:
        for s, bt in zip(self.scheds, self.bts):
            assert s.num_running == 0 and s.num_waiting == 0
            assert bt.num_free_blocks == self.tr.num_blocks and (bt.tables == -1).all()
            assert s.schedule() == 0

    def compare_twins(self, extra: tuple[str, ...]) -> None:
        a = self.s
        for b, bt in zip(self.scheds[1:], self.bts[1:]):
            for name in COUNTERS:
                assert getattr(a, name) == getattr(b, name), name
            for names, n in ((ROW_ARRAYS, a.num_rows), (TOKEN_ARRAYS, a.num_step_tokens)):
                for name in names:
                    assert np.array_equal(getattr(a, name)[:n], getattr(b, name)[:n]), name
            for name in ("prop_src", "prop_dst"):
                assert np.array_equal(getattr(a, name)[: a.num_prop], getattr(b, name)[: a.num_prop]), name
            for name in extra:
                assert np.array_equal(getattr(a, name)[: a.num_events], getattr(b, name)[: a.num_events]), (
                    name
                )
            assert np.array_equal(self.bt.tables, bt.tables) and self.bt.num_free_blocks == bt.num_free_blocks
            assert np.array_equal(self.bt.cached, bt.cached)
            assert (a.cache_queries, a.cache_hits) == (b.cache_queries, b.cache_hits)


# ---- traces ------------------------------------------------------------------------


@st.composite
def specs(draw, max_arrival: int) -> Spec:
    lo = draw(st.integers(1, T))
    return Spec(
        arrival=draw(st.integers(0, max_arrival)),
        prompt_len=draw(st.integers(1, 40)),
        max_new=draw(st.integers(1, 20)),
        min_loops=lo,
        max_loops=draw(st.integers(lo, T)),
        log1mq=draw(st.sampled_from([float("-inf"), -0.5, -1e-3, 0.0, float("inf")])),
    )


@st.composite
def traces(
    draw, max_requests: int = 8, max_arrival: int = 30, tight: bool = False, caching: bool = False
) -> Trace:
    """Random traffic; `tight`: a pool that holds the largest request plus at most one block per loop."""
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    reqs = tuple(draw(st.lists(specs(max_arrival), min_size=1, max_size=max_requests)))
    largest = max(-(-(s.prompt_len + s.max_new) // bs) for s in reqs)
    max_rows = draw(st.integers(2 if tight else 1, 5))
    return Trace(
        block_size=bs,
        num_blocks=(largest + draw(st.integers(0, 1 if tight else 2 * largest))) * T,
        max_rows=max_rows,
        max_tokens=draw(st.integers(1, 8 if tight else 48)),
        max_requests=max_rows + draw(st.integers(0, 3)),
        refill=draw(st.booleans()),
        specs=reqs,
        seed=draw(st.integers(0, 2**32 - 1)),
        p_exit=draw(st.sampled_from([0.1, 0.5, 0.9])),
        p_abort=draw(st.sampled_from([0.0, 0.0, 0.03, 0.15])),
        caching=caching,
    )


def step_bound(tr: Trace) -> int:
    """Generous: every token at full depth, one row at a time, all of it recomputed three times."""
    work = sum((s.prompt_len + s.max_new) * T for s in tr.specs)
    return 4 * work + max(s.arrival for s in tr.specs) + 50


def pinned(block_size: int, num_blocks: int, max_rows: int, max_tokens: int, *specs: tuple) -> Trace:
    """A fixed trace: min_loops == max_loops everywhere, so exits do not depend on the random stream."""
    reqs = tuple(Spec(a, p, m, d, d, float("-inf")) for a, p, m, d in specs)
    return Trace(block_size, num_blocks, max_rows, max_tokens, 4, True, reqs, 0, 0.5, 0.0)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
IMPLS = pytest.mark.parametrize("impl", [COMPILED[0], BOTH[1]], ids=["compiled", "twin"])


@settings(max_examples=150, **SETTINGS)
@given(traces())
def test_random_traffic_invariants(tr: Trace):
    sim = Sim(tr)
    sim.run(step_bound(tr))
    assert sim.arrivals == len(sim.done) == len(tr.specs)


@settings(max_examples=150, report_multiple_bugs=False, **SETTINGS)
@given(traces(tight=True))
def test_tight_pool_progress_and_seniority(tr: Trace):
    """Constant preemption: everyone finishes, and victims are always younger idle requests."""
    Sim(tr, seniority=True).run(step_bound(tr))


@settings(max_examples=50, **SETTINGS)
@given(st.one_of(traces(max_requests=5, max_arrival=12), traces(max_requests=4, max_arrival=8, tight=True)))
def test_compiled_and_twin_decide_identically(tr: Trace):
    Sim(tr, BOTH).run(step_bound(tr))


@settings(max_examples=150, **SETTINGS)
@given(st.one_of(traces(caching=True), traces(tight=True, caching=True)))
def test_prefix_cache_under_random_traffic(tr: Trace):
    """Hits are whole prompt blocks written for the same prefix at every loop; nothing writes a cached
    block; everyone finishes, under preemption and eviction pressure too."""
    sim = Sim(tr, BOTH)
    sim.run(step_bound(tr))
    assert sim.arrivals == len(sim.done) == len(tr.specs)
    assert sim.s.cache_hits == sim.hits


@IMPLS
def test_two_long_requests_do_not_livelock(impl):
    """Each fits the pool alone, not both: the older must finish, not restart forever.

    A (7 prompt + 4 new tokens, exits at loop 0) needs the whole pool (11 tokens at
    every loop); B (1 + 6, full depth) arrives with it. With self-preemption each
    throws its own work away whenever it needs a block while the other's row is in
    flight, and is readmitted at once: neither ever finishes.
    """
    tr = pinned(1, 44, 2, 4, (0, 7, 4, 1), (0, 1, 6, 4))
    sim = Sim(tr, (impl,))
    sim.run(step_bound(tr))
    assert sim.preemptions <= 2


@IMPLS
def test_oldest_request_is_not_preempted_by_a_younger_one(impl):
    """The oldest request (15 + 4 tokens) keeps its work when younger ones (17 + 2, 15 + 14) crowd the pool.

    With admission order as seniority, the oldest preempts itself (step 9), is
    readmitted behind the younger ones, and at step 25 the youngest preempts it
    although it needed no block: 17 computed tokens thrown away.
    """
    tr = pinned(4, 40, 3, 12, (0, 15, 4, 1), (1, 17, 2, 1), (1, 15, 14, 1))
    Sim(tr, (impl,), seniority=True).run(step_bound(tr))


@IMPLS
def test_add_rejects_what_can_never_run(impl):
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(8, 4, T, 2, 3)  # 2 blocks per loop: 8 tokens at most
    s = ls_mod.LoopScheduler(bt, 2, 2, 16)
    prompt = np.arange(3, dtype=np.int32)
    with pytest.raises(ValueError, match="pool"):
        s.add(prompt, 9, 1, T, 0.0)
    with pytest.raises(ValueError):
        s.add(prompt[:0], 2, 1, T, 0.0)
    with pytest.raises(ValueError):
        s.add(prompt, 3, 1, T, 0.0)  # no room for a new token
    with pytest.raises(ValueError):
        ls_mod.LoopScheduler(bt, 2, 3, 16)  # more rows than the table has slots
    assert {s.add(prompt, 8, 1, T, 0.0), s.add(prompt, 4, 1, T, 0.0)} == {0, 1}
    with pytest.raises(OverflowError):
        s.add(prompt, 4, 1, T, 0.0)
    s.finish(1)
    s.finish(1)  # a freed rid: no-op
    assert s.num_waiting == 1 and s.add(prompt, 4, 1, T, 0.0) == 1


@IMPLS
def test_no_refill_drains_the_batch(impl):
    """refill=False: a request that exits early waits until the batch's slowest row is done."""
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(64, 4, T, 2, 4)
    s = ls_mod.LoopScheduler(bt, 2, 2, 16, refill=False)
    fast, slow = s.add(np.array([5, 6], np.int32), 5, 1, 1, 0.0), s.add(np.array([7], np.int32), 3, 4, 4, 0.0)
    loops, events = [], []
    for _ in range(10):
        n = s.schedule()
        loops.append(sorted(zip(s.row_rid[:n].tolist(), s.row_loop[:n].tolist())))
        exited = (s.row_loop[:n] >= s.row_exit_hi[:n]) & (s.row_exit_lo[:n] != NO_EXIT)
        e = s.update(exited.astype(np.uint8), np.full(n, 9, np.int32))
        events += zip(s.ev_rid[:e].tolist(), s.ev_loop[:e].tolist(), s.ev_finished[:e].tolist())
    # Prompts run all loops; then `fast` decodes at 1 loop but must wait for `slow`'s 4.
    assert loops[:4] == [[(fast, t), (slow, t)] for t in range(T)]
    assert loops[4:] == [[(fast, 0), (slow, 0)], [(slow, 1)], [(slow, 2)], [(slow, 3)], [(fast, 0)], []]
    assert events == [(fast, 0, 0), (slow, 3, 0), (fast, 0, 0), (slow, 3, 1), (fast, 0, 1)]
    assert s.status(fast) == s.status(slow) == FREE and bt.num_free_blocks == 64


@IMPLS
def test_held_request_is_admitted_and_started_only_when_released(impl):
    """Run-ahead's seating: a held request is not admitted by schedule(); admit_now gives it KV
    without a row; its prompt row starts at the first schedule() after it is released."""
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(64, 4, T, 3, 4)
    s = ls_mod.LoopScheduler(bt, 3, 3, 16)
    first = s.add(np.array([5, 6], np.int32), 6, 1, T, 0.0)
    held = s.add(np.array([7, 8, 9], np.int32), 6, 1, T, 0.0)
    s.hold(held, True)
    assert s.schedule() == 1 and s.row_rid[0] == first and s.status(held) == WAITING
    late = s.add(np.array([1], np.int32), 3, 1, T, 0.0)
    assert s.admit_now(late) is False  # not at the head of the queue: changes nothing
    assert s.admit_now(held) is True
    assert s.status(held) == RUNNING and s.kv_slot(held) >= 0 and s.num_waiting == 1
    assert bt.num_blocks_of[s.kv_slot(held)] == 1  # 3 tokens: one block of 4 at every loop
    s.hold(late, True)
    s.update(np.zeros(1, np.uint8), np.zeros(1, np.int32))
    n = s.schedule()  # `first` continues; the admitted request still has no row
    assert n == 1 and s.row_rid[0] == first and s.status(late) == WAITING
    s.update(np.zeros(1, np.uint8), np.zeros(1, np.int32))
    s.hold(held, False)
    n = s.schedule()
    rows = dict(zip(s.row_rid[:n].tolist(), zip(s.row_loop[:n].tolist(), s.row_len[:n].tolist())))
    assert rows == {first: (2, 2), held: (0, 3)}  # the whole prompt at loop 0
    s.finish(late)
    assert s.num_waiting == 0 and s.admit_now(late) is False


@IMPLS
def test_admit_now_changes_nothing_without_a_slot_or_blocks(impl):
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(8, 4, T, 2, 2)  # two KV slots, two blocks per loop in the whole pool
    s = ls_mod.LoopScheduler(bt, 4, 1, 16)  # one row: one slot for the scheduler
    a = s.add(np.arange(5, dtype=np.int32), 8, 1, T, 0.0)
    b = s.add(np.array([3, 4], np.int32), 4, 1, T, 0.0)
    assert s.admit_now(a) is True and bt.num_free_blocks == 0
    assert s.admit_now(b) is False and s.status(b) == WAITING and s.kv_slot(b) == -1  # no slot
    s.finish(a)
    s2 = ls_mod.LoopScheduler(bt_mod.BlockTable(8, 4, T, 2, 2), 4, 2, 16)
    a = s2.add(np.arange(5, dtype=np.int32), 8, 1, T, 0.0)
    b = s2.add(np.array([3, 4], np.int32), 4, 1, T, 0.0)
    assert s2.admit_now(a) is True
    assert s2.admit_now(b) is False  # a slot, but no blocks
    assert s2.status(b) == WAITING and s2.kv_slot(b) == -1 and s2.num_waiting == 1 and s2.num_running == 1
    s2.finish(a)
    assert s2.admit_now(b) is True and s2.status(b) == RUNNING and s2.num_waiting == 0


def test_module_constants_match_the_twin():
    """Compiled, the states and NO_EXIT are C constants (a cpdef enum) that stay module attributes."""
    names = (("FREE", FREE), ("WAITING", WAITING), ("RUNNING", RUNNING), ("NO_EXIT", NO_EXIT))
    for name, value in (*names, ("PARKED", 3)):
        assert getattr(ls_c, name) == getattr(ls_py, name) == value
        assert type(getattr(ls_c, name)) is int


def test_compiled_scheduler_takes_only_the_compiled_block_table():
    """It calls the block table through its C interface, so the twin's BlockTable is refused."""
    with pytest.raises(TypeError):
        ls_c.LoopScheduler(bt_py.BlockTable(8, 4, T, 2, 2), 2, 2, 16)
    ls_py.LoopScheduler(bt_c.BlockTable(8, 4, T, 2, 2), 2, 2, 16)  # the twin duck-types


# ---- shared prompts: one prefix request computed, its blocks forked ------------------------------

PARKED = 3


def step(s, token: int = 9) -> list[tuple[int, int, int]]:
    """One schedule + update with a fake runner: live rows exit at their last allowed loop.
    Returns the events (rid, token, finished)."""
    n = s.schedule()
    exited = (s.row_loop[:n] >= s.row_exit_hi[:n]) & (s.row_exit_lo[:n] != NO_EXIT)
    e = s.update(exited.astype(np.uint8), np.full(n, token, np.int32))
    return list(zip(s.ev_rid[:e].tolist(), s.ev_token[:e].tolist(), s.ev_finished[:e].tolist()))


def shared_group(impl, num_blocks=64, max_rows=4, choices=3, prompt_len=10, max_new=3):
    """A prefix request of the prompt's whole blocks but the last token's, and `choices` requests on it."""
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(num_blocks, 4, T, max_rows, 8)
    s = ls_mod.LoopScheduler(bt, 8, max_rows, 64)
    prompt = np.arange(100, 100 + prompt_len, dtype=np.int32)
    shared = (prompt_len - 1) // 4 * 4
    prefix = s.add_prefix(prompt[:shared])
    kids = [s.add(prompt, prompt_len + max_new, T, T, 0.0, prefix=prefix) for _ in range(choices)]
    return bt, s, prefix, kids


@IMPLS
def test_a_shared_prompt_is_computed_once_and_forked_at_a_block_boundary(impl):
    bt, s, prefix, kids = shared_group(impl)
    assert [s.status(k) for k in kids] == [PARKED] * 3 and s.num_waiting == 4
    prefix_blocks = None
    for t in range(T):  # the prefix alone runs its 8 tokens at every loop; it never samples
        n = s.schedule()
        assert n == 1 and s.row_rid[0] == prefix and s.row_loop[0] == t and s.row_exit_lo[0] == NO_EXIT
        assert s.num_prefill_tokens == (8 if t == 0 else 0)
        prefix_blocks = bt.tables[s.kv_slot(prefix), :, :2].copy()
        assert s.update(np.ones(1, np.uint8), np.zeros(1, np.int32)) == 0  # exit flags of a prefix: ignored
    assert s.status(prefix) == FREE and [s.status(k) for k in kids] == [WAITING] * 3
    assert (bt.refs[prefix_blocks.ravel()] == 3).all()  # held by the three choices, none by a table yet
    n = s.schedule()
    assert n == 3 and s.row_rid[:n].tolist() == kids and s.num_prefill_tokens == 3 * 2
    assert s.row_start[:n].tolist() == [8] * 3 and s.row_len[:n].tolist() == [2] * 3
    for k in kids:
        assert (bt.tables[s.kv_slot(k), :, :2] == prefix_blocks).all()
    # Writes land in each choice's own third block, never in the shared two.
    own = {int(bt.tables[s.kv_slot(k), 0, 2]) for k in kids}
    assert len(own) == 3 and set((s.slot_mapping[: s.num_step_tokens] // 4).tolist()) == own
    shared = set(prefix_blocks.ravel().tolist())
    s.update(np.zeros(n, np.uint8), np.zeros(n, np.int32))
    finished = []
    for _ in range(40):
        written = s.slot_mapping[: s.num_step_tokens]
        assert not shared & set((written[written >= 0] // 4).tolist())
        assert not shared & set((s.prop_dst[: s.num_prop] // 4).tolist())
        finished += [rid for rid, _, fin in step(s) if fin]
    assert sorted(finished) == sorted(kids) and bt.num_free_blocks == 64 and not bt.refs.any()


@IMPLS
def test_a_choice_that_ends_frees_only_its_own_blocks(impl):
    bt, s, prefix, kids = shared_group(impl, choices=2, max_new=6)
    for _ in range(T + 1):
        step(s)
    a, b = kids
    shared = bt.tables[s.kv_slot(a), :, :2].copy()
    own_a = bt.num_blocks_of[s.kv_slot(a)] - 2
    free = bt.num_free_blocks
    s.finish(a)
    assert bt.num_free_blocks == free + own_a * T and (bt.refs[shared.ravel()] == 1).all()
    assert (bt.tables[s.kv_slot(b), :, :2] == shared).all() and s.status(b) == RUNNING
    s.finish(b)
    assert bt.num_free_blocks == 64 and not bt.refs.any()


@IMPLS
def test_ending_every_choice_ends_the_prefix_and_frees_everything(impl):
    bt, s, prefix, kids = shared_group(impl)
    step(s)  # the prefix is computing
    s.finish(kids[0])
    assert s.status(prefix) == RUNNING  # the others still wait for it
    for k in kids[1:]:
        s.finish(k)
    assert s.status(prefix) == FREE and s.num_waiting == 0 and s.num_running == 0
    assert bt.num_free_blocks == 64 and s.schedule() == 0
    # Ended after the fork but before admission: the holds on the prefix's blocks are dropped.
    bt, s, prefix, kids = shared_group(impl, max_rows=1)
    for _ in range(T):
        step(s)
    assert s.status(prefix) == FREE and bt.num_free_blocks == 64 - 2 * T
    for k in kids:
        s.finish(k)
    assert bt.num_free_blocks == 64 and not bt.refs.any() and s.num_waiting == 0


@IMPLS
def test_a_prefix_ended_early_leaves_its_choices_the_whole_prompt(impl):
    bt, s, prefix, kids = shared_group(impl, choices=2)
    step(s)
    s.finish(prefix)
    assert [s.status(k) for k in kids] == [WAITING] * 2 and bt.num_free_blocks == 64
    n = s.schedule()
    assert s.row_rid[:n].tolist() == kids and s.row_start[:n].tolist() == [0, 0]
    assert s.row_len[:n].tolist() == [10, 10]


@IMPLS
def test_parked_choices_let_later_requests_run_and_keep_their_place(impl):
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(64, 4, T, 2, 8)
    s = ls_mod.LoopScheduler(bt, 8, 2, 64)
    prompt = np.arange(9, dtype=np.int32)
    prefix = s.add_prefix(prompt[:8])
    a, b = (s.add(prompt, 12, T, T, 0.0, prefix=prefix) for _ in range(2))
    late = s.add(np.array([1, 2], np.int32), 4, T, T, 0.0)
    later = s.add(np.array([3], np.int32), 4, T, T, 0.0)
    n = s.schedule()  # the parked choices do not hold the queue up
    assert sorted(s.row_rid[:n].tolist()) == sorted([prefix, late])
    s.update(np.zeros(n, np.uint8), np.zeros(n, np.int32))
    for _ in range(T - 1):
        step(s)
    n = s.schedule()  # one slot is free: the older choice, not the later request
    assert a in s.row_rid[:n].tolist() and later not in s.row_rid[:n].tolist()
    assert s.status(b) == WAITING and s.status(later) == WAITING


@IMPLS
def test_a_preempted_choice_recomputes_its_prompt_alone(impl):
    """A pool too small for three choices: younger ones are preempted, drop their shared blocks,
    recompute from position 0 in blocks of their own, and every choice finishes with the pool whole."""
    bt, s, prefix, kids = shared_group(impl, num_blocks=4 * T, choices=3, prompt_len=6, max_new=9)
    firsts: dict[int, list] = {k: [] for k in kids}  # (start, length) of each new row not a decode
    finished, preempted = [], 0
    for _ in range(400):
        n = s.schedule()
        preempted += s.num_preempted
        for r in range(n):
            rid = int(s.row_rid[r])
            if rid in firsts and s.row_loop[r] == 0 and s.row_len[r] > 1:
                firsts[rid].append((int(s.row_start[r]), int(s.row_len[r])))
        exited = (s.row_loop[:n] >= s.row_exit_hi[:n]) & (s.row_exit_lo[:n] != NO_EXIT)
        e = s.update(exited.astype(np.uint8), np.full(n, 9, np.int32))
        finished += [rid for rid, fin in zip(s.ev_rid[:e].tolist(), s.ev_finished[:e].tolist()) if fin]
        if len(finished) == 3:
            break
    assert sorted(finished) == sorted(kids) and preempted > 0
    assert all(rows[0] == (4, 2) for rows in firsts.values())  # forked: only the tail computed
    assert any(start == 0 for rows in firsts.values() for start, _ in rows[1:])  # a recomputation
    assert bt.num_free_blocks == 4 * T and not bt.refs.any()


@IMPLS
def test_shared_prompt_input_is_checked(impl):
    bt_mod, ls_mod = impl
    s = ls_mod.LoopScheduler(bt_mod.BlockTable(64, 4, T, 2, 8), 8, 2, 64)
    prompt = np.arange(9, dtype=np.int32)
    with pytest.raises(ValueError, match="whole 4-token blocks"):
        s.add_prefix(prompt[:6])
    plain = s.add(prompt, 12, 1, T, 0.0)
    with pytest.raises(ValueError, match="not a prefix"):
        s.add(prompt, 12, 1, T, 0.0, prefix=plain)
    prefix = s.add_prefix(prompt[:8])
    with pytest.raises(ValueError, match="extend"):
        s.add(prompt[:8], 12, 1, T, 0.0, prefix=prefix)  # no token of its own to sample from
    with pytest.raises(ValueError, match="extend"):
        s.add(prompt[::-1].copy(), 12, 1, T, 0.0, prefix=prefix)
    child = s.add(prompt, 12, 1, T, 0.0, prefix=prefix)
    assert s.admit_now(prefix) is False and s.status(child) == PARKED
    s.finish(plain)
    for _ in range(T):
        step(s)
    assert s.status(child) == WAITING and s.admit_now(child) is False  # its shared blocks: schedule() only


# ---- the prefix cache ----------------------------------------------------------------------------


def cache_sched(impl, num_blocks=64, max_rows=2, max_tokens=64):
    bt_mod, ls_mod = impl
    bt = bt_mod.BlockTable(num_blocks, 4, T, max_rows, 8, True)
    return bt, ls_mod.LoopScheduler(bt, 8, max_rows, max_tokens)


def run_alone(s, prompt, max_new=6, **kw) -> int:
    rid = s.add(np.asarray(prompt, np.int32), len(prompt) + max_new, T, T, 0.0, **kw)
    while s.status(rid) != FREE:
        step(s)
    return rid


@IMPLS
def test_a_cached_prompt_is_reused_short_of_its_last_token(impl):
    bt, s = cache_sched(impl)
    prompt = np.arange(100, 112, dtype=np.int32)  # 3 whole blocks
    run_alone(s, prompt)
    assert s.cache_hits == 0 and s.cache_queries == 12
    # Prompt blocks only: the block of generated tokens (positions 12..15, full after 4) is not cached.
    assert bt.num_cached_blocks == 3 * T
    rid = s.add(prompt, 20, T, T, 0.0)
    n = s.schedule()
    # Two blocks hit; the third holds the last prompt token, which the request computes itself.
    assert n == 1 and s.row_start[0] == 8 and s.row_len[0] == 4 and s.cached_tokens(rid) == 8
    assert (s.cache_queries, s.cache_hits) == (24, 8)
    s.update(np.zeros(1, np.uint8), np.zeros(1, np.int32))
    while s.status(rid) != FREE:
        step(s)
    assert s.cached_tokens(rid) == 8  # still readable once finished, for its final output
    assert bt.num_free_blocks == 64 and not bt.refs.any()


@IMPLS
def test_a_longer_prompt_hits_the_earlier_ones_blocks_and_extends_the_cache(impl):
    bt, s = cache_sched(impl)
    first = np.arange(100, 109, dtype=np.int32)  # 2 whole blocks and one token
    run_alone(s, first)
    second = np.concatenate([first, np.arange(7, 14, dtype=np.int32)]).astype(np.int32)  # the next turn: 16
    rid = s.add(second, 20, T, T, 0.0)
    assert s.schedule() == 1 and s.row_start[0] == 8 and s.cached_tokens(rid) == 8
    s.update(np.zeros(1, np.uint8), np.zeros(1, np.int32))
    while s.status(rid) != FREE:
        step(s)
    assert bt.num_cached_blocks == 4 * T  # its own blocks 2 and 3 joined the cache
    third = s.add(second, 20, T, T, 0.0)
    assert s.schedule() == 1 and s.row_start[0] == 12 and s.cached_tokens(third) == 12


@IMPLS
def test_may_hit_false_computes_every_token_but_still_caches(impl):
    bt, s = cache_sched(impl)
    prompt = np.arange(100, 112, dtype=np.int32)
    run_alone(s, prompt)
    rid = s.add(prompt, 20, T, T, 0.0, may_hit=False)
    assert s.schedule() == 1 and s.row_start[0] == 0 and s.row_len[0] == 12 and s.cached_tokens(rid) == 0
    assert (s.cache_queries, s.cache_hits) == (12, 0)  # no lookup, no query
    prefix = s.add_prefix(prompt[:8], may_hit=False)
    kid = s.add(prompt, 20, T, T, 0.0, prefix=prefix)
    assert s.status(kid) == PARKED and s.cached_tokens(kid) == 0


@IMPLS
def test_a_preempted_request_takes_its_own_prompt_blocks_back(impl):
    # 24 blocks, 6 per loop: two 9-token prompts fit (3 each); the older's fourth block preempts the other.
    bt, s = cache_sched(impl, num_blocks=24, max_rows=2, max_tokens=32)
    a = s.add(np.arange(100, 109, dtype=np.int32), 16, T, T, 0.0)
    b = s.add(np.arange(200, 209, dtype=np.int32), 16, T, T, 0.0)
    preempted, restarts = 0, []
    for _ in range(200):
        if s.status(a) == FREE and s.status(b) == FREE:
            break
        n = s.schedule()
        preempted += s.num_preempted
        restarts += [
            (int(s.row_rid[k]), int(s.row_start[k])) for k in range(n) if s.row_new[k] and s.row_len[k] > 1
        ]
        exited = (s.row_loop[:n] >= s.row_exit_hi[:n]) & (s.row_exit_lo[:n] != NO_EXIT)
        s.update(exited.astype(np.uint8), np.full(n, 9, np.int32))
    # The victim recomputes from its third block: its first two came back from the cache.
    assert preempted == 1 and restarts[-1] == (b, 8) and s.cached_tokens(b) == 0
    assert s.cache_hits == 8 and bt.num_free_blocks == 24 and not bt.refs.any()
