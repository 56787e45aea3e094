"""Shared helpers of the benchmarks: percentiles, batched timers, machine facts, result files.

Pure standard library, so both the project's venv and the vLLM client venv
(bench/setup_vllm_client.sh) can import it. Every result file written by
`write_result` carries the machine (CPU model, cores, load average before and
after), the git commit, the exact command line and the UTC time.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def default_out(name: str) -> Path:
    """bench/results/<name>-<UTC time>: where a benchmark writes its raw output unless told otherwise
    (bench/results/ is git-ignored: raw output is never committed)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RESULTS / f"{name}-{stamp}"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-quantile (0..1) of an already sorted, non-empty sequence."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Sequence[float], ndigits: int = 3) -> dict:
    """{"p10", "p50", "p90", "mean", "n"} of values (any unit; the caller names it)."""
    s = sorted(values)
    return {
        "p10": round(percentile(s, 0.1), ndigits),
        "p50": round(percentile(s, 0.5), ndigits),
        "p90": round(percentile(s, 0.9), ndigits),
        "mean": round(sum(s) / len(s), ndigits),
        "n": len(s),
    }


def time_batches(fn: Callable[[int], None], calls: int, repeats: int, warmup: int = 1) -> dict:
    """Microseconds per call of fn(calls) (which runs `calls` operations), over `repeats` batches.

    For operations far below a microsecond: the timer is read once per batch, so
    its own cost (~50 ns) is spread over the batch. Garbage collection is run
    before, not during, the batches.
    """
    for _ in range(warmup):
        fn(calls)
    gc.collect()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(calls)
        samples.append((time.perf_counter_ns() - t0) / 1e3 / calls)
    return summarize(samples, 4)


def ratio(slow: dict, fast: dict) -> float:
    """How many times faster `fast` is than `slow`, by median."""
    return round(slow["p50"] / fast["p50"], 2) if fast["p50"] > 0 else float("inf")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "csrc", "ouro_fast", "bench"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """What the numbers were measured on, and the load at this moment."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def command_line() -> str:
    """The command that produced this run, as one could type it from the repo root."""
    exe = os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    target = f"-m {spec.name}" if spec is not None else (sys.argv[0] if sys.argv else "")
    return " ".join([exe, target, *sys.argv[1:]]).strip()


def start_run() -> dict:
    """Call before measuring: records the machine, commit, command and load at the start."""
    return {
        "machine": machine(),
        "commit": git_commit(),
        "command": command_line(),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(meta: dict, results: object, out: str | Path | None, name: str) -> Path | None:
    """Write {meta..., "loadavg_after", "results"} as JSON to `out` (a file, or a folder that gets
    `name`.json); None writes nothing. Returns the path written."""
    if out is None:
        return None
    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(meta)
    doc["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    doc["results"] = results
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def fmt_us(stats: dict) -> str:
    """`p50 [p10-p90]` in microseconds, for tables."""

    def f(x: float) -> str:
        return f"{x:,.2f}" if x < 10 else f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"

    return f"{f(stats['p50'])} [{f(stats['p10'])}-{f(stats['p90'])}]"


def bench_args(doc: str, argv: list[str] | None, extra=None):
    """The micro-benchmarks' shared command line: --quick and --out (plus `extra(parser)`)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="toy sizes (smoke test)")
    p.add_argument("--out", default=None, help="result file or folder (JSON); default: print only")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def bench_main(doc: str, name: str, run: Callable[[bool], object], argv: list[str] | None = None):
    """Parse the shared command line, run, write `name`.json with the machine and commit."""
    args = bench_args(doc, argv)
    meta = start_run()
    res = run(args.quick)
    write_result(meta, res, args.out, name)
    return res
