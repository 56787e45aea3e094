"""Security basics on one server with an API key and a small body limit: 401 for a
missing or wrong key, 413 past the size limit, error bodies without tracebacks or paths, and no
CORS headers (the server has no CORS option: it is off)."""

from __future__ import annotations

import re

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
