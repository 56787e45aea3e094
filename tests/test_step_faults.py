"""Every accepted request ends, whatever fails and wherever in the step.

Each stage of the step raises for one request of a batch (engine/faults.py, test-only): a batch
stage ends the requests holding KV and spares the waiting one; a request stage ends that request
alone and the others finish with the tokens of a run without faults. Afterwards every KV block is
free and the engine serves a new request correctly. Real (not injected) failures of the same kinds
are covered too: a logits processor that cannot be built, a tokenizer that fails one request's decode.
"""

import numpy as np
import pytest
import torch

from ouro_fast.engine.detokenizer import IncrementalDetokenizer
from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.faults import BATCH_STAGES, REQUEST_STAGES, STAGES, InjectedFault, parse_faults
from ouro_fast.engine.logits_processors import LogitsProcessors
from ouro_fast.engine.sampling import SamplingParams

SEED = 77
PROMPTS = {"victim": [5, 6, 7, 8], "a": [100, 200, 300], "b": list(range(10, 30)), "waiting": [42] * 9}


def params(seed=None, n=12):
    # A penalty puts the request in the logits processors, where the sample stage runs.
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, seed=seed, repetition_penalty=1.2)


def serve(engine, prompts, victim_seed=None):
    """Submit (the victim with victim_seed), step until done; returns request id -> final output."""
    for key, prompt in prompts.items():
        engine.add_request(key, prompt, params(victim_seed if key == "victim" else None))
    finals = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "two finals for one request"
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finals) == set(prompts), "a request never ended"
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks, "KV blocks leaked"
    assert not engine.requests and engine.num_running == engine.num_waiting == 0
    return finals


def make(model_dir, faults=""):
    # Three rows: the victim, a and b run together, "waiting" waits for a slot.
    return Engine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=3, test_faults=faults))


@pytest.fixture(scope="module")
def clean(model_dir):
    """The same requests without faults: what every survivor must produce."""
    return {k: o.request.output_ids for k, o in serve(make(model_dir), PROMPTS).items()}


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_each_stage_ends_exactly_its_requests(model_dir, clean, stage):
    engine = make(model_dir, f"{stage}:{SEED}@2")
    finals = serve(engine, PROMPTS, victim_seed=SEED)
    assert engine.faults.fired[stage] == 1
    victim = finals["victim"]
    assert victim.finish_reason == "error" and f"injected {stage} fault" in victim.error
    assert victim.completion_tokens >= 2  # it failed mid-reply, at the armed token count
    failed = {k for k, o in finals.items() if o.finish_reason == "error"}
    if stage in BATCH_STAGES:
        assert failed == {"victim", "a", "b"}  # the requests holding KV
        assert engine.stats.failed_steps == 1
    else:
        assert failed == {"victim"}
        assert engine.stats.failed_steps == 0
        for key in ("a", "b"):
            assert finals[key].finish_reason == "length" and finals[key].request.output_ids == clean[key]
    waiting = finals["waiting"]
    assert waiting.finish_reason == "length" and waiting.request.output_ids == clean["waiting"]
    # The engine serves on: a new request gives the tokens it gives on a fresh engine.
    again = serve(engine, {"a": PROMPTS["a"]})
    assert again["a"].finish_reason == "length" and again["a"].request.output_ids == clean["a"]


@pytest.mark.parametrize("stage", REQUEST_STAGES)
def test_a_request_fault_at_its_first_token(model_dir, stage):
    engine = make(model_dir, f"{stage}:{SEED}@0")
    finals = serve(engine, {"victim": PROMPTS["victim"], "a": PROMPTS["a"]}, victim_seed=SEED)
    assert finals["victim"].finish_reason == "error" and finals["a"].finish_reason == "length"


def test_faults_are_off_by_default_and_a_bad_spec_is_refused(model_dir):
    engine = make(model_dir)
    assert not engine.faults.stages
    finals = serve(engine, {"victim": PROMPTS["victim"]}, victim_seed=SEED)
    assert finals["victim"].finish_reason == "length"
    for bad in ("execute", "7@3", "nowhere:7@3", "execute:x@1", "execute:7@-1"):
        with pytest.raises(ValueError, match="STAGE:SEED@TOKENS"):
            parse_faults(bad)
    with pytest.raises(ValueError, match="STAGE:SEED@TOKENS"):
        make(model_dir, "7@3")
    assert [(f.stage, f.seed, f.tokens) for f in parse_faults(" update:5@0, output:6@2 ")] == [
        ("update", 5, 0),
        ("output", 6, 2),
    ]


def test_a_failing_scheduler_ends_the_requests_holding_kv(model_dir, clean):
    """A real failure inside the scheduler (not the injector): the waiting request is spared."""
    engine = make(model_dir)
    for key, prompt in PROMPTS.items():
        engine.add_request(key, prompt, params())
    for _ in range(5):
        engine.step()
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (_ for _ in ()).throw(MemoryError("no room"))
    outs = engine.step()
    engine.scheduler.schedule = schedule
    assert sorted(o.request_id for o in outs if o.finished) == ["a", "b", "victim"]
    assert all("MemoryError: no room" in o.error for o in outs if o.finished)
    rest = [o for _ in range(200) for o in engine.step() if o.finished]
    assert [(o.request_id, o.request.output_ids) for o in rest] == [("waiting", clean["waiting"])]
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_a_logits_processor_that_cannot_be_built_fails_its_request_alone():
    proc = LogitsProcessors(capacity=4, num_slots=2, vocab=16, device="cpu")
    stop = frozenset()
    proc.add(0, SamplingParams(logit_bias={3: 5.0}), [1, 2], [], stop)
    proc.add(1, SamplingParams(logit_bias={40: 5.0}), [1, 2], [], stop)  # beyond the vocabulary
    logits = torch.zeros(2, 16)
    out = proc.apply(logits, np.array([0, 1]), np.array([0, 1]), np.zeros(4, np.int32))
    assert out[0, 3] == 5.0 and torch.equal(out[1], logits[1])
    assert list(proc.take_failed()) == [1] and proc.take_failed() == {}
    assert not proc.any(np.array([1]))  # it is processed no more


class PoisonDecoder:
    """A tokenizer whose decode of any window holding `poison` raises, or (broken_text) returns no text."""

    def __init__(self, poison: int, broken_text: bool = False):
        self.poison, self.broken_text = poison, broken_text

    def decode(self, ids, skip_special_tokens=True):
        if self.poison in ids:
            if self.broken_text:
                return None
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "poisoned")
        return "".join(chr(97 + i % 26) for i in ids)

    def decode_batch(self, sequences, skip_special_tokens=True):
        return [self.decode(ids, skip_special_tokens) for ids in sequences]


@pytest.mark.parametrize("broken_text", [False, True], ids=["decode", "stop_check"])
def test_a_request_whose_decode_fails_fails_alone(broken_text):
    detok = IncrementalDetokenizer(PoisonDecoder(99, broken_text))
    for key in (1, 2, 3):
        detok.add(key, [0, 1])
    failed = {}
    got = detok.step({1: [2, 3], 2: [99], 3: [4]}, failed)
    assert got == {1: ("cd", False), 3: ("e", False)}
    assert list(failed) == [2]
    assert detok.step({1: [5]}) == {1: ("f", False)}  # the others go on
    with pytest.raises((UnicodeDecodeError, TypeError)):
        detok.step({2: [6]})  # without `failed`, the error is raised


def test_the_injected_fault_names_stage_and_request(model_dir):
    engine = make(model_dir, f"detokenize:{SEED}@0")
    engine.add_request("x", [1, 2, 3], params(SEED))
    with pytest.raises(InjectedFault, match="injected detokenize fault for request x"):
        engine.detok.fault_hook(engine.requests["x"].rid)
