"""The server's pieces without a server: configuration, validation, SSE framing, metrics text,
and the event-loop side of the ring (admission, routing, slow-client drop, abort backlog)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import math
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from ouro_fast.core.ring import RequestRing
from ouro_fast.engine.outputs import StepOutput, StepStats
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.server import protocol, stream
from ouro_fast.server.config import ConfigError, ServerConfig
from ouro_fast.server.engine_client import EngineClient
from ouro_fast.server.metrics import REJECT_REASONS, ServerMetrics
from ouro_fast.server.owner import (
    ABORT,
    MAX_FAILURES_IN_A_ROW,
    SUBMIT,
    EngineOwner,
    EngineSnapshot,
    OwnerFault,
    parse_owner_faults,
)
from ouro_fast.server.protocol import ApiError, ModelInfo
from tests.server_helpers import parse_metrics, sample

INFO = ModelInfo(names=("m", "alias"), root="/x", max_model_len=64, max_request_tokens=48, vocab_limit=100,
                 num_loops=4)  # fmt: skip


def test_config_from_env():
    env = {"OURO_FAST_MAX_NUM_SEQS": "3", "OURO_FAST_SHUTDOWN_GRACE": "0.5", "OURO_FAST_MODEL": "",
           "OURO_FAST_SERVED_MODEL_NAME": "a, b,", "OURO_FAST_API_KEY": "k"}  # fmt: skip
    c = ServerConfig.from_env(env)
    assert (c.max_num_seqs, c.shutdown_grace, c.model, c.api_key) == (3, 0.5, None, "k")
    assert c.model_names == ("a", "b") and c.max_in_flight == 3 + 1024
    assert ServerConfig.from_env({}).model_names == ("ouro-tiny-random",)
    assert ServerConfig.from_env({"OURO_FAST_MODEL": "/ckpt"}).model_names == ("/ckpt",)
    assert c.engine_options()["max_num_seqs"] == 3 and "api_key" not in c.engine_options()
    env = {"OURO_FAST_RUN_AHEAD_FULL_DEPTH": "false", "OURO_FAST_RUN_AHEAD_DEPTH": "2"}
    ahead = ServerConfig.from_env(env).engine_options()
    assert (ahead["run_ahead_full_depth"], ahead["run_ahead_depth"]) == (False, 2)
    assert c.engine_options()["run_ahead_full_depth"] is True and c.engine_options()["run_ahead_depth"] == 1
    assert ServerConfig.from_env({"OURO_FAST_COMPILE_THREADS": "3"}).engine_options()["compile_threads"] == 3
    assert c.engine_options()["compile_threads"] is None  # the CPUs, at most 16
    with pytest.raises(ConfigError, match="OURO_FAST_RUN_AHEAD"):
        ServerConfig.from_env({"OURO_FAST_RUN_AHEAD": "sometimes"})
    with pytest.raises(ConfigError, match="OURO_FAST_COMPILE_THREADS"):
        ServerConfig.from_env({"OURO_FAST_COMPILE_THREADS": "0"})
    with pytest.raises(ConfigError, match="OURO_FAST_MAX_WAITING"):
        ServerConfig.from_env({"OURO_FAST_MAX_WAITING": "many"})
    with pytest.raises(ConfigError, match="OURO_FAST_STREAM_BUFFER"):
        ServerConfig.from_env({"OURO_FAST_STREAM_BUFFER": "0"})
    with pytest.raises(ConfigError, match="OURO_FAST_GIL_SWITCH_MS"):
        ServerConfig.from_env({"OURO_FAST_GIL_SWITCH_MS": "0"})


def test_api_key_file_and_redaction(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("\n  s3cret-from-file \n")
    c = ServerConfig.from_env({"OURO_FAST_API_KEY_FILE": str(key_file)})
    assert (c.api_key, c.api_key_file) == ("s3cret-from-file", str(key_file))
    for shown in (repr(c), str(c), f"{c}", repr(ServerConfig(api_key="s3cret-from-file"))):
        assert "s3cret" not in shown and "api_key='<redacted>'" in shown
    assert "api_key=None" in repr(ServerConfig())
    both = {"OURO_FAST_API_KEY": "k", "OURO_FAST_API_KEY_FILE": str(key_file)}
    with pytest.raises(ConfigError, match="OURO_FAST_API_KEY and OURO_FAST_API_KEY_FILE"):
        ServerConfig.from_env(both)
    with pytest.raises(ConfigError, match="cannot read .*missing: No such file"):
        ServerConfig.from_env({"OURO_FAST_API_KEY_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="cannot read .*Is a directory"):
        ServerConfig.from_env({"OURO_FAST_API_KEY_FILE": str(tmp_path)})
    key_file.write_text(" \n\t")
    with pytest.raises(ConfigError, match="holds no key"):
        ServerConfig.from_env({"OURO_FAST_API_KEY_FILE": str(key_file)})
    key_file.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        ServerConfig.from_env({"OURO_FAST_API_KEY_FILE": str(key_file)})


def test_metrics_label_is_a_served_name_never_a_path(tmp_path):
    assert ServerConfig().metrics_model_name == "ouro-tiny-random"
    assert ServerConfig(model=str(tmp_path / "ckpt") + "/").metrics_model_name == "ckpt"
    assert ServerConfig(model="/", served_model_name=("a", "b")).metrics_model_name == "a"
    assert ServerConfig(model="/").metrics_model_name == "ouro-tiny-random"


def test_connection_bounds_and_queue_timeout_settings():
    env = {"OURO_FAST_MAX_CONNECTIONS": "10", "OURO_FAST_HEADER_TIMEOUT": "1.5",
           "OURO_FAST_BODY_TIMEOUT": "2", "OURO_FAST_KEEP_ALIVE_TIMEOUT": "3",
           "OURO_FAST_QUEUE_TIMEOUT": "4"}  # fmt: skip
    c = ServerConfig.from_env(env)
    assert (c.max_connections, c.header_timeout, c.body_timeout, c.keep_alive_timeout) == (10, 1.5, 2, 3)
    assert c.engine_options()["queue_timeout"] == 4 and "header_timeout" not in c.engine_options()
    for name in ("MAX_CONNECTIONS", "HEADER_TIMEOUT", "BODY_TIMEOUT", "KEEP_ALIVE_TIMEOUT", "QUEUE_TIMEOUT"):
        with pytest.raises(ConfigError, match=f"OURO_FAST_{name}"):
            ServerConfig.from_env({f"OURO_FAST_{name}": "0"})


def test_gil_switch_interval_applied_only_when_set():
    from ouro_fast.server.app import apply_gil_switch

    before = sys.getswitchinterval()
    try:
        apply_gil_switch(ServerConfig.from_env({}))
        assert sys.getswitchinterval() == before
        apply_gil_switch(ServerConfig.from_env({"OURO_FAST_GIL_SWITCH_MS": "0.5"}))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


def test_parse_owner_faults():
    assert parse_owner_faults("") == {}
    assert parse_owner_faults("die@7, stall@8") == {7: "die", 8: "stall"}
    for bad in ("kill@1", "die@x", "die"):
        with pytest.raises(ValueError, match="die@SEED or stall@SEED"):
            parse_owner_faults(bad)


def test_completion_defaults_and_neutral_fields():
    body = {"model": "alias", "prompt": ["hi"], "repetition_penalty": 1.0, "logprobs": None, "n": 1,
            "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 1, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "stop": "x",
            "user": "u"}  # fmt: skip
    req = protocol.parse_completion(body, INFO)
    assert (req.model, req.prompts, req.max_tokens, req.stream, req.include_usage, req.n) == (
        "alias",
        ["hi"],
        16,
        True,
        True,
        1,
    )
    assert req.options == {"ignore_eos": True, "stop": ["x"]}
    req = protocol.parse_completion({"prompt": [[1, 2]], "exit_threshold": 0.5, "max_loops": 2}, INFO)
    assert (req.model, req.prompts, req.stream, req.include_usage) == ("m", [[1, 2]], False, False)
    batch = protocol.parse_completion({"prompt": ["a", "b"], "n": 3, "best_of": 3}, INFO)
    assert (batch.prompts, batch.n) == (["a", "b"], 3)
    batch = protocol.parse_completion({"prompt": [[3, 4], [5]]}, INFO)
    assert batch.prompts == [[3, 4], [5]]
    params = protocol.sampling_params(req, 2, INFO)
    assert (params.max_tokens, params.exit_threshold, params.max_loops) == (16, 0.5, 2)


@pytest.mark.parametrize(
    "field, value",
    [("use_beam_search", True), ("length_penalty", 0.5), ("suffix", "end"),
     ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
     ("guided_grammar", "root ::= [a]"),
     ("bad_words", ["x"]), ("allowed_token_ids", [1]), ("truncate_prompt_tokens", 4),
     ("return_tokens_as_token_ids", True)],
)  # fmt: skip
def test_a_feature_the_engine_lacks_is_a_400_naming_it(field, value):
    with pytest.raises(ApiError) as e:
        protocol.parse_completion({"prompt": "x", field: value}, INFO)
    assert e.value.status == 400 and e.value.param == field and "not supported" in e.value.message
    assert ("structured_outputs" in e.value.message) == field.startswith("guided_")


def test_neutral_values_and_unknown_fields_pass():
    body = {"prompt": "x", "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
            "return_tokens_as_token_ids": False, "guided_json": None, "no_such_field": 3}  # fmt: skip
    assert protocol.parse_completion(body, INFO).prompts == ["x"]
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}}  # fmt: skip
    assert protocol.parse_chat(chat, INFO, lambda *a, **k: "T").chat
    with pytest.raises(ApiError) as e:
        protocol.parse_chat({**chat, "response_format": {"type": "yaml"}}, INFO, lambda *a, **k: "T")
    assert e.value.param == "response_format"


def test_huge_integers_get_a_400_not_an_overflow():
    # Found by tests/test_fuzz.py: math.isfinite(-10**400) raised OverflowError, a 500 from the catch-all.
    huge = -(10**400)
    for field in ("n", "presence_penalty", "temperature", "exit_threshold", "max_tokens"):
        with pytest.raises(ApiError) as e:
            protocol.parse_completion({"prompt": "x", field: huge}, INFO)
        assert e.value.status == 400 and e.value.param == field and "-1000" in e.value.message
    chat = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 10**400}
    with pytest.raises(ApiError) as e:
        protocol.parse_chat(chat, INFO, lambda *a, **k: "T")
    assert e.value.status == 400 and e.value.param == "top_logprobs"


def test_length_and_chat_limits():
    req = protocol.parse_completion({"prompt": "x", "max_tokens": 40}, INFO)
    assert protocol.sampling_params(req, 8, INFO).max_tokens == 40
    with pytest.raises(ApiError) as e:
        protocol.sampling_params(req, 9, INFO)  # 9 + 40 > 48
    assert e.value.status == 400 and e.value.param == "max_tokens"
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}]}, INFO, lambda *a, **k: "T")
    assert chat.prompts == ["T"] and chat.max_tokens is None
    assert protocol.sampling_params(chat, 10, INFO).max_tokens == 38  # the room the context leaves
    both = {"messages": [], "max_tokens": 5, "max_completion_tokens": 7}
    assert protocol.parse_chat(both, INFO, lambda *a, **k: "T").max_tokens == 7


def test_boolean_options_take_vllm_spellings():
    import argparse

    from ouro_fast.server.config import ServerConfig, env_name
    from ouro_fast.server.launch import add_serve_args

    def config(*args):
        parser = argparse.ArgumentParser()
        add_serve_args(parser)
        parsed = vars(parser.parse_args(list(args)))
        return ServerConfig.from_env({env_name(k): str(v) for k, v in parsed.items() if v is not None})

    assert config().enable_prefix_caching is True
    assert config().engine_options()["enable_prefix_caching"] is True
    assert config("--no-enable-prefix-caching").engine_options()["enable_prefix_caching"] is False
    assert config("--enable-prefix-caching").enable_prefix_caching is True
    assert config("--enable-prefix-caching", "false").enable_prefix_caching is False
    assert config("--refill", "false").refill is False and config("--no-refill").refill is False
    assert ServerConfig.from_env({"OURO_FAST_ENABLE_PREFIX_CACHING": "0"}).enable_prefix_caching is False
    with pytest.raises(SystemExit):
        config("--no-enable-prefix-caching", "true")


def test_every_option_has_help_and_a_metavar():
    import argparse

    from ouro_fast.server.launch import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    options = [a for a in parser._actions if a.option_strings and a.dest not in ("help", "access_log")]
    assert len(options) >= 30
    for action in options:
        assert action.help and action.metavar and action.metavar != "VALUE", action.dest


def test_chat_replies_stop_at_the_end_of_their_turn():
    info = ModelInfo(names=("m",), root="/x", max_model_len=64, max_request_tokens=48, vocab_limit=100,
                     num_loops=4, end_of_turn_ids=(2,))  # fmt: skip
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [9]}, info,
                               lambda *a, **k: "T")  # fmt: skip
    assert protocol.sampling_params(chat, 10, info).stop_token_ids == [9, 2]
    ignore = protocol.parse_chat({"messages": [], "ignore_eos": True}, info, lambda *a, **k: "T")
    assert protocol.sampling_params(ignore, 10, info).stop_token_ids == []
    completion = protocol.parse_completion({"prompt": "x"}, info)
    assert protocol.sampling_params(completion, 10, info).stop_token_ids == []


def test_chat_template_fields_reach_the_template():
    seen = []
    body = {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    protocol.parse_chat(body, INFO, lambda m, add, cont, **kw: seen.append((add, cont, kw)) or "T")
    assert seen == [(False, True, {"enable_thinking": True})]
    for bad, param in (({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):  # fmt: skip
        with pytest.raises(ApiError) as e:
            protocol.parse_chat({"messages": [], **bad}, INFO, lambda *a, **k: "T")
        assert e.value.param == param


def test_an_overlong_prompt_is_named_as_such():
    chat = protocol.parse_chat({"messages": []}, INFO, lambda *a, **k: "T")
    with pytest.raises(ApiError) as e:
        protocol.sampling_params(chat, 60, INFO)  # no max_tokens: nothing is left for the reply
    assert e.value.param == "messages" and "60 tokens" in e.value.message and "48 tokens" in e.value.message
    assert "max_tokens" not in e.value.message


def test_request_id_echo():
    assert protocol.request_id("bench-1") == "bench-1" and protocol.request_id("a.B:9_-") == "a.B:9_-"
    assert protocol.request_id("x" * 128) == "x" * 128
    assert protocol.response_id("x", True) == "chatcmpl-x" and protocol.response_id("x", False) == "cmpl-x"
    for bad in (None, "", "a\nb", "bench-1\n", "é", "a b", "a/b", "<x>", "x" * 129, "x" * 5000, "\udcff"):
        assert len(protocol.request_id(bad)) == 32


def test_sse_event_is_ascii_framed():
    ev = stream.event({"text": "你好 👋"})
    assert ev == b'data: {"text":"\\u4f60\\u597d \\ud83d\\udc4b"}\n\n'
    assert stream.DONE == b"data: [DONE]\n\n"


def test_metrics_text():
    m = ServerMetrics('quote"d')
    m.first_token(0.03)
    m.first_token(100.0)
    m.request_done("length", 5, 3, 1.0, 0.2)
    m.aborted("slow_client")
    m.engine = EngineSnapshot(kv_blocks_used=3, kv_blocks_total=12, exit_depth=[1, 0, 2, 5],
                              step_rows=[4, 1] + [0] * 9, rows_total=6)  # fmt: skip
    text = m.render().decode()
    assert 'model_name="quote\\"d"' in text
    v = parse_metrics(text)
    assert v["vllm:kv_cache_usage_perc"] == 0.25 and v["vllm:prompt_tokens_total"] == 5
    assert v['vllm:time_to_first_token_seconds_bucket{le="0.02"}'] == 0
    assert v['vllm:time_to_first_token_seconds_bucket{le="0.04"}'] == 1
    assert (
        v['vllm:time_to_first_token_seconds_bucket{le="+Inf"}']
        == v["vllm:time_to_first_token_seconds_count"]
        == 2
    )
    assert v["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(0.1)
    assert [v[f'ouro_fast:token_exit_depth_bucket{{le="{d}"}}'] for d in (1, 2, 3, 4)] == [1, 1, 3, 8]
    assert v["ouro_fast:token_exit_depth_sum"] == 1 + 3 * 2 + 4 * 5
    assert v['ouro_fast:step_rows_bucket{le="1"}'] == 4 and v["ouro_fast:step_rows_count"] == 5
    assert v['ouro_fast:requests_aborted_total{reason="slow_client"}'] == 1


class FakeTransport:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


def make_client(**config) -> EngineClient:
    client = EngineClient(ServerConfig(**config), asyncio.get_running_loop())
    client.state, client.info = "ready", INFO  # as if the owner had reported ready
    return client


def output(rid: str, ids: list[int], finish: str | None = None) -> StepOutput:
    return StepOutput(rid, ids, "t" * len(ids), finish is not None, finish, 3, len(ids), [3] * len(ids))


def test_admission_bounds_and_ring_full():
    async def scenario():
        client = make_client(max_num_seqs=2, max_waiting=1, ring_capacity=2)
        a = client.submit([1], "params-a", None)
        client.submit([2], "params-b", None)
        assert client.ring.pop_many(8) == [(SUBMIT, a.key), (SUBMIT, a.key + 1)]
        assert client.payloads[a.key] == ([1], "params-a")  # filled before the push
        client.submit([3], "params-c", None)
        with pytest.raises(ApiError) as e:  # three in flight: the bound
            client.submit([4], "p", None)
        assert e.value.status == 429 and e.value.retry_after == 1 and "full" in e.value.message
        client.config = ServerConfig(max_num_seqs=9, ring_capacity=2)
        client.submit([5], "p", None)
        with pytest.raises(ApiError) as e:  # the ring holds two records: full
            client.submit([6], "p", None)
        assert e.value.status == 429 and "ring" in e.value.message
        # The refused submission left no payload behind (the owner would never pop it).
        assert [p for p, _ in client.payloads.values()] == [[1], [2], [3], [5]]
        assert sample(client.metrics, "ouro_fast:requests_rejected_total", reason="overload") == 2

    asyncio.run(scenario())


def test_dispatch_routes_outputs_and_drops_slow_clients():
    async def scenario():
        client = make_client(stream_buffer=2, ring_capacity=2)
        fast, slow = client.submit([1], "p", FakeTransport()), client.submit([2], "p", FakeTransport())
        client.ring.pop_many(8)
        snap = EngineSnapshot(kv_blocks_used=7)
        for step in range(3):  # the slow handler never reads: its third step overflows
            client._dispatch([output(fast.request_id, [step]), output(slow.request_id, [step])], snap)
            assert [o.new_token_ids for o in await fast.next()] == [[step]]
        assert slow.dropped and slow.transport.aborted and not fast.dropped
        assert client.ring.pop_many(8) == [(ABORT, slow.key)]
        m = client.metrics
        assert m.engine is snap and sample(m, "ouro_fast:output_batches_total") == 3
        assert sample(m, "vllm:generation_tokens_total") == 6
        assert sample(m, "vllm:time_to_first_token_seconds_count") == 2
        # The handler leaves before the engine's final: still counted until the final arrives.
        client.release(slow)
        assert slow.request_id in client.handles
        client._dispatch([output(slow.request_id, [], "abort")], snap)
        assert slow.request_id not in client.handles
        assert sample(m, "vllm:request_success_total", finished_reason="abort") == 1

    asyncio.run(scenario())


def test_abort_backlog_when_the_ring_is_full():
    async def scenario():
        client = make_client(ring_capacity=2)
        a, b = client.submit([1], "p", None), client.submit([2], "p", None)
        client.abort(a, "disconnect")
        client.abort(a, "disconnect")  # idempotent
        client.abort(b, "disconnect")
        assert len(client._backlog) == 2
        assert client.ring.pop_many(8) == [(SUBMIT, a.key), (SUBMIT, b.key)]
        for _ in range(200):  # the retry timer pushes the backlog once there is room
            await asyncio.sleep(0.005)
            if not client._backlog:
                break
        assert client.ring.pop_many(8) == [(ABORT, a.key), (ABORT, b.key)]
        assert sample(client.metrics, "ouro_fast:requests_aborted_total", reason="disconnect") == 2

    asyncio.run(scenario())


class FakeEngine:
    """The Engine API the owner uses: one token per request per step; failures on demand."""

    def __init__(self):
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.stats = StepStats(num_loops=4)
        self.scheduler = SimpleNamespace(num_blocks=8, num_free_blocks=8)
        self.num_running = self.num_waiting = 0
        self.step_fails = self.abort_all_fails = False
        self.batch_fails = False  # a failed step the engine handled: its requests end with an error

    def add_request(self, rid, prompt_ids, params):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.requests[rid] = len(prompt_ids)

    def add_requests(self, rids, prompt_ids, params):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.requests.update(dict.fromkeys(rids, len(prompt_ids)))

    def abort_request(self, rid):
        self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        if self.step_fails:
            raise RuntimeError("boom")
        if self.batch_fails:
            self.stats.failed_steps += 1
            self.stats.last_failure = "the engine step failed: InjectedFault: injected"
            return self.abort_all("error", self.stats.last_failure)
        self.stats.steps += 1
        return [StepOutput(rid, [7], "x", False, None, n, 1, [3]) for rid, n in self.requests.items()]

    def abort_all(self, reason, error):
        if self.abort_all_fails:
            raise RuntimeError("stuck")
        outs = [StepOutput(rid, [], "", True, reason, n, 0, [], error) for rid, n in self.requests.items()]
        self.requests.clear()
        return outs


def make_owner() -> tuple[EngineOwner, list]:
    posted = []
    owner = EngineOwner({}, RequestRing(8), {}, lambda batch, snap: posted.append((batch, snap)), None)
    owner.engine = FakeEngine()
    return owner, posted


def test_owner_drains_submissions_and_aborts():
    owner, _ = make_owner()
    owner.payloads.update({1: ([4, 5], SamplingParams()), 2: ([], SamplingParams())})
    for record in ((SUBMIT, 1), (SUBMIT, 2), (ABORT, 1)):
        owner.ring.push(*record)
    (rejected,) = owner._drain()
    assert (rejected.request_id, rejected.status, rejected.message) == ("2", 400, "the prompt is empty")
    assert owner.engine.requests == {"1": 2} and owner.engine.aborted == ["1"] and not owner.payloads


def test_owner_queues_a_prompts_choices_together_or_refuses_them_all():
    owner, _ = make_owner()
    owner.payloads.update({3: ([4, 5], [SamplingParams()] * 2), 7: ([], [SamplingParams()] * 3)})
    for record in ((SUBMIT, 3), (SUBMIT, 7)):
        owner.ring.push(*record)
    rejected = owner._drain()  # the choices of one record take consecutive keys
    assert [(r.request_id, r.status) for r in rejected] == [("7", 400), ("8", 400), ("9", 400)]
    assert owner.engine.requests == {"3": 2, "4": 2} and owner._live == {"3": 2, "4": 2}


def test_owner_step_failure_recovers_then_goes_out_of_service():
    owner, posted = make_owner()
    assert owner._submit("1", ([5], SamplingParams(seed=9))) is None
    assert owner._submit("2", ([5, 6], SamplingParams())) is None
    assert len(owner._step()) == 2 and len(owner._step()) == 2
    owner.engine.batch_fails = True
    outs = owner._step()  # the engine ended the requests its failed step touched, and counted it
    assert [(o.request_id, o.finish_reason) for o in outs] == [("1", "error"), ("2", "error")]
    assert "InjectedFault" in outs[0].error and owner._failures == 1 and owner._broken is None
    owner.engine.batch_fails = False
    assert owner._submit("3", ([5], SamplingParams())) is None and len(owner._step()) == 1  # recovered
    owner.engine.step_fails = owner.engine.abort_all_fails = True
    (out,) = owner._step()  # abort_all fails too: the engine goes out of service
    assert (out.request_id, out.finish_reason, out.prompt_tokens) == ("3", "error", 1)
    assert owner._broken == "RuntimeError: stuck" and owner._failures == 2
    assert owner._submit("4", ([5], SamplingParams())).status == 503
    owner._post([])
    assert posted[-1][1].broken == "RuntimeError: stuck" and posted[-1][1].step_failures == 2


@pytest.mark.parametrize("failure", ["step_fails", "batch_fails"])
def test_owner_goes_out_of_service_after_failures_in_a_row(failure):
    """A fault that survives recovery (every step fails, raising or handled by the engine) must not fail
    requests forever."""
    owner, _ = make_owner()
    setattr(owner.engine, failure, True)
    for i in range(MAX_FAILURES_IN_A_ROW):
        assert owner._broken is None
        assert owner._submit(str(i), ([5], SamplingParams())) is None
        assert [o.finish_reason for o in owner._step()] == ["error"]
    assert "in a row" in owner._broken
    assert owner._submit("x", ([5], SamplingParams())).status == 503


def test_owner_going_out_of_service_ends_the_requests_the_engine_still_holds():
    """A failed step ends only the requests holding KV; the waiting ones must not hang once the engine
    goes out of service."""
    owner, _ = make_owner()
    assert owner._submit("w", ([5], SamplingParams())) is None

    def failed_step():
        owner.engine.stats.failed_steps += 1
        owner.engine.stats.last_failure = "the engine step failed: RuntimeError: boom"
        return []  # the failed batch touched nothing: "w" was waiting

    owner.engine.step = failed_step
    for _ in range(MAX_FAILURES_IN_A_ROW - 1):
        assert owner._step() == [] and owner._broken is None
    outs = owner._step()
    assert "in a row" in owner._broken
    assert [(o.request_id, o.finish_reason) for o in outs] == [("w", "error")]
    assert "out of service" in outs[-1].error and owner._live == {}


def test_not_ready_is_503():
    async def scenario():
        client = EngineClient(ServerConfig(), asyncio.get_running_loop())
        assert not client.healthy and client.status() == "loading"
        with pytest.raises(ApiError) as e:
            client.submit([1], "p", None)
        assert (e.value.status, e.value.headers()) == (503, {"Retry-After": "1"})
        client.state, client.info = "ready", INFO
        client.metrics.engine = EngineSnapshot(broken="RuntimeError: stuck")
        assert not client.healthy and client.status() == "out of service: RuntimeError: stuck"

    asyncio.run(scenario())


def test_grammars_are_compiled_off_the_event_loop_and_invalid_ones_are_400s():
    class Cache:  # the engine's GrammarCache: records the thread that compiles
        threads = []

        def cached(self, want):
            return want == "seen"

        def compile(self, want):
            self.threads.append(threading.current_thread().name)
            if want == "bad":
                raise ValueError("invalid regex: missing )")
            if want == "no-xgrammar":
                raise ImportError("no module named xgrammar")

    async def scenario():
        client = make_client()
        client.grammars = Cache()
        await client.compile_grammar("good")
        await client.compile_grammar("seen")  # compiled before: not handed to the thread again
        assert Cache.threads == ["ouro-heavy-input_0"]
        for want, says in (("bad", "missing )"), ("no-xgrammar", "xgrammar")):
            with pytest.raises(ApiError) as e:
                await client.compile_grammar(want)
            assert e.value.status == 400 and says in e.value.message

    asyncio.run(scenario())


def test_error_handler_counts_refusals_before_submission_once():
    app_mod = importlib.import_module("ouro_fast.server.app")  # the module (the package exports the app)
    metrics = ServerMetrics("m")
    client = SimpleNamespace(metrics=metrics)

    def run(path: str, err: ApiError, submitted: bool = False) -> int:
        ctx = SimpleNamespace(submitted=True) if submitted else SimpleNamespace()
        req = SimpleNamespace(
            path=path, method="POST", ctx=ctx, app=SimpleNamespace(ctx=SimpleNamespace(client=client))
        )
        return asyncio.run(app_mod.on_error(req, err)).status

    assert run("/v1/completions", ApiError(400, "bad max_tokens")) == 400
    assert run("/v1/chat/completions", ApiError(413, "too large")) == 413
    # After submission the engine's refusal was already counted by the client; 429s are counted there too.
    assert run("/v1/completions", ApiError(400, "refused by the engine"), submitted=True) == 400
    assert run("/v1/completions", ApiError(429, "full")) == 429
    assert run("/tokenize", ApiError(400, "bad")) == 400  # not a generation request
    rejected = {r: sample(metrics, "ouro_fast:requests_rejected_total", reason=r) for r in REJECT_REASONS}
    assert rejected == {**dict.fromkeys(REJECT_REASONS, 0), "invalid": 2}


def test_a_huge_prompt_is_refused_before_tokenizing():
    info = ModelInfo(names=("m",), root="/x", max_model_len=64, max_request_tokens=48, vocab_limit=100,
                     num_loops=4, max_prompt_chars=48 * 5)  # fmt: skip

    class NoTokenizer:
        def encode(self, text):
            raise AssertionError("tokenized")

    async def scenario():
        client = make_client()
        client.info, client.tokenizer = info, NoTokenizer()
        with pytest.raises(ApiError) as e:
            protocol.check_prompt_chars(48 * 5 + 1, info, "prompt")
        assert e.value.status == 400 and e.value.param == "prompt" and "241 characters" in e.value.message
        protocol.check_prompt_chars(48 * 5, info, "prompt")  # at the bound: tokenized
        with pytest.raises(ApiError) as e:  # chat: the messages' text, before the template renders it
            body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 300}]}]}
            protocol.parse_chat(body, info, lambda *a, **k: pytest.fail("rendered"))
        assert e.value.param == "messages"

    asyncio.run(scenario())


def test_the_character_bound_holds_for_the_shipped_tokenizer():
    from ouro_fast.model.tokenizer import OuroTokenizer

    tok = OuroTokenizer.default()
    bound = tok.max_token_chars()
    for text in ("hello world " * 50, "<|endoftext|>" * 20, "é漢字 " * 40, "a" * 999):
        assert len(tok.encode(text)) >= len(text) / bound  # so chars > tokens * bound means too many tokens


def serve_in_thread(owner: EngineOwner) -> EngineOwner:
    """Run the owner's thread on its FakeEngine (the build skipped)."""
    owner.on_ready = lambda info, error: None
    owner._build = lambda: "info"
    owner.start()
    return owner


@pytest.mark.parametrize("where", ["drain", "step", "post"])
def test_owner_death_anywhere_in_its_loop_is_reported(where):
    """Whatever part of the loop raises, the thread ends and failure() says why."""
    owner, posted = make_owner()
    owner.owner_faults = {5: "die"} if where == "drain" else {}
    owner.payloads[1] = ([4], SamplingParams(seed=5))
    if where == "step":
        owner.engine.step = lambda: None  # the step returns; tracking its outputs (outside its try) fails
    if where == "post":
        owner.post = lambda batch, snap: posted.append(batch) if not posted else 1 / 0  # after the ready one
    serve_in_thread(owner)
    owner.ring.push(SUBMIT, 1)
    owner.wake()
    assert owner.join(10)
    reason = owner.failure(math.inf)
    expected = {"drain": OwnerFault.__name__, "step": "TypeError", "post": "ZeroDivisionError"}[where]
    assert reason.startswith("the engine owner thread died: " + expected), reason


def test_owner_stall_is_seen_only_past_the_limit():
    owner, _ = make_owner()
    owner.owner_faults = {6: "stall"}
    owner.payloads[1] = ([4], SamplingParams(seed=6))
    serve_in_thread(owner)
    owner.ring.push(SUBMIT, 1)
    owner.wake()
    deadline = time.monotonic() + 10
    while owner.failure(0.3) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "made no progress" in owner.failure(0.3) and owner.failure(math.inf) is None
    owner.stop()  # the held step then ends, and so does the thread: an asked-for end is no failure
    assert owner.join(10) and owner.failure(0.3) is None


def test_watchdog_fails_requests_when_the_owner_dies():
    async def scenario():
        stopped = asyncio.Event()
        client = make_client(max_num_seqs=4)
        client.on_failure = stopped.set
        a, b = client.submit([1, 2], "p", None), client.submit([3], "p", None)
        client._dispatch([output(a.request_id, [5])], EngineSnapshot())
        client.owner.died = "OwnerFault: gone"
        client._watch()
        assert client.state == "failed" and not client.healthy
        assert client.status() == "failed: the engine owner thread died: OwnerFault: gone"
        for handle, prompt_tokens in ((a, 2), (b, 1)):
            final = (await handle.next())[-1]
            assert (final.finish_reason, final.prompt_tokens) == ("error", prompt_tokens)
            assert "OwnerFault: gone" in final.error
        with pytest.raises(ApiError) as e:
            client.submit([1], "p", None)
        assert e.value.status == 503
        # Late outputs of the failed owner are dropped; the failure shows in /metrics.
        client._dispatch([output(b.request_id, [9])], EngineSnapshot())
        assert b.queue.empty() and client.metrics.engine.broken.startswith("the engine owner")
        assert sample(client.metrics, "vllm:request_success_total", finished_reason="error") == 2
        assert not stopped.is_set()
        client.release(a)
        client.release(b)
        await asyncio.wait_for(stopped.wait(), 10)  # after the linger: the server stops

    asyncio.run(scenario())


def test_large_inputs_are_rendered_tokenized_and_decoded_off_the_event_loop():
    """Above the inline bound, the chat template, tokenizing and /detokenize's decoding run on the
    large-input thread; below it they stay on the loop (a thread hop costs more than they do)."""
    app_mod = importlib.import_module("ouro_fast.server.app")
    info = dataclasses.replace(INFO, max_prompt_chars=10**6)
    where: list[tuple[str, bool]] = []  # (what, ran on the event loop's thread)

    def ran(what: str) -> None:
        where.append((what, threading.current_thread() is threading.main_thread()))

    class Tokenizer:
        def apply_chat_template(self, messages, *args, **kwargs):
            ran("render")
            return messages[-1]["content"]

        def encode(self, text):
            ran("encode")
            return [1] * (INFO.max_request_tokens + 1)  # too many for a request: refused after tokenizing

        def decode(self, ids, skip_special_tokens=True):
            ran("decode")
            return "x" * len(ids)

    async def scenario():
        client = make_client()
        client.state, client.info, client.tokenizer = "ready", info, Tokenizer()
        ctx = SimpleNamespace(client=client)

        def request(body: dict):
            return SimpleNamespace(body=json.dumps(body).encode(), app=SimpleNamespace(ctx=ctx), ctx=ctx)

        for text in ("y" * 20_000, "y" * 200):
            chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
            with pytest.raises(ApiError, match="tokens"):  # refused by its token count, once rendered
                await app_mod.chat_completions(request(chat))
            await app_mod.tokenize(request({"messages": [{"role": "user", "content": text}]}))
        for count in (20_000, 20):
            await app_mod.detokenize(request({"tokens": [1] * count}))

    asyncio.run(scenario())
    off, on = (False, False, False, False), (True, True, True, True)
    assert [w for _, w in where[:4]] == list(off) and [w for _, w in where[4:8]] == list(on)
    assert [w for _, w in where[8:]] == [False, True]
    assert [what for what, _ in where] == ["render", "encode"] * 4 + ["decode"] * 2


def test_tokenize_refuses_text_no_request_could_hold_before_tokenizing():
    info = dataclasses.replace(INFO, max_prompt_chars=100)
    render = lambda *a, **k: pytest.fail("rendered")  # noqa: E731
    with pytest.raises(ApiError) as e:
        protocol.parse_tokenize({"prompt": "y" * 101}, info, render)
    assert e.value.status == 400 and e.value.param == "prompt" and "101 characters" in e.value.message
    with pytest.raises(ApiError) as e:
        protocol.parse_tokenize({"messages": [{"role": "user", "content": "y" * 101}]}, info, render)
    assert e.value.param == "messages"
    assert protocol.parse_tokenize({"prompt": "y" * 100}, info, render) == "y" * 100


def test_long_texts_go_through_the_tokenizer_entry_points_that_release_the_gil():
    from ouro_fast.model.tokenizer import OuroTokenizer

    tok = OuroTokenizer.default()
    text = "the loop model " * 1000
    expected = tok.raw.encode(text, add_special_tokens=False).ids
    calls = []

    class Recorder:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(raw, name)

    raw, tok.raw = tok.raw, Recorder()
    assert tok.encode(text) == expected and tok.encode("short") == raw.encode("short").ids
    assert (
        tok.decode(expected, skip_special_tokens=False) == text
        and tok.decode(expected[:3]) == "the loop model"
    )
    assert calls == ["encode_batch", "encode", "decode_batch", "decode"]


def test_outputs_channel_keeps_order_bounds_and_wakes_its_reader():
    from ouro_fast.server.engine_client import Outputs

    async def main():
        box = Outputs(3)
        reader = asyncio.ensure_future(box.take_all())
        await asyncio.sleep(0)
        assert not reader.done() and box.empty()  # waits for the first item
        box.put_nowait("a")
        box.put_nowait("b")
        assert await reader == ["a", "b"] and box.empty()
        for item in "xyz":
            box.put_nowait(item)
        with pytest.raises(asyncio.QueueFull):
            box.put_nowait("over")  # maxsize unread items: the client fell behind
        assert await box.take_all() == ["x", "y", "z"]
        # A reader cancelled while it waits leaves the channel usable.
        waiting = asyncio.ensure_future(box.take_all())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.put_nowait("after")
        assert await box.take_all() == ["after"]

    asyncio.run(main())
