"""The HTTP server end to end: `sanic ouro_fast.server:app --single-process` on 127.0.0.1, the embedded
tiny model, driven with the openai SDK and an SSE reader that parses as `vllm bench serve` does."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from ouro_fast.engine.llm import LLM
from ouro_fast.engine.sampling import SamplingParams
from tests.server_helpers import ServerProcess, bench_stream
from tests.test_metrics_aiperf import FAMILIES

KV_BLOCKS = 1024  # 2048 tokens per request on the tiny model; a small pool keeps the test light
NAMES = ("ouro-tiny-random", "tiny")
MODEL = NAMES[0]
ENV = {
    "OURO_FAST_NUM_KV_BLOCKS": str(KV_BLOCKS),
    "OURO_FAST_SERVED_MODEL_NAME": ",".join(NAMES),
    "OURO_FAST_MAX_BODY_BYTES": str(256 << 10),
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("single", ENV)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=KV_BLOCKS)


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline(llm: LLM, prompt, **params) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) from the offline engine."""
    (c,) = llm.generate([prompt], SamplingParams(**params))
    out = c.outputs[0]
    return out.text, len(out.token_ids), out.finish_reason


def wait_idle(server: ServerProcess, timeout: float = 60.0) -> dict[str, float]:
    """Metrics once nothing is in flight and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["ouro_fast:requests_in_flight"] == 0 and m["vllm:num_requests_running"] == 0
        if idle and m["ouro_fast:kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.05)


# ---- discovery -------------------------------------------------------------------------


def test_health_models_and_tokenize(server, llm):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    import ouro_fast

    assert httpx.get(server.url + "/version").json() == {"version": ouro_fast.__version__}
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == list(NAMES)
    entry = models["data"][0]
    assert entry["object"] == "model" and entry["owned_by"] == "ouro_fast"
    assert entry["root"] == str(llm.engine.model_dir) and entry["max_model_len"] == 2048
    text = "Hello 👋 世界 <|im_end|>"
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tok == {
        "count": len(tok["tokens"]),
        "max_model_len": 2048,
        "tokens": llm.engine.tokenizer.encode(text),
    }
    assert llm.engine.tokenizer.im_end_id in tok["tokens"]
    detok = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert detok == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert chat["tokens"] == llm.engine.tokenizer.encode(llm.engine.tokenizer.apply_chat_template(messages))


# ---- completions -----------------------------------------------------------------------


def test_completion_sdk_matches_offline(server, sdk, llm):
    prompt = "The loop runs"
    resp = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    text, n, finish = offline(llm, prompt, max_tokens=6, temperature=0, ignore_eos=True)
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.choices[0].text == text and resp.choices[0].finish_reason == finish == "length"
    assert resp.usage.prompt_tokens == len(llm.engine.tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == n == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6


def test_completion_stream_as_vllm_bench_reads_it(server, llm):
    # The body vllm bench serve 0.33 sends, plus what older clients add (temperature, Bearer None).
    body = {"model": MODEL, "prompt": "Count: one two", "repetition_penalty": 1.0, "max_tokens": 7,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    headers = {"Authorization": "Bearer None", "x-request-id": "bench-42"}
    got = bench_stream(server.url + "/v1/completions", body, headers)
    assert got.status == 200 and got.done and got.error is None
    got.raw.decode("ascii")  # ASCII-only on the wire
    events = got.raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    text_chunks = got.text_chunks
    assert text_chunks, "no chunk with choices"
    assert all(c["id"] == "cmpl-bench-42" and c["object"] == "text_completion" for c in got.chunks)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * (len(text_chunks) - 1) + [
        "length"
    ]
    # The usage chunk comes last, with no choices, after the final text chunk.
    assert got.chunks[-1]["choices"] == [] and got.chunks[-2] is text_chunks[-1]
    text, n, _ = offline(llm, body["prompt"], max_tokens=7, temperature=0, ignore_eos=True)
    assert got.text == text
    prompt_tokens = len(llm.engine.tokenizer.encode(body["prompt"]))
    assert got.usage == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 7,
        "total_tokens": prompt_tokens + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_stream_sdk_and_token_prompt(server, sdk, llm):
    ids = llm.engine.tokenizer.encode("token ids in")
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 11}
    chunks = list(sdk.completions.create(model="tiny", prompt=ids, max_tokens=9, stream=True, seed=11,
                                         temperature=0.8, top_p=0.9, extra_body={"top_k": 40},
                                         stream_options={"include_usage": True}))  # fmt: skip
    text, n, finish = offline(llm, ids, max_tokens=9, **params)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == text
    assert with_choices[-1].choices[0].finish_reason == finish
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.model == "tiny" for c in chunks)


CASES = [
    ("greedy", "A looped model", {"max_tokens": 8, "temperature": 0}),
    ("seeded", "Sampling with a seed", {"max_tokens": 8, "temperature": 1.0, "seed": 1234}),
    ("top-k-p", "Filtered", {"max_tokens": 8, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 5}),
    ("early-exit", "Exit early", {"max_tokens": 10, "temperature": 0, "exit_threshold": 0.5, "min_loops": 2}),
    ("shallow", "One loop", {"max_tokens": 6, "temperature": 0, "max_loops": 1}),
    ("stop", "Stop here", {"max_tokens": 12, "temperature": 0, "stop": ["e"]}),
    ("cjk", "你好，世界", {"max_tokens": 8, "temperature": 1.0, "seed": 7}),
    ("emoji", "👋🌍 emoji 🎉", {"max_tokens": 8, "temperature": 1.0, "seed": 8}),
    ("special", "<|im_start|>user\nhi<|im_end|>\n", {"max_tokens": 8, "temperature": 1.0, "seed": 9}),
    ("keep-specials", "x", {"max_tokens": 8, "temperature": 1.5, "seed": 3, "skip_special_tokens": False}),
]


def test_http_equals_offline_concurrently(server, llm):
    """Every case streamed and non-streamed at once (so rows batch together), each equal to the
    offline engine's output for the same prompt and parameters, with exact usage."""
    before = server.metrics()
    expected = {name: offline(llm, prompt, **params) for name, prompt, params in CASES}

    def run(case, stream: bool):
        name, prompt, params = case
        body = {"model": MODEL, "prompt": prompt, "stream": stream, **params}
        if stream:
            body["stream_options"] = {"include_usage": True}
            got = bench_stream(server.url + "/v1/completions", body)
            assert got.status == 200 and got.done, got
            got.raw.decode("ascii")
            return name, got.text, got.usage, got.text_chunks[-1]["choices"][0]["finish_reason"]
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        r.content.decode("ascii")
        out = r.json()
        return name, out["choices"][0]["text"], out["usage"], out["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda a: run(*a), [(c, s) for c in CASES for s in (False, True)]))
    for name, text, usage, finish in results:
        prompt = next(p for n, p, _ in CASES if n == name)
        exp_text, exp_n, exp_finish = expected[name]
        assert (text, finish) == (exp_text, exp_finish), name
        assert usage["completion_tokens"] == exp_n, name
        assert usage["prompt_tokens"] == len(llm.engine.tokenizer.encode(prompt)), name
    assert any(
        any(ord(ch) > 127 for ch in expected[n][0]) for n in ("cjk", "emoji", "special", "keep-specials")
    )
    after = wait_idle(server)
    # Overlapping requests really shared engine steps: some steps ran more than one row.
    multi = lambda m: m["ouro_fast:step_rows_count"] - m['ouro_fast:step_rows_bucket{le="1"}']
    assert multi(after) > multi(before)
    # Outputs reach the event loop once per owner iteration (one step) for all requests, not per token.
    delta = {k: after[k] - before[k] for k in after if k in before}
    assert 0 < delta["ouro_fast:output_batches_total"] <= delta["ouro_fast:owner_wakeups_total"]
    assert delta["ouro_fast:output_batches_total"] < delta["vllm:generation_tokens_total"]


def test_owner_sleeps_while_idle(server):
    wait_idle(server)
    time.sleep(0.2)
    first = server.metrics()["ouro_fast:owner_wakeups_total"]
    time.sleep(0.5)
    assert server.metrics()["ouro_fast:owner_wakeups_total"] == first


def test_metrics_page_as_prometheus_reads_it(server, sdk):
    """/metrics parses with prometheus_client's parser, and a completed request moves its counters."""

    def scrape() -> tuple[dict, dict]:
        r = httpx.get(server.url + "/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
        fams = list(text_string_to_metric_families(r.text))
        values = {(s.name, *sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
                  for f in fams for s in f.samples}  # fmt: skip
        return {f.name: f.type for f in fams}, values

    wait_idle(server)
    kinds, before = scrape()
    assert kinds == FAMILIES
    resp = sdk.completions.create(model=MODEL, prompt="Count the loops", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    _, after = scrape()
    delta = lambda *key: after[key] - before[key]
    assert delta("vllm:request_success_total", ("finished_reason", "length")) == 1
    assert delta("vllm:request_success_total", ("finished_reason", "stop")) == 0
    assert delta("vllm:prompt_tokens_total") == resp.usage.prompt_tokens > 0
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 1, phase
    assert delta("ouro_fast:engine_steps_total") >= 5


def test_long_prompt_is_counted_exactly(server, llm):
    """Prompts over 16K characters are tokenized off the event loop; the count is still exact."""
    text = "the " * 4400
    n = len(llm.engine.tokenizer.encode(text))
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    # The prompt alone leaves no room for a reply: the error names the prompt, not max_tokens.
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"the prompt is {n} tokens" in r.json()["error"]["message"]


# ---- chat ------------------------------------------------------------------------------


def test_chat_nonstream_and_stream(server, sdk, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀 there"}]
    tok = llm.engine.tokenizer
    prompt = tok.apply_chat_template(messages)
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 99}
    text, n, finish = offline(llm, prompt, **params)
    resp = sdk.chat.completions.create(model=MODEL, messages=messages, **params)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == finish
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(tok.encode(prompt)), n)

    body = {"model": MODEL, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 6, "temperature": 1.0, "seed": 99}  # fmt: skip
    got = bench_stream(server.url + "/v1/chat/completions", body)
    assert got.status == 200 and got.done
    chunks = got.text_chunks
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in got.chunks)
    # The role rides on the first chunk, with the first content; never a role-only chunk before tokens.
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert got.text == text and chunks[-1]["choices"][0]["finish_reason"] == finish
    assert got.usage["completion_tokens"] == n


# ---- cancellations and disconnects -----------------------------------------------------


def test_concurrent_streams_with_cancellations(server, llm):
    """Half of the streams hang up after two chunks: the aborts reach the engine, the KV is freed,
    and the others finish with exactly the offline output."""
    before = server.metrics()
    keep = [(f"keep {i}", {"max_tokens": 8, "temperature": 1.0, "seed": 100 + i}) for i in range(3)]
    drop = [(f"drop {i}", {"max_tokens": 400, "temperature": 1.0, "seed": 200 + i, "ignore_eos": True})
            for i in range(3)]  # fmt: skip

    def run(prompt, params, stop_after):
        body = {"model": MODEL, "prompt": prompt, "stream": True, **params}
        return bench_stream(server.url + "/v1/completions", body, stop_after=stop_after)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, p, kw, None) for p, kw in keep]
        futures += [pool.submit(run, p, kw, 2) for p, kw in drop]
        results = [f.result() for f in futures]
    for (prompt, params), got in zip(keep, results[:3]):
        assert got.done and got.text == offline(llm, prompt, **params)[0]
    assert all(not got.done and len(got.chunks) == 2 for got in results[3:])
    after = wait_idle(server)
    aborted = 'ouro_fast:requests_aborted_total{reason="disconnect"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 3
    assert after['vllm:request_success_total{finished_reason="abort"}'] >= 3


def test_nonstream_disconnect_frees_kv(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    after = wait_idle(server)
    aborted = 'ouro_fast:requests_aborted_total{reason="disconnect"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1


# ---- bad input -------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
BAD = [
    (C, b'{"prompt": "x",', 400, None),
    (C, b'{"prompt": "\xff\xfe"}', 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"", 400, None),
    (C, b"[" * 5000 + b"]" * 5000, 400, None),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (C, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (C, {"max_tokens": 5}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, -1]}, 400, "prompt"),
    (C, {"prompt": [10**6]}, 400, "prompt"),
    (C, {"prompt": [1.5]}, 400, "prompt"),
    (C, {"prompt": [True]}, 400, "prompt"),
    (C, {"prompt": ["a", ""]}, 400, "prompt"),
    (C, {"prompt": ["a", [1, -1]]}, 400, "prompt"),
    (C, {"prompt": 123}, 400, "prompt"),
    (C, {"prompt": {"text": "x"}}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 2048}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "x", "top_k": 2**40}, 400, "top_k"),
    (C, {"prompt": "x", "seed": -1}, 400, "seed"),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    (C, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "x", "n": 2000}, 400, "n"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    (C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "repetition_penalty": True}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "logit_bias": {"a": 5}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}, 400, "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": [1]}, 400, "stream_options"),
    (C, {"prompt": "x", "stop": 5}, 400, "stop"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "min_loops": 0}, 400, "min_loops"),
    (C, {"prompt": "x", "max_loops": 5}, 400, "max_loops"),
    (C, {"prompt": "x", "min_loops": 3, "max_loops": 2}, 400, "max_loops"),
    (C, {"prompt": "x", "exit_threshold": 2}, 400, "exit_threshold"),
    (C, {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    (C, {"prompt": "x", "model": "nope"}, 404, "model"),
    (C, {"prompt": "x", "model": 5}, 400, "model"),
    (C, {"prompt": "x" * 300_000}, 413, None),
    (CH, {"max_tokens": 2}, 400, "messages"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": [{"role": "bogus", "content": "x"}]}, 400, "messages"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CH, {"messages": "hello"}, 400, "messages"),
    (CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CH, {"messages": MSG, "logprobs": 2}, 400, "logprobs"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
    ("/nowhere", {}, 404, None),
]


def test_bad_input_is_a_4xx_in_openai_shape(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, param in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (path, body if len(content) < 200 else len(content), r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert err["param"] == param, (body, err)
            if status == 404 and param == "model":
                assert err["code"] == "model_not_found"
        r = http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        assert http.get("/health").status_code == 200


# ---- shutdown --------------------------------------------------------------------------


def _sse(r: httpx.Response) -> list[dict]:
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_response_shapes_are_the_openai_sdks_types(server):
    """Every body and stream chunk validates against the openai SDK's own pydantic models."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    base = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    msgs = [{"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        Completion.model_validate(
            http.post("/v1/completions", json={**base, "prompt": "Hi"}).json(), strict=False
        )
        chat = ChatCompletion.model_validate(
            http.post("/v1/chat/completions", json={**base, "messages": msgs}).json()
        )
        assert isinstance(chat.usage.prompt_tokens_details.cached_tokens, int)
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        chunks = _sse(http.post("/v1/completions", json={**base, "prompt": "Hi", **stream}))
        assert len(chunks) >= 2 and chunks[-1]["usage"]["completion_tokens"] == 3
        for chunk in chunks:
            # Text-completion chunks carry finish_reason null until the last, as vLLM's do; the SDK's
            # Completion type has no null there, so every other field is what it checks.
            for choice in chunk["choices"]:
                choice["finish_reason"] = choice["finish_reason"] or "length"
            Completion.model_validate(chunk)
        chunks = _sse(http.post("/v1/chat/completions", json={**base, "messages": msgs, **stream}))
        for chunk in chunks:
            ChatCompletionChunk.model_validate(chunk)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_logprobs_in_the_openai_shapes(server, llm):
    """Completions (logprobs N) and chat (logprobs, top_logprobs) report the offline engine's numbers."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    params = dict(max_tokens=4, temperature=0, ignore_eos=True)
    (want,) = llm.generate("Hi there", SamplingParams(**params, logprobs=2))
    want = want.outputs[0]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hi there", "logprobs": 2, **params}
        ).json()
        Completion.model_validate(body)
        lp = body["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 4 and lp["text_offset"][0] == 0
        for got, entry, tok in zip(lp["token_logprobs"], want.logprobs, want.token_ids):
            assert got == pytest.approx(entry[tok].logprob, abs=1e-5)
        assert all(len(top) >= 1 for top in lp["top_logprobs"])  # keyed by text: two ids may share one
        # Streamed: each chunk carries its tokens' logprobs, offsets continuing across chunks.
        chunks = _sse(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "logprobs": 2,
                                                          "stream": True, **params}))  # fmt: skip
        streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)
        msgs = [{"role": "user", "content": "Hi"}]
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "logprobs": True,
                                                       "top_logprobs": 3, **params}).json()  # fmt: skip
        ChatCompletion.model_validate(chat)
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 for c in content)
        assert content[0]["logprob"] == content[0]["top_logprobs"][0]["logprob"]  # greedy: the likeliest
        plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **params}).json()
        assert plain["choices"][0]["logprobs"] is None


def test_penalties_bias_and_min_tokens_reach_the_engine(server, llm):
    """The processors' fields give the offline engine's tokens, and they change the reply."""
    params = dict(max_tokens=8, temperature=0, ignore_eos=True)
    extra = dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"5": 4.0})
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "Hello there", **params, **extra}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", **params}).json()
    extra["logit_bias"] = {5: 4.0}
    assert text == offline(llm, "Hello there", **params, **extra)[0]
    assert text != plain["choices"][0]["text"]


def test_prompt_lists_and_n(server, llm):
    """Choice i*n + j is prompt i's j-th; usage counts each prompt once and every choice's tokens."""
    params = dict(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = ["Hello", "Bye now"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2, **params}).json()
        texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        want = [offline(llm, p, **params)[0] for p in prompts]
        assert texts == [want[0], want[0], want[1], want[1]]  # greedy: a prompt's choices agree
        ids = [llm.engine.tokenizer.encode(p) for p in prompts]
        n_prompt = sum(map(len, ids))
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 16, "total_tokens": n_prompt + 16}
        assert body["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
        # Seeded sampling: the choices differ, and the request is reproducible.
        sampled = {"model": MODEL, "prompt": "Hello", "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 5}
        a = [c["text"] for c in http.post("/v1/completions", json=sampled).json()["choices"]]
        b = [c["text"] for c in http.post("/v1/completions", json=sampled).json()["choices"]]
        assert a == b and len(set(a)) > 1
        stream = {**sampled, "stream": True, "stream_options": {"include_usage": True}}
        chunks = _sse(http.post("/v1/completions", json=stream))
        by_index = {}
        for c in chunks[:-1]:
            for ch in c["choices"]:
                by_index[ch["index"]] = by_index.get(ch["index"], "") + ch["text"]
        assert [by_index[i] for i in range(3)] == a and chunks[-1]["usage"]["completion_tokens"] == 24
        msgs = [{"role": "user", "content": "Hi"}]
        chat = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "n": 2, **params}
        ).json()
        assert [c["index"] for c in chat["choices"]] == [0, 1]


def test_n_choices_compute_their_prompt_once(server, llm):
    """n = 4 choices of a 40-token prompt: its two whole 16-token blocks are computed once and shared,
    each choice computes its last 8 tokens; every choice is what a request of its own gives."""
    ids = list(range(300, 340))
    params = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = wait_idle(server)["ouro_fast:prefill_tokens_total"]
        body = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "n": 4, "seed": 5, **params})
        after = wait_idle(server)["ouro_fast:prefill_tokens_total"]
        assert after - before == 32 + 4 * 8  # not 4 x 40
        choices = sorted(body.json()["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        assert [c["text"] for c in choices] == [offline(llm, ids, seed=5 + j, **params)[0] for j in range(4)]
        usage = {"prompt_tokens": 40, "completion_tokens": 24, "total_tokens": 64}
        assert body.json()["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
        # Equal prompts of a list share too; echo and prompt logprobs are computed once, reported per choice.
        body = {"model": MODEL, "prompt": [ids, ids], "n": 2, "max_tokens": 1, "echo": True, "logprobs": 1,
                "prompt_logprobs": 1, "temperature": 0}  # fmt: skip
        before = after
        r = http.post("/v1/completions", json=body).json()
        assert wait_idle(server)["ouro_fast:prefill_tokens_total"] - before == 32 + 4 * 8
        assert r["usage"]["prompt_tokens"] == 80 and r["usage"]["completion_tokens"] == 4
        echoed = [c["logprobs"]["token_logprobs"][:40] for c in r["choices"]]
        assert len(echoed) == 4 and echoed[0][0] is None and all(e == echoed[0] for e in echoed)
        assert all(c["prompt_logprobs"] == r["choices"][0]["prompt_logprobs"] for c in r["choices"])


def test_a_repeated_prompt_reuses_its_cached_blocks(server, llm):
    """The second time a 40-token prompt comes, its first two 16-token blocks come from the prefix cache:
    usage.prompt_tokens_details.cached_tokens and vLLM's prefix-cache counters (tokens) show it, and the
    reply is the offline engine's."""
    ids = list(range(600, 640))
    params = dict(max_tokens=4, temperature=0, ignore_eos=True)
    body = {"model": MODEL, "prompt": ids, **params}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = wait_idle(server)
        first = http.post("/v1/completions", json=body).json()
        second = http.post("/v1/completions", json=body).json()
        after = wait_idle(server)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert first["choices"][0]["text"] == second["choices"][0]["text"] == offline(llm, ids, **params)[0]
        assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == 80
        assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 32
        # Chat: the same long message twice; the streamed usage chunk reports the reuse too.
        msgs = [{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}]
        chat = {"model": MODEL, "messages": msgs, **params}
        assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] > 32
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        chunks = _sse(http.post("/v1/chat/completions", json={**chat, **stream}))
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_echo_and_prompt_logprobs(server, llm):
    """What lm-evaluation-harness asks for a loglikelihood: the prompt echoed with each token's logprob."""
    tok = llm.engine.tokenizer
    text = "The cat sat on the mat"
    ids = tok.encode(text)
    # The offline engine's prompt logprobs are the reference.
    want = llm.engine
    want.add_request("ref", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    ref = None
    while ref is None:
        ref = next((o for o in want.step() if o.finished), None)
    expected = [lp.logprob for lp in ref.request.prompt_logprobs]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {
            "model": MODEL,
            "prompt": text,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        }
        r = http.post("/v1/completions", json=body).json()
        c = r["choices"][0]
        assert c["text"] == text and r["usage"]["completion_tokens"] == 0
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
        assert len(lp["tokens"]) == len(ids) and lp["text_offset"][0] == 0
        # echo with a reply: the prompt's tokens, then the reply's.
        body.update(max_tokens=2, ignore_eos=True)
        c = http.post("/v1/completions", json=body).json()["choices"][0]
        assert c["text"].startswith(text) and len(c["logprobs"]["tokens"]) == len(ids) + 2
        # vLLM's prompt_logprobs field, without echo.
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
        c = http.post("/v1/completions", json=body).json()["choices"][0]
        assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == len(ids)
        first = c["prompt_logprobs"][1][str(ids[1])]
        assert first["logprob"] == pytest.approx(expected[0], abs=1e-5) and first["rank"] >= 1
        # Streamed echo without logprobs: the prompt leads the stream.
        chunks = _sse(http.post("/v1/completions", json={"model": MODEL, "prompt": text, "echo": True,
                                                          "max_tokens": 2, "stream": True}))  # fmt: skip
        assert "".join(ch["choices"][0]["text"] for ch in chunks).startswith(text)


def test_stop_string_inclusion_and_continuous_usage(server, llm):
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    full = offline(llm, "Hello there", **params)[0]
    stop = full[1:3]
    k = full.index(stop)  # where the stop string first appears
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "Hello there", "stop": [stop], **params}
        cut = http.post("/v1/completions", json=body).json()["choices"][0]
        kept = http.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()[
            "choices"
        ][0]
        assert (cut["text"], cut["finish_reason"]) == (full[:k], "stop")
        assert (kept["text"], kept["finish_reason"]) == (full[: k + 2], "stop")
        stream = {"model": MODEL, "prompt": "Hello there", **params, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
        chunks = _sse(http.post("/v1/completions", json=stream))
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert (
            counts == sorted(counts) and counts[-1] == 12 and chunks[-1]["usage"]["completion_tokens"] == 12
        )


def test_unknown_fields_are_ignored_and_logged(server):
    """As vLLM's server does: a field no endpoint declares does not fail the request."""
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 2,
        "vendor_flag": True,
        "messages": "not for this endpoint",
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    deadline = time.monotonic() + 5
    while "messages, vendor_flag" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (
        "the request's fields messages, vendor_flag are not parameters of this endpoint: ignored"
        in server.log()
    )


def test_sigint_shutdown_is_clean(server):
    """Last in this module: SIGINT ends the idle server cleanly and joins the owner thread."""
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 0
    assert "the engine owner thread has ended" in server.log()
    assert "Traceback" not in server.log()
