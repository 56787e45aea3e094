"""Server start-up: seconds from launch to a ready /health, with Triton's cache cold (an empty
TRITON_CACHE_DIR, as on a fresh machine) and then warm (the same cache again), for each setting.

    python3 -P bench/gpu/startup_bench.py --model CKPT walk "serial OURO_FAST_COMPILE_THREADS=1"

A setting is a label and VAR=VAL environment entries. Prints and appends one JSON object per start: the
setting, cold or warm, seconds to ready, and the server's own start-up log lines (the compile walk, the
graph capture, the engine build); each server's log goes beside it. --out defaults to
bench/results/startup-<UTC time>.jsonl (git-ignored). The checkpoint must exist (`ouro-fast
make-checkpoint`); not timed here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

LOG_LINES = re.compile(
    r"compiled \d+ kernel variants|captured \d+ step graphs|engine ready in|process start to ready"
)


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start_once(model: str, env: dict, port: int, log: Path, timeout: float) -> dict:
    """Launch the server, wait for /health, stop it with SIGINT; the seconds to ready and its log lines."""
    # -P: the installed package (with its compiled core), not the source tree in the working directory.
    cmd = [sys.executable, "-P", "-m", "ouro_fast.cli", "serve", "--model", model, "--port", str(port)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        seconds = None
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            if ready(port):
                seconds = time.monotonic() - t0
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [ln.split(" ouro_fast", 1)[-1] for ln in log.read_text(errors="replace").splitlines()]
    return {"ready_s": seconds, "rc": proc.returncode, "log": [ln for ln in lines if LOG_LINES.search(ln)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", help="JSON lines file to append to (default: bench/results/startup-<time>.jsonl)")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("settings", nargs="+", help='"label VAR=VAL ..." (one argument each)')
    args = p.parse_args()
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        args.out = str(Path(__file__).resolve().parents[2] / "bench" / "results" / f"startup-{stamp}.jsonl")
    logs = Path(args.out).with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    for setting in args.settings:
        label, *pairs = setting.split()
        env = {**os.environ, **dict(kv.split("=", 1) for kv in pairs)}
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{label}-")  # cold: nothing compiled yet
        for cache in ("cold", "warm"):
            got = start_once(args.model, env, args.port, logs / f"{label}-{cache}.log", args.timeout)
            row = {"setting": setting, "cache": cache, **got}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
