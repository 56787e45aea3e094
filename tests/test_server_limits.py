"""Limits and failures of the server, started with `ouro-fast serve` and tight limits: the API key,
overload (429), a client that stops reading, and engine steps that raise (test-only fault hook)."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from tests.server_helpers import ServerProcess, bench_stream

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "ouro-tiny-random"
IN_FLIGHT = 3  # --max-num-seqs 2 + --max-waiting 1
FAULT_BEFORE_TEXT, FAULT_MID_STREAM, FAULT_ALONE = 777, 888, 999  # seeds the fault hook watches
ARGS = ("--max-num-seqs", "2", "--max-waiting", "1", "--stream-buffer", "8", "--api-key", KEY,
        "--num-kv-blocks", "1024")  # fmt: skip
ENV = {
    "OURO_FAST_TEST_FAULTS": f"execute:{FAULT_BEFORE_TEXT}@0,execute:{FAULT_MID_STREAM}@3,"
    f"detokenize:{FAULT_ALONE}@3"
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("cli", ENV, ARGS)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def wait_for(server: ServerProcess, done, timeout: float = 90.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if done(m):
            return m
        assert time.monotonic() < deadline, f"timed out; metrics: {m}"
        time.sleep(0.05)


def idle(m: dict[str, float]) -> bool:
    return m["ouro_fast:requests_in_flight"] == 0 and m["ouro_fast:kv_blocks_used"] == 0


def completion(server, **body):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer None"}, {"Authorization": "Bearer sekre"}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert completion(server).status_code == 200


def open_stream(server, body: dict, extra_headers: str = "", rcvbuf: int | None = None,
                path: str = "/v1/completions") -> socket.socket:  # fmt: skip
    """A streaming request sent on a raw socket that the caller reads (or not) as it likes."""
    data = json.dumps({"model": MODEL, "stream": True, **body}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nAuthorization: Bearer {KEY}\r\n{extra_headers}\r\n")  # fmt: skip
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(head.encode() + data)
    return sock


def test_overload_answers_429_with_retry_after(server):
    body = {"prompt": "busy", "max_tokens": 1000, "ignore_eos": True}
    socks = [open_stream(server, body) for _ in range(IN_FLIGHT)]
    try:
        wait_for(server, lambda m: m["ouro_fast:requests_in_flight"] == IN_FLIGHT)
        r = completion(server)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "server_overloaded"
    finally:
        for sock in socks:
            sock.close()
    m = wait_for(server, idle)
    assert m['ouro_fast:requests_rejected_total{reason="overload"}'] >= 1
    assert completion(server).status_code == 200  # room again


def test_invalid_generation_requests_are_counted_as_rejected(server):
    key = 'ouro_fast:requests_rejected_total{reason="invalid"}'
    before = server.metrics()[key]
    assert completion(server, max_tokens=-1).status_code == 400
    assert completion(server, prompt=12.5).status_code == 400
    assert completion(server, prompt="").status_code == 400
    assert server.metrics()[key] == before + 3


def test_slow_client_is_aborted_without_slowing_others(server):
    """A client that never reads: once its unsent output exceeds --stream-buffer steps the request
    is aborted and the connection cut, while another request completes normally meanwhile."""
    before = server.metrics()["vllm:generation_tokens_total"]
    # 20 top logprobs with their bytes and the longest x-request-id in every chunk (1.7 KB) fill the
    # socket buffers long before the 1900th token.
    body = {"messages": [{"role": "user", "content": "flood"}], "max_tokens": 1900, "ignore_eos": True,
            "max_loops": 1, "logprobs": True, "top_logprobs": 20}  # fmt: skip
    with open_stream(server, body, f"x-request-id: {'r' * 128}\r\n", 4096, "/v1/chat/completions") as sock:
        r = completion(server, max_tokens=6, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        m = wait_for(
            server, lambda m: m.get('ouro_fast:requests_aborted_total{reason="slow_client"}', 0) == 1
        )
        m = wait_for(server, idle)
        # The slow request stopped long before its 1900 tokens.
        assert m["vllm:generation_tokens_total"] - before < 1900
        sock.settimeout(30)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(1 << 16):
                pass  # drains what was sent, then sees the connection end


def test_engine_failure_ends_requests_and_engine_recovers(server):
    before = server.metrics()
    # A failure before any text: HTTP 500, OpenAI error shape.
    r = completion(server, seed=FAULT_BEFORE_TEXT)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "engine_error"
    # A failure mid-stream: text already sent, then the stream is cut (no [DONE]); a bystander
    # stream in flight at the time ends the same way, before or after its own first text.
    url = server.url + "/v1/completions"
    base = {"model": MODEL, "stream": True, "ignore_eos": True, "max_tokens": 400}
    bystander_body = {**base, "prompt": "bystander"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json=bystander_body, headers=AUTH) as bystander,
    ):
        reader = bystander.iter_raw()
        next(reader)
        got = bench_stream(url, {**base, "prompt": "victim", "seed": FAULT_MID_STREAM}, AUTH)
        assert got.status == 200 and got.text_chunks and not got.done
        assert got.chunks[-1]["error"]["code"] == "engine_error"
        with pytest.raises(httpx.HTTPError):
            for piece in reader:
                assert b"[DONE]" not in piece
    # The engine recovered: KV freed, health fine, new requests served.
    m = wait_for(server, idle)
    assert m["ouro_fast:engine_step_failures_total"] - before["ouro_fast:engine_step_failures_total"] == 2
    assert httpx.get(server.url + "/health").status_code == 200
    r = completion(server, max_tokens=5, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_a_request_fault_ends_that_request_alone(server):
    """A failure that belongs to one request (its detokenization) cuts its stream with an error event;
    a stream running beside it finishes, and no engine step counts as failed."""
    before = server.metrics()
    url = server.url + "/v1/completions"
    base = {"model": MODEL, "stream": True, "ignore_eos": True, "max_tokens": 40}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json={**base, "prompt": "by"}, headers=AUTH) as by,
    ):
        reader = by.iter_raw()
        next(reader)
        got = bench_stream(url, {**base, "prompt": "victim", "seed": FAULT_ALONE}, AUTH)
        assert got.status == 200 and not got.done
        assert got.chunks[-1]["error"]["code"] == "engine_error"
        rest = b"".join(reader)
    assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in rest.replace(b" ", b"")
    m = wait_for(server, idle)
    assert m["ouro_fast:engine_step_failures_total"] == before["ouro_fast:engine_step_failures_total"]
    assert errors(m) == errors(before) + 1


def errors(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("vllm:request_success_total") and '"error"' in k)
