"""Structured output on the tiny random model: it knows nothing of JSON, so only the grammar's mask can make
its output valid. Engine-level cases cover every mode at full depth and with early exit; the server cases
cover the request fields, streaming and the errors."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import openai
import pytest

from ouro_fast.engine.engine import Engine
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.engine.structured import Grammars, StructuredOutput
from tests.server_helpers import ServerProcess

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bb", 'c"d']}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog", 3, None]}, "note": S},
        "required": ["kind"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 10, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "boolean"}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "alias": S,
            "flag": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "pairs": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
            }
        },
        "required": ["pairs"],
        "additionalProperties": False,
    },
]
REGEXES = [r"[a-c]{2,4}-\d\d", r"(yes|no)!", r"\d{3}\.[xyz]+", r"[A-Z][a-z]{0,3}( [A-Z][a-z]{0,3})?"]
# Sums of small numbers: the grammar case, checked by an equivalent regex.
GRAMMAR = 'root ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"[1-9][0-9]?([+*][1-9][0-9]?)*"


@pytest.fixture(scope="module")
def engine():
    return Engine(num_kv_blocks=1024, max_num_seqs=64)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Every request to its end: request id -> (text, finish reason, tokens)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.request.text, out.finish_reason, len(out.request.output_ids))
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    return done


def grammars_of(engine: Engine) -> Grammars:
    """The engine's grammars, built by its first structured request."""
    run(engine, {"first": ([3], SamplingParams(max_tokens=3, structured=StructuredOutput("regex", "a+")))})
    return engine.scheduler.sampling.grammars


def params(want: StructuredOutput, i: int, **extra) -> SamplingParams:
    # Half greedy, half sampled; half at full depth, half exiting early.
    temperature = 0.0 if i % 4 == 0 else 1.0
    return SamplingParams(max_tokens=120, temperature=temperature, seed=i, structured=want,
                          exit_threshold=0.5 if i % 2 else 1.0, **extra)  # fmt: skip


def test_two_hundred_json_outputs_validate_against_their_schemas(engine):
    rng = np.random.default_rng(0)
    reqs, schema_of = {}, {}
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompt = rng.integers(3, 1000, int(rng.integers(1, 12))).tolist()
        reqs[f"j{i}"] = (prompt, params(StructuredOutput("json", json.dumps(schema)), i))
        schema_of[f"j{i}"] = schema
    done = run(engine, reqs)
    depths = engine.stats.exit_depth_histogram
    assert sum(depths[:-1]) > 0  # early exit happened
    for rid, (text, reason, _) in done.items():
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema_of[rid])


def test_without_the_mask_the_model_writes_no_json(engine):
    reqs = {f"free{i}": ([5 + i], SamplingParams(max_tokens=30, temperature=1.0, seed=i)) for i in range(10)}
    for text, _, _ in run(engine, reqs).values():
        with pytest.raises(ValueError):
            json.loads(text)


def test_regex_choice_and_grammar_outputs_match(engine):
    choices = ["yes", "no", 'say "maybe"', "a\\b"]
    reqs, check = {}, {}
    for i in range(24):
        kind = ("regex", "choice", "grammar")[i % 3]
        if kind == "regex":
            pattern = REGEXES[i % len(REGEXES)]
            want = StructuredOutput("regex", pattern)
            check[f"s{i}"] = lambda t, p=pattern: re.fullmatch(p, t) is not None
        elif kind == "choice":
            want = StructuredOutput("choice", json.dumps(choices))
            check[f"s{i}"] = lambda t: t in choices
        else:
            want = StructuredOutput("grammar", GRAMMAR)
            check[f"s{i}"] = lambda t: re.fullmatch(GRAMMAR_RE, t) is not None
        reqs[f"s{i}"] = ([7, 8, 9 + i], params(want, i))
    for rid, (text, reason, _) in run(engine, reqs).items():
        assert reason == "stop" and check[rid](text), (rid, text, reason)


def test_a_grammar_that_ends_without_eos_still_stops(engine):
    # ignore_eos leaves no eos among the request's stop ids: the grammar's end is its stop all the same.
    want = StructuredOutput("choice", json.dumps(["left", "right"]))
    free_of_eos = SamplingParams(max_tokens=40, seed=1, ignore_eos=True, structured=want)
    done = run(engine, {"ie": ([3, 4], free_of_eos)})
    text, reason, tokens = done["ie"]
    assert text in ("left", "right") and reason == "stop" and tokens < 40


def test_structured_requests_batch_with_free_ones_unchanged(engine):
    # Rows without a grammar pay nothing and sample exactly what they would alone.
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=42)
    alone = run(engine, {"alone": ([11, 12, 13], free)})["alone"]
    want = StructuredOutput("json", json.dumps(SCHEMAS[0]))
    mixed = run(engine, {"with": ([11, 12, 13], free), "g": ([11, 12, 13], params(want, 1))})
    assert mixed["with"] == alone


def test_invalid_specs_are_value_errors_that_say_what_is_wrong(engine):
    cases = [("json", '{"type": "strnig"}', "strnig"), ("json", "not json", "JSON"),
             ("regex", "a(b", "parenthes"), ("grammar", 'root ::= "a" |', "EBNF"),
             ("choice", "[]", "non-empty"), ("yaml", "x", "kind")]  # fmt: skip
    for kind, spec, says in cases:
        want = SamplingParams(structured=StructuredOutput(kind, spec))
        with pytest.raises(ValueError) as e:
            engine.add_request(f"bad-{kind}-{says}", [5], want)
        assert says in str(e.value) and "/project" not in str(e.value) and "[" not in str(e.value)[:1]
    assert not engine.requests  # nothing half-registered


def test_each_grammar_is_compiled_once(engine):
    grammars = grammars_of(engine)
    want = StructuredOutput("regex", r"z+")
    first = grammars.compile(want)
    assert grammars.compile(StructuredOutput("regex", r"z+")) is first
    assert grammars.compile(StructuredOutput("regex", r"zz+")) is not first


def test_the_cache_keeps_the_most_recently_used_grammars(engine, monkeypatch):
    from ouro_fast.engine import structured

    monkeypatch.setattr(structured, "MAX_COMPILED", 2)
    cache = structured.GrammarCache(None, grammars_of(engine).cache.compiler)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first_a = cache.compile(a)
    cache.compile(b)
    assert cache.compile(a) is first_a  # a is now the most recent
    cache.compile(c)  # b, the least recent, leaves
    assert len(cache) == 2 and cache.compile(a) is first_a
    assert cache.compile(b) is not None and len(cache) == 2


def test_a_missing_compiler_raises_at_each_use(monkeypatch):
    from ouro_fast.engine import structured

    def build():
        raise ImportError("no module named xgrammar")

    cache = structured.GrammarCache(None, build)
    for _ in range(2):
        with pytest.raises(ImportError):
            cache.compile(StructuredOutput("regex", "a"))


def test_the_compiler_is_built_while_the_engine_starts_not_by_the_first_request(monkeypatch):
    # The engine-owner thread must not import xgrammar or preprocess the vocabulary when the first grammar
    # arrives: every step in flight would wait for it.
    import ouro_fast.engine.engine as engine_module
    from ouro_fast.engine import structured

    eng = Engine(num_kv_blocks=256, max_num_seqs=8)
    compiler = eng.grammar_cache.compiler()  # built on its own thread since start-up
    assert eng.scheduler.sampling.grammars is None

    def refuse(*args, **kwargs):
        raise AssertionError("the compiler was built again on the owner thread")

    monkeypatch.setattr(engine_module, "grammar_compiler", refuse)
    monkeypatch.setattr(structured, "grammar_compiler", refuse)
    done = run(eng, {"r": ([3], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "ab+")))})
    assert re.fullmatch("ab+", done["r"][0]) and eng.scheduler.sampling.grammars.cache.compiler() is compiler


def test_a_grammar_compiled_before_submission_is_not_compiled_again_by_the_engine(engine, monkeypatch):
    # The server compiles a request's grammar on a worker thread; the engine-owner thread then finds it.
    from ouro_fast.engine import structured

    want = StructuredOutput("regex", "(xy)+")
    engine.grammar_cache.compile(want)

    def refuse(*args):
        raise AssertionError("compiled again on the owner thread")

    monkeypatch.setattr(structured, "_compile", refuse)
    done = run(engine, {"r": ([3], SamplingParams(max_tokens=4, structured=want))})
    assert done["r"][0] and re.fullmatch("(xy)*x?", done["r"][0])


# ---- the server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdk():
    srv = ServerProcess("single", {"OURO_FAST_NUM_KV_BLOCKS": "1024"})
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        srv.stop()


def test_response_format_json_schema_in_chat_stream_and_not(sdk):
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Who?"}]
    for i, threshold in enumerate((1.0, 0.5)):
        extra = {"exit_threshold": threshold}
        r = sdk.chat.completions.create(model="ouro-tiny-random", messages=messages, response_format=fmt,
                                        seed=i, max_tokens=100, extra_body=extra)  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        text, reasons = "", []
        for chunk in sdk.chat.completions.create(model="ouro-tiny-random", messages=messages, stream=True,
                                                 response_format=fmt, seed=10 + i, max_tokens=100,
                                                 extra_body=extra):  # fmt: skip
            for c in chunk.choices:
                text += c.delta.content or ""
                reasons.append(c.finish_reason)
        assert reasons[-1] == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_structured_outputs_on_completions(sdk):
    r = sdk.completions.create(model="ouro-tiny-random", prompt="x", max_tokens=100, seed=3,
                               extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert isinstance(json.loads(r.choices[0].text), dict)
    body = {"structured_outputs": {"choice": ["alpha", "beta"]}}
    r = sdk.completions.create(model="ouro-tiny-random", prompt="x", max_tokens=20, n=3, extra_body=body)
    assert {c.text for c in r.choices} <= {"alpha", "beta"} and len(r.choices) == 3
    body = {"structured_outputs": {"regex": REGEXES[0]}}
    text = "".join(c.choices[0].text for c in sdk.completions.create(
        model="ouro-tiny-random", prompt="x", max_tokens=20, stream=True, extra_body=body))  # fmt: skip
    assert re.fullmatch(REGEXES[0], text)
    body = {"structured_outputs": {"grammar": GRAMMAR}}
    r = sdk.completions.create(model="ouro-tiny-random", prompt="x", max_tokens=30, extra_body=body)
    assert re.fullmatch(GRAMMAR_RE, r.choices[0].text)


@pytest.mark.parametrize(
    "extra, says",
    [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}}, "strnig"),
     ({"structured_outputs": {"regex": "a(b"}}, "parenthes"),
     ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "one of"),
     ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "one of"),
     ({"structured_outputs": {"choice": []}}, "non-empty"),
     ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
     ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
     ({"response_format": {"type": "yaml"}}, "yaml")],
)  # fmt: skip
def test_bad_structured_requests_are_400s_that_say_why(sdk, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="ouro-tiny-random", prompt="x", max_tokens=5, extra_body=extra)
    assert says in e.value.message


def test_a_row_is_filled_once_after_each_accepted_token(engine):
    """accept() leaves the next row to fill_pending (called by the GPU runner while its loop runs) or to
    apply(), which fills what is still pending: the mask is the matcher's, whichever fills it."""
    import torch

    grammars = grammars_of(engine)
    rid = 5
    grammars.add(rid, StructuredOutput("choice", json.dumps(["ab", "cd"])))
    assert rid in grammars.stale
    logits = torch.zeros(1, engine.model_config.vocab_size)
    first = grammars.apply(logits, np.array([rid]))
    allowed = set(torch.nonzero(first[0] > -1e30).flatten().tolist())
    assert not grammars.stale and allowed and len(allowed) < 10
    token = min(allowed)
    assert grammars.accept(rid, token) and rid in grammars.stale
    grammars.fill_pending()
    second = grammars.apply(logits, np.array([rid]))
    assert not torch.equal(first, second)
    grammars.remove(rid)
    assert rid not in grammars.stale and not grammars.any(np.array([rid]))


def test_rows_due_together_are_filled_as_each_matcher_fills_its_own(engine):
    """fill_pending fills several rows in one batched call: each row equals its matcher's own fill."""
    import xgrammar

    grammars = grammars_of(engine)
    specs = [StructuredOutput("json", json.dumps(s)) for s in SCHEMAS[:3]]
    specs += [StructuredOutput("regex", "[a-c]+x"), StructuredOutput("choice", json.dumps(["ab", "cd"]))]
    rids = [11, 12, 13, 14, 15]
    stops = engine.eos_ids | set(engine.tokenizer.end_of_turn_ids())
    for rid, spec in zip(rids, specs):
        grammars.add(rid, spec)
    grammars.fill_pending()
    for step in range(3):  # advance each by its likeliest allowed token, so the rows differ in state
        for rid in rids:
            if not grammars.matchers[rid].is_terminated():
                row = grammars.bitmask[rid]
                bits = range(32 * row.shape[0])
                allowed = [t for t in bits if (int(row[t // 32]) >> (t % 32)) & 1 and t not in stops]
                if allowed:  # else only a stop token may follow: the grammar is complete
                    assert grammars.accept(rid, allowed[step % len(allowed)])
        assert len(grammars.stale) > 1
        grammars.fill_pending()
        alone = xgrammar.allocate_token_bitmask(1, engine.model_config.vocab_size)
        for rid in rids:
            if not grammars.matchers[rid].is_terminated():
                grammars.matchers[rid].fill_next_token_bitmask(alone, 0)
                assert torch_equal(alone[0], grammars.bitmask[rid]), (step, rid)
    for rid in rids:
        grammars.remove(rid)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_failed_bitmask_fill_ends_its_step_s_requests_with_an_error(engine, monkeypatch):
    """The worker's error reaches the engine-owner thread when it waits for the fill: the step fails, its
    requests end with finish reason "error" and free their KV, and the engine serves the next request."""
    want = StructuredOutput("regex", "[a-c]{4}")

    def broken(self, matchers, rids):
        raise RuntimeError("fill failed")

    with monkeypatch.context() as m:
        m.setattr(Grammars, "_fill_rows", broken)
        done = run(engine, {"bad": ([7, 8], SamplingParams(max_tokens=8, temperature=0, structured=want))})
    assert done["bad"][1] == "error" and engine.stats.failed_steps >= 1
    assert "fill failed" in engine.stats.last_failure
    done = run(engine, {"good": ([7, 8], SamplingParams(max_tokens=8, temperature=0, structured=want))})
    assert done["good"][1] == "stop" and re.fullmatch("[a-c]{4}", done["good"][0])
