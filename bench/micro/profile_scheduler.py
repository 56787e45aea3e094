"""Where a scheduler step's time goes: cProfile of the twin, and a steady loop of the compiled core for perf.

  --mode cprofile   cProfile of the twin's schedule()+update() in steady decode
                    (the fake runner excluded from the report); top functions by
                    own time.
  --mode loop       runs the compiled core's steps for --seconds, to be sampled
                    by `perf record -e cpu-clock -F 4000 -g -- python -m
                    bench.micro.profile_scheduler --mode loop`; then `perf report
                    --no-children --sort dso,symbol` shows the C-level split
                    (memoryview acquisition, Python-level calls into BlockTable,
                    the scheduler's own loops).

Run: python -m bench.micro.profile_scheduler [--mode cprofile|loop] [--batch 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

from bench.micro.scheduler import build


def cprofile_twin(batch: int, steps: int, top: int) -> str:
    sched, runner = build("twin", batch, 0, "full", steps)
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        sched.schedule()
        prof.disable()
        exited, sampled = runner.run(sched)
        prof.enable()
        ev = sched.update(exited, sampled)
        prof.disable()
        runner.after(sched, ev)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    head = f"cProfile of the twin: batch {batch}, {steps} steps of schedule()+update(), full depth\n"
    return head + buf.getvalue()


def loop_compiled(batch: int, seconds: float) -> str:
    sched, runner = build("compiled", batch, 0, "full", 1_000_000)
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sched.schedule()
        runner.after(sched, sched.update(*runner.run(sched)))
        steps += 1
    return f"compiled core: batch {batch}, {steps} steps in {seconds} s (fake runner included)\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("cprofile", "loop"), default="cprofile")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="cprofile: steps profiled")
    p.add_argument("--seconds", type=float, default=5.0, help="loop: how long to run")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None, help="write the report to this file too")
    args = p.parse_args(argv)
    if args.mode == "cprofile":
        text = cprofile_twin(args.batch, args.steps, args.top)
    else:
        text = loop_compiled(args.batch, args.seconds)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
