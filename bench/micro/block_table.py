"""BlockTable's per-call cost: compiled core vs its uncompiled twin.

Operations, each timed in batches of many calls (microseconds per call):
  allocate_noop     allocate() of positions already covered (every decode row start)
  allocate_grow     allocate() that adds one block per loop (every block_size tokens)
  alloc_free_128    allocate() of 128 tokens at every loop, then free()
  slot_map_1        fill_slot_mapping() of one decode token
  slot_map_128      fill_slot_mapping() of a 128-token prefill chunk
  propagation_64    fill_propagation() of 64 exited tokens at random loops (one step's exits)

Run: python -m bench.micro.block_table [--quick] [--out bench/results/DIR]
"""

from __future__ import annotations

import importlib

import numpy as np

from bench.benchlib import bench_main, ratio, time_batches

NUM_LOOPS = 4
BS = 16
SLOTS = 64
PER_SEQ = 256


def make(kind: str):
    pkg = "ouro_fast.core" if kind == "compiled" else "ouro_fast.core_py"
    mod = importlib.import_module(f"{pkg}.block_table")
    return mod.BlockTable(SLOTS * PER_SEQ * NUM_LOOPS, BS, NUM_LOOPS, SLOTS, PER_SEQ)


def cases(kind: str) -> dict:
    """name -> fn(calls) running `calls` operations of that kind."""
    bt = make(kind)
    used = SLOTS - 1  # slots 0..used-1 hold 1024 tokens; the last one is grown and freed
    for s in range(used):
        bt.allocate(s, 1024)
    out = np.zeros(4096, np.int64)
    rng = np.random.default_rng(0)
    slots = rng.integers(0, used, 64).astype(np.int32)
    pos = rng.integers(0, 1024, 64).astype(np.int32)
    loops = rng.integers(0, NUM_LOOPS - 1, 64).astype(np.int32)
    src, dst = np.zeros(64 * NUM_LOOPS, np.int64), np.zeros(64 * NUM_LOOPS, np.int64)
    grow_slot = SLOTS - 1

    def allocate_noop(n: int) -> None:
        for i in range(n):
            bt.allocate(i % used, 1000)

    def allocate_grow(n: int) -> None:
        # One block per loop per call; the free() that resets the slot is a small share of the batch.
        bt.free(grow_slot)
        for i in range(n):
            k = i % PER_SEQ
            if k == 0:
                bt.free(grow_slot)
            bt.allocate(grow_slot, (k + 1) * BS)

    def alloc_free_128(n: int) -> None:
        for _ in range(n):
            bt.allocate(grow_slot, 128)
            bt.free(grow_slot)

    def slot_map_1(n: int) -> None:
        for i in range(n):
            bt.fill_slot_mapping(i % used, i % NUM_LOOPS, 500, 1, out, i % 64)

    def slot_map_128(n: int) -> None:
        for i in range(n):
            bt.fill_slot_mapping(i % used, i % NUM_LOOPS, 128, 128, out, 0)

    def propagation_64(n: int) -> None:
        for _ in range(n):
            bt.fill_propagation(slots, pos, loops, 64, src, dst)

    return {
        "allocate_noop": allocate_noop,
        "allocate_grow": allocate_grow,
        "alloc_free_128": alloc_free_128,
        "slot_map_1": slot_map_1,
        "slot_map_128": slot_map_128,
        "propagation_64": propagation_64,
    }


def run(quick: bool = False) -> list[dict]:
    calls, repeats = (200, 3) if quick else (5000, 21)
    got = {k: cases(k) for k in ("compiled", "twin")}
    out = []
    for name in got["compiled"]:
        # Twin and compiled back to back per operation, so both see the same load.
        c = time_batches(got["compiled"][name], calls, repeats)
        t = time_batches(got["twin"][name], max(calls // 10, 20), repeats)
        row = {"op": name, "compiled_us": c, "twin_us": t, "twin_over_compiled": ratio(t, c)}
        out.append(row)
        print(
            f"{name:15s} compiled {c['p50']:8.3f} us  twin {t['p50']:9.3f} us  "
            f"ratio {row['twin_over_compiled']:.1f}x"
        )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    return bench_main(__doc__, "block_table", run, argv)


if __name__ == "__main__":
    main()
