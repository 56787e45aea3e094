"""The step contract's invariants: every StepPlan the Scheduler emits under random traffic is well formed.

A fake runner answers each plan with exits that honour the rows' exit windows and random tokens, so
the traffic covers prefill chunks, refills, early exits, propagation, length caps and preemption.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ouro_fast.engine.plan import NO_EXIT, StepPlan, StepResult
from ouro_fast.engine.scheduler import Scheduler

T = 4


def fake_result(plan: StepPlan, rng: random.Random) -> StepResult:
    """Exit where the window forces it, maybe where it allows it; never where a row does not sample."""
    exited = np.zeros(plan.num_rows, np.uint8)
    for r in range(plan.num_rows):
        lo, hi, loop = int(plan.exit_lo[r]), int(plan.exit_hi[r]), int(plan.loop[r])
        if lo != NO_EXIT and (loop >= hi or (loop >= lo and rng.random() < 0.5)):
            exited[r] = 1
    sampled = np.array([rng.randrange(1, 50) for _ in range(plan.num_rows)], np.int32)
    return StepResult(exited, sampled)


def check_plan(plan: StepPlan, last: StepPlan | None, sched: Scheduler, limits: tuple[int, int, int]) -> None:
    max_rows, max_tokens, block_size = limits
    r, n = plan.num_rows, plan.num_tokens
    assert 1 <= r <= max_rows and r <= n <= max_tokens
    # Rows tile the step's tokens in order; a request has at most one row.
    assert (plan.length >= 1).all()
    assert plan.tok_off.tolist() == np.concatenate(([0], np.cumsum(plan.length)[:-1])).tolist()
    assert int(plan.length.sum()) == n
    assert len(set(plan.rid.tolist())) == r
    # Carried rows first, their tokens exactly the first num_carried; loop-0 rows embed.
    carried = plan.loop > 0
    k = int(carried.sum())
    assert carried[:k].all() and not carried[k:].any()
    assert plan.num_carried == int(plan.length[:k].sum())
    assert (plan.hidden_src[: plan.num_carried] >= 0).all() and (
        plan.hidden_src[plan.num_carried :] == -1
    ).all()
    tables = plan.block_tables
    for i in range(r):
        o, m, start = int(plan.tok_off[i]), int(plan.length[i]), int(plan.start[i])
        pos = np.arange(start, start + m)
        assert plan.positions[o : o + m].tolist() == pos.tolist()
        table = tables[plan.kv_slot[i], plan.loop[i]]
        assert (table[pos // block_size] >= 0).all(), "a row's positions lie in blocks it holds"
        expect = table[pos // block_size].astype(np.int64) * block_size + pos % block_size
        slots = plan.slot_mapping[o : o + m]
        assert ((slots == -1) | (slots == expect)).all()
        if plan.decode[i]:
            assert m == 1 and plan.exit_lo[i] != NO_EXIT
        lo, hi = int(plan.exit_lo[i]), int(plan.exit_hi[i])
        assert (lo, hi) == (NO_EXIT, NO_EXIT) or 0 <= lo <= hi < T
        if carried[i]:
            # A carried row continues the same tokens of the same request, one loop deeper.
            assert last is not None
            src = plan.hidden_src[o : o + m]
            assert (src < last.num_tokens).all()
            assert last.positions[src].tolist() == pos.tolist()
            j = int(np.flatnonzero(last.rid == plan.rid[i])[0])
            assert int(last.loop[j]) == int(plan.loop[i]) - 1
    # Propagation copies whole slots between distinct, real places of the pool.
    assert plan.num_prop == len(plan.prop_dst)
    limit = sched.num_blocks * block_size
    assert ((plan.prop_src >= 0) & (plan.prop_src < limit)).all()
    assert ((plan.prop_dst >= 0) & (plan.prop_dst < limit)).all()
    assert (plan.prop_src != plan.prop_dst).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    num_blocks=st.integers(24, 200),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_rows=st.integers(1, 8),
    max_tokens=st.integers(8, 48),
    refill=st.booleans(),
)
def test_every_plan_is_well_formed(seed, num_blocks, block_size, max_rows, max_tokens, refill):
    rng = random.Random(seed)
    max_len = 64
    sched = Scheduler(num_blocks, block_size, T, max_rows, 16, max_tokens, -(-max_len // block_size), refill)
    pool_tokens = num_blocks // T * block_size
    pending = [
        (rng.randrange(0, 30), rng.randrange(1, 20), rng.randrange(1, 12), rng.randrange(1, T + 1))
        for _ in range(rng.randrange(1, 12))
    ]
    last, steps, added = None, 0, 0
    while steps < 400:
        for arrival, prompt, new, lo in pending:
            if arrival == steps and prompt + new <= min(pool_tokens, max_len):
                hi = rng.randrange(lo, T + 1)
                sched.add(np.arange(1, prompt + 1, dtype=np.int32), prompt + new, lo, hi, float(np.log(0.5)))
                added += 1
        plan = sched.schedule()
        steps += 1
        if plan is None:
            if steps > 30 and not sched.num_running and not sched.num_waiting:
                break
            last = None
            continue
        check_plan(plan, last, sched, (max_rows, max_tokens, block_size))
        events = sched.update(fake_result(plan, rng))
        assert len(events) <= plan.num_rows
        for rid in events.rid[events.finished == 1].tolist():
            sched.finish(rid)
        # The next plan's carried rows index this plan's tokens: keep a copy of what they refer to.
        last = StepPlan(**{f: getattr(plan, f).copy() if isinstance(getattr(plan, f), np.ndarray) else
                           getattr(plan, f) for f in plan.__slots__})  # fmt: skip
    assert not sched.num_running and not sched.num_waiting, "every request finished within the steps"
    assert sched.num_free_blocks == sched.num_blocks
