"""How long the event loop answers /health while clients send the heaviest input the server accepts.

Starts `ouro-fast serve` (the embedded tiny model, default settings) and polls GET /health
one request at a time, first idle, then while `clients` threads each send, back to back:

- a completion whose prompt is the longest the character bound lets through (it is then
  tokenized, and refused by its token count: the most tokenizing one request can cost);
- a chat request with that much text in one message (template rendering, then the same);
- /tokenize of that prompt, and /detokenize of its token ids;
- a completion and a chat request of 8 MiB less 4 KiB of text (parsed, then refused by the
  character bound before any tokenizing).

Prints p50, p99 and max of the /health latency, idle and loaded, and what the load did.

    python -m bench.loop_latency                 # 200 polls, 4 clients
    python -m bench.loop_latency --polls 50      # quicker
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import threading
import time

import httpx

from bench.benchlib import percentile, start_run, write_result
from tests.server_helpers import ServerProcess

MODEL = "ouro-tiny-random"
WORDS = ("the", "loop", "model", "token", "exit", "depth", "ouro", "serve", "engine", "step")
REFUSED_CHARS = (8 << 20) - 4096  # under the 8 MiB body limit: parsed, then refused by its length


def text_of(chars: int) -> str:
    words = " ".join(WORDS[i % len(WORDS)] for i in range(chars // 4 + 1))
    return words[:chars]


def prompt_bound(url: str) -> int:
    """The longest prompt (characters) the server tokenizes, read from its refusal of a longer one."""
    body = {"model": MODEL, "prompt": "x" * 1_000_000, "max_tokens": 1}
    message = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["error"]["message"]
    return int(re.search(r"more than the (\d+)", message).group(1))


def bodies(url: str, bound: int) -> list[tuple[str, bytes]]:
    """(path, JSON body) of each kind of heavy request, encoded once."""
    longest, refused = text_of(bound), text_of(REFUSED_CHARS)
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": longest}, timeout=120).json()[
        "tokens"
    ]
    chat = lambda text: {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}  # noqa: E731
    reqs = [
        ("/v1/completions", {"model": MODEL, "prompt": longest, "max_tokens": 1}),
        ("/v1/chat/completions", chat(longest)),
        ("/tokenize", {"model": MODEL, "prompt": longest}),
        ("/detokenize", {"model": MODEL, "tokens": ids}),
        ("/v1/completions", {"model": MODEL, "prompt": refused, "max_tokens": 1}),
        ("/v1/chat/completions", chat(refused)),
    ]
    return [(path, json.dumps(body).encode()) for path, body in reqs]


def poll_health(url: str, polls: int, interval: float) -> list[float]:
    """Seconds each of `polls` sequential GET /health took."""
    out = []
    with httpx.Client(timeout=30) as http:
        for _ in range(polls):
            t0 = time.perf_counter()
            assert http.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(interval)
    return out


def send(url: str, reqs: list, stop: threading.Event, seen: dict, offset: int) -> None:
    """Send the heavy requests round-robin until stop; count answers by (path, size, status)."""
    with httpx.Client(timeout=300) as http:
        i = offset
        while not stop.is_set():
            path, body = reqs[i % len(reqs)]
            status = http.post(
                url + path, content=body, headers={"Content-Type": "application/json"}
            ).status_code
            key = f"{path} {len(body) >> 10} KiB -> {status}"
            seen[key] = seen.get(key, 0) + 1
            i += 1


def load(url: str, reqs: list, clients: int, stop, answers) -> None:
    """`clients` threads sending, in a process of their own: their GIL is not the poller's."""
    halt, seen = threading.Event(), {}
    threads = [threading.Thread(target=send, args=(url, reqs, halt, seen, i)) for i in range(clients)]
    for t in threads:
        t.start()
    stop.wait()
    halt.set()
    for t in threads:
        t.join()
    answers.update(seen)


def stats(latencies: list[float]) -> dict:
    s = sorted(latencies)
    ms = lambda q: round(1000 * percentile(s, q), 1)  # noqa: E731
    return {"p50_ms": ms(0.5), "p99_ms": ms(0.99), "max_ms": round(1000 * s[-1], 1), "polls": len(s)}


def run(polls: int, clients: int, interval: float) -> dict:
    server = ServerProcess("cli").wait_ready()
    try:
        bound = prompt_bound(server.url)
        reqs = bodies(server.url, bound)
        idle = poll_health(server.url, polls, interval)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager:
            stop, answers = ctx.Event(), manager.dict()
            loader = ctx.Process(target=load, args=(server.url, reqs, clients, stop, answers))
            loader.start()
            time.sleep(2.0)  # every client has a request in flight
            loaded = poll_health(server.url, polls, interval)
            stop.set()
            loader.join()
            seen = dict(answers)
    finally:
        server.stop()
    return {"prompt_bound_chars": bound, "clients": clients, "idle": stats(idle), "loaded": stats(loaded),
            "answers": dict(sorted(seen.items()))}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--polls", type=int, default=200, help="GET /health requests, idle and then loaded")
    p.add_argument("--clients", type=int, default=4, help="threads sending heavy requests")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between polls")
    p.add_argument("--out", default=None, help="result file or folder (JSON); default: print only")
    args = p.parse_args(argv)
    meta = start_run()
    res = run(args.polls, args.clients, args.interval)
    write_result(meta, res, args.out, "loop_latency")
    print(f"prompt bound: {res['prompt_bound_chars']:,} characters; {res['clients']} clients")
    for phase in ("idle", "loaded"):
        s = res[phase]
        figures = f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms"
        print(f"/health {phase:6}: {figures} ({s['polls']} polls)")
    for key, n in res["answers"].items():
        print(f"  {n:5} x {key}")
    return res


if __name__ == "__main__":
    main()
