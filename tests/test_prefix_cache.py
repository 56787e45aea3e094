"""Automatic prefix caching in the engine: a prompt's full blocks, computed at every loop, are reused by
later prompts that begin with the same tokens.

A hit must give exactly the tokens and exit loops a cold run gives (greedy, float32, the torch runner):
at full depth and with early exit, after eviction pressure and under preemption. Requests that want
prompt logprobs compute every position, and the option turns the cache off.
"""

import pytest

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams

SYSTEM = list(range(10, 58))  # 48 tokens: three 16-token blocks every prompt below begins with


def engine(model_dir, **options) -> Engine:
    return Engine(EngineConfig(model=model_dir, device="cpu", **options))


def drain(eng: Engine) -> dict:
    """Step until idle; request id -> its final StepOutput. Every KV block must be back (cached ones
    count as free)."""
    finals = {}
    while eng.has_unfinished_requests():
        finals.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_free_blocks == eng.scheduler.num_blocks, "KV blocks leaked"
    assert not eng.scheduler.blocks.refs.any()
    return finals


def params(threshold: float, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, exit_threshold=threshold, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    """The shared system prompt, then a question of its own (17..20 tokens) per request."""
    return [SYSTEM + [100 + 7 * j + k for k in range(17 + j % 4)] for j in range(n)]


def one_by_one(eng: Engine, items: list[list[int]], p: SamplingParams) -> list:
    """Each prompt run to the end before the next is added: the later ones find the earlier ones' blocks."""
    out = []
    for j, prompt in enumerate(items):
        eng.add_request(f"r{j}", prompt, p)
        out.append(drain(eng)[f"r{j}"])
    return out


def tokens(finals: list) -> list:
    return [(f.request.output_ids, f.request.exit_loops) for f in finals]


@pytest.mark.parametrize("threshold", [1.0, 0.5], ids=["full-depth", "early-exit"])
def test_a_hit_gives_the_tokens_of_a_cold_run(model_dir, threshold):
    items = prompts(3) + [prompts(1)[0]]  # the last repeats the first prompt whole
    warm = engine(model_dir)
    got = one_by_one(warm, items, params(threshold))
    want = [
        one_by_one(engine(model_dir, enable_prefix_caching=False), [p], params(threshold))[0] for p in items
    ]
    assert tokens(got) == tokens(want)
    # The first computes everything; the others reuse the system prompt, the repeat all but its last block.
    assert [f.cached_tokens for f in got] == [0, 48, 48, 64]
    assert [f.cached_tokens for f in want] == [0, 0, 0, 0]
    stats = warm.stats
    assert stats.prefix_cache_hits == 48 + 48 + 64
    assert stats.prefix_cache_queries == sum(len(p) for p in items)
    assert stats.total_prefill_tokens == sum(len(p) for p in items) - stats.prefix_cache_hits


def test_the_next_chat_turn_hits_the_previous_turn(model_dir):
    eng = engine(model_dir)
    first = one_by_one(eng, [SYSTEM + [200, 201]], params(0.5, max_tokens=14))[0]
    # The next turn's prompt holds the reply: only prompt blocks were cached, so it reuses 48 tokens,
    # computing the reply's positions at every loop as a cold prefill does.
    turn = SYSTEM + [200, 201] + first.request.output_ids + [300, 301, 302]
    got = one_by_one(eng, [turn], params(0.5))[0]
    want = one_by_one(engine(model_dir, enable_prefix_caching=False), [turn], params(0.5))[0]
    assert tokens([got]) == tokens([want]) and got.cached_tokens == 48
    again = one_by_one(eng, [turn + [5]], params(0.5))[0]
    assert again.cached_tokens == 64  # the second turn's own prompt blocks joined the cache


@pytest.mark.parametrize("threshold", [1.0, 0.5], ids=["full-depth", "early-exit"])
def test_hits_under_eviction_pressure_and_preemption_match_cold_runs(model_dir, threshold):
    # 40 blocks = 10 per loop: four requests of ~67 tokens + 40 new (7 blocks each, 3 of them shared when
    # cached) cannot all run at once, so they preempt each other, and cache entries are evicted.
    items = prompts(6) + prompts(2)
    opts = dict(num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=32)
    on, off = engine(model_dir, **opts), engine(model_dir, enable_prefix_caching=False, **opts)
    for eng in (on, off):
        for j, prompt in enumerate(items):
            eng.add_request(f"r{j}", prompt, params(threshold, max_tokens=40))
    got, want = drain(on), drain(off)
    keys = [f"r{j}" for j in range(len(items))]
    assert tokens([got[k] for k in keys]) == tokens([want[k] for k in keys])
    assert on.stats.total_preemptions > 0 and on.stats.prefix_cache_hits > 0
    assert off.stats.prefix_cache_hits == 0 and off.scheduler.blocks.num_cached_blocks == 0
    # Then one after another through the same small pool: evictions, and hits that still match.
    later = one_by_one(on, prompts(5)[::-1], params(threshold))
    cold = [
        one_by_one(engine(model_dir, enable_prefix_caching=False), [p], params(threshold))[0]
        for p in prompts(5)[::-1]
    ]
    assert tokens(later) == tokens(cold)
    # Each finds the system prompt at least (the one before it left it), or its whole earlier run.
    assert all(f.cached_tokens in (48, 64) for f in later)


def test_prompt_logprobs_requests_compute_every_position(model_dir):
    eng = engine(model_dir)
    one_by_one(eng, [SYSTEM + [1, 2]], params(0.5))
    p = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    got = one_by_one(eng, [SYSTEM + [3, 4]], p)[0]
    want = one_by_one(engine(model_dir, enable_prefix_caching=False), [SYSTEM + [3, 4]], p)[0]
    assert got.cached_tokens == 0 and len(got.request.prompt_logprobs) == len(SYSTEM) + 1
    assert got.request.prompt_logprobs == want.request.prompt_logprobs
    # Its blocks still join the cache for later requests.
    assert one_by_one(eng, [SYSTEM + [3, 4, 5]], params(0.5))[0].cached_tokens == 48


def test_choices_of_a_cached_prompt_reuse_it(model_dir):
    eng = engine(model_dir)
    one_by_one(eng, [SYSTEM + [1, 2]], params(0.5))
    eng.add_requests(["a", "b"], SYSTEM + [7, 8, 9], [params(0.5)] * 2)
    finals = drain(eng)
    want = one_by_one(engine(model_dir, enable_prefix_caching=False), [SYSTEM + [7, 8, 9]], params(0.5))[0]
    assert tokens([finals["a"], finals["b"]]) == tokens([want, want])
    # The prefix request took the system prompt's first two blocks from the cache and computed the third;
    # each choice reports what its prompt reused.
    assert eng.stats.prefix_cache_hits == 32 and finals["a"].cached_tokens == finals["b"].cached_tokens == 32


def test_prefix_caching_off_reuses_nothing(model_dir):
    eng = engine(model_dir, enable_prefix_caching=False)
    finals = one_by_one(eng, [SYSTEM + [1], SYSTEM + [1]], params(1.0))
    assert [f.cached_tokens for f in finals] == [0, 0]
    assert eng.stats.prefix_cache_queries == eng.stats.prefix_cache_hits == 0
    assert eng.stats.total_prefill_tokens == 2 * (len(SYSTEM) + 1)
