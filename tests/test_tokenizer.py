"""The shipped byte-level BPE tokenizer and the OuroTokenizer wrapper."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest

from ouro_fast.model import build_tokenizer
from ouro_fast.model.tokenizer import ASSETS_DIR, OuroTokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # tabs\tand  double  spaces\n",
    "机器学习是人工智能的一个分支。日本語、한국어",
    "emoji 😀🚀👍🏽 ❤️ and a flag 🇫🇷",
    "mixed: café naïve Ωmega 3.14159 — “quotes” <b>tags</b> 😂中",
    "",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tok() -> OuroTokenizer:
    return OuroTokenizer.default()


def test_special_ids_are_fixed(tok):
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert (tok.bos_token_id, tok.eos_token_id, tok.im_start_id, tok.im_end_id) == (0, 0, 1, 2)
    assert tok.special_ids == {0, 1, 2}


def test_vocab_size_and_byte_alphabet(tok):
    assert tok.vocab_size == build_tokenizer.VOCAB_SIZE == 1024
    vocab = tok.raw.get_vocab()
    assert sorted(vocab.values()) == list(range(1024))
    # Every byte has its own symbol, so any text is encodable without <unk>.
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(ByteLevel.alphabet()) <= set(vocab)
    merges = (ASSETS_DIR / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(merges) == 1 + 1024 - 3 - 256  # header line + one merge per learned token


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert not set(ids) & tok.special_ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_merges_compress_english(tok):
    text = "The scheduler groups rows by loop, the runner computes them."
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_special_text_is_parsed_as_special(tok):
    text = "before<|im_end|>after <|im_start|>user\nhi<|endoftext|>"
    ids = tok.encode(text)
    assert ids.count(2) == 1 and ids.count(1) == 1 and ids.count(0) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=True) == "beforeafter user\nhi"
    # No BOS is added.
    assert tok.encode("x")[0] != tok.bos_token_id


def test_decode_batch_matches_decode(tok):
    batch = [tok.encode(t) for t in TEXTS]
    assert tok.raw.decode_batch(batch) == [tok.decode(ids) for ids in batch]


def test_chat_template_shape(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == text.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_chat_template_matches_shipped_jinja(tok):
    # The Jinja template in tokenizer_config.json (what transformers renders) and ours agree.
    config = json.loads((ASSETS_DIR / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(config["chat_template"])
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "line1\nline2"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "again"},
    ]
    for gen in (True, False):
        expected = template.render(messages=messages, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], "messages[0] must be an object"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], "messages[1].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], "content[0]"),
    ],
)
def test_chat_template_validation(tok, messages, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        tok.apply_chat_template(messages)


def test_encode_rejects_non_text(tok):
    with pytest.raises(ValueError):
        tok.encode([1, 2])


def test_from_dir_and_fallbacks(tmp_path):
    shutil.copy(ASSETS_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    # Without tokenizer_config.json, bos/eos fall back to <|endoftext|>.
    tok = OuroTokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 0, 1024)
    # A config naming <|im_end|> as eos (as some Ouro revisions do), in the dict form.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert OuroTokenizer.from_dir(tmp_path).eos_token_id == 2
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        OuroTokenizer.from_dir(tmp_path / "nowhere")


def test_build_is_deterministic(tmp_path):
    paths = build_tokenizer.build(tmp_path)
    for path in paths:
        assert path.read_bytes() == (ASSETS_DIR / path.name).read_bytes(), path.name


def test_lone_surrogate_is_a_value_error():
    # JSON can carry "\ud800"; no UTF-8 text holds it, and tokenizers would raise TypeError.
    with pytest.raises(ValueError, match="not valid Unicode"):
        OuroTokenizer.default().encode("a\ud800b")
