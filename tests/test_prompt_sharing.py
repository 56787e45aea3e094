"""Requests of one prompt (a request's n choices) share its KV: the prompt's whole blocks are computed
once by a prefix request, each choice computes the rest and decodes on its own.

Every choice must be what it would be as a request of its own (greedy and seeded), the blocks must all
come back however the choices end, and prompt logprobs are computed once and reported to each choice.
"""

import pytest
import torch

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.llm import LLM
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.reference import DenseReference

PROMPT = list(range(10, 40))  # 30 tokens: one 16-token block shared, 14 computed by each choice
SHARED = 16


def engine(model_dir, **options) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cpu", **options))


def drain(eng: Engine) -> dict:
    """Step until idle; request id -> its final StepOutput. Every KV block must be back."""
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_free_blocks == eng.scheduler.num_blocks, "KV blocks leaked"
    assert not eng.scheduler.blocks.refs.any() and not eng.prefixes
    return finals


def choices(n: int, seeded: bool, **extra) -> list[SamplingParams]:
    if not seeded:
        return [
            SamplingParams(max_tokens=12, temperature=0, exit_threshold=0.5, ignore_eos=True, **extra)
        ] * n
    return [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234 + j, exit_threshold=0.5,
                       ignore_eos=True, **extra)
        for j in range(n)
    ]  # fmt: skip


def separately(model_dir, params: list[SamplingParams], prompt=PROMPT, **options) -> list:
    """Each choice as a request of its own, one engine each: what sharing must reproduce."""
    out = []
    for p in params:
        eng = engine(model_dir, **options)
        eng.add_request("solo", prompt, p)
        out.append(drain(eng)["solo"].request)
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_choices_sharing_a_prompt_equal_separate_requests_and_compute_it_once(model_dir, seeded):
    params = choices(3, seeded)
    eng = engine(model_dir)
    eng.add_requests(["a", "b", "c"], PROMPT, params)
    finals = drain(eng)
    want = separately(model_dir, params)
    got = [finals[k].request for k in "abc"]
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.exit_loops for r in got] == [r.exit_loops for r in want]
    if seeded:
        assert len({tuple(r.output_ids) for r in got}) == 3  # the seeds differ, so do the choices
    # The shared block once, then each choice's 14 tokens: not 3 x 30.
    assert eng.stats.total_prefill_tokens == SHARED + 3 * (len(PROMPT) - SHARED)
    assert [finals[k].prompt_tokens for k in "abc"] == [len(PROMPT)] * 3


def test_shared_choices_match_the_dense_reference(model_dir):
    eng = engine(model_dir, keep_logits=True)
    eng.add_requests(["a", "b"], PROMPT, choices(2, seeded=False))
    finals = drain(eng)
    ref = DenseReference(dict(eng.model.state_dict()), eng.model_config, 128, eng.vocab_limit)
    want = ref.generate(PROMPT, 12, threshold=0.5)
    for k in "ab":
        req = finals[k].request
        assert req.output_ids == want.tokens and req.exit_loops == want.exit_loops
        for a, b in zip(req.logits, want.logits):
            torch.testing.assert_close(a[: eng.vocab_limit], b[: eng.vocab_limit], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=5),  # the prefix and the tails in chunks
        dict(num_kv_blocks=28, max_num_seqs=4),  # a pool too small for every choice: preemption
        dict(max_num_seqs=2),  # choices wait for a KV slot while holding the shared block
    ],
)
def test_sharing_under_chunking_preemption_and_few_slots(model_dir, options):
    params = choices(4, seeded=True)
    eng = engine(model_dir, **options)
    eng.add_requests(list("abcd"), PROMPT, params)
    finals = drain(eng)
    want = separately(model_dir, params)
    assert [finals[k].request.output_ids for k in "abcd"] == [r.output_ids for r in want]
    if options.get("num_kv_blocks"):
        assert eng.stats.total_preemptions > 0


def test_prompt_logprobs_are_computed_once_and_reported_to_each_choice(model_dir):
    eng = engine(model_dir, max_num_batched_tokens=7)
    params = [
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=k, exit_threshold=0.5)
        for k in (3, 1)
    ] + [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)]
    eng.add_requests(["three", "one", "none"], PROMPT, params)
    finals = drain(eng)
    ref = DenseReference(dict(eng.model.state_dict()), eng.model_config, 128, eng.vocab_limit)
    logits, _ = ref.prefill(PROMPT)
    want = torch.log_softmax(logits[-1, :-1, : eng.vocab_limit].float(), dim=-1)
    for key, k in (("three", 3), ("one", 1)):
        lps = finals[key].request.prompt_logprobs
        assert len(lps) == len(PROMPT) - 1
        for i, lp in enumerate(lps):
            assert abs(lp.logprob - float(want[i, PROMPT[i + 1]])) < 1e-3
            assert lp.top_ids == want[i].topk(k).indices.tolist()
    assert finals["none"].request.prompt_logprobs == []
    assert eng.stats.total_prefill_tokens == SHARED + 3 * (len(PROMPT) - SHARED)


@pytest.mark.parametrize("when", [1, 6, 12])  # the prefix computing, the tails computing, decoding
def test_aborting_one_choice_frees_only_its_own_blocks(model_dir, when):
    params = choices(3, seeded=True)
    eng = engine(model_dir)
    eng.add_requests(["a", "b", "c"], PROMPT, params)
    for _ in range(when):
        eng.step()
    blocks = eng.scheduler.blocks
    shared = {int(b) for b in blocks.tables[:, :, 0].ravel() if b >= 0 and blocks.refs[b] > 1}
    eng.abort_request("b")
    assert all(blocks.refs[b] >= 1 for b in shared)  # the others still hold the shared block
    finals = drain(eng)
    assert finals["b"].finish_reason == "abort"
    want = separately(model_dir, [params[0], params[2]])
    assert [finals[k].request.output_ids for k in "ac"] == [r.output_ids for r in want]


@pytest.mark.parametrize("when", [0, 1, 6])
def test_aborting_every_choice_frees_every_block(model_dir, when):
    eng = engine(model_dir)
    eng.add_requests(["a", "b", "c"], PROMPT, choices(3, seeded=False))
    for _ in range(when):
        eng.step()
    outs = eng.abort_all()
    assert {o.request_id for o in outs if o.finished} == {"a", "b", "c"} and not eng.prefixes
    assert eng.scheduler.num_free_blocks == eng.scheduler.num_blocks and not eng.scheduler.blocks.refs.any()
    assert eng.num_running == eng.num_waiting == 0 and eng.scheduler.schedule() is None


def test_a_refused_choice_queues_none_of_them(model_dir):
    eng = engine(model_dir)
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        eng.add_requests(["a", "b"], PROMPT, [good, SamplingParams(top_p=0)])
    eng.add_request("taken", [1, 2], good)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_requests(["a", "taken"], PROMPT, [good, good])
    with pytest.raises(ValueError, match="distinct"):
        eng.add_requests(["a", "a"], PROMPT, [good, good])
    assert set(eng.requests) == {"taken"} and eng.num_waiting == 1 and not eng.prefixes
    drain(eng)


def test_choices_beyond_the_schedulers_capacity_queue_none_of_them(model_dir):
    eng = engine(
        model_dir, max_num_seqs=2, max_waiting=2
    )  # 4 requests at once; 3 choices take 4 with their prefix
    eng.add_request("first", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(OverflowError):
        eng.add_requests(["a", "b", "c"], PROMPT, choices(3, seeded=False))
    assert set(eng.requests) == {"first"} and eng.num_waiting == 1 and not eng.prefixes
    eng.add_requests(["a", "b"], PROMPT, choices(2, seeded=False))  # 3 fit
    assert set(drain(eng)) == {"first", "a", "b"}


def test_short_prompts_and_single_requests_share_nothing(model_dir):
    eng = engine(model_dir)
    eng.add_requests(
        ["a", "b"], PROMPT[:16], choices(2, seeded=False)
    )  # no whole block before the last token
    eng.add_requests(["c"], PROMPT, choices(1, seeded=False))
    drain(eng)
    assert eng.stats.total_prefill_tokens == 16 + 16 + len(PROMPT)


def test_llm_identical_prompts_share_their_kv(model_dir):
    llm = LLM(model_dir, device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=0.5, ignore_eos=True)
    outs = llm.generate([PROMPT, [5, 6, 7], PROMPT], params)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == separately(model_dir, [params])[0].output_ids
    assert [o.prompt_token_ids for o in outs] == [PROMPT, [5, 6, 7], PROMPT]
    assert llm.engine.stats.total_prefill_tokens == SHARED + 2 * (len(PROMPT) - SHARED) + 3
