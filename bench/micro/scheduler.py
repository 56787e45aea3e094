"""The loop scheduler's per-step cost: compiled core vs its uncompiled twin, in steady decode.

One measured step is `schedule()` + `update()`; the fake runner between them
(exit flags and sampled ids from numpy) is not timed. B requests with 128-token
prompts are prefilled first; then each step carries B decode rows (one per
request) at mixed loop indices. Extra requests wait in the queue (they cannot be
admitted: every KV slot is taken), which is what a long queue costs per step.

Depth policies of the fake runner: "full" (every token runs 4 loops) and
"mixed" (a request's tokens cycle through depths 1, 2, 3, 4: mean 2.5).
Per generated token = total scheduler time / tokens sampled; "per batch
token" = the time to advance every row by one token (B tokens).

The prefix cache (a block table that caches, written to scheduler_cache.json):
a hit of a 4,096-token prompt, i.e. looking up its cached blocks (every loop's
plane, all but the block of its last token) and allocating the rest; its
hashing (once per request, when it is added) and the free are timed apart.

Run: python -m bench.micro.scheduler [--quick] [--out bench/results/DIR]
"""

from __future__ import annotations

import gc
import importlib
import time

import numpy as np

from bench.benchlib import bench_args, ratio, start_run, summarize, write_result

NUM_LOOPS = 4
BLOCK_SIZE = 16
PROMPT = 128
NO_EXIT = 127


def load(kind: str):
    """(BlockTable, LoopScheduler) of the compiled core ("compiled"), the twin ("twin"), or
    "candidate:MODULE": MODULE's LoopScheduler (e.g. a patched build on PYTHONPATH) over the
    compiled BlockTable."""
    if kind.startswith("candidate:"):
        bt = importlib.import_module("ouro_fast.core.block_table")
        return bt.BlockTable, importlib.import_module(kind.split(":", 1)[1]).LoopScheduler
    pkg = "ouro_fast.core" if kind == "compiled" else "ouro_fast.core_py"
    bt = importlib.import_module(f"{pkg}.block_table")
    ls = importlib.import_module(f"{pkg}.loop_scheduler")
    return bt.BlockTable, ls.LoopScheduler


class FakeRunner:
    """Exit flags and sampled ids for the scheduled rows, from per-request target depths."""

    def __init__(self, max_requests: int, max_rows: int, policy: str):
        self.policy = policy
        self.depth = np.full(max_requests, NUM_LOOPS, np.int32)
        if policy == "mixed":
            self.depth[:] = 1 + np.arange(max_requests) % NUM_LOOPS
        self.sampled = np.full(max_rows, 7, np.int32)
        self.exited = np.zeros(max_rows, np.uint8)

    def run(self, s) -> tuple[np.ndarray, np.ndarray]:
        r = s.num_rows
        live = s.row_exit_lo[:r] != NO_EXIT
        want = np.minimum(self.depth[s.row_rid[:r]] - 1, s.row_exit_hi[:r])
        self.exited[:r] = live & (s.row_loop[:r] >= want)
        return self.exited, self.sampled

    def after(self, s, events: int) -> None:
        if self.policy == "mixed" and events:
            rids = s.ev_rid[:events]
            self.depth[rids] = 1 + self.depth[rids] % NUM_LOOPS


def build(kind: str, batch: int, waiting: int, policy: str, steps: int):
    """A scheduler with `batch` running requests past prefill and `waiting` queued ones."""
    BlockTable, LoopScheduler = load(kind)
    # Room for the prompt and every token the run can generate (at most one per step), at every loop.
    cap = PROMPT + steps + 64
    need = (cap + BLOCK_SIZE - 1) // BLOCK_SIZE
    bt = BlockTable(batch * need * NUM_LOOPS, BLOCK_SIZE, NUM_LOOPS, batch, need)
    sched = LoopScheduler(bt, batch + waiting, batch, max(2048, batch), True)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        sched.add(rng.integers(3, 1000, PROMPT, dtype=np.int32), cap, 1, NUM_LOOPS, 0.0)
    runner = FakeRunner(batch + waiting, batch, policy)
    # Prefill, then a few decode rounds so rows sit at mixed loops.
    for _ in range(10_000):
        if sched.schedule() == 0:
            raise RuntimeError("the scheduler stalled during prefill")
        ev = sched.update(*runner.run(sched))
        runner.after(sched, ev)
        if sched.num_step_tokens == sched.num_rows == batch:
            break  # every row is one decode token
    for _ in range(4 * NUM_LOOPS):
        sched.schedule()
        runner.after(sched, sched.update(*runner.run(sched)))
    for _ in range(waiting):
        sched.add(rng.integers(3, 1000, PROMPT, dtype=np.int32), PROMPT + 64, 1, NUM_LOOPS, 0.0)
    return sched, runner


def measure(kind: str, batch: int, waiting: int, policy: str, steps: int) -> dict:
    sched, runner = build(kind, batch, waiting, policy, steps)
    step_us, sched_us, upd_us = [], [], []
    tokens = 0
    rows = 0
    gc.collect()
    clock = time.perf_counter_ns
    for _ in range(steps):
        t0 = clock()
        sched.schedule()
        t1 = clock()
        exited, sampled = runner.run(sched)
        t2 = clock()
        ev = sched.update(exited, sampled)
        t3 = clock()
        runner.after(sched, ev)
        tokens += ev
        rows += sched.num_rows
        sched_us.append((t1 - t0) / 1e3)
        upd_us.append((t3 - t2) / 1e3)
        step_us.append((t1 - t0 + t3 - t2) / 1e3)
    if sched.num_waiting != waiting or sched.num_running != batch:
        raise RuntimeError("the measured window was not steady decode")
    total = sum(step_us)
    step = summarize(step_us)
    return {
        "impl": kind,
        "batch": batch,
        "waiting": waiting,
        "policy": policy,
        "steps": steps,
        "rows_per_step": round(rows / steps, 2),
        "tokens": tokens,
        "steps_per_token": round(steps * batch / tokens, 3) if tokens else None,
        "step_us": step,
        "schedule_us": summarize(sched_us),
        "update_us": summarize(upd_us),
        # Per token from the median step (robust to a busy machine's outliers) and from the mean.
        "us_per_token": round(step["p50"] * steps / tokens, 4) if tokens else None,
        "us_per_batch_token": round(step["p50"] * steps / tokens * batch, 3) if tokens else None,
        "mean_us_per_token": round(total / tokens, 4) if tokens else None,
    }


CACHE_PROMPT = 4096


def measure_cache(kind: str, reps: int) -> dict:
    """Microseconds of a 4,096-token prompt's prefix-cache hit: lookup + allocation, free, hashing."""
    BlockTable, _ = load(kind)
    blocks = CACHE_PROMPT // BLOCK_SIZE
    bt = BlockTable(2 * blocks * NUM_LOOPS, BLOCK_SIZE, NUM_LOOPS, 2, blocks, True)
    tokens = np.random.default_rng(0).integers(3, 1000, CACHE_PROMPT, dtype=np.int32)
    hashes = bt.hash_blocks(tokens, CACHE_PROMPT)
    bt.allocate(0, CACHE_PROMPT)
    bt.cache(0, hashes, tokens, 0, blocks)
    bt.free(0)  # the entries wait unheld in the LRU list, as after their request ended
    hit_us, free_us, hash_us = [], [], []
    gc.collect()
    clock = time.perf_counter_ns
    for _ in range(reps):
        t0 = clock()
        hit = bt.lookup(1, hashes, tokens, blocks - 1)
        bt.allocate(1, CACHE_PROMPT)
        t1 = clock()
        bt.free(1)
        t2 = clock()
        bt.hash_blocks(tokens, CACHE_PROMPT)
        t3 = clock()
        if hit != blocks - 1:
            raise RuntimeError(f"the cached prompt hit {hit} blocks, not {blocks - 1}")
        hit_us.append((t1 - t0) / 1e3)
        free_us.append((t2 - t1) / 1e3)
        hash_us.append((t3 - t2) / 1e3)
    return {
        "impl": kind,
        "prompt_tokens": CACHE_PROMPT,
        "hit_blocks": blocks - 1,
        "lookup_allocate_us": summarize(hit_us),
        "free_us": summarize(free_us),
        "hash_us": summarize(hash_us),
    }


def run_cache(quick: bool = False) -> list[dict]:
    out = [measure_cache(kind, 50 if quick else 2000) for kind in ("compiled", "twin")]
    for r in out:
        print(
            f"prefix cache, {CACHE_PROMPT}-token prompt, {r['impl']:8s}: lookup + allocate "
            f"{r['lookup_allocate_us']['p50']:8.2f} us (p90 {r['lookup_allocate_us']['p90']:.2f}); "
            f"free {r['free_us']['p50']:.2f} us; hashing (once, when added) {r['hash_us']['p50']:.2f} us",
            flush=True,
        )
    return out


def steps_for(kind: str, batch: int, quick: bool) -> int:
    if quick:
        return 24
    budget = 40_000 if kind == "twin" else 400_000  # row-steps per configuration
    return max(200, min(4000, budget // batch))


def run(
    quick: bool = False,
    batches=(1, 8, 64, 256),
    waitings=(0, 10, 1000, 10000),
    policies=("full", "mixed"),
    candidate: str | None = None,
):
    """Every (batch, waiting, policy) for both builds, compiled and twin measured back to back
    (and a candidate LoopScheduler module, when given, with no waiting requests)."""
    if quick:
        batches, waitings, policies = (1, 8), (0, 10), ("full",)
    out = []
    for policy in policies:
        for batch in batches:
            for waiting in waitings:
                pair = {
                    k: measure(k, batch, waiting, policy, steps_for(k, batch, quick))
                    for k in ("compiled", "twin")
                }
                pair["compiled"]["twin_over_compiled"] = ratio(
                    pair["twin"]["step_us"], pair["compiled"]["step_us"]
                )
                out += [pair["compiled"], pair["twin"]]
                if candidate and waiting == 0:
                    cand = measure(
                        f"candidate:{candidate}", batch, 0, policy, steps_for("compiled", batch, quick)
                    )
                    cand["impl"] = f"candidate:{candidate}"
                    cand["twin_over_candidate"] = ratio(pair["twin"]["step_us"], cand["step_us"])
                    cand["compiled_over_candidate"] = ratio(pair["compiled"]["step_us"], cand["step_us"])
                    out.append(cand)
                    print(
                        f"{policy:5s} batch {batch:4d}: candidate {cand['step_us']['p50']:9.2f} us/step, "
                        f"{cand['us_per_token']:.3f} us/token; "
                        f"twin/candidate {cand['twin_over_candidate']:.1f}x",
                        flush=True,
                    )
                c = pair["compiled"]
                print(
                    f"{policy:5s} batch {batch:4d} waiting {waiting:5d}: "
                    f"compiled {c['step_us']['p50']:9.2f} us/step "
                    f"(p10 {c['step_us']['p10']:.2f}, p90 {c['step_us']['p90']:.2f}), "
                    f"{c['us_per_token']:.3f} us/token; twin {pair['twin']['step_us']['p50']:9.1f} us/step; "
                    f"twin/compiled {c['twin_over_compiled']:.1f}x",
                    flush=True,
                )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    extra = lambda p: p.add_argument(  # noqa: E731
        "--candidate", default=None, help="also measure MODULE's LoopScheduler (a patched build)"
    )
    args = bench_args(__doc__, argv, extra)
    meta = start_run()
    res = run(args.quick, candidate=args.candidate)
    write_result(meta, res, args.out, "scheduler")
    write_result(meta, run_cache(args.quick), args.out, "scheduler_cache")
    return res


if __name__ == "__main__":
    main()
