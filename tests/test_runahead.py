"""Run-ahead decode (device-driven lanes) against the host-driven step: the same tokens and depths.

The Triton runner runs under TRITON_INTERPRET=1 on a CPU-only machine (eagerly), and
with CUDA graphs on a GPU. Every case checks that run-ahead actually ran, that the
greedy tokens and exit loops equal those of run_ahead=False, and that all KV is
freed at the end.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.engine.engine import Engine, EngineConfig  # noqa: E402
from ouro_fast.engine.sampling import SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 18))]


def engine(model_dir, run_ahead=True, **kw):
    # A fixed small pool: on a GPU the default takes most free memory, and tests hold two engines.
    opts = dict(model=model_dir, dtype="float32", runner="triton", max_num_batched_tokens=16)
    opts["num_kv_blocks"] = 256
    return Engine(EngineConfig(run_ahead=run_ahead, **{**opts, **kw}))


def run(eng, requests, hook=None):
    """requests: (id, prompt, params); hook(engine) runs before every step until it returns True.
    Returns id -> final output."""
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    done = {}
    while eng.has_unfinished_requests():
        if hook is not None and hook(eng):
            hook = None
        for out in eng.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    assert eng.scheduler.num_free_blocks == eng.scheduler.num_blocks
    assert eng.ahead is None or not eng.ahead.active
    if eng.ahead is not None:
        # Every launch's last kernel published its records: the device's ring position is the host's.
        assert int(eng.ahead.lanes.emitted) == eng.ahead.lanes.count
    return done


def tokens(done):
    return {k: (o.request.output_ids, o.request.exit_loops, o.finish_reason) for k, o in done.items()}


def greedy(max_tokens, threshold=0.5, **kw):
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, exit_threshold=threshold, ignore_eos=True, **kw
    )


WINDOW = {"exit_threshold": 0.3, "min_loops": 2, "max_loops": 3}  # exits only after loop 1 or 2


@pytest.mark.parametrize(
    "policies",
    [
        [{"exit_threshold": 0.5}] * 3,
        # Full-depth lanes ride along once one row may exit early; an exit window clamps depths.
        [{"exit_threshold": 1.0}, {"exit_threshold": 0.5}, WINDOW],
    ],
    ids=["threshold", "mixed"],
)
def test_same_tokens_and_depths_as_host_driven(model_dir, policies):
    # Different caps: lanes end on the device at different launches while the others go on.
    reqs = [
        (str(i), p, SamplingParams(max_tokens=2 + 2 * i, temperature=0, ignore_eos=True, **pol))
        for i, (p, pol) in enumerate(zip(PROMPTS, policies))
    ]
    want = tokens(run(engine(model_dir, run_ahead=False), reqs))
    eng = engine(model_dir)
    got = tokens(run(eng, reqs))
    assert got == want
    assert eng.ahead.runs >= 1 and eng.ahead.total_launches >= 4
    assert len({loop for ids, loops, _ in got.values() for loop in loops}) > 1
    if policies[2] is WINDOW:
        assert got["0"][1] == [3, 3] and all(1 <= loop <= 2 for loop in got["2"][1])


def logprobs_of(done):
    return {k: [(lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs) for lp in o.request.logprobs]
            for k, o in done.items()}  # fmt: skip


def assert_same_logprobs(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert len(got[k]) == len(want[k]), k
        for (lp, rank, ids, top), (lp0, rank0, ids0, top0) in zip(got[k], want[k]):
            assert lp == pytest.approx(lp0, abs=1e-4) and rank == rank0 and ids == ids0
            assert top == pytest.approx(top0, abs=1e-4)


def test_logprobs_are_computed_in_the_lanes_as_on_the_host(model_dir):
    # Requests with and without log-probabilities in one run; a newcomer that wants the most (20)
    # rides in mid-run, its first token's from its riding prompt's row. Tokens and log-probabilities
    # equal the host path's.
    early = [(str(i), p, greedy(5, logprobs=n)) for i, (p, n) in enumerate(zip(PROMPTS, (0, None, 5)))]
    late = ("late", [9, 8, 7, 6], greedy(4, logprobs=20))
    host = run(engine(model_dir, run_ahead=False), early + [late])
    eng = engine(model_dir)
    seen = {}

    def add_late(e):
        if e.ahead.active and e.ahead.launched >= 2:
            e.add_request(*late)
            seen["late"] = e.ahead.active
            return True
        return False

    done = run(eng, early, hook=add_late)
    assert tokens(done) == tokens(host)
    assert_same_logprobs(logprobs_of(done), logprobs_of(host))
    assert [len(lp.top_ids) for lp in done["late"].request.logprobs] == [20] * 4
    assert done["1"].request.logprobs == []
    assert seen == {"late": True} and eng.ahead.total_riders == 1 and eng.ahead.hand_backs == 0
    assert eng.ahead.rider_launches == 4  # the prompt's four loops, one a launch


def test_top_k_top_p_and_min_p_are_applied_in_the_lanes(model_dir):
    # Each request samples at temperature 1 with a filter that keeps only its likeliest token, so the lanes
    # must give the greedy tokens; a greedy request rides beside them, unfiltered.
    hot = dict(max_tokens=5, temperature=1.0, exit_threshold=0.5, ignore_eos=True)
    filters = ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0})
    reqs = [(str(i), p, SamplingParams(**hot, **f)) for i, (p, f) in enumerate(zip(PROMPTS, filters))]
    reqs.append(("g", [9, 8, 7, 6], greedy(5)))
    want = tokens(run(engine(model_dir, run_ahead=False), [(k, p, greedy(5)) for k, p, _ in reqs]))
    eng = engine(model_dir)
    seen = []

    def watch(e):
        seen.append(e.ahead.active and e.ahead.lanes.filtering)
        return False

    got = tokens(run(eng, reqs, hook=watch))
    assert got == want
    assert eng.ahead.total_launches >= 4 and any(seen)


def test_stop_ids_on_the_device_and_stop_strings_on_the_host(model_dir):
    base = tokens(run(engine(model_dir, run_ahead=False), [("a", PROMPTS[0], greedy(8))]))
    stop_tok = base["a"][0][3]  # a stop id the device sees: the lane ends itself
    eng = engine(model_dir, run_ahead=False)
    text = eng.tokenizer.decode(base["a"][0][:4])
    reqs = [
        ("stop_id", PROMPTS[0], greedy(8, stop_token_ids=[stop_tok])),
        ("stop_str", PROMPTS[0], greedy(8, stop=[text[-1]]) if text else greedy(8)),
        ("plain", PROMPTS[1], greedy(8)),
    ]
    want = run(eng, reqs)
    ahead = engine(model_dir)
    got = run(ahead, reqs)
    assert tokens(got) == tokens(want)
    assert {k: o.request.text for k, o in got.items()} == {k: o.request.text for k, o in want.items()}
    assert got["stop_id"].finish_reason == "stop" and len(got["stop_id"].request.output_ids) <= 4
    assert ahead.ahead.total_launches > 0


def test_request_arriving_mid_run_rides_in_a_free_lane_at_once(model_dir):
    # Three lanes of four busy: the newcomer is seated in the next launch, nothing replayed first.
    late = ("late", [9, 8, 7, 6], greedy(4))
    early = [(str(i), p, greedy(6)) for i, p in enumerate(PROMPTS)]
    want = tokens(run(engine(model_dir, run_ahead=False), early + [late]))
    eng = engine(model_dir)
    seen = {}

    def add_late(e):
        if "in flight" not in seen and e.ahead.active and e.ahead.launched >= 3:
            e.add_request(*late)
            seen["in flight"] = e.ahead.launched - e.ahead.replayed  # the arrival waited for nothing
            return False
        if "in flight" in seen:
            seen["seated"] = not e.ahead.arrivals and e.ahead.total_riders == 1  # after one step
            return True
        return False

    got = tokens(run(eng, early, hook=add_late))
    assert got == want
    assert seen == {"in flight": 1, "seated": True}
    assert eng.ahead.runs == 1 and eng.ahead.catch_ups == 0 and eng.ahead.hand_backs == 0


def test_riders_join_together_and_while_others_ride(model_dir):
    # b stops on its first token (a stop id the device sees); c wants one token (its length cap).
    b_first = tokens(run(engine(model_dir, run_ahead=False), [("b", PROMPTS[1], greedy(3))]))["b"][0][0]
    early = [("0", PROMPTS[0], greedy(10))]
    late = [("a", PROMPTS[0], greedy(4)), ("b", PROMPTS[1], greedy(3, stop_token_ids=[b_first]))]
    later = ("c", [11, 12], greedy(1))
    want = tokens(run(engine(model_dir, run_ahead=False), early + late + [later]))
    eng = engine(model_dir)
    seen = {}

    def hook(e):
        if "late" not in seen and e.ahead.active and e.ahead.launched >= 2:
            seen["late"] = [e.add_request(*r) for r in late]
        elif "late" in seen and e.ahead.riders:
            seen["riding"] = len(e.ahead.riders)
            e.add_request(*later)  # a lane is free: it joins while the others ride
            return True
        return False

    got = tokens(run(eng, early, hook=hook))
    assert got == want
    assert got["b"][0] == [b_first] and got["b"][2] == "stop" and got["c"][0] == want["c"][0]
    assert seen["riding"] >= 1 and eng.ahead.total_riders == 3 and eng.ahead.runs == 1
    # One lane busy: a and b made the host catch up and double the lanes twice; c took a free lane.
    assert eng.ahead.catch_ups == 1


def test_a_newcomer_that_cannot_ride_hands_back_mid_ride_with_same_tokens(model_dir):
    # A seeded request needs the host sampler: its arrival ends the run while a prompt rides, and the
    # host path carries that prompt's remaining loops from where the lanes left them.
    early = [(str(i), p, greedy(8)) for i, p in enumerate(PROMPTS)]
    late = ("late", [9, 8, 7], greedy(4))
    seeded = ("seeded", [4, 4], greedy(3, seed=7))
    want = tokens(run(engine(model_dir, run_ahead=False), early + [late, seeded]))
    eng = engine(model_dir)
    seen = {}

    def hook(e):
        if "late" not in seen and e.ahead.active and e.ahead.launched >= 2:
            seen["late"] = e.add_request(*late)
        elif "late" in seen and e.ahead.riders and e.ahead.launched > e.ahead.span.max(axis=0)[0]:
            e.add_request(*seeded)  # the next step schedules it beside the prompt, mid-ride
            return True
        return False

    got = tokens(run(eng, early, hook=hook))
    assert got == want
    assert eng.ahead.hand_backs == 1 and eng.ahead.total_riders == 1


def held_newcomers(model_dir):
    """A run of early requests; a seeded one that hands the batch back; newcomers to arrive on the host
    path after it; and the host path's tokens for all of them."""
    early = [(f"e{i}", [5 + i, 6, 7 + i], greedy(12)) for i in range(5)]
    seeded = ("seeded", [4, 4], greedy(1, seed=7))
    late = [(f"l{i}", [30 + i, 31, 32], greedy(4)) for i in range(3)]
    return early, seeded, late, tokens(run(engine(model_dir, run_ahead=False), early + [seeded] + late))


def test_newcomers_on_the_host_path_are_held_so_a_run_starts_and_they_ride(model_dir):
    # A seeded request hands the batch back; after it ends, a newcomer arrives at every host step. Admitted
    # at once, each would keep a prompt in flight (no run could start until they stop coming); held, the
    # prompts in flight finish, a run starts, and the held ones ride in it.
    early, seeded, late, want = held_newcomers(model_dir)
    eng = engine(model_dir)
    pending, held = list(late), []

    def hook(e):
        if not held and e.ahead.active and e.ahead.launched >= 2:
            e.add_request(*seeded)
            held.append(0)
        elif held and seeded[0] not in e.requests and not e.ahead.active and pending:
            e.add_request(*pending.pop(0))
            held.append(len(e.ahead.holding))
        return False

    got = tokens(run(eng, early, hook=hook))
    assert got == want
    assert not pending and max(held) >= 1 and eng.ahead.holding == []
    assert eng.ahead.hand_backs == 1 and eng.ahead.runs == 2 and eng.ahead.total_riders >= 1


def test_a_host_step_that_fails_while_newcomers_are_held_ends_its_rows_and_the_held_ones_run(model_dir):
    # As above, until a request is held; then the host step raises. The requests holding KV end with the
    # error; the held ones hold none, so they are not ended: they run after it, with their own tokens.
    early, seeded, late, want = held_newcomers(model_dir)
    eng = engine(model_dir)
    execute, pending, state = eng.runner.execute, list(late), {"held": None, "added": False}

    def fail_once_while_held(plan):
        if eng.ahead.holding and state["held"] is None:
            state["held"] = [req.request_id for _, req in eng.ahead.holding]
            raise RuntimeError("injected host step failure")
        return execute(plan)

    eng.runner.execute = fail_once_while_held

    def hook(e):
        if not state["added"] and e.ahead.active and e.ahead.launched >= 2:
            e.add_request(*seeded)
            state["added"] = True
        elif state["added"] and seeded[0] not in e.requests and not e.ahead.active and pending:
            e.add_request(*pending.pop(0))
        return False

    got = run(eng, early, hook=hook)
    assert eng.stats.failed_steps == 1 and state["held"], "a host step failed while a request was held"
    errors = {k for k, o in got.items() if o.finish_reason == "error"}
    assert errors and all("injected host step failure" in got[k].error for k in errors)
    assert not errors & set(state["held"]) and set(state["held"]) <= set(got)
    assert all(tokens({k: o})[k] == want[k] for k, o in got.items() if k not in errors)
    assert eng.ahead.holding == [] and not eng.has_unfinished_requests()


def test_a_seated_arrival_whose_launch_never_runs_starts_on_the_host_path(model_dir, monkeypatch):
    # The pool runs dry right after an arrival was given KV and a lane: the run ends before the
    # launch it was seated in, and the host path starts its prompt, with the same tokens.
    early = [(str(i), p, greedy(6)) for i, p in enumerate(PROMPTS)]  # three lanes of four busy
    late = ("late", [9, 8, 7, 6], greedy(4))
    want = tokens(run(engine(model_dir, run_ahead=False), early + [late]))
    eng = engine(model_dir)
    reserve = type(eng.ahead)._reserve

    def dry(self, in_flight):
        return not self.release and reserve(self, in_flight)  # no blocks while a seat is pending

    def hook(e):
        if e.ahead.active and e.ahead.launched >= 3:
            e.add_request(*late)
            monkeypatch.setattr(type(e.ahead), "_reserve", dry)
            return True
        return False

    got = tokens(run(eng, early, hook=hook))
    assert got == want
    assert eng.ahead.total_riders == 1 and eng.ahead.runs >= 2  # seated, then handed to the host


def test_abort_of_a_rider_frees_its_kv_and_spares_the_others(model_dir):
    early = [(str(i), p, greedy(6)) for i, p in enumerate(PROMPTS[:2])]
    late = ("late", PROMPTS[2], greedy(4))
    want = tokens(run(engine(model_dir, run_ahead=False), early))
    eng = engine(model_dir)
    seen = {}

    def hook(e):
        if "late" not in seen and e.ahead.active and e.ahead.launched >= 3:
            seen["late"] = e.add_request(*late)
        elif "late" in seen and e.ahead.riders:
            e.abort_request("late")  # mid-prompt: its lane is killed at the next launch
            return True
        return False

    done = run(eng, early, hook=hook)
    assert done["late"].finish_reason == "abort"
    got = tokens(done)
    assert got["0"] == want["0"] and got["1"] == want["1"]
    assert eng.ahead.total_riders == 1


def test_abort_mid_run_frees_the_lane_and_spares_the_others(model_dir):
    reqs = [(str(i), p, greedy(6)) for i, p in enumerate(PROMPTS)]
    want = tokens(run(engine(model_dir, run_ahead=False), reqs))
    eng = engine(model_dir)

    def abort(e):
        if e.ahead.active and e.ahead.launched >= 3:
            e.abort_request("1")  # its lane is killed at the next launch
            return True
        return False

    done = run(eng, reqs, hook=abort)
    assert done["1"].finish_reason == "abort"
    got = tokens(done)
    assert got["0"] == want["0"] and got["2"] == want["2"]
    assert got["1"][0] == want["1"][0][: len(got["1"][0])]  # a prefix of what it would have said


def test_kv_pressure_falls_back_to_the_host_path_with_same_tokens(model_dir):
    # 24 blocks of 4 tokens over 4 loops: 6 positions-blocks per loop, so requests preempt each other.
    kw = dict(num_kv_blocks=24, block_size=4)
    reqs = [(str(i), p, greedy(6)) for i, p in enumerate(PROMPTS[:2])]
    late = ("late", [3, 1, 4], greedy(3))
    want = tokens(run(engine(model_dir, run_ahead=False, **kw), reqs + [late]))
    eng = engine(model_dir, **kw)

    def add_late(e):
        # A newcomer in a tight pool: it rides, or the run hands back, with the same tokens.
        if e.ahead.active and e.ahead.launched >= 2:
            e.add_request(*late)
            return True
        return False

    assert tokens(run(eng, reqs, hook=add_late)) == want


def test_sampled_lanes_draw_differently_per_lane(model_dir):
    # Same prompt twice at temperature 1: each lane has its own Philox stream.
    p = SamplingParams(max_tokens=8, temperature=1.0, exit_threshold=0.5, ignore_eos=True)
    eng = engine(model_dir)
    done = run(eng, [("x", PROMPTS[0], p), ("y", PROMPTS[0], p)])
    assert eng.ahead.total_launches > 0
    x, y = done["x"].request.output_ids, done["y"].request.output_ids
    assert len(x) == len(y) == 8 and x != y
    assert all(0 <= t < eng.vocab_limit for t in x + y)


def test_ineligible_batches_stay_host_driven(model_dir):
    eng = engine(model_dir, run_ahead_full_depth=False)
    sampled = dict(max_tokens=3, temperature=1.0, exit_threshold=0.5, ignore_eos=True)
    run(eng, [("s", PROMPTS[0], SamplingParams(seed=3, **sampled))])  # seeded: the host sampler
    run(eng, [("r", PROMPTS[0], SamplingParams(repetition_penalty=1.2, **sampled))])  # a logits processor
    run(eng, [("f", PROMPTS[0], greedy(3, threshold=1.0))])  # full depth, switched off: nothing to wait for
    assert eng.ahead.total_launches == 0
    assert engine(model_dir, run_ahead=False).ahead is None


def test_an_engine_failure_mid_run_ends_every_request_and_the_engine_recovers(model_dir):
    # A launch that raises while run-ahead drives the device: the step ends every request with an error
    # (their launches in flight belong to requests that no longer exist), resets run-ahead, and serves on.
    reqs = [(str(i), p, greedy(6)) for i, p in enumerate(PROMPTS[:2])]
    want = tokens(run(engine(model_dir, run_ahead=False), [("again", PROMPTS[2], greedy(4))]))
    eng = engine(model_dir)
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    while not (eng.ahead.active and eng.ahead.launched >= 2):
        eng.step()
    launch = eng.ahead.lanes.launch
    eng.ahead.lanes.launch = lambda: (_ for _ in ()).throw(RuntimeError("injected launch failure"))
    finals = [o for o in eng.step() if o.finished]
    eng.ahead.lanes.launch = launch
    assert sorted(o.request_id for o in finals) == ["0", "1"]
    assert all(o.finish_reason == "error" and "injected launch failure" in o.error for o in finals)
    assert eng.stats.failed_steps == 1
    assert not eng.ahead.active and not eng.has_unfinished_requests()
    assert eng.scheduler.num_free_blocks == eng.scheduler.num_blocks
    assert tokens(run(eng, [("again", PROMPTS[2], greedy(4))])) == want


def test_full_depth_runs_ahead_unless_switched_off(model_dir):
    # Full depth never waits on exits; run_ahead_full_depth (the default) still lets the device run
    # ahead (hiding the host's per-step work), with the same tokens as the host path.
    reqs = [(str(i), p, greedy(2 + i, threshold=1.0)) for i, p in enumerate(PROMPTS[:2])]
    want = tokens(run(engine(model_dir, run_ahead=False), reqs))
    off = engine(model_dir, run_ahead_full_depth=False)
    assert tokens(run(off, reqs)) == want and off.ahead.total_launches == 0
    eng = engine(model_dir)
    got = tokens(run(eng, reqs))
    assert got == want
    assert all(loops == [eng.num_loops - 1] * len(loops) for _, loops, _ in got.values())  # 0-based
    assert eng.ahead.runs >= 1 and eng.ahead.total_launches >= 2 * eng.num_loops


def test_deeper_run_ahead_gives_the_same_tokens(model_dir):
    # Two launches queued ahead of the replayed one: more KV reserved ahead, kills a launch later.
    reqs = [(str(i), p, greedy(3 + 2 * i)) for i, p in enumerate(PROMPTS)]
    want = tokens(run(engine(model_dir, run_ahead=False), reqs))
    eng = engine(model_dir, run_ahead_depth=2)
    assert tokens(run(eng, reqs)) == want
    assert eng.ahead.runs >= 1 and eng.ahead.total_launches >= 6
    with pytest.raises(ValueError, match="run_ahead_depth"):
        engine(model_dir, run_ahead_depth=4)


def _exit_launches(eng):
    """Wrap the lanes' read-back: request id -> launches (in order) at which its lane exited."""
    seen, result = {}, eng.ahead.lanes.result

    def record(index):
        rec = result(index)
        for j, rid in enumerate(eng.ahead.lane_rids[: len(rec)]):
            if rid >= 0 and rec[j, 3] and rec[j, 1]:
                seen.setdefault(eng.by_rid[int(rid)].request_id, []).append(eng.ahead.runs * 10_000 + index)
        return rec

    eng.ahead.lanes.result = record
    return seen


def test_exit_steps_count_the_launches_where_a_row_exited(model_dir):
    # Full depth, started together: the lanes exit in the same launches, one in four; the others
    # skip the lm_head. The counter equals the launches whose records show an exit.
    reqs = [(str(i), p, greedy(6, threshold=1.0)) for i, p in enumerate(PROMPTS[:2])]
    eng = engine(model_dir)
    exits = _exit_launches(eng)
    run(eng, reqs)
    launches = set().union(*map(set, exits.values()))
    assert eng.ahead.exit_launches == len(launches) >= 5
    assert eng.ahead.total_launches >= eng.num_loops * eng.ahead.exit_launches - eng.num_loops


@pytest.mark.parametrize("case", ["seated", "joined"])
def test_newcomers_with_cached_prompts_ride_from_their_cache_hits(model_dir, case):
    # A 20-token newcomer (a step holds 16) whose first 16 tokens are cached takes its hits and its lane
    # computes the other 4: seated at once in a free lane, or, with every lane busy, after the host caught
    # up and doubled the lanes. Either way: the tokens of a cold host-path run.
    cached = list(range(40, 58))  # 18 tokens: four 4-token blocks cached by the first request
    warm = ("warm", cached, greedy(2))
    late = ("late", cached + [2, 3], greedy(4))
    prompts = PROMPTS if case == "seated" else [*PROMPTS, [60, 61, 62]]  # 3 of 4 lanes busy, or all 4
    early = [(str(i), p, greedy(8)) for i, p in enumerate(prompts)]
    cold = engine(model_dir, run_ahead=False, block_size=4, enable_prefix_caching=False)
    want = tokens(run(cold, [warm] + early + [late]))
    eng = engine(model_dir, block_size=4)
    got = tokens(run(eng, [warm]))

    def add_late(e):
        if e.ahead.active and e.ahead.launched >= 3:
            e.add_request(*late)
            return True
        return False

    done = run(eng, early, hook=add_late)
    got.update(tokens(done))
    assert got == want
    assert done["late"].cached_tokens == 16
    assert eng.ahead.total_riders == 1 and eng.ahead.hand_backs == 0
    assert eng.ahead.catch_ups == (0 if case == "seated" else 1)


def test_grammar_masks_are_applied_in_the_lanes_at_full_depth(model_dir):
    # JSON and regex requests at full depth (their next token's bitmask reaches the device in time) run
    # ahead, one of them riding in mid-run; a grammar request that may exit after its first loop stays
    # host-driven. Tokens equal the host path's and every output matches its grammar.
    import json
    import re

    from ouro_fast.engine.structured import StructuredOutput

    n = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"n": n}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    js = StructuredOutput("json", json.dumps(schema))
    rx = StructuredOutput("regex", "[a-c]{3}-[0-9]{2}")

    def params(s, threshold=1.0, **kw):
        return SamplingParams(max_tokens=24, temperature=0, exit_threshold=threshold, structured=s, **kw)

    early = [("j", PROMPTS[0], params(js)), ("r", PROMPTS[1], params(rx)), ("f", PROMPTS[2], greedy(6, 1.0))]
    late = ("late", [9, 8, 7, 6], params(js))
    host = run(engine(model_dir, run_ahead=False), early + [late])
    eng = engine(model_dir)
    seen = []

    def add_late(e):
        if e.ahead.active and e.ahead.launched >= 2:
            e.add_request(*late)
            seen.append(e.ahead.lanes.masking)
            return True
        return False

    done = run(eng, early, hook=add_late)
    assert tokens(done) == tokens(host)
    assert seen == [True] and eng.ahead.total_riders == 1 and eng.ahead.hand_backs == 0
    assert [done[k].finish_reason for k in ("j", "r", "late")] == ["stop"] * 3
    for k in ("j", "late"):
        assert json.loads(done[k].request.text).keys() == {"n"}
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", done["r"].request.text)
    # Early exit after the first loop: the mask could not reach the device in time, so it never rides.
    eng = engine(model_dir)
    reqs = [("e", PROMPTS[0], params(rx, threshold=0.5, min_loops=1))]
    assert tokens(run(eng, reqs)) == tokens(run(engine(model_dir, run_ahead=False), reqs))
    assert eng.ahead.runs == 0


def test_a_grammar_fill_is_waited_for_only_at_the_launch_where_its_token_may_sample(model_dir, monkeypatch):
    # The worker fills bitmasks while the owner launches on. Here a fill ends only once the owner waits for
    # it: launches still go out while it is in flight, and each bitmask reaches the device before its lane
    # samples (the host path's tokens).
    import json
    import threading

    from ouro_fast.engine.gpu.runahead import RunAhead
    from ouro_fast.engine.structured import Grammars, StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    js = StructuredOutput("json", json.dumps(schema))
    params = SamplingParams(max_tokens=12, temperature=0, structured=js)
    reqs = [(f"j{i}", p, params) for i, p in enumerate(PROMPTS)]
    host = run(engine(model_dir, run_ahead=False), reqs)
    fill, wait, masks = Grammars._fill_rows, Grammars.wait_fill, RunAhead._masks
    waited, went_on = threading.Event(), []

    def held_fill(self, matchers, rids):
        assert waited.wait(60)
        waited.clear()
        fill(self, matchers, rids)

    def wait_fill(self):
        if self._fill is not None:
            waited.set()
        wait(self)

    def spied_masks(self):
        masks(self)
        went_on.append(not self.scheduler.sampling.grammars.fill_done())  # launched with a fill in flight

    monkeypatch.setattr(Grammars, "_fill_rows", held_fill)
    monkeypatch.setattr(Grammars, "wait_fill", wait_fill)
    monkeypatch.setattr(RunAhead, "_masks", spied_masks)
    eng = engine(model_dir)
    done = run(eng, reqs)
    assert tokens(done) == tokens(host) and eng.ahead.runs == 1
    assert sum(went_on) >= 3


def test_lanes_sharing_a_cached_prefix_read_it_once_with_the_same_tokens(model_dir, monkeypatch):
    # Three requests hit one cached 64-position prefix and decode together in lanes; a fourth hits it too
    # and rides in mid-run. The class's prefix goes through the shared-prefix attention, once per loop
    # plane, in the lanes' launches and in the launches that carry the rider (the step graph's attention),
    # with the tokens and exits of lanes that read it each (cascade_attention=False). Some tokens exit
    # early, others run all four loops.
    from ouro_fast.engine.gpu import prefix_groups
    from ouro_fast.kernels import cascade_attention

    monkeypatch.setattr(prefix_groups, "MIN_SAVED_POSITIONS", 1)
    launches = []
    launch = cascade_attention.launch_prefix_partials

    def spy(q, kc, vc, positions, cos_sin, tables, lens, tok_off, prefixes, *args):
        # Under CUDA graphs launches are captured, not run here: only eager (CPU) launches are seen.
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            grouped = prefixes.row_group[: lens.shape[0]]
            if bool(((grouped >= 0) & (lens == 1)).any()):  # a launch where some lane has a group
                launches.append("step graph" if cos_sin is None else "lanes")
        return launch(q, kc, vc, positions, cos_sin, tables, lens, tok_off, prefixes, *args)

    monkeypatch.setattr(cascade_attention, "launch_prefix_partials", spy)
    prefix = [(7 * i) % 250 + 3 for i in range(64)]
    reqs = [(f"r{i}", prefix + [200 + i, 31 * i + 5], greedy(8)) for i in range(3)]
    late = ("late", prefix + [77, 78, 79], greedy(5))

    def go(cascade):
        eng = engine(model_dir, cascade_attention=cascade)
        run(eng, [("warm", prefix + [9], greedy(1))])  # caches the prefix's four blocks
        launches.clear()
        variants = []  # each step's choice: with the prefix launch or without
        run_shape = eng.runner.run_shape

        def spied_run_shape(shape, casc=False):
            variants.append(casc)
            return run_shape(shape, casc)

        monkeypatch.setattr(eng.runner, "run_shape", spied_run_shape)

        def add_late(e):
            if e.ahead.active and e.ahead.launched >= 3:
                e.add_request(*late)
                return True
            return False

        done = run(eng, reqs, hook=add_late)
        assert all(o.cached_tokens == 64 for o in done.values())
        assert eng.ahead.total_riders == 1
        return tokens(done), eng.ahead.lanes.cascade_launches, set(launches), any(variants)

    got, lane_launches, paths, rider_casc = go(True)
    expect, none, no_paths, no_casc = go(False)
    assert got == expect
    assert lane_launches > 0 and none == 0
    assert rider_casc and not no_casc  # the rider's launches took the step variant with the prefix launch
    if not torch.cuda.is_available():  # on a GPU the launches are graph replays, which call no Python
        assert paths == {"lanes", "step graph"} and not no_paths


def test_steps_without_shared_prefixes_run_no_prefix_launch(model_dir, monkeypatch):
    # Host-driven prompt steps and riders beside lanes of no class take the step variant without the
    # shared-prefix launch: with the option on, a workload with no shared prefix never launches it.
    from ouro_fast.kernels import cascade_attention

    calls = []
    launch = cascade_attention.launch_prefix_partials

    def spy(*args):
        calls.append(1)
        return launch(*args)

    monkeypatch.setattr(cascade_attention, "launch_prefix_partials", spy)
    eng = engine(model_dir, cascade_attention=True)
    calls.clear()  # start-up compiles (and on a GPU captures) both variants
    variants = []
    run_shape = eng.runner.run_shape

    def spied_run_shape(shape, casc=False):
        variants.append(casc)
        return run_shape(shape, casc)

    monkeypatch.setattr(eng.runner, "run_shape", spied_run_shape)
    reqs = [(f"r{i}", [(13 * i + 7 * j) % 250 + 3 for j in range(20 + i)], greedy(6)) for i in range(3)]

    def add_late(e):
        if e.ahead.active and e.ahead.launched >= 2:
            e.add_request("late", [(11 * j) % 240 + 5 for j in range(9)], greedy(3))
            return True
        return False

    done = run(eng, reqs, hook=add_late)
    assert len(done) == 4 and eng.ahead.total_riders == 1 and eng.ahead.rider_launches >= 1
    assert variants and not any(variants) and eng.ahead.lanes.cascade_launches == 0
    assert not calls  # graph replays (GPU) call no Python; eager steps (CPU) would call it


def test_a_lane_that_a_new_request_takes_leaves_its_prefix_class(model_dir, monkeypatch):
    # Three lanes share a cached prefix; the first ends early and a request with an unrelated short prompt
    # rides into its lane under the same rid (rids are reused last-freed first), with no launch between
    # that saw the lane empty. It must not join the old class, whose prefix blocks are not its own: every
    # token equals the run without shared-prefix attention.
    from ouro_fast.engine.gpu import prefix_groups

    monkeypatch.setattr(prefix_groups, "MIN_SAVED_POSITIONS", 1)
    prefix = [(5 * i) % 240 + 4 for i in range(64)]
    reqs = [(f"r{i}", prefix + [90 + i], greedy(3 if i == 0 else 10)) for i in range(3)]
    other = ("x", [(11 * i) % 230 + 6 for i in range(10)], greedy(6))

    def go(cascade):
        eng = engine(model_dir, cascade_attention=cascade)
        run(eng, [("warm", prefix + [9], greedy(1))])
        rids = {}

        def add_other(e):
            if "r0" in e.requests:
                rids["r0"] = e.requests["r0"].rid
                return False
            if not e.ahead.active:
                return False
            e.add_request(*other)
            rids["x"] = e.requests["x"].rid
            return True

        done = run(eng, reqs, hook=add_other)
        return tokens(done), eng.ahead.lanes.cascade_launches, eng.ahead.total_riders, rids

    got, launches, riders, rids = go(True)
    expect, *_ = go(False)
    assert riders == 1 and rids["x"] == rids["r0"]
    assert got == expect and launches > 0
