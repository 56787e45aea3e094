"""IncrementalDetokenizer against the simple reference: decode all output ids at once, cut at the first stop.

Every check runs with the compiled core and its uncompiled twin, on the shipped byte-level
tokenizer and on a small one trained here whose merges cover CJK and emoji.
"""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ouro_fast.core_py.detok as twin_core
from ouro_fast.core import detok as compiled_core
from ouro_fast.engine.detokenizer import IncrementalDetokenizer

ASSETS = Path(__file__).resolve().parent.parent / "ouro_fast" / "model" / "assets" / "tokenizer.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MULTIBYTE = ["é", "ü", "中", "文", "語", "€", "😀", "🎉", "👍🏽", "𝄞"]
ALPHABET = "ab xyz.,\n" + "".join(MULTIBYTE)
REPLACEMENT = "\ufffd"
CORES = {"compiled": compiled_core, "twin": twin_core}


def train_tokenizer() -> Tokenizer:
    """A ~500-token byte-level BPE with the three ChatML specials at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [
        "hello",
        "world",
        "the",
        "quick",
        "fox",
        "中文",
        "测试",
        "你好",
        "世界",
        "😀",
        "🎉",
        "👍🏽",
        "café",
    ]
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(i % 9 + 3)) for i in range(400)]
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def byte_level_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE spells it with (GPT-2's table)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    table = {b: chr(b) for b in kept}
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


@pytest.fixture(scope="module", params=["shipped", "trained"])
def tok(request) -> Tokenizer:
    if request.param == "shipped":
        assert ASSETS.is_file(), "the shipped tokenizer is missing"
        tok = Tokenizer.from_file(str(ASSETS))
    else:
        tok = train_tokenizer()
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    return tok


@pytest.fixture(scope="module")
def byte_ids(tok) -> list[int]:
    ids = [tok.token_to_id(c) for c in byte_level_chars().values()]
    assert None not in ids
    return [tok.token_to_id(byte_level_chars()[b]) for b in range(256)]


def token_stream(tok: Tokenizer, byte_ids: list[int], max_chunks: int = 12):
    """Ids mixing encoded text, characters split into single-byte tokens, any id, and specials."""
    text = st.text(alphabet=ALPHABET, max_size=6).map(lambda s: tok.encode(s).ids)
    split = st.sampled_from(MULTIBYTE).map(lambda c: [byte_ids[b] for b in c.encode()])
    partial = st.sampled_from(MULTIBYTE).flatmap(
        lambda c: st.integers(1, len(c.encode()) - 1).map(lambda n: [byte_ids[b] for b in c.encode()[:n]])
    )
    any_id = st.integers(0, tok.get_vocab_size() - 1).map(lambda i: [i])
    special = st.sampled_from([0, 1, 2]).map(lambda i: [i])
    chunk = st.one_of(text, split, partial, any_id, special)
    return st.lists(chunk, max_size=max_chunks).map(lambda cs: [i for c in cs for i in c])


def split_steps(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """ids cut into consecutive steps of the given sizes (cycled); some steps may be empty."""
    sizes = sizes if any(sizes) else [*sizes, 1]
    steps, at, n = [], 0, 0
    while at < len(ids):
        size = sizes[n % len(sizes)]
        steps.append(ids[at : at + size])
        at, n = at + size, n + 1
    return steps


def reference(tok, ids: list[int], skip: bool, stop: list[str]) -> tuple[str, bool]:
    """decode(ids) cut before the first stop string to appear (the shortest prefix holding one;
    of the stops ending there, the longest), and whether one appeared."""
    full = tok.decode(ids, skip_special_tokens=skip)
    stop = [s for s in stop if s]
    for end in range(len(full) + 1):
        ending = [s for s in stop if full.endswith(s, 0, end)]
        if ending:
            return full[: end - max(map(len, ending))], True
    return full, False


def run(tok, core, prompt, steps, skip, stop):
    """Feed one request step by step; returns its [(delta, stop_hit)], the flush and text()."""
    detok = IncrementalDetokenizer(tok, core)
    detok.add(7, prompt, skip_special_tokens=skip, stop=stop)
    out = [detok.step({7: ids})[7] for ids in steps]
    flush = detok.finish(7)
    return out, flush, detok.text(7), detok.stopped(7)


def check_against_reference(out, flush, text, stopped, expected, hit):
    """Every emitted prefix is a prefix of the expected text, so no delta holds a U+FFFD the
    full decode lacks at that position and no part of a stop string is ever emitted."""
    emitted = ""
    for delta, _ in out:
        for j, ch in enumerate(delta):
            assert ch != "\ufffd" or expected[len(emitted) + j] == "\ufffd"
        emitted += delta
        assert expected.startswith(emitted)
    assert emitted + flush == expected == text
    assert stopped == hit
    flags = [h for _, h in out]
    assert flags == sorted(flags), "stop_hit never goes back to False"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_concatenate_to_full_decode(tok, byte_ids, data):
    ids = data.draw(token_stream(tok, byte_ids), label="ids")
    prompt = data.draw(token_stream(tok, byte_ids, max_chunks=4), label="prompt")
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5), label="sizes")
    steps = split_steps(ids, sizes)
    for skip in (True, False):
        expected, _ = reference(tok, ids, skip, [])
        event(f"U+FFFD in the text: {REPLACEMENT in expected}")
        runs = [run(tok, core, prompt, steps, skip, []) for core in CORES.values()]
        assert runs[0] == runs[1], "compiled and twin cores differ"
        check_against_reference(*runs[0], expected, False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_are_cut_and_never_emitted(tok, byte_ids, data):
    ids = data.draw(token_stream(tok, byte_ids), label="ids")
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5), label="sizes")
    skip = data.draw(st.booleans(), label="skip")
    full = tok.decode(ids, skip_special_tokens=skip)
    inside = st.integers(0, max(0, len(full) - 1)).flatmap(
        lambda at: st.integers(1, 6).map(lambda n: full[at : at + n])
    )
    stop = data.draw(st.lists(st.one_of(inside, st.text(ALPHABET, max_size=4)), max_size=3), label="stop")
    expected, hit = reference(tok, ids, skip, stop)
    event(f"stop hit: {hit}")
    runs = [run(tok, core, [], split_steps(ids, sizes), skip, stop) for core in CORES.values()]
    assert runs[0] == runs[1], "compiled and twin cores differ"
    check_against_reference(*runs[0], expected, hit)


class CountingTokenizer:
    """Only decode/decode_batch (no special-token table), counting batches and recording windows."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.batches: list[tuple[bool, list[list[int]]]] = []

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences, skip_special_tokens=True):
        self.batches.append((skip_special_tokens, [list(s) for s in sequences]))
        return self.tok.decode_batch(sequences, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("core", CORES.values(), ids=CORES.keys())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_one_step_batches_all_requests(tok, byte_ids, core, data):
    n = data.draw(st.integers(1, 6), label="requests")
    reqs = [
        (
            data.draw(token_stream(tok, byte_ids, max_chunks=8)),
            data.draw(st.booleans()),
            data.draw(st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=2)),
        )
        for _ in range(n)
    ]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, core)
    for key, (_, skip, stop) in enumerate(reqs):
        detok.add(key, [], skip_special_tokens=skip, stop=stop)
    emitted = [""] * n
    for t in range(max((len(ids) for ids, _, _ in reqs), default=0)):
        # Requests that have no token this step are left out of the update, as the engine does.
        updates = {k: ids[t : t + 1] for k, (ids, _, _) in enumerate(reqs) if t < len(ids)}
        before = len(counting.batches)
        results = detok.step(updates)
        assert list(results) == list(updates)
        new = counting.batches[before:]
        assert len(new) <= 2 and len({skip for skip, _ in new}) == len(new)
        for k, (delta, _) in results.items():
            emitted[k] += delta
    for key, (ids, skip, stop) in enumerate(reqs):
        expected, hit = reference(tok, ids, skip, stop)
        assert emitted[key] + detok.finish(key) == expected == detok.text(key)
        assert detok.stopped(key) == hit


@pytest.fixture(params=CORES.values(), ids=CORES.keys())
def core(request):
    return request.param


def test_split_character_is_held_until_complete(tok, byte_ids, core):
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, tok.encode("hi").ids)
    steps = [[byte_ids[b]] for b in "😀".encode()] + [tok.encode(" ok").ids]
    assert [detok.step({1: s})[1] for s in steps] == [("", False)] * 3 + [("😀", False), (" ok", False)]


def test_flush_emits_an_unfinished_character_as_decode_does(tok, byte_ids, core):
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [])
    ids = tok.encode("a").ids + [byte_ids[b] for b in "中".encode()[:2]]
    # The whole step waits: its new text ends inside a character.
    assert detok.step({1: ids})[1] == ("", False)
    assert detok.finish(1) == tok.decode(ids) == "a\ufffd"
    assert detok.finish(1) == "" and detok.step({1: ids})[1] == ("", False)


def test_leading_space_of_first_token_kept(tok, core):
    detok = IncrementalDetokenizer(tok, core)
    out = tok.encode(" world").ids
    detok.add(1, tok.encode("Hello").ids)
    assert detok.step({1: out})[1] == (" world", False) and tok.decode(out) == " world"


def test_prompt_ending_inside_a_character_does_not_leak_into_output(tok, byte_ids, core):
    """Output starting with continuation bytes decodes alone to U+FFFDs, not to the prompt's character."""
    zh = "中".encode()
    prompt = tok.encode("say").ids + [byte_ids[zh[0]]]
    out = [byte_ids[zh[1]], byte_ids[zh[2]], *tok.encode("b").ids]
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, prompt)
    text = "".join(detok.step({1: [i]})[1][0] for i in out) + detok.finish(1)
    assert text == tok.decode(out) == "\ufffd\ufffdb"


def test_stop_string_spanning_tokens(tok, core):
    ids = tok.encode("Hello world, stop here").ids
    assert all("o w" not in tok.decode([i]) for i in ids), "the stop string must span tokens"
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [], stop=["xyz", "o w"])
    out = [detok.step({1: [i]})[1] for i in ids]
    assert "".join(d for d, _ in out) == "Hell" and out[-1][1] and detok.stopped(1)
    assert detok.finish(1) == "" and detok.text(1) == "Hell"
    assert detok.step({1: ids})[1] == ("", True)


def test_stop_completed_first_wins_over_one_starting_earlier(tok, core):
    ids = tok.encode("a.a").ids
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [], stop=["a.a", "."])
    assert "".join(detok.step({1: [i]})[1][0] for i in ids) == "a" and detok.stopped(1)
    assert reference(tok, ids, True, ["a.a", "."]) == ("a", True)


def test_holdback_lags_by_longest_stop_minus_one(tok, core):
    ids = tok.encode("abcdefgh").ids
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [], stop=["zz", "qqqq"])
    emitted = "".join(detok.step({1: [i]})[1][0] for i in ids)
    assert emitted == "abcde" and detok.finish(1) == "fgh"


def test_stop_found_only_in_the_final_flush(tok, byte_ids, core):
    """Tokens held for an unfinished character are searched for stops when flushed."""
    ids = [*tok.encode("one").ids, *(byte_ids[b] for b in "中".encode()[:2])]
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [], stop=["e\ufffd"])
    assert "".join(detok.step({1: [i]})[1][0] for i in ids) == "on"
    assert not detok.stopped(1)
    assert detok.finish(1) == "" and detok.stopped(1) and detok.text(1) == "on"


def test_special_tokens_follow_skip_flag(tok, core):
    ids = [*tok.encode("a").ids, 2, *tok.encode(" b").ids, 0]
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [1], skip_special_tokens=True)
    detok.add(2, [1], skip_special_tokens=False)
    got = detok.step({1: ids, 2: ids})
    assert got == {1: ("a b", False), 2: ("a<|im_end|> b<|endoftext|>", False)}


def test_skipped_special_tokens_keep_the_window_small(tok, core):
    counting = CountingTokenizer(tok)
    counting.get_added_tokens_decoder = tok.get_added_tokens_decoder
    detok = IncrementalDetokenizer(counting, core)
    detok.add(1, [])
    detok.step({1: tok.encode("x").ids})
    for _ in range(300):
        assert detok.step({1: [0]})[1] == ("", False)
    assert detok.step({1: tok.encode(" y").ids})[1] == (" y", False)
    assert max(len(w) for _, ws in counting.batches for w in ws) <= 1 + len(tok.encode(" y").ids)


def test_bookkeeping_errors(tok, core):
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [], stop=["", "q"])
    with pytest.raises(ValueError):
        detok.add(1, [])
    assert detok.step({1: np.array(tok.encode("aq").ids)})[1] == ("a", True)
    detok.remove(1)
    detok.remove(1)
    assert 1 not in detok and len(detok) == 0
    with pytest.raises(KeyError):
        detok.step({1: [5]})
    state = core.DetokState([], 0, True, frozenset(), ())
    state.extend([5])
    with pytest.raises(ValueError):
        core.apply_decoded([state], [], False)


def test_include_stop_keeps_the_stop_string(tok, core):
    ids = tok.encode("Hello world, stop here").ids
    for include, want in ((False, "Hell"), (True, "Hello w")):
        detok = IncrementalDetokenizer(tok, core)
        detok.add(1, [], stop=["xyz", "o w"], include_stop=include)
        text = "".join(detok.step({1: [i]})[1][0] for i in ids) + detok.finish(1)
        assert text == want and detok.stopped(1)
    # Of two stops, the one completed first decides where the kept text ends.
    detok = IncrementalDetokenizer(tok, core)
    detok.add(1, [], stop=["a.a", "."], include_stop=True)
    assert "".join(detok.step({1: [i]})[1][0] for i in tok.encode("a.a").ids) == "a."
