"""Bounded connections and the queue timeout, on a server started with `sanic ouro_fast.server:app`
(the launcher that cannot be handed a protocol): header, body and keep-alive deadlines that
trickled bytes do not extend, and a queue timeout that ends waiting requests only; and the
connection cap, on `ouro-fast serve`."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time

import httpx
import pytest

from tests.server_helpers import ServerProcess

MODEL = "ouro-tiny-random"
HEADER_S, BODY_S, IDLE_S, QUEUE_S = 3.0, 3.0, 2.0, 1.0
SLOW_CLIENTS = 600
CAP = 8  # the capped server's --max-connections
# Deadlines are the contract: a closure must come after its deadline and well before this much later.
SLACK_S = 10.0
ENV = {
    "OURO_FAST_MAX_NUM_SEQS": "1",
    "OURO_FAST_MAX_WAITING": "4",
    "OURO_FAST_QUEUE_TIMEOUT": str(QUEUE_S),
    "OURO_FAST_HEADER_TIMEOUT": str(HEADER_S),
    "OURO_FAST_BODY_TIMEOUT": str(BODY_S),
    "OURO_FAST_KEEP_ALIVE_TIMEOUT": str(IDLE_S),
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("sanic", ENV)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def capped_server():
    """`ouro-fast serve` with a tiny connection cap and the default deadlines (none expires here)."""
    srv = ServerProcess("cli", args=("--max-connections", str(CAP)))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def closed_count(server: ServerProcess, reason: str) -> float:
    return server.metrics().get(f'ouro_fast:connections_closed_total{{reason="{reason}"}}', 0.0)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def completion(server: ServerProcess, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **body}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def test_trickled_headers_are_cut_at_the_header_deadline(server):
    """600 clients each trickle a header byte every second: every connection is closed once the
    header deadline from its start has passed, however recently its last byte came, while other
    clients are served."""
    before = closed_count(server, "header_timeout")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    sel = selectors.DefaultSelector()
    opened = {}
    for _ in range(SLOW_CLIENTS):
        sock = connect(server)
        sock.setblocking(False)
        opened[sock] = time.monotonic()
        sel.register(sock, selectors.EVENT_READ)
    sent, lifetimes = 0, []
    try:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # served meanwhile
        deadline = time.monotonic() + HEADER_S + SLACK_S
        while opened and time.monotonic() < deadline:
            for sock in opened:
                with contextlib.suppress(OSError):  # closed by the server: seen by the selector below
                    sock.send(head[sent : sent + 1])
            sent += 1
            step_end = time.monotonic() + 1.0
            while (left := step_end - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    sock = key.fileobj
                    try:
                        if sock.recv(65536):
                            continue  # the 408 answer; the close follows
                    except ConnectionResetError:
                        pass
                    lifetimes.append(time.monotonic() - opened.pop(sock))
                    sel.unregister(sock)
                    sock.close()
        assert not opened, f"{len(opened)} slow connections open {HEADER_S + SLACK_S:g} s after connecting"
        assert sent >= HEADER_S  # each kept sending past the deadline: bytes did not extend it
        assert min(lifetimes) >= HEADER_S - 0.1
        assert completion(server).status_code == 200
        assert closed_count(server, "header_timeout") - before >= SLOW_CLIENTS
    finally:
        for sock in opened:
            sock.close()
        sel.close()


def test_a_body_that_never_completes_is_cut_at_the_body_deadline(server):
    before = closed_count(server, "body_timeout")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
        start = time.monotonic()
        sock.setblocking(False)
        answer = b""
        while time.monotonic() - start < BODY_S + SLACK_S:
            try:
                sock.send(b" ")  # a body byte every 0.2 s: never enough to finish, always arriving
            except OSError:
                break
            time.sleep(0.2)
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        lifetime = time.monotonic() - start
    assert BODY_S - 0.1 <= lifetime < BODY_S + SLACK_S
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["message"] == f"the request body did not arrive within {BODY_S:g} s"
    assert closed_count(server, "body_timeout") == before + 1


def test_kept_alive_connections_are_reused_then_closed_when_idle(server):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        for i in range(3):  # reused within the idle timeout
            time.sleep(IDLE_S / 2 if i else 0)
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        assert IDLE_S - 0.1 <= time.monotonic() - start < IDLE_S + SLACK_S


def test_connections_beyond_the_cap_are_refused_at_once(capped_server):
    server = capped_server
    before = closed_count(server, "limit")
    held = [connect(server) for _ in range(CAP)]
    try:
        time.sleep(0.5)  # every one accepted: the next is over the cap
        with connect(server) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = read_until_closed(extra)
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in status
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the admitted ones are served
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    for _ in range(100):  # the server sees the closes
        with contextlib.suppress(httpx.TransportError):
            r = httpx.get(server.url + "/health", timeout=30)
            if r.status_code == 200:
                break
        time.sleep(0.05)
    assert r.status_code == 200
    assert closed_count(server, "limit") >= before + 1


def test_the_queue_timeout_ends_waiting_requests_and_never_running_ones(server):
    """With one row, a long request runs past every timeout and completes; a request queued
    behind it gets a 503 once it has waited the queue timeout; the next one is served."""
    results = {}

    def long_request():
        results["long"] = completion(server, max_tokens=700, ignore_eos=True)

    runner = threading.Thread(target=long_request)
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while server.metrics()["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        queued = completion(server)
        waited = time.monotonic() - start
    finally:
        runner.join()
    assert queued.status_code == 503 and queued.headers["Retry-After"] == "1"
    assert queued.json()["error"]["message"] == (
        f"the request waited {QUEUE_S:g} s in the queue without being scheduled"
    )
    assert QUEUE_S - 0.1 <= waited < QUEUE_S + SLACK_S
    long = results["long"]
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 700
    assert long.elapsed.total_seconds() > QUEUE_S
    assert completion(server).status_code == 200
    m = server.metrics()
    assert m["ouro_fast:requests_in_flight"] == 0 and m["ouro_fast:kv_blocks_used"] == 0
