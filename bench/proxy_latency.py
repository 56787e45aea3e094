"""The latency HAProxy adds: time to the first streamed token through deploy/haproxy and directly.

Starts one `ouro-fast serve` replica behind HAProxy with deploy/haproxy/replicas.py (the shipped
configuration), then sends streamed completions one at a time, alternating between HAProxy's port and
the replica's own, and reports each path's TTFT (request sent to the first chunk with text) at p50 and
p99 and their difference. One request at a time, so that queueing does not hide the proxy's share.

    python -m bench.proxy_latency                               # the embedded tiny model, CPU
    python -m bench.proxy_latency --requests 500 -- --model /models/ouro-1.4b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from tests.server_helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "ouro-proxy-bench"


def ttft(client: httpx.Client, url: str, i: int, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first chunk that carries text."""
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first


def wait_healthy(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="per path (default 300)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--haproxy", default=shutil.which("haproxy") or "haproxy")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    proxy, replica, stats = free_port(), free_port(), free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="proxy-latency-"))
    cmd = [sys.executable, str(ROOT / "deploy/haproxy/replicas.py"), "--gpus", "0", "--port", str(proxy),
           "--bind", "127.0.0.1", "--base-port", str(replica), "--stats-port", str(stats),
           "--run-dir", str(run_dir), "--haproxy", args.haproxy,
           "--", "--served-model-name", MODEL, *serve_args]  # fmt: skip
    env = {**os.environ, "OURO_FAST_DRAIN_DELAY": "0"}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        direct, proxied = f"http://127.0.0.1:{replica}", f"http://127.0.0.1:{proxy}"
        wait_healthy(direct, 300)
        wait_healthy(proxied, 60)
        times: dict[str, list[float]] = {"direct": [], "haproxy": []}
        with httpx.Client(timeout=60) as client:
            for i in range(20):  # warm-up: both paths' connections, the engine's first steps
                ttft(client, direct if i % 2 else proxied, i, args.max_tokens)
            for i in range(args.requests):
                for name, url in (("direct", direct), ("haproxy", proxied))[:: 1 if i % 2 else -1]:
                    times[name].append(ttft(client, url, i, args.max_tokens))
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(120)
        shutil.rmtree(run_dir, ignore_errors=True)
    ms = {k: np.array(v) * 1e3 for k, v in times.items()}
    summary = {k: {f"p{q}_ms": round(float(np.percentile(v, q)), 3) for q in (50, 99)} for k, v in ms.items()}
    summary["added_ms"] = {
        q: round(summary["haproxy"][q] - summary["direct"][q], 3) for q in ("p50_ms", "p99_ms")
    }
    print(json.dumps({"requests_per_path": args.requests, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
