"""Property-based fuzzing of the HTTP API against one real server.

POST /v1/completions, /v1/chat/completions, /tokenize and /detokenize get raw bytes
(invalid JSON and UTF-8, duplicate keys, NaN/Infinity literals, huge numbers, deep
nesting, truncation, control characters, bodies past the size limit), JSON of every
shape with wrong types in every field, and well-formed requests with extreme values.
Every answer must be a 2xx, or a 4xx with an ASCII OpenAI error body free of tracebacks
and paths; afterwards the server must be alive, healthy, idle and holding no KV.

Deterministic (derandomized hypothesis, no example database) and cheap: generation is
capped by a tiny max_model_len and max_tokens of at most 3 in the well-formed cases.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_helpers import ServerProcess

MODEL = "ouro-tiny-random"
MAX_BODY = 65536
MAX_MODEL_LEN = 64  # bounds a chat request's default max_tokens (the room left), so nothing runs long
MIN_CASES = 2000
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
ENV = {
    "OURO_FAST_MAX_NUM_SEQS": "8",
    "OURO_FAST_MAX_BODY_BYTES": str(MAX_BODY),
    "OURO_FAST_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
    "OURO_FAST_NUM_KV_BLOCKS": "256",
}
# Answers are checked against these: what a leaked traceback or source path looks like.
LEAKS = re.compile(r'Traceback \(most recent call last\)|File "/|site-packages|/ouro_fast/|\.py", line')
ERROR_KEYS = {"message", "type", "param", "code"}

COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
          "ignore_eos", "skip_special_tokens", "stream", "stream_options", "user", "min_loops",
          "max_loops", "exit_threshold", "n", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "min_tokens", "min_p", "length_penalty", "use_beam_search",
          "logit_bias", "logprobs")  # fmt: skip
FIELDS = {
    "/v1/completions": (*COMMON, "prompt", "echo", "best_of", "suffix"),
    "/v1/chat/completions": (
        *COMMON,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "response_format",
    ),  # fmt: skip
    "/tokenize": ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"),
    "/detokenize": ("model", "tokens"),
}
SETTINGS = dict(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

cases: Counter = Counter()  # requests sent, by test
statuses: Counter = Counter()  # (test, HTTP status) of every answer


class Fuzzed:
    """The module's server, one keep-alive client, and the vocabulary size found by probing."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0))
        self.vocab = self._probe_vocab()

    def _probe_vocab(self) -> int:
        """The first token id /detokenize refuses, by bisection (ids below it all decode)."""
        lo, hi = 0, 1 << 31  # lo decodes, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = self.http.post("/detokenize", json={"tokens": [mid]}).status_code == 200
            lo, hi = (mid, hi) if ok else (lo, mid)
        return hi

    def post(self, test: str, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
        cases[test] += 1
        try:
            r = self.http.post(
                path, content=body, headers={"content-type": "application/json", **(headers or {})}
            )
        except httpx.HTTPError as e:
            raise AssertionError(f"{path} {body[:300]!r}: no answer ({e!r})\n{self.log_tail()}") from e
        statuses[test, r.status_code] += 1
        check_answer(r, path, body, self.log_tail)
        return r

    def log_tail(self) -> str:
        return self.server.log()[-4000:]


@pytest.fixture(scope="module")
def fz():
    srv = ServerProcess("single", ENV)
    try:
        f = Fuzzed(srv.wait_ready())
        yield f
        f.http.close()
    finally:
        srv.stop()


def check_answer(r: httpx.Response, path: str, body: bytes, log_tail) -> None:
    """2xx or 4xx, ASCII JSON (or an ASCII SSE stream ending in [DONE]), errors in the OpenAI shape."""
    where = f"{path} {body[:300]!r} -> {r.status_code} {r.content[:500]!r}"
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, f"{where}\nserver log:\n{log_tail()}"
    assert r.content.isascii(), where
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200, where
        events = [e for e in r.text.split("\n\n") if e]
        assert events and all(e.startswith("data: ") for e in events), where
        assert events[-1] == "data: [DONE]", where
        for e in events[:-1]:
            chunk = json.loads(e.removeprefix("data: "))
            assert "error" not in chunk, where
        return
    assert r.headers.get("content-type", "").startswith("application/json"), where
    data = json.loads(r.content)
    assert isinstance(data, dict), where
    if r.status_code >= 400:
        err = data.get("error")
        assert set(data) == {"error"} and isinstance(err, dict) and set(err) == ERROR_KEYS, where
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str), where
        assert err["param"] is None or isinstance(err["param"], str), where
        assert err["code"] is None or isinstance(err["code"], str), where
        assert not LEAKS.search(r.text), where


# ---- strategies ------------------------------------------------------------------------

# A lone surrogate (JSON "\ud800") is not valid Unicode: as text to tokenize it must be a 400.
LONE_SURROGATES = ("\ud800", "a\udfffb")
NASTY_STRINGS = (
    "", " ", "\x00", "\x1b[31m", "\r\n", "\u2028", "\ufeff", "\ud83d\ude00", "😀",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "%s%n", "{}", "null", "\\", '"', "é" * 300,
    "a" * 5000, "\U0010ffff", "\x7f\x80\x9f", *LONE_SURROGATES,
)  # fmt: skip
NASTY_NUMBERS = (
    0, -0.0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, -(10**400), 1e308,
    -1e308, 5e-324, 1e-5, 0.5, 1.0, float("nan"), float("inf"), float("-inf"),
)  # fmt: skip

texts = st.one_of(st.text(max_size=40), st.sampled_from(NASTY_STRINGS))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**40), 10**40),
    st.floats(),
    st.sampled_from(NASTY_NUMBERS),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(texts, st.sampled_from(FIELDS["/v1/completions"])), inner, max_size=5),
    ),
    max_leaves=12,
)
endpoints = st.sampled_from(ENDPOINTS)


def encode(obj: object, ascii_only: bool) -> bytes:
    """JSON text as a client might send it; NaN/Infinity become literals and lone surrogates
    either \\u escapes or (non-ASCII mode) invalid UTF-8 bytes."""
    return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def field_bodies(draw, path: str) -> dict:
    """An object whose keys are mostly the endpoint's own fields, with values of any type."""
    names = st.one_of(st.sampled_from(FIELDS[path]), texts)
    return draw(st.dictionaries(names, json_values, max_size=6))


MUTATIONS = ("duplicate", "nan", "huge_number", "invalid_utf8", "truncate", "nest_array", "nest_object",
             "bom", "trailing", "control", "whitespace")  # fmt: skip
NUMBER_LITERALS = ("NaN", "-NaN", "Infinity", "-Infinity", "nan", "inf", "1e999999", "-1e-999999",
                   "9" * 5000, "-" + "9" * 400, "0." + "0" * 1000 + "1", "1" + "0" * 400 + ".5", "01", "+1",
                   "0x10", "1_000", ".5", "1.", "2e", "-")  # fmt: skip


@st.composite
def mutated(draw, path: str) -> bytes:
    """Valid-looking JSON text with one or two raw-text faults injected."""
    base = draw(field_bodies(path))
    text = encode(base, draw(st.booleans()))
    for kind in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=2)):
        name = draw(st.sampled_from(FIELDS[path])).encode()
        if kind == "duplicate":
            value = encode(draw(json_values), True)
            text = b'{"%s": %s, "%s": %s, ' % (name, value, name, value) + text.lstrip(b"{")
            if text.endswith(b", }"):
                text = text[:-3] + b"}"
        elif kind == "nan":
            text = b'{"%s": %s}' % (name, draw(st.sampled_from(NUMBER_LITERALS)).encode())
        elif kind == "huge_number":
            literal = draw(st.sampled_from(NUMBER_LITERALS[6:]))
            text = b'{"%s": [%s], "max_tokens": %s}' % (name, literal.encode(), literal.encode())
        elif kind == "invalid_utf8":
            at = draw(st.integers(0, len(text)))
            junk = draw(
                st.sampled_from(
                    (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80")
                )
            )
            text = text[:at] + junk + text[at:]
        elif kind == "truncate":
            text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
        elif kind == "nest_array":
            depth = draw(st.sampled_from((10, 100, 1000, 10000, 30000)))
            text = b'{"%s": %s%s}' % (name, b"[" * depth, b"]" * depth)
        elif kind == "nest_object":
            depth = draw(st.sampled_from((10, 100, 1000, 5000)))
            text = b'{"%s": ' % name + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
        elif kind == "bom":
            text = b"\xef\xbb\xbf" + text
        elif kind == "trailing":
            text = text + draw(st.sampled_from((b"}", b",", b" x", b"\x00", b"{}", b"\n\n")))
        elif kind == "control":
            s = draw(st.text(st.characters(max_codepoint=0x1F), min_size=1, max_size=8))
            text = b'{"%s": "%s"}' % (name, s.encode())
        else:
            text = draw(st.sampled_from((b" ", b"\t", b"\n", b"\r"))) * draw(st.integers(0, 2000)) + text
    return text


def _settings(n: int):
    return settings(max_examples=n, **SETTINGS)


# ---- the fuzz tests --------------------------------------------------------------------


@_settings(400)
@given(path=endpoints, body=st.binary(max_size=600))
def test_raw_bytes(fz, path, body):
    fz.post("raw_bytes", path, body)


@_settings(400)
@given(path=endpoints, value=json_values, ascii_only=st.booleans())
def test_any_json_value(fz, path, value, ascii_only):
    r = fz.post("any_json_value", path, encode(value, ascii_only))
    if not isinstance(value, dict):
        assert r.status_code == 400


@_settings(800)
@given(data=st.data(), path=endpoints, ascii_only=st.booleans())
def test_fields_of_any_type(fz, data, path, ascii_only):
    fz.post("fields_of_any_type", path, encode(data.draw(field_bodies(path)), ascii_only))


@_settings(450)
@given(data=st.data(), path=endpoints)
def test_mutated_json_text(fz, data, path):
    fz.post("mutated_json_text", path, data.draw(mutated(path)))


# ---- well-formed requests with extreme values --------------------------------------------

odd_text = st.one_of(st.text(min_size=1, max_size=60), st.sampled_from([s for s in NASTY_STRINGS if s]))


@st.composite
def sampling_fields(draw, vocab: int) -> dict:
    """Valid-typed sampling fields at their edges (some combinations are still refused: fine)."""
    pick = {
        "temperature": st.sampled_from((0, 0.0, 5e-324, 1e-6, 1e-5, 0.7, 1, 2.5, 1e6)),
        "top_p": st.sampled_from((5e-324, 1e-9, 0.1, 0.999999, 1, 1.0)),
        "top_k": st.sampled_from((-1, 0, 1, 2, vocab - 1, vocab, vocab + 1, 2**31 - 1)),
        "seed": st.one_of(st.sampled_from((0, 1, 2**63 - 1)), st.integers(0, 2**63 - 1)),
        "stop": st.one_of(odd_text, st.lists(odd_text, min_size=1, max_size=16)),
        "stop_token_ids": st.lists(
            st.one_of(st.integers(0, vocab - 1), st.sampled_from((vocab, 2**31 - 1))), max_size=64
        ),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "min_loops": st.integers(1, 4),
        "max_loops": st.integers(1, 4),
        "exit_threshold": st.sampled_from((0, 0.0, 1e-9, 0.5, 1, 1.0)),
        "user": odd_text,
        "n": st.sampled_from((1, None)),
        "presence_penalty": st.sampled_from((0, 0.0, None)),
        "logit_bias": st.sampled_from(({}, None)),
    }
    chosen = draw(st.lists(st.sampled_from(sorted(pick)), unique=True, max_size=len(pick)))
    body = {name: draw(pick[name]) for name in chosen}
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):
        body["model"] = MODEL
    return body


@st.composite
def messages(draw) -> list:
    roles = st.sampled_from(("system", "developer", "user", "assistant", "tool"))
    content = st.one_of(
        odd_text,
        st.just(""),
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}), max_size=3),
    )
    return draw(st.lists(st.fixed_dictionaries({"role": roles, "content": content}), min_size=1, max_size=4))


@st.composite
def well_formed(draw, path: str, vocab: int) -> dict:
    ids = st.lists(
        st.one_of(st.integers(0, vocab - 1), st.sampled_from((0, vocab - 1))), min_size=1, max_size=70
    )
    if path == "/tokenize":
        if draw(st.booleans()):
            body = {"prompt": draw(st.one_of(odd_text, st.just("")))}
        else:
            body = {"messages": draw(messages()), "add_generation_prompt": draw(st.booleans())}
        if draw(st.booleans()):
            body["add_special_tokens"] = draw(st.booleans())
        return body
    if path == "/detokenize":
        return {"tokens": draw(st.one_of(ids, st.just([])))}
    body = draw(sampling_fields(vocab))
    limit = draw(st.sampled_from(("max_tokens", "max_completion_tokens")))
    if path == "/v1/completions":
        body["prompt"] = draw(st.one_of(odd_text, ids, ids.map(lambda x: [x]), odd_text.map(lambda x: [x])))
        limit = "max_tokens"
    else:
        body["messages"] = draw(messages())
    body[limit] = draw(st.integers(1, 3))
    return body


# Printable ASCII without surrounding blanks: HTTP clients refuse to send those in a header.
request_ids = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=50).map(str.strip)
request_ids |= st.from_regex(r"[A-Za-z0-9._:-]{1,140}", fullmatch=True)
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@_settings(600)
@given(data=st.data(), path=endpoints, ascii_only=st.booleans(), request_id=st.none() | request_ids)
def test_well_formed_extremes(fz, data, path, ascii_only, request_id):
    body = data.draw(well_formed(path, fz.vocab))
    headers = {} if request_id is None else {"x-request-id": request_id}
    r = fz.post("well_formed_extremes", path, encode(body, ascii_only), headers)
    if r.status_code == 200 and not body.get("stream") and path.startswith("/v1/"):
        usage = r.json()["usage"]
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        assert 1 <= usage["completion_tokens"] <= cap
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # A valid x-request-id becomes the response id; any other is replaced by a generated one.
        echoed = request_id if request_id and VALID_REQUEST_ID.fullmatch(request_id) else None
        assert r.json()["id"].split("-", 1)[1] == (echoed or r.headers["x-request-id"])
        assert echoed is None or r.headers["x-request-id"] == echoed


# ---- sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("size", [MAX_BODY - 16, MAX_BODY + 1, 2 * MAX_BODY])
def test_huge_bodies(fz, path, size):
    """A body past the limit is a 413; one just under it (a long prompt) is parsed and answered."""
    key = {"/v1/chat/completions": "user", "/detokenize": "model"}.get(path, "prompt")
    skeleton = b'{"%s": "%%s"}' % key.encode()
    body = skeleton.replace(b"%s", b"x" * (size - len(skeleton) + 2))
    assert len(body) == size
    r = fz.post("huge_bodies", path, body)
    # Text longer than any request could hold is refused, /tokenize included; detokenize: an unknown model.
    under = {"/detokenize": 404}.get(path, 400)
    assert r.status_code == (413 if size > MAX_BODY else under)


def test_chunked_body_past_the_limit_is_413(fz):
    cases["huge_bodies"] += 1
    chunks = iter([b'{"prompt": "'] + [b"y" * 8192] * 12 + [b'"}'])
    r = fz.http.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
    check_answer(r, "/v1/completions", b"<chunked>", fz.log_tail)
    assert r.status_code == 413


# ---- found by this fuzzing: a lone surrogate in text to tokenize was a 500 ---------------------

SURROGATE_BODIES = [
    ("/v1/completions", {"prompt": LONE_SURROGATES[0], "max_tokens": 1}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONE_SURROGATES[1]}], "max_tokens": 1},
    ),
    ("/tokenize", {"prompt": LONE_SURROGATES[1]}),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE_SURROGATES[0]}]}]},
    ),
]


@pytest.mark.parametrize(("path", "body"), SURROGATE_BODIES)
def test_lone_surrogate_in_text_is_a_400(fz, path, body):
    r = fz.post("surrogates", path, encode(body, True))
    assert r.status_code == 400, r.text
    assert "not valid Unicode" in r.json()["error"]["message"]


# ---- afterwards: nothing lost, nothing leaked ---------------------------------------------


def test_server_survived_healthy_and_idle(fz):
    """Runs last (file order): the server lives, is healthy, runs nothing and holds no KV."""
    total = sum(cases.values())
    print(f"fuzz cases {total}: {dict(cases)}; answers {dict(sorted(statuses.items()))}")
    assert total >= MIN_CASES, f"only {total} cases ran: {dict(cases)}"
    assert fz.server.proc.poll() is None, fz.log_tail()
    assert fz.http.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while True:
        m = fz.server.metrics()
        busy = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["ouro_fast:requests_in_flight"], m["ouro_fast:kv_blocks_used"])  # fmt: skip
        if busy == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, f"not idle after the fuzzing: {busy}"
        time.sleep(0.05)
    assert m.get("ouro_fast:engine_step_failures_total", 0) == 0
    # The well-formed cases really generated (not all refused), streams included.
    assert statuses["well_formed_extremes", 200] >= 100, dict(statuses)
    assert m["vllm:generation_tokens_total"] >= 100, m
    # No request reached the server's catch-all error handler.
    assert fz.server.log().count("unhandled error on") == 0, fz.log_tail()
    # Every generated request finished (stop or length); none was aborted or failed.
    assert all(v == 0 for k, v in m.items() if k.startswith("vllm:request_success_total") and
               ('"abort"' in k or '"error"' in k)), m  # fmt: skip
