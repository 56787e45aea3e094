"""The paged, loop-batched engine against the dense reference, and its bookkeeping.

The tiny preset's gate is biased so that, at threshold 0.5, tokens exit at
every depth: rows at different loops share steps, exits refill rows, and
last-exited propagation matters for later tokens. Every engine here is the CPU one (fp32, the
torch runner), also on a GPU machine: the GPU engine has its own tests (test_gpu_runner.py).
"""

import time

import numpy as np
import pytest
import torch

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.llm import LLM
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.reference import DenseReference

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 40)), [1], [42] * 17, [7, 7, 8, 9, 300, 301]]


def run(engine, prompts, params):
    """Submit all prompts, step until done; returns finished Requests in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request
        mixed_steps += sum(1 for n in engine.stats.rows_per_loop if n) > 1
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks, "KV blocks leaked"
    engine.mixed_steps = mixed_steps
    return [done[str(i)] for i in range(len(prompts))]


def greedy(q, n=20):
    return SamplingParams(max_tokens=n, temperature=0, exit_threshold=q, ignore_eos=True)


@pytest.mark.parametrize("threshold", [1.0, 0.5, 0.2])
def test_engine_matches_dense_reference(model_dir, threshold):
    engine = Engine(EngineConfig(model=model_dir, device="cpu", keep_logits=True))
    got = run(engine, PROMPTS, greedy(threshold))
    ref = DenseReference(dict(engine.model.state_dict()), engine.model_config, 128, engine.vocab_limit)
    depths = set()
    for prompt, req in zip(PROMPTS, got):
        want = ref.generate(prompt, 20, threshold=threshold)
        assert req.output_ids == want.tokens
        assert req.exit_loops == want.exit_loops
        depths |= set(req.exit_loops)
        v = engine.vocab_limit
        for a, b in zip(req.logits, want.logits):
            torch.testing.assert_close(a[:v], b[:v], atol=1e-4, rtol=1e-4)
    if threshold == 1.0:
        assert depths == {3}
    else:
        assert len(depths) >= 3, depths  # the test exercises early exit at several depths
        assert engine.mixed_steps > 0  # rows at different loops shared a step


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_seqs=1),  # one request at a time
        dict(refill=False),  # the batch drains to its slowest row
        dict(max_num_batched_tokens=5),  # chunked prefill
        dict(num_kv_blocks=20, max_num_seqs=6),  # a tiny pool: preemption and recompute
    ],
)
def test_batching_modes_give_identical_tokens(model_dir, options):
    params = greedy(0.5)
    base = run(Engine(EngineConfig(model=model_dir, device="cpu")), PROMPTS, params)
    engine = Engine(EngineConfig(model=model_dir, device="cpu", **options))
    got = run(engine, PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    assert [r.exit_loops for r in got] == [r.exit_loops for r in base]
    if options.get("num_kv_blocks"):
        assert engine.stats.total_preemptions > 0
    if options.get("refill") is False:
        assert engine.stats.total_refills == 0


def test_refill_fills_rows_freed_by_exits(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    run(engine, PROMPTS, greedy(0.5))
    assert engine.stats.total_refills > 0


def test_propagation_copies_exited_kv_into_deeper_planes(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    engine.add_request("a", [3, 4, 5, 6], greedy(0.5, n=40))
    for _ in range(60):
        engine.step()
    rid = engine.requests["a"].rid
    sched, bt, kv = engine.scheduler.core, engine.scheduler.blocks, engine.runner.kv_cache
    slot, depths = sched.kv_slot(rid), sched.depths(rid)
    bs, checked = bt.block_size, 0

    def phys(loop, pos):
        return int(bt.tables[slot, loop, pos // bs]) * bs + pos % bs

    # Only tokens whose exit was followed by a step have been propagated.
    for pos in range(4, len(depths) - 2):
        d = int(depths[pos])
        assert 1 <= d <= 4
        for t in range(d, 4):
            assert torch.equal(kv[:, :, phys(t, pos)], kv[:, :, phys(d - 1, pos)])
            checked += 1
        if d >= 2:  # computed planes hold distinct K/V
            assert not torch.equal(kv[:, :, phys(0, pos)], kv[:, :, phys(1, pos)])
    assert checked > 0
    engine.abort_request("a")
    engine.step()
    assert bt.num_free_blocks == bt.num_blocks


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_abort_frees_everything_and_spares_others(model_dir, when):
    params = greedy(0.5, n=12)
    solo = run(Engine(EngineConfig(model=model_dir, device="cpu")), [PROMPTS[0]], params)[0]
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_batched_tokens=8))
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", list(range(1, 60)), params)
    steps = 2 if when == "prefill" else 40
    outs = [o for _ in range(steps) for o in engine.step()]
    assert not any(o.finished and o.request_id == "drop" for o in outs)
    if when == "decode":
        assert any(o.request_id == "drop" and o.new_token_ids for o in outs)
    engine.abort_request("drop")
    while engine.has_unfinished_requests():
        outs += engine.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert finals["drop"].finish_reason == "abort"
    assert finals["keep"].request.output_ids == solo.output_ids
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    assert engine.num_running == engine.num_waiting == 0


def test_abort_of_waiting_request(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=1))
    engine.add_request("a", PROMPTS[0], greedy(1.0, 4))
    engine.add_request("b", PROMPTS[1], greedy(1.0, 4))
    engine.step()
    assert engine.num_waiting == 1
    engine.abort_request("b")
    assert engine.num_waiting == 0
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished == {"a": "length", "b": "abort"}


def test_queue_timeout_ends_only_requests_never_scheduled(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=1, queue_timeout=0.05))
    engine.add_request("a", PROMPTS[0], greedy(1.0, 8))
    engine.add_request("b", PROMPTS[1], greedy(1.0, 4))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    time.sleep(0.1)  # both are older than the timeout now: only the waiting one ends
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = (o.finish_reason, o.completion_tokens, o.error)
    waited = "the request waited 0.05 s in the queue without being scheduled"
    assert finished == {"a": ("length", 8, None), "b": ("abort", 0, waited)}
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks and not engine.unstarted
    engine.add_request("c", PROMPTS[2], greedy(1.0, 2))  # served normally afterwards
    reasons = []
    while engine.has_unfinished_requests():
        reasons += [o.finish_reason for o in engine.step() if o.finished]
    assert reasons == ["length"]


def test_request_times_split_queue_prefill_and_decode(model_dir):
    # One row at a time: b waits in the queue while a runs, so b is scheduled only after a's last token.
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=1))
    a, b = run(engine, PROMPTS[:2], greedy(1.0, 3))
    for r in (a, b):
        assert r.arrival <= r.scheduled_time <= r.first_token_time <= r.finished_time
    assert b.scheduled_time >= a.first_token_time
    assert b.scheduled_time - b.arrival > a.scheduled_time - a.arrival


def test_seeded_sampling_is_reproducible_across_batches(model_dir):
    sp = SamplingParams(
        max_tokens=15, temperature=0.9, top_p=0.95, seed=1234, exit_threshold=0.5, ignore_eos=True
    )
    other = SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)
    alone = run(Engine(EngineConfig(model=model_dir, device="cpu")), [PROMPTS[2]], sp)[0].output_ids
    mixed = run(
        Engine(EngineConfig(model=model_dir, device="cpu", seed=7)),
        PROMPTS,
        [other, other, sp, other, other, other],
    )
    assert mixed[2].output_ids == alone
    reseeded = SamplingParams(**{**sp.__dict__, "seed": 99})
    assert (
        run(Engine(EngineConfig(model=model_dir, device="cpu")), [PROMPTS[2]], reseeded)[0].output_ids
        != alone
    )


def test_finish_reasons_and_stop_conditions(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    free = run(engine, [PROMPTS[2]], greedy(1.0, 12))[0]
    assert free.output_ids and len(free.output_ids) == 12
    # A stop token id: generation ends on it; its text is not emitted.
    stop_tok = free.output_ids[5]
    first = free.output_ids.index(stop_tok)
    sp = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok])
    engine.add_request("s", PROMPTS[2], sp)
    outs = [o for _ in range(200) for o in engine.step()]
    final = [o for o in outs if o.finished][0]
    assert final.finish_reason == "stop"
    assert final.request.output_ids == free.output_ids[: first + 1]
    assert final.request.text == engine.tokenizer.decode(free.output_ids[:first])
    # A stop string spanning tokens is cut and never emitted.
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip() and "\ufffd" not in stop:
        engine.add_request("t", PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
        outs = [o for _ in range(200) for o in engine.step()]
        streamed = "".join(o.text_delta for o in outs if o.request_id == "t")
        fin = [o for o in outs if o.finished and o.request_id == "t"][0]
        assert fin.finish_reason == "stop"
        assert streamed == text[: text.index(stop)]
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_streamed_text_equals_full_decode(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True, skip_special_tokens=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, sp)
    texts, ids = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            texts[o.request_id] = texts.get(o.request_id, "") + o.text_delta
            if o.finished:
                ids[o.request_id] = o.request.output_ids
    for k, toks in ids.items():
        assert texts[k] == engine.tokenizer.decode(toks, skip_special_tokens=False)


def test_bad_requests_are_rejected_clearly(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_model_len=64, num_kv_blocks=16))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("b", [5, 99999], SamplingParams())
    with pytest.raises(ValueError, match="exceeds"):
        engine.add_request("c", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("d", [1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="min_loops"):
        engine.add_request("e", [1, 2], SamplingParams(min_loops=5))
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request("h", [5], SamplingParams(max_tokens=2, top_k=2**31))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("i", [5], SamplingParams(max_tokens=2, temperature=1e39))
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request("h", [5], SamplingParams(max_tokens=2, top_k=2**31))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("i", [5], SamplingParams(max_tokens=2, temperature=1e39))
    engine.add_request("f", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("f", [1, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():  # rejected requests left nothing behind
        engine.step()
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    # 16 blocks at 4 loops hold 64 tokens: a request fitting max_model_len but not the pool is refused.
    small = Engine(EngineConfig(model=model_dir, device="cpu", num_kv_blocks=8))
    with pytest.raises(ValueError, match="KV pool"):
        small.add_request("g", list(range(30)), SamplingParams(max_tokens=10))


def test_step_statistics(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    got = run(engine, PROMPTS, greedy(0.5, 10))
    st = engine.stats
    produced = sum(len(r.output_ids) for r in got)
    assert st.total_exits == produced == sum(st.exit_depth_histogram)
    hist = np.bincount([loop for r in got for loop in r.exit_loops], minlength=4).tolist()
    assert st.exit_depth_histogram == hist
    assert sum(st.total_rows_per_loop) >= produced
    assert st.model_seconds > 0 and st.scheduler_seconds > 0


def test_llm_facade(model_dir):
    llm = LLM(model_dir, device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(["Hello, world", [1, 2, 3], {"prompt_token_ids": [4, 5]}], sampling_params=params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    first = outs[0].outputs[0]
    assert outs[0].prompt == "Hello, world"
    assert outs[0].prompt_token_ids == llm.engine.tokenizer.encode("Hello, world")
    assert first.text == llm.engine.tokenizer.decode(first.token_ids)
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [1, 2, 3]
    assert outs[2].prompt_token_ids == [4, 5] and len(outs[1].outputs[0].exit_loops) == 6
    # The same call one at a time gives the same tokens (greedy).
    assert llm.generate([1, 2, 3], params)[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_llm_a_refused_request_leaves_the_next_call_working(model_dir):
    llm = LLM(model_dir, device="cpu")
    ok = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["a", "b"], [ok, SamplingParams(max_tokens=0)])
    assert not llm.engine.has_unfinished_requests()  # the first request left with the error
    assert [len(o.outputs[0].token_ids) for o in llm.generate(["a", "b"], ok)] == [3, 3]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [ok])


def test_llm_chat_uses_the_template_and_stops_at_the_end_of_turn(model_dir):
    llm = LLM(model_dir, device="cpu")
    tok = llm.engine.tokenizer
    conversation = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert out.prompt == tok.apply_chat_template(conversation)
    assert out.prompt_token_ids == tok.encode(out.prompt)
    # The template's end-of-turn token (ChatML: <|im_end|>) joins a chat request's stop ids.
    seen, add = [], llm.engine.add_requests
    llm.engine.add_requests = lambda keys, ids, ps: (
        seen.extend(p.stop_token_ids for p in ps) or add(keys, ids, ps)
    )
    llm.chat(conversation, SamplingParams(max_tokens=2, temperature=0, stop_token_ids=[7]))
    llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))
    assert seen == [[7, tok.token_to_id("<|im_end|>")], []]
    llm.engine.add_requests = add
    outs = llm.chat(
        [conversation, conversation], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_a_failing_step_loses_no_final(model_dir):
    """A step whose model call raises ends its requests with an error and returns normally; finals
    queued before it (aborts) survive, every request gets exactly one final, and the engine serves on."""
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    for key in "abc":
        engine.add_request(key, [3, 4, 5], greedy(1.0, n=30))
    for _ in range(6):
        engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("injected"))
    finals = [o for o in engine.step() if o.finished]
    assert sorted((o.request_id, o.finish_reason) for o in finals) == [
        ("a", "abort"),
        ("b", "abort"),
        ("c", "error"),
    ]
    assert "RuntimeError: injected" in finals[-1].error
    assert engine.stats.failed_steps == 1
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    engine.runner.execute = execute
    assert run(engine, [[6, 7]], greedy(1.0, n=3))[0].output_ids  # still serving


def test_outputs_made_inside_a_failing_step_are_not_lost(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    engine.add_request("a", [3, 4, 5], greedy(1.0, n=1))
    engine.add_request("b", [3, 4, 5, 6], greedy(1.0, n=20))
    apply = engine._apply

    def apply_then_fail(*args):
        apply(*args)  # the step's outputs are queued (a's final among them), then the step fails
        if any(o.finished for o in engine.pending):
            raise RuntimeError("injected after apply")

    engine._apply = apply_then_fail
    finals = {}
    for _ in range(20):
        finals |= {o.request_id: o.finish_reason for o in engine.step() if o.finished}
    assert finals == {"a": "length", "b": "error"}
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_failure_handling_that_raises_still_loses_no_final(model_dir):
    """Should even the failure handling raise, step() raises, and abort_all() hands out what the step
    had queued along with the finals of the requests still held."""
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    engine.add_request("a", [3, 4, 5], greedy(1.0, n=30))
    engine.add_request("b", [3, 4, 5], greedy(1.0, n=30))
    engine.step()
    engine.abort_request("a")
    engine.runner.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("injected"))
    engine._fail_batch = lambda e: (_ for _ in ()).throw(RuntimeError("handler broke"))
    with pytest.raises(RuntimeError, match="handler broke"):
        engine.step()
    finals = sorted((o.request_id, o.finish_reason) for o in engine.abort_all("error") if o.finished)
    assert finals == [("a", "abort"), ("b", "error")]
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_logprobs_match_the_dense_reference(model_dir, threshold):
    """Each token's log-probability and its top 5, from the logits of the loop it exited at, before
    temperature: the dense reference's log_softmax within 1e-3 (fp32)."""
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    params = SamplingParams(
        max_tokens=12, temperature=0, exit_threshold=threshold, ignore_eos=True, logprobs=5
    )
    got = run(engine, PROMPTS, params)
    ref = DenseReference(dict(engine.model.state_dict()), engine.model_config, 128, engine.vocab_limit)
    for prompt, req in zip(PROMPTS, got):
        want = ref.generate(prompt, 12, threshold=threshold)
        assert req.output_ids == want.tokens and len(req.logprobs) == 12
        for tok, lp, logits in zip(req.output_ids, req.logprobs, want.logits):
            ref_lp = torch.log_softmax(logits[: engine.vocab_limit].float(), dim=-1)
            assert abs(lp.logprob - float(ref_lp[tok])) < 1e-3
            top = ref_lp.topk(5)
            assert lp.top_ids[0] == tok == int(top.indices[0])  # greedy: the sampled token is the likeliest
            torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, atol=1e-3, rtol=0)


def test_logprobs_are_before_temperature_and_only_when_asked(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu", keep_logits=True))
    hot = SamplingParams(max_tokens=6, temperature=5.0, seed=3, ignore_eos=True, logprobs=0)
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a, b = run(engine, [PROMPTS[0], PROMPTS[1]], [hot, plain])
    assert b.logprobs == [] and len(a.logprobs) == 6
    for tok, lp, logits in zip(a.output_ids, a.logprobs, a.logits):
        assert lp.top_ids == [] and lp.top_logprobs == []
        assert abs(lp.logprob - float(torch.log_softmax(logits[: engine.vocab_limit], -1)[tok])) < 1e-5
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("x", [1, 2], SamplingParams(logprobs=21))


def test_llm_reports_logprobs_in_vllms_shape(model_dir):
    llm = LLM(model_dir, device="cpu")
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1 and len(entry) == 3  # greedy: the top one
        assert entry[tok].decoded_token == llm.engine.tokenizer.decode([tok], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def penalized_choice(prompt, presence=0.0, frequency=0.0, repetition=1.0, bias=None, min_tokens=0, stops=()):
    """The reference's choice under vLLM's logits processors, token by token, in plain Python."""

    def choose(logits, tokens):
        x = logits.clone()
        for t, v in (bias or {}).items():
            x[t] += v
        if len(tokens) < min_tokens:
            for t in stops:
                x[t] = float("-inf")
        seen = set(prompt) | set(tokens)
        for t in seen:
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t in set(tokens):
            x[t] -= frequency * tokens.count(t) + presence
        return int(x.argmax())

    return choose


@pytest.mark.parametrize(
    "opts",
    [
        dict(repetition_penalty=1.8),
        dict(presence_penalty=1.5, frequency_penalty=0.7),
        dict(frequency_penalty=-1.0),
        dict(logit_bias={7: 6.0, 9: -100.0}),
        dict(min_tokens=10, repetition_penalty=1.3),
    ],
)
def test_logits_processors_match_the_reference_token_for_token(model_dir, opts):
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=3))
    ref = DenseReference(dict(engine.model.state_dict()), engine.model_config, 128, engine.vocab_limit)
    params = SamplingParams(max_tokens=16, temperature=0, exit_threshold=0.5, **opts)
    plain = SamplingParams(max_tokens=16, temperature=0, exit_threshold=0.5)
    prompts = PROMPTS[:4]
    # Penalized requests share the batch with a plain one, and a 3-row limit makes them take turns in slots.
    got = run(engine, prompts, [params, plain, params, params])
    stops = sorted(engine.eos_ids)
    for prompt, req, p in zip(prompts, got, [params, plain, params, params]):
        choose = None
        if p is params:
            choose = penalized_choice(
                prompt, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
                p.min_tokens, stops,
            )  # fmt: skip
        want = ref.generate(prompt, 16, threshold=0.5, choose=choose)
        n = len(req.output_ids)
        assert req.output_ids == want.tokens[:n], (opts, prompt)
        assert n == 16 or req.output_ids[-1] in engine.eos_ids
        if "min_tokens" in opts:
            assert n >= 10
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_min_p_keeps_only_tokens_near_the_likeliest(model_dir):
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    # min_p 1: only the likeliest token survives, so sampling at any temperature is greedy.
    hot = SamplingParams(max_tokens=10, temperature=3.0, min_p=1.0, ignore_eos=True)
    greedy_run = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a, b = run(engine, [PROMPTS[0], PROMPTS[0]], [hot, greedy_run])
    assert a.output_ids == b.output_ids
    with pytest.raises(ValueError, match="min_p"):
        engine.add_request("x", [1], SamplingParams(min_p=1.5))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("y", [1], SamplingParams(logit_bias={engine.vocab_limit: 1.0}))


def test_prompt_logprobs_match_the_dense_reference(model_dir):
    """Each prompt token's log-probability given the tokens before it, from the prompt's last loop, whatever
    the chunking or the batch; the first token has none."""
    prompts = [PROMPTS[2], PROMPTS[3], list(range(5, 30))]
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_batched_tokens=7))  # chunked prefill
    params = SamplingParams(
        max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3, exit_threshold=0.5
    )
    got = run(engine, prompts, params)
    ref = DenseReference(dict(engine.model.state_dict()), engine.model_config, 128, engine.vocab_limit)
    v = engine.vocab_limit
    for prompt, req in zip(prompts, got):
        logits, _ = ref.prefill(prompt)
        want = torch.log_softmax(logits[-1, :-1, :v].float(), dim=-1)  # the last loop, positions 0..n-2
        assert len(req.prompt_logprobs) == len(prompt) - 1
        for i, lp in enumerate(req.prompt_logprobs):
            assert abs(lp.logprob - float(want[i, prompt[i + 1]])) < 1e-3
            assert lp.top_ids == want[i].topk(3).indices.tolist()
        assert req.exit_loops == [3, 3]  # asking for prompt logprobs runs the request at full depth
