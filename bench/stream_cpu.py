"""The event loop's CPU time per streamed token: what serving costs the thread that shares the GIL with the
engine owner.

Starts `ouro-fast serve` (the embedded tiny model on the CPU, `--max-num-seqs` = the concurrency) and runs
`--concurrency` clients in a separate process, each streaming completions of `--max-tokens` tokens
(ignore_eos, usage in the last chunk) back to back for `--seconds`. Reads the CPU time of the server's
event-loop thread (the main thread of `ouro-fast serve`) and of the whole process from /proc before and
after, and prints the microseconds each costs per streamed token. Linux only.

    python -m bench.stream_cpu                       # 128 clients, 64-token streams, 20 s
    python -m bench.stream_cpu --concurrency 32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time

import httpx

from tests.server_helpers import ServerProcess

MODEL = "ouro-tiny-random"


def cpu_ns(pid: int, tid: int | None = None) -> int:
    """On-CPU nanoseconds of one thread (tid), or of every thread of the process."""
    if tid is not None:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    return sum(cpu_ns(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task"))


async def _client(url: str, max_tokens: int, deadline: float, counts: list[int]) -> None:
    body = {"model": MODEL, "prompt": "the loop model", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < deadline:
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            counts[0] += usage["completion_tokens"]
                            counts[1] += 1


def _load(url: str, concurrency: int, max_tokens: int, seconds: float, out) -> None:
    counts = [0, 0]

    async def main():
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client(url, max_tokens, deadline, counts) for _ in range(concurrency)))

    asyncio.run(main())
    out.send(counts)


def measure(concurrency: int, max_tokens: int, seconds: float) -> dict:
    env = {"OURO_FAST_MAX_NUM_SEQS": str(concurrency), "OURO_FAST_MAX_WAITING": str(concurrency)}
    server = ServerProcess("cli", env).wait_ready()
    try:
        pid = server.proc.pid
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        loop0, all0, t0 = cpu_ns(pid, pid), cpu_ns(pid), time.monotonic()
        clients = ctx.Process(target=_load, args=(server.url, concurrency, max_tokens, seconds, send))
        clients.start()
        tokens, requests = recv.recv()
        clients.join()
        loop1, all1, t1 = cpu_ns(pid, pid), cpu_ns(pid), time.monotonic()
    finally:
        server.stop()
    return {
        "concurrency": concurrency, "max_tokens": max_tokens, "requests": requests, "tokens": tokens,
        "seconds": round(t1 - t0, 2), "tok_per_s": round(tokens / (t1 - t0), 1),
        "loop_us_per_token": round((loop1 - loop0) / 1e3 / max(tokens, 1), 2),
        "process_us_per_token": round((all1 - all0) / 1e3 / max(tokens, 1), 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.concurrency, args.max_tokens, args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
