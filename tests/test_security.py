"""Security basics on one server with an API key and a small body limit: 401 for a
missing, wrong or malformed key, errors before the handler with their own status, 413 past the size
limit, error bodies without tracebacks or paths, x-request-id validation, no CORS headers (the server
has no CORS option: it is off); and on a second server, a key read from a file that no log line,
config repr or metric shows, and metrics labelled without the checkpoint's path."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest

from tests.server_helpers import ServerProcess

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4096
LEAKS = re.compile(r"Traceback|File \"/|site-packages|/ouro_fast/|\.py\b")


@pytest.fixture(scope="module")
def srv():
    env = {
        "OURO_FAST_API_KEY": KEY,
        "OURO_FAST_MAX_BODY_BYTES": str(MAX_BODY),
        "OURO_FAST_NUM_KV_BLOCKS": "256",
    }
    server = ServerProcess("cli", env)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def assert_clean_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert not LEAKS.search(r.text), r.text
    return err


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
     {"Authorization": f"bearer {KEY}"}, {"Authorization": f"Basic {KEY}"}, {"X-Api-Key": KEY}],
)  # fmt: skip
def test_missing_or_wrong_key_is_401(srv, headers):
    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(srv.url + path, json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert assert_clean_error(r, 401)["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/v1/models", headers=headers).status_code == 401


def test_right_key_is_served(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 200


def test_body_past_the_limit_is_413(srv):
    body = b'{"prompt": "' + b"a" * MAX_BODY + b'"}'
    assert_clean_error(httpx.post(srv.url + "/v1/completions", content=body, headers=AUTH), 413)
    # Without a key the answer is 401: the key is checked before the body is read.
    assert_clean_error(httpx.post(srv.url + "/v1/completions", content=body), 401)


def test_error_bodies_carry_no_traceback_or_path(srv):
    for path, body in (("/v1/completions", b"{"), ("/v1/completions", b'{"prompt": 1e999}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "x"}]}'),
                       ("/detokenize", b'{"tokens": [-1]}'), ("/tokenize", b"\xff\xfe")):  # fmt: skip
        assert_clean_error(httpx.post(srv.url + path, content=body, headers=AUTH), 400)
    assert_clean_error(httpx.get(srv.url + "/no/such/route", headers=AUTH), 404)
    assert_clean_error(httpx.get(srv.url + "/v1/completions", headers=AUTH), 405)


def test_cors_is_off(srv):
    origin = {"Origin": "https://evil.example"}
    for r in (
        httpx.get(srv.url + "/health", headers=origin),
        httpx.post(
            srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={**AUTH, **origin}
        ),
        httpx.options(
            srv.url + "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"}
        ),  # fmt: skip
    ):
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], dict(r.headers)


def raw_request(srv, head: bytes, body: bytes = b"", tries: int = 5) -> tuple[int, dict[str, str], bytes]:
    """Send bytes no HTTP client would (undecodable headers, huge heads); (status, headers, body).

    A server that answers before reading all it was sent closes with bytes unread, so its kernel may reset
    the connection before the answer is read here: then the request is sent again."""
    for attempt in range(tries):
        try:
            data = _send_raw(srv, head + b"Connection: close\r\n\r\n" + body)
            break
        except (ConnectionResetError, BrokenPipeError):
            if attempt == tries - 1:
                raise
    head_part, _, payload = data.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, payload


def _send_raw(srv, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


def assert_clean_raw(answer: tuple[int, dict, bytes], status: int) -> dict:
    got, _, payload = answer
    assert got == status, payload
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert not LEAKS.search(payload.decode("latin-1")), payload
    return err


def completion_head(auth: bytes | None, length: int) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n" % length
    return head if auth is None else head + b"Authorization: " + auth + b"\r\n"


@pytest.mark.parametrize(
    "auth",
    [b"Bearer \xff\xfe", b"Bearer " + KEY.encode() + b"\xe9", b"\xff" + KEY.encode(), b"", b"Bearer",
     b"Bearer ", b"Bearer  " + KEY.encode(), b"Bearer\t" + KEY.encode(), KEY.encode(),
     "Bearer ключ".encode()],
)  # fmt: skip
def test_malformed_authorization_is_401(srv, auth):
    body = b'{"prompt": "x", "max_tokens": 1}'
    err = assert_clean_raw(raw_request(srv, completion_head(auth, len(body)), body), 401)
    assert err["code"] == "invalid_api_key"
    assert "Traceback" not in srv.log()


def test_errors_before_the_handler_keep_their_status(srv):
    """With a valid key each keeps its own status; without one, a protected path answers 401 to
    anything that reached the server's middleware (a request head Sanic cannot read is refused first)."""
    key = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    big = b"a" * (MAX_BODY + 1)
    cases = (
        (b"GET /v1/no/such/route HTTP/1.1\r\nHost: x\r\n", b"", 404),
        (b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n", b"", 405),
        (b"PUT /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n", b"{}", 405),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(big), big, 413),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n",
         b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big), 413),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n", b"{", 400),
    )  # fmt: skip
    for head, body, status in cases:
        assert_clean_raw(raw_request(srv, head + key, body), status)
        assert assert_clean_raw(raw_request(srv, head, body), 401)["code"] == "invalid_api_key"
    # A request head past Sanic's limit is refused before any middleware, key or not.
    huge_head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n"
    for head in (huge_head + key, huge_head):
        assert_clean_raw(raw_request(srv, head), 413)
    assert "Traceback" not in srv.log()


def test_request_id_is_echoed_only_when_valid(srv):
    url, body = srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}
    for given in ("bench-1", "a.b:c_D-9", "r" * 128):
        r = httpx.post(url, json=body, headers={**AUTH, "x-request-id": given})
        assert r.json()["id"] == "cmpl-" + given and r.headers["x-request-id"] == given
    for given in ("r" * 129, "has space", "semi;colon", "<script>", "a/b", "%0d%0a"):
        r = httpx.post(url, json=body, headers={**AUTH, "x-request-id": given})
        generated = r.headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", generated) and r.json()["id"] == "cmpl-" + generated
    # Errors carry the id too, and a header with undecodable bytes is replaced like any invalid one.
    head = completion_head(None, 2) + b"x-request-id: \xff\xfe\r\n"
    status, headers, _ = raw_request(srv, head, b"{}")
    assert status == 401 and re.fullmatch("[0-9a-f]{32}", headers["x-request-id"])


@pytest.fixture(scope="module")
def key_file_srv(tmp_path_factory, model_dir):
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(f"  {FILE_KEY}\n")
    args = ("--model", model_dir, "--api-key-file", str(key_file), "--num-kv-blocks", "256")
    server = ServerProcess("cli", {}, args)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


FILE_KEY = "f1le-k3y-never-shown"


def test_key_from_a_file_is_never_shown(key_file_srv, model_dir):
    srv, body = key_file_srv, {"prompt": "x", "max_tokens": 1}
    assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
    r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {FILE_KEY}"})
    assert r.status_code == 200, r.text
    metrics = httpx.get(srv.url + "/metrics").text
    assert FILE_KEY not in metrics
    log = srv.log()
    assert "configuration: ServerConfig(" in log and "api_key='<redacted>'" in log
    assert FILE_KEY not in log


def test_metrics_are_labelled_without_the_checkpoint_path(key_file_srv, model_dir):
    from pathlib import Path

    metrics = httpx.get(key_file_srv.url + "/metrics").text
    labels = set(re.findall(r'model_name="([^"]*)"', metrics))
    assert labels == {Path(model_dir).name}
    assert model_dir not in metrics
