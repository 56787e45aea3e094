"""A/B runs of the captured decode loop: each setting in its own process, rounds alternating, one table.

The environment switches (OURO_FAST_TC_PACE, OURO_FAST_TC_RING, ...) are read at import, so every setting
needs its own process; machines drift by ~0.5% between calls (docs/benchmarks.md, twenty-eighth session), so
settings are compared within one call, and rounds alternate (a, then b) so that a drift within the call shows
as rounds that disagree. Each setting is "TAG [VAR=VALUE ...]":

    python3 -P bench/gpu/loop_ab.py --rows 1 8 --rounds 2 --out $OUT/step.jsonl \\
        base "q1 OURO_FAST_TC_PACE=6144x2048=1" "g1 OURO_FAST_TC_PACE=11264x2048=1"

runs bench/gpu/step_bench.py as `--tag TAG-a`, `TAG-b`, appends its JSON lines to --out (stderr beside it,
in .err) and prints one row per setting: each row count's loop time in every round. A process that fails or
runs past --timeout is reported and the others still run (exit status 1 then). --step replaces the
step_bench command (the tests use a stub).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

STEP = [sys.executable, "-P", str(Path(__file__).with_name("step_bench.py"))]


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """'TAG VAR=VALUE ...' -> (TAG, {VAR: VALUE}); a word after the tag without "=" is an error."""
    tag, *assignments = shlex.split(text)
    env = {}
    for item in assignments:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ValueError(f"setting {text!r}: {item!r} is not VAR=VALUE")
        env[name] = value
    return tag, env


def run_one(step: list[str], tag: str, env: dict[str, str], args, out: Path) -> dict | None:
    """One step_bench process; its last JSON line (None if it failed)."""
    cmd = [*step, "--rows", *map(str, args.rows), "--replays", str(args.replays), "--tag", tag]
    try:
        done = subprocess.run(
            cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        print(f"{tag}: past {args.timeout} s", flush=True)
        return None
    with out.open("a") as f:
        f.write(done.stdout)
    with out.with_suffix(out.suffix + ".err").open("a") as f:
        f.write(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"{tag}: rc {done.returncode}, {done.stderr.strip()[-300:]}", flush=True)
        return None
    return json.loads(lines[-1])


def table(
    settings: list[str], rows: list[int], results: dict[tuple[str, str], dict | None], rounds: str
) -> str:
    """One line per setting: for each row count, the loop's ms in each round (- where a run failed)."""
    head = "| setting | " + " | ".join(f"{r} rows, ms ({'/'.join(rounds)})" for r in rows) + " |"
    lines = [head, "|" + "---|" * (len(rows) + 1)]
    for tag in settings:
        cells = []
        for r in rows:
            got = [results.get((tag, k)) for k in rounds]
            cells.append(" / ".join(f"{g[f'rows_{r}_ms']:.4f}" if g else "-" for g in got))
        lines.append(f"| {tag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="+", help='"TAG [VAR=VALUE ...]", one per setting')
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2, help="1-26 (rounds are named a, b, ...)")
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a process may take")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines of every run (appended)")
    ap.add_argument("--step", default=None, help="the command that stands for step_bench (tests)")
    args = ap.parse_args(argv)
    parsed = [parse_setting(s) for s in args.settings]
    tags = [tag for tag, _ in parsed]
    if not 1 <= args.rounds <= 26:
        ap.error("--rounds takes 1-26")
    if len(set(tags)) != len(tags):
        ap.error(f"two settings share a tag: {tags}")
    step = shlex.split(args.step) if args.step else STEP
    rounds = "abcdefghijklmnopqrstuvwxyz"[: args.rounds]
    results = {}
    for k in rounds:  # all settings once, then again: a drift shows as rounds that disagree
        for tag, env in parsed:
            results[(tag, k)] = got = run_one(step, f"{tag}-{k}", env, args, args.out)
            if got:
                print(f"{tag}-{k}: " + ", ".join(f"{r} rows {got[f'rows_{r}_ms']:.4f} ms" for r in args.rows),
                      flush=True)  # fmt: skip
    print(table(tags, args.rows, results, rounds), flush=True)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
