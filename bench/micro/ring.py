"""RequestRing: the compiled SPSC ring (C11 atomics) vs its pure-Python twin.

  push_pop      one push then one pop, one thread (microseconds per pair)
  pop_many_64   64 pushes then one pop_many(64), per record
  two_threads   a producer thread pushes N records while the consumer (this
                thread) drains them with pop_many(256); records per second.
                A side that finds the ring full/empty calls time.sleep(0) to
                hand over the GIL, as a polling thread would.
  ping_pong     round trip through two rings between two threads (push, the
                other side pops and pushes back), the same polling: median
                microseconds. Both sides hold the GIL while running Python,
                so this is a GIL hand-off, not a cache-line, latency.

Run: python -m bench.micro.ring [--quick] [--out bench/results/DIR]
"""

from __future__ import annotations

import importlib
import threading
import time

from bench.benchlib import bench_main, ratio, summarize, time_batches


def ring_cls(kind: str):
    pkg = "ouro_fast.core" if kind == "compiled" else "ouro_fast.core_py"
    return importlib.import_module(f"{pkg}.ring").RequestRing


def single_thread(kind: str, calls: int, repeats: int) -> dict:
    ring = ring_cls(kind)(1024)

    def push_pop(n: int) -> None:
        push, pop = ring.push, ring.pop
        for i in range(n):
            push(1, i)
            pop()

    def pop_many_64(n: int) -> None:
        push, pop_many = ring.push, ring.pop_many
        for _ in range(max(n // 64, 1)):
            for i in range(64):
                push(1, i)
            pop_many(64)

    return {
        "push_pop_us": time_batches(push_pop, calls, repeats),
        "pop_many_64_us_per_record": time_batches(pop_many_64, calls, repeats),
    }


def two_threads(kind: str, n: int) -> dict:
    ring = ring_cls(kind)(4096)
    got = []

    def produce() -> None:
        push = ring.push
        i = 0
        while i < n:
            if push(1, i):
                i += 1
            else:
                time.sleep(0)

    t0 = time.perf_counter()
    th = threading.Thread(target=produce)
    th.start()
    count = 0
    last = -1
    while count < n:
        recs = ring.pop_many(256)
        if not recs:
            time.sleep(0)
            continue
        count += len(recs)
        last = recs[-1][1]
    th.join()
    dt = time.perf_counter() - t0
    got.append(last)
    if last != n - 1:
        raise RuntimeError("records arrived out of order")
    return {"records": n, "seconds": round(dt, 4), "records_per_s": round(n / dt)}


def ping_pong(kind: str, rounds: int) -> dict:
    cls = ring_cls(kind)
    there, back = cls(16), cls(16)
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            rec = there.pop()
            if rec is None:
                time.sleep(0)
                continue
            back.push(*rec)

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    samples = []
    for i in range(rounds):
        t0 = time.perf_counter_ns()
        there.push(2, i)
        while back.pop() is None:
            time.sleep(0)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    stop.set()
    th.join()
    return summarize(samples[rounds // 10 :])


def run(quick: bool = False) -> dict:
    calls, repeats, n, rounds = (256, 3, 2000, 50) if quick else (20_000, 21, 200_000, 2000)
    out: dict = {}
    for kind in ("compiled", "twin"):
        out[kind] = single_thread(kind, calls if kind == "compiled" else calls // 4, repeats)
        out[kind]["two_threads"] = two_threads(kind, n if kind == "compiled" else n // 4)
        out[kind]["ping_pong_us"] = ping_pong(kind, rounds)
    c, t = out["compiled"], out["twin"]
    out["twin_over_compiled"] = {
        "push_pop": ratio(t["push_pop_us"], c["push_pop_us"]),
        "pop_many_64": ratio(t["pop_many_64_us_per_record"], c["pop_many_64_us_per_record"]),
        "two_threads_throughput": round(
            c["two_threads"]["records_per_s"] / t["two_threads"]["records_per_s"], 2
        ),
    }
    for kind in ("compiled", "twin"):
        r = out[kind]
        print(
            f"{kind:8s} push+pop {r['push_pop_us']['p50']:.3f} us, pop_many(64) "
            f"{r['pop_many_64_us_per_record']['p50']:.3f} us/record, two threads "
            f"{r['two_threads']['records_per_s']:,} records/s, ping-pong {r['ping_pong_us']['p50']:.1f} us",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    return bench_main(__doc__, "ring", run, argv)


if __name__ == "__main__":
    main()
