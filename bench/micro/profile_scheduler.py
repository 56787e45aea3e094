"""Where a scheduler step's time goes: cProfile of the twin, and a steady loop of the compiled core for perf.

  --mode cprofile   cProfile of the twin's schedule()+update() in steady decode
                    (the fake runner excluded from the report); top functions by
                    own time.
  --mode loop       runs the compiled core's steps for --seconds, to be sampled
                    by `perf record -e cpu-clock -F 4000 -o perf.data -- python -m
                    bench.micro.profile_scheduler --mode loop`
  --mode group      reads `perf report -i perf.data --no-children --sort dso,symbol`
                    output (--perf-report FILE) and adds the samples up by cause:
                    memoryview acquisition, Python-level calls and boxing, the
                    scheduler's and the block table's own code, numpy (the fake
                    runner), the rest.

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
    budget = 60_000  # steps the pool is sized for (one token per request per step at most)
    sched, runner = build("compiled", batch, 0, "full", budget)
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds and steps < budget:
        sched.schedule()
        runner.after(sched, sched.update(*runner.run(sched)))
        steps += 1
    return f"compiled core: batch {batch}, {steps} steps in {seconds} s (fake runner included)\n"


# Symbol substrings -> cause, first match wins (perf report's "dso symbol" columns).
CAUSES = (
    (
        "memoryview acquisition/release (per-row typed memoryviews)",
        (
            "memview",
            "memoryview",
            "BufFmt",
            "buffer_",
            "Buffer",
            "getbuffer",
            "strcmp",
            "GenericAlloc",
            "_PyObject_Malloc",
            "_PyObject_Free",
            "GC_Del",
            "GC_UnTrack",
            "GC_Track",
            "memset",
        ),
    ),
    (
        "Python-level calls and boxing (scheduler -> BlockTable)",
        (
            "PyLong_",
            "tuple",
            "GetMethod",
            "_PyType_Lookup",
            "vectorcall",
            "_PyErr_",
            "PyErr_",
            "PyArg",
            "Py_NewReference",
            "ParseKeywords",
            "PyDict",
            "FromSsize_t",
            "PyNumber",
        ),
    ),
    ("LoopScheduler's own code", ("loop_scheduler",)),
    ("BlockTable's own code", ("block_table",)),
    (
        "numpy (the fake runner, not timed by the benchmark)",
        ("_multiarray_umath", "libopenblas", "libscipy_openblas"),
    ),
)


def group_perf(report: str) -> str:
    """Add up `perf report --sort dso,symbol` percentages by cause."""
    totals: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split()
        if not parts or not parts[0].endswith("%"):
            continue
        pct = float(parts[0].rstrip("%"))
        text = " ".join(parts[1:])
        cause = next(
            (name for name, keys in CAUSES if any(k in text for k in keys)), "other (interpreter, kernel)"
        )
        totals[cause] = totals.get(cause, 0.0) + pct
    lines = [f"{pct:6.1f}%  {cause}" for cause, pct in sorted(totals.items(), key=lambda kv: -kv[1])]
    return "perf samples by cause (compiled core, steady decode)\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("cprofile", "loop", "group"), default="cprofile")
    p.add_argument("--perf-report", default=None, help="group: a saved `perf report` text")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="cprofile: steps profiled")
    p.add_argument("--seconds", type=float, default=5.0, help="loop: how long to run")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None, help="write the report to this file too")
    args = p.parse_args(argv)
    if args.mode == "cprofile":
        text = cprofile_twin(args.batch, args.steps, args.top)
    elif args.mode == "group":
        text = group_perf(Path(args.perf_report).read_text())
    else:
        text = loop_compiled(args.batch, args.seconds)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
