"""Where a GPU timeline's time goes, by kernel, when kernels overlap (PDL), from a torch-profiler trace.

With programmatic dependent launch a kernel starts while the one before it runs and waits inside, so the
profiler's per-kernel durations overlap and their sum exceeds the wall time. Here each kernel is charged only
what it adds to the stream's completion frontier: the time from the latest end of the kernels before it to
its own end (0 if it ends earlier). Time with no kernel running is charged to "idle". The charges partition
the span from the first kernel's start to the last one's end, so they add up to the wall time.

A kernel is named by its function, its grid's x size and the function before it, which tells the loop's
matmuls apart (tc_gemm with 132 CTAs after the attention is o_proj, 176 after a norm is gate_up, ...).

    python3 bench/gpu/trace_split.py trace.json [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys


def load_kernels(path: str) -> list[dict]:
    """The trace's GPU kernels as {name, start, end} (microseconds), in start order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    out = [
        {"name": short_name(e["name"]), "grid": (e.get("args", {}).get("grid") or [0])[0],
         "start": float(e["ts"]), "end": float(e["ts"]) + float(e.get("dur", 0.0))}
        for e in kernels
    ]  # fmt: skip
    return sorted(out, key=lambda k: (k["start"], k["end"]))


def short_name(name: str) -> str:
    """A kernel's function name without C++ templates, argument lists or a leading namespace."""
    name = name.replace("(anonymous namespace)", "anon")
    name = re.split(r"[<(]", name, maxsplit=1)[
        0
    ].strip()  # templates and arguments may nest: cut at the first
    return name.split("::")[-1].split(" ")[-1] or name


def split(kernels: list[dict]) -> dict:
    """Per label: calls, mean own duration and the frontier time it adds; plus idle time and the span."""
    rows: dict[str, dict] = {}
    idle = 0.0
    frontier = None
    prev = "start"
    for k in kernels:
        label = f"{k['name']}/{k['grid']} after {prev}"
        if frontier is None:
            frontier = k["start"]
        if k["start"] > frontier:  # nothing ran in between
            idle += k["start"] - frontier
            frontier = k["start"]
        added = max(0.0, k["end"] - frontier)
        frontier = max(frontier, k["end"])
        r = rows.setdefault(label, {"calls": 0, "own_us": 0.0, "added_us": 0.0})
        r["calls"] += 1
        r["own_us"] += k["end"] - k["start"]
        r["added_us"] += added
        prev = k["name"]
    span = (frontier - kernels[0]["start"]) if kernels else 0.0
    return {"span_us": span, "idle_us": idle, "rows": rows}


def table(result: dict, top: int) -> str:
    span, idle = result["span_us"], result["idle_us"]
    share = 100 / (span or 1.0)
    head = f"{'kernel / grid after previous':70s} {'calls':>6s} {'mean own us':>11s} {'added us':>10s} share"
    lines = [f"span {span:.1f} us, idle {idle:.1f} us ({idle * share:.1f}%)", head]
    ranked = sorted(result["rows"].items(), key=lambda kv: -kv[1]["added_us"])
    for label, r in ranked[:top]:
        own, added = r["own_us"] / r["calls"], r["added_us"]
        lines.append(f"{label[:70]:70s} {r['calls']:6d} {own:11.2f} {added:10.1f} {added * share:5.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="", help="also write the split as JSON here")
    args = ap.parse_args(argv)
    result = split(load_kernels(args.trace))
    print(table(result, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
