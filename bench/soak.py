"""A bounded soak of the HTTP server under disconnects, overload, stalled readers and engine faults.

Starts `ouro-fast serve` (the embedded tiny model) on 127.0.0.1 with small limits so
that overload is reachable, then sends, at a fixed concurrency:

- `requests` ordinary requests: mixed prompt lengths and max_tokens, completions and
  chat, streamed or not; a fraction of their clients disconnect mid-stream (after a few
  chunks), a few more before the answer;
- a burst of requests past the admission bound, all at once (429s expected);
- a few clients that open a stream and never read (the server must abort and cut them);
- one request per stage of the engine step that trips the test-only fault injection
  (OURO_FAST_TEST_FAULTS, engine/faults.py), before its first token or mid-stream: batch
  stages end every request holding KV, request stages that request alone.

Afterwards it checks that every request is accounted for (completed, 429, cancelled
by its client, or failed with a reason; none silent or hung), that at most
`max_429_frac` of them were 429s, that the server's own counters agree (one failed step
per batch-stage fault), that the engine holds no KV and runs nothing, that the server's
threads, file descriptors and memory are back near their level before the load, and
that /health answers 200. Bounded in time and count; writes a JSON summary (--out).

    python -m bench.soak --out bench/results/soak.json     # 2,000 requests at concurrency 64
    python -m bench.soak --model /models/ouro-1.4b         # the same against a real checkpoint (a GPU)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from tests.server_helpers import ServerProcess, parse_metrics

MODEL = "ouro-tiny-random"
# Stage -> (sampling seed the fault injection watches, tokens the request has when it fires).
FAULTS = {"schedule": (990001, 0), "execute": (990002, 3), "update": (990003, 2),
          "sample": (990004, 0), "detokenize": (990005, 3), "output": (990006, 2)}  # fmt: skip
BATCH_STAGES = ("schedule", "execute", "update")
WORDS = ("the", "of", "loop", "model", "token", "exit", "depth", "ouro", "serve", "ring", "engine", "step")
SLOW_ID = "s" * 128  # the longest x-request-id echoed: every chunk's id carries it
OUTCOMES = ("completed", "rejected_429", "cancelled", "failed", "hung", "silent")


@dataclass
class SoakConfig:
    """What to send and the server's limits; the defaults are the documented soak."""

    requests: int = 2000
    concurrency: int = 64
    disconnect_frac: float = 0.2  # clients that disconnect mid-stream (their requests stream)
    early_disconnect_frac: float = 0.05  # clients that disconnect before the answer
    burst: int = 96  # sent at once halfway through, on top of the running load
    slow_clients: int = 3
    seed: int = 0
    max_num_seqs: int = 16
    max_waiting: int = 112  # admission bound 128: room for the concurrency and disconnected requests
    retry_after_s: float = 1.0  # how long an ordinary client waits after a 429 (the server says 1 s)
    max_429_frac: float = 0.10  # more 429s than this share of all requests: the admission is too tight
    stream_buffer: int = 8
    num_kv_blocks: int = 2048
    request_timeout_s: float = 60.0  # one request taking longer counts as hung
    time_limit_s: float = 600.0  # the whole load phase; what is left then counts as hung
    settle_s: float = 20.0  # how long the server gets to become idle afterwards
    rss_tolerance: float = 0.25  # RSS after the load may exceed RSS before it by this fraction
    rss_slack_mib: float = 48.0  # ... or by this much, whichever is larger
    model: str = ""  # a checkpoint directory to serve (default: the embedded tiny model)


@dataclass
class Result:
    """One client request as the client saw it."""

    kind: str  # normal, burst, fault, slow
    stage: str = ""  # the engine stage a fault request trips
    outcome: str = "silent"  # one of OUTCOMES
    reason: str = ""  # why it failed / how it was cancelled
    stream: bool = False
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class Plan:
    """One request to send: its body, how its client behaves."""

    kind: str
    body: dict
    path: str = "/v1/completions"
    disconnect: str = ""  # "", "before_answer" or "mid_stream"
    disconnect_after: float = 0.0  # seconds (before_answer) or chunks (mid_stream)
    stage: str = ""  # fault requests: the engine stage they trip


def server_env(cfg: SoakConfig) -> dict[str, str]:
    return {
        "OURO_FAST_MAX_NUM_SEQS": str(cfg.max_num_seqs),
        "OURO_FAST_MAX_WAITING": str(cfg.max_waiting),
        "OURO_FAST_STREAM_BUFFER": str(cfg.stream_buffer),
        "OURO_FAST_NUM_KV_BLOCKS": str(cfg.num_kv_blocks),
        "OURO_FAST_TEST_FAULTS": ",".join(f"{st}:{seed}@{n}" for st, (seed, n) in FAULTS.items()),
        "OURO_FAST_SHUTDOWN_GRACE": "2",
    }


# ---- the plan -------------------------------------------------------------------------------


def plan_requests(cfg: SoakConfig, rng: random.Random) -> list[Plan]:
    """The ordinary requests, in sending order (deterministic for a seed)."""
    plans = []
    for _ in range(cfg.requests):
        mid_stream = rng.random() < cfg.disconnect_frac
        stream = mid_stream or rng.random() < 0.5
        body = {"model": MODEL, "max_tokens": rng.choice((1, 2, 4, 8, 16, 32, 64)), "stream": stream}
        if rng.random() < 0.5:
            body["ignore_eos"] = True
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        if rng.random() < 0.3:
            body["max_loops"] = rng.randint(1, 4)
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 4, 16, 48, 120))))
        path = "/v1/completions"
        if rng.random() < 0.2:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        plan = Plan("normal", body, path)
        if mid_stream:
            plan.disconnect, plan.disconnect_after = "mid_stream", rng.randint(1, 4)
        elif rng.random() < cfg.early_disconnect_frac:
            plan.disconnect, plan.disconnect_after = "before_answer", rng.uniform(0.0, 0.05)
        plans.append(plan)
    return plans


def fault_plans() -> list[Plan]:
    """One request per stage; a penalty puts it in the logits processors, where the sample stage runs."""
    base = {
        "model": MODEL,
        "prompt": "fault",
        "ignore_eos": True,
        "max_tokens": 32,
        "repetition_penalty": 1.1,
    }
    return [
        Plan("fault", {**base, "seed": seed, "stream": tokens > 0}, stage=stage)
        for stage, (seed, tokens) in FAULTS.items()
    ]


def burst_plans(cfg: SoakConfig) -> list[Plan]:
    body = {"model": MODEL, "prompt": "burst", "max_tokens": 16, "ignore_eos": True}
    return [Plan("burst", dict(body)) for _ in range(cfg.burst)]


# ---- the clients ----------------------------------------------------------------------------


def _raw_request(port: int, plan: Plan, extra_headers: str = "") -> bytes:
    data = json.dumps(plan.body).encode()
    head = (f"POST {plan.path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra_headers}\r\n")  # fmt: skip
    return head.encode() + data


async def _disconnect_before_answer(port: int, plan: Plan, res: Result) -> None:
    """Send the whole request, wait a little, close without reading a byte."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_raw_request(port, plan))
    await writer.drain()
    await asyncio.sleep(plan.disconnect_after)
    writer.transport.abort()
    res.outcome, res.reason = "cancelled", "closed before the answer"


def _check_final(res: Result, body: dict, finish: str | None, tokens: int | None) -> None:
    """A completed request's figures, checked against what it asked for."""
    res.tokens = tokens or 0
    if finish not in ("stop", "length"):
        res.outcome, res.reason = "failed", f"finish_reason {finish!r}"
    elif tokens is not None and (tokens > body["max_tokens"] or (
            body.get("ignore_eos") and finish == "length" and tokens != body["max_tokens"])):  # fmt: skip
        res.outcome, res.reason = "failed", f"{tokens} tokens for max_tokens {body['max_tokens']}"
    else:
        res.outcome = "completed"


async def _plain(http: httpx.AsyncClient, plan: Plan, res: Result) -> None:
    r = await http.post(plan.path, json=plan.body)
    if r.status_code == 200:
        data = r.json()
        choice = data["choices"][0]
        _check_final(res, plan.body, choice["finish_reason"], data["usage"]["completion_tokens"])
    else:
        _error_answer(r.status_code, r.content, res)


def _error_answer(status: int, content: bytes, res: Result) -> None:
    try:
        err = json.loads(content)["error"]
        code = err.get("code") or err.get("type")
    except (ValueError, KeyError, TypeError):
        res.outcome, res.reason = "silent", f"HTTP {status} without an OpenAI error body"
        return
    if status == 429:
        res.outcome, res.reason = "rejected_429", code
    else:
        res.outcome, res.reason = "failed", f"HTTP {status} {code}"


async def _streamed(http: httpx.AsyncClient, plan: Plan, res: Result) -> None:
    res.stream = True
    chunks, done, finish, usage_tokens, error = 0, False, None, None, None
    buffer = b""
    async with http.stream("POST", plan.path, json=plan.body) as resp:
        if resp.status_code != 200:
            _error_answer(resp.status_code, await resp.aread(), res)
            return
        try:
            async for piece in resp.aiter_raw():
                buffer += piece
                while b"\n\n" in buffer:
                    message, buffer = buffer.split(b"\n\n", 1)
                    data = message.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        error = obj["error"].get("code") or "error"
                        continue
                    chunks += 1
                    if obj.get("choices"):
                        finish = obj["choices"][0].get("finish_reason") or finish
                    if obj.get("usage"):
                        usage_tokens = obj["usage"]["completion_tokens"]
                if plan.disconnect == "mid_stream" and chunks >= plan.disconnect_after and not done:
                    res.outcome, res.reason = "cancelled", f"closed after {chunks} chunks"
                    return  # leaving the block unread closes the connection
        except httpx.HTTPError as e:
            if error is None:
                res.outcome, res.reason = "silent", f"stream broke without an error event: {e!r}"
                return
    if error is not None:
        res.outcome, res.reason = "failed", f"stream error event {error}"
    elif not done:
        res.outcome, res.reason = "silent", "stream ended without [DONE]"
    elif finish == "abort":
        res.outcome, res.reason = "failed", "stream aborted by the server"
    else:
        _check_final(res, plan.body, finish, usage_tokens)


async def run_one(http: httpx.AsyncClient, port: int, plan: Plan, timeout: float) -> Result:
    res = Result(plan.kind, plan.stage, stream=bool(plan.body.get("stream")))
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            if plan.disconnect == "before_answer":
                await _disconnect_before_answer(port, plan, res)
            elif plan.body.get("stream"):
                await _streamed(http, plan, res)
            else:
                await _plain(http, plan, res)
    except TimeoutError:
        res.outcome, res.reason = "hung", f"no complete answer within {timeout:.0f}s"
    except (httpx.HTTPError, OSError) as e:
        res.outcome, res.reason = "silent", f"transport error {e!r}"
    res.seconds = time.monotonic() - t0
    return res


def open_slow_client(port: int) -> socket.socket:
    """A chat stream that is never read: a tiny receive buffer, the longest id and 20 top logprobs
    (with their bytes) per token fill every buffer fast."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stall"}], "max_tokens": 1900,
            "ignore_eos": True, "max_loops": 1, "stream": True, "logprobs": True,
            "top_logprobs": 20}  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        _raw_request(port, Plan("slow", body, "/v1/chat/completions"), f"x-request-id: {SLOW_ID}\r\n")
    )
    return sock


def drain_slow_client(sock: socket.socket, timeout: float) -> Result:
    """Read what the server sent; the connection must end (EOF or reset) within timeout."""
    res = Result("slow", stream=True)
    sock.settimeout(timeout)
    received = b""
    try:
        while piece := sock.recv(1 << 16):
            received += piece
        res.reason = "connection closed by the server"
    except ConnectionResetError:
        res.reason = "connection reset by the server"
    except TimeoutError:
        if received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # complete; the connection is kept alive
            res.outcome, res.reason = "completed", "never fell far enough behind"
        elif received.startswith(b"HTTP/1.1 429"):  # refused at admission; the connection stays alive
            res.outcome, res.reason = "rejected_429", "server_overloaded"
        else:
            res.outcome, res.reason = (
                "hung",
                f"still open after {timeout:.0f}s, {len(received)} bytes, ending {received[-120:]!r}",
            )
        return res
    finally:
        sock.close()
    res.outcome = "failed" if b"data: [DONE]" not in received else "completed"
    if b"engine_error" in received:
        res.reason = "engine error, then " + res.reason
    res.reason += f" after {len(received)} bytes"
    return res


# ---- the server's side ----------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """RSS (KiB), threads and open file descriptors of a process, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    fields["fds"] = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return fields


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def wait_idle(url: str, timeout: float) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until nothing runs, waits, is in flight or holds KV."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if busy(m) == (0, 0, 0, 0):
            return True, m
        if time.monotonic() > deadline:
            return False, m
        time.sleep(0.05)


def wait_slow_aborts(url: str, before: dict[str, float], n: int, timeout: float) -> None:
    """Poll /metrics until the server has aborted n more requests as slow clients (or timeout)."""
    key = 'ouro_fast:requests_aborted_total{reason="slow_client"}'
    deadline = time.monotonic() + timeout
    while metrics(url).get(key, 0) - before.get(key, 0) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def busy(m: dict[str, float]) -> tuple[float, ...]:
    return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
            m["ouro_fast:requests_in_flight"], m["ouro_fast:kv_blocks_used"])  # fmt: skip


def delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    """Counter increases of every sample starting with prefix."""
    return {
        k: v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix) and v != before.get(k, 0)
    }


# ---- the run --------------------------------------------------------------------------------


async def load(cfg: SoakConfig, url: str, port: int) -> tuple[list[Result], list[socket.socket]]:
    """Send every planned request; returns the results and the stalled readers' sockets."""
    rng = random.Random(cfg.seed)
    plans = plan_requests(cfg, rng)
    faults = fault_plans()
    limits = httpx.Limits(
        max_connections=cfg.concurrency + cfg.burst + 8, max_keepalive_connections=cfg.concurrency
    )
    sem = asyncio.Semaphore(cfg.concurrency)
    slow: list[socket.socket] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=cfg.request_timeout_s) as http:

        async def bounded(plan: Plan) -> Result:
            async with sem:
                res = await run_one(http, port, plan, cfg.request_timeout_s)
                if res.outcome == "rejected_429":
                    await asyncio.sleep(cfg.retry_after_s)  # a client honours Retry-After before its next
                return res

        async def fault(plan: Plan) -> Result:
            for _ in range(50):  # a 429 would mean the fault never fired: retry until admitted
                res = await run_one(http, port, plan, cfg.request_timeout_s)
                if res.outcome != "rejected_429":
                    return res
                await asyncio.sleep(0.1)
            return res

        tasks: list[asyncio.Task] = []
        fault_tasks: list[asyncio.Task] = []
        n = len(plans)
        fault_at = {n * (k + 1) // 16: plan for k, plan in enumerate(faults)}  # 1/16 .. 6/16 of the run
        for i, plan in enumerate(plans):
            if i in fault_at:
                if fault_tasks:
                    await asyncio.wait(fault_tasks)  # one fault at a time
                fault_tasks.append(asyncio.create_task(fault(fault_at[i])))
            if i == 7 * n // 16:
                # After the faults: a failed step would end the stalled streams as errors instead.
                await asyncio.wait(fault_tasks)
                tasks += fault_tasks
                # With every client slot held, the server has room: the stalled readers are admitted.
                for _ in range(cfg.concurrency):
                    await sem.acquire()
                slow += [open_slow_client(port) for _ in range(cfg.slow_clients)]
                await asyncio.sleep(0.2)
                for _ in range(cfg.concurrency):
                    sem.release()
            if i == n // 2:
                tasks += [asyncio.create_task(run_one(http, port, p, cfg.request_timeout_s))
                          for p in burst_plans(cfg)]  # fmt: skip
            await sem.acquire()  # pace task creation by the concurrency
            sem.release()
            tasks.append(asyncio.create_task(bounded(plan)))
        done, pending = await asyncio.wait(tasks, timeout=cfg.time_limit_s)
        for task in pending:
            task.cancel()
        results = []
        for task in tasks:
            if task in pending:
                results.append(Result("?", "hung", f"unfinished at the {cfg.time_limit_s:.0f}s limit"))
            else:
                results.append(task.result())
    return results, slow


def check(cfg: SoakConfig, results: list[Result], before: dict, after: dict, idle: bool,
          proc_before: dict, proc_after: dict, health: int) -> list[str]:  # fmt: skip
    """Every broken invariant, as a sentence (empty: the soak passed)."""
    problems = []
    by = Counter(r.outcome for r in results)
    expected = cfg.requests + cfg.burst + cfg.slow_clients + len(FAULTS)
    if len(results) != expected:
        problems.append(f"{len(results)} results for {expected} requests")
    if by["rejected_429"] > cfg.max_429_frac * len(results):
        problems.append(
            f"{by['rejected_429']} of {len(results)} requests got 429: the admission bound is too tight"
        )
    for bad in ("hung", "silent"):
        if by[bad]:
            examples = [r.reason for r in results if r.outcome == bad][:5]
            problems.append(f"{by[bad]} requests {bad}: {examples}")
    fails = [r for r in results if r.outcome == "failed" and r.kind == "normal" and not r.reason]
    if fails:
        problems.append(f"{len(fails)} failures without a reason")
    if not idle:
        problems.append(f"the server is not idle afterwards (running, waiting, in flight, KV): {busy(after)}")
    if health != 200:
        problems.append(f"/health answered {health}")
    finished = delta(after, before, "vllm:request_success_total")
    rejected = delta(after, before, "ouro_fast:requests_rejected_total")
    aborted = delta(after, before, "ouro_fast:requests_aborted_total")
    ok = sum(v for k, v in finished.items() if '"stop"' in k or '"length"' in k)
    cancelled = by["cancelled"]
    if not by["completed"] <= ok <= by["completed"] + cancelled:
        problems.append(f"server finished {ok} requests normally; clients completed {by['completed']}")
    server_429 = rejected.get('ouro_fast:requests_rejected_total{reason="overload"}', 0)
    if not by["rejected_429"] <= server_429 <= by["rejected_429"] + cancelled:
        problems.append(f"server rejected {server_429} (overload); clients saw {by['rejected_429']} 429s")
    if cfg.burst and not any(r.outcome == "rejected_429" for r in results if r.kind == "burst"):
        problems.append("the burst past the admission bound got no 429")
    slow_aborts = aborted.get('ouro_fast:requests_aborted_total{reason="slow_client"}', 0)
    stalled = sum(
        1 for r in results if r.kind == "slow" and r.outcome == "failed" and "engine error" not in r.reason
    )
    if slow_aborts != stalled:
        problems.append(f"{slow_aborts} slow-client aborts for {stalled} stalled readers")
    step_failures = (
        after["ouro_fast:engine_step_failures_total"] - before["ouro_fast:engine_step_failures_total"]
    )
    if step_failures != len(BATCH_STAGES):
        problems.append(
            f"{step_failures:.0f} engine step failures; {len(BATCH_STAGES)} batch faults were injected"
        )
    faults = [r for r in results if r.kind == "fault"]
    if [r.outcome for r in faults] != ["failed"] * len(FAULTS):
        problems.append(f"fault requests ended {[(r.stage, r.outcome, r.reason) for r in faults]}")
    if proc_after["Threads"] > proc_before["Threads"]:
        problems.append(f"server threads {proc_before['Threads']} -> {proc_after['Threads']}")
    if proc_after["fds"] > proc_before["fds"]:
        problems.append(f"server file descriptors {proc_before['fds']} -> {proc_after['fds']}")
    rss0, rss1 = proc_before["VmRSS"] / 1024, proc_after["VmRSS"] / 1024
    if rss1 - rss0 > max(cfg.rss_tolerance * rss0, cfg.rss_slack_mib):
        problems.append(f"server RSS {rss0:.0f} MiB -> {rss1:.0f} MiB")
    return problems


def warm_up(url: str) -> None:
    """A few requests of every kind, so RSS and thread counts are measured after lazy setup."""
    with httpx.Client(base_url=url, timeout=60) as http:
        for stream in (False, True, False, True):
            body = {"model": MODEL, "prompt": "warm up " * 20, "max_tokens": 32, "stream": stream}
            assert http.post("/v1/completions", json=body).status_code == 200
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            assert http.post("/v1/chat/completions", json={**chat, "stream": stream}).status_code == 200


def run_soak(cfg: SoakConfig) -> dict:
    """Start a server, run the soak against it, stop it; the summary (summary["problems"] empty: passed)."""
    args = ("--model", cfg.model, "--served-model-name", MODEL) if cfg.model else ()
    srv = ServerProcess("cli", server_env(cfg), args=args)
    try:
        srv.wait_ready()
        port = srv.port
        warm_up(srv.url)
        _, before = wait_idle(srv.url, cfg.settle_s)
        proc_before = proc_status(srv.proc.pid)
        t0 = time.monotonic()
        results, slow = asyncio.run(load(cfg, srv.url, port))
        load_s = time.monotonic() - t0
        wait_slow_aborts(srv.url, before, len(slow), cfg.settle_s)  # before reading, which unblocks them
        slow_results = [drain_slow_client(s, cfg.settle_s) for s in slow]
        results += slow_results
        idle, after = wait_idle(srv.url, cfg.settle_s)
        time.sleep(0.5)  # closed connections' descriptors are released by the server's event loop
        proc_after = proc_status(srv.proc.pid)
        health = httpx.get(srv.url + "/health", timeout=10).status_code
        problems = check(cfg, results, before, after, idle, proc_before, proc_after, health)
        exit_code = srv.stop()
        if exit_code != 0:
            problems.append(f"the server exited {exit_code} on SIGTERM")
        if "unhandled error on" in srv.log():
            problems.append("the server's catch-all error handler ran (see its log)")
    finally:
        srv.stop()
    return summarize(cfg, results, before, after, proc_before, proc_after, health, load_s, problems)


def summarize(cfg, results, before, after, proc_before, proc_after, health, load_s, problems) -> dict:
    reasons = Counter(f"{r.kind}:{r.outcome}:{r.reason.split(' after ')[0]}" for r in results
                      if r.outcome != "completed")  # fmt: skip
    done = [r for r in results if r.outcome == "completed"]
    return {
        "config": asdict(cfg),
        "requests_total": len(results),
        "outcomes": dict(Counter(r.outcome for r in results)),
        "outcomes_by_kind": {
            k: dict(Counter(r.outcome for r in results if r.kind == k))
            for k in ("normal", "burst", "fault", "slow")
        },  # fmt: skip
        "reasons": dict(reasons.most_common()),
        "faults": {r.stage: f"{r.outcome}: {r.reason}" for r in results if r.kind == "fault"},
        "unaccounted": sum(1 for r in results if r.outcome in ("hung", "silent")),
        "load_seconds": round(load_s, 2),
        "completed_per_second": round(len(done) / load_s, 1) if load_s else 0.0,
        "generated_tokens_completed": sum(r.tokens for r in done),
        "server_finished": delta(after, before, "vllm:request_success_total"),
        "server_rejected": delta(after, before, "ouro_fast:requests_rejected_total"),
        "server_aborted": delta(after, before, "ouro_fast:requests_aborted_total"),
        "server_step_failures": after["ouro_fast:engine_step_failures_total"]
        - before["ouro_fast:engine_step_failures_total"],
        "server_after": dict(zip(("running", "waiting", "in_flight", "kv_blocks_used"), busy(after))),
        "kv_blocks_total": after["ouro_fast:kv_blocks_total"],
        "process_before": proc_before,
        "process_after": proc_after,
        "rss_mib_before_after": [round(proc_before["VmRSS"] / 1024, 1), round(proc_after["VmRSS"] / 1024, 1)],
        "health_after": health,
        "problems": problems,
        "passed": not problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in SoakConfig.__dataclass_fields__.values():
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    parser.add_argument("--out", type=Path, help="write the JSON summary here")
    args = parser.parse_args(argv)
    cfg = SoakConfig(**{k: v for k, v in vars(args).items() if k != "out"})
    summary = run_soak(cfg)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print("soak PASSED" if summary["passed"] else f"soak FAILED: {summary['problems']}", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
