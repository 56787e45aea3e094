"""Build the small byte-level BPE tokenizer shipped in ouro_fast/model/assets/.

Run `python -m ouro_fast.model.build_tokenizer [OUT_DIR]` (default: the assets
folder). The output is a pure function of the corpus below and the tokenizers
version: training is single-threaded and ties between equally frequent pairs
are broken by the pair itself, so two runs give byte-identical files.

The vocabulary has exactly VOCAB_SIZE = 1024 entries: the three special tokens
at fixed ids 0, 1, 2, the 256 byte symbols, then 765 merges. The real Ouro
tokenizer (49,152 entries) uses the same scheme, so the engine treats both alike.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MODEL_MAX_LENGTH = 65536
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A looped language model runs the same
stack of layers several times, so that a small model can think for longer on a hard
token and stop early on an easy one. Each pass through the layers is called a loop.
When the exit gate is confident, the token leaves the loop and the next token starts.
Serving such a model well means keeping the accelerator busy: requests arrive at any
time, prompts have different lengths, and every sequence may exit at a different depth.
The scheduler groups rows by loop, the runner computes them, and the sampler picks the
next token. Good software is written for the people who read it after you have left.
It was the best of times, it was the worst of times, it was the age of wisdom, it was
the age of foolishness. Call me Ishmael. Some years ago, never mind how long precisely,
having little or no money in my purse, I thought I would sail about a little and see
the watery part of the world. In the beginning the universe was created; this has made
a lot of people very angry and been widely regarded as a bad move.
Questions and answers: What is the capital of France? Paris. How many legs does a
spider have? Eight. Who wrote "Pride and Prejudice"? Jane Austen. Why is the sky blue?
Because air scatters short wavelengths of sunlight more than long ones.
Please summarise the following paragraph in one sentence, then list three key points.
Thank you! I'd be happy to help with that. Here's what I found: the results suggest
that the method works, although the evidence isn't conclusive yet. Let's try again.
Weather report: cloudy in the morning, sunny in the afternoon, with a light breeze
from the west. Temperatures between 12 and 19 degrees. Tomorrow: rain, then clearing.
Recipe: mix 200 g of flour, 2 eggs and 300 ml of milk; rest the batter for 30 minutes,
then cook thin pancakes in a hot pan. Serve with lemon and sugar, or with cheese.
"""

_CODE = '''\
def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Request:
    def __init__(self, request_id: str, prompt: str, max_tokens: int = 16):
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output_ids: list[int] = []

    def is_finished(self) -> bool:
        return len(self.output_ids) >= self.max_tokens


for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

import torch
x = torch.randn(4, 8, dtype=torch.float32)
y = torch.nn.functional.softmax(x @ x.T, dim=-1)
assert y.shape == (4, 4)

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) {
        printf("%d: %s\\n", i, argv[i]);
    }
    return 0;
}

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
console.log(JSON.stringify({ items, total: items.length }));

SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name ORDER BY n DESC;
{"model": "ouro", "prompt": "Hello", "max_tokens": 32, "stream": true, "temperature": 0.0}
<html><body><p class="note">Hello, world!</p></body></html>
$ git commit -m "Fix the off-by-one error" && git push origin main
'''

_NUMBERS = """\
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 32 42 64 100 128 256 512 1024
2048 4096 65536 1000000 3.14159 2.71828 1.41421 -1 -0.5 1e-6 6.022e23 0x1F 0b1010 99.9%
2024-01-15 12:30:45 +01:00 $19.99 EUR 7.50 #1 No. 2 (3) [4] {5} 1/2 3/4 x^2 + y^2 = z^2
"""

_WORLD = """\
机器学习是人工智能的一个分支。今天天气很好，我们去公园散步吧。你好，世界！
日本語のテキストも少し含めます。こんにちは、元気ですか？ありがとうございます。
한국어 문장도 있습니다. 안녕하세요, 만나서 반갑습니다.
Ça va très bien, merci ! Der schnelle braune Fuchs springt über den faulen Hund.
¿Dónde está la biblioteca? Здравствуйте, как дела? Γειά σου κόσμε. مرحبا بالعالم
Emoji: 😀 😂 🚀 🎉 👍 ❤️ 🌍 🐍 🔥 ✨ — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ∞ ≈ ≠ ≤ ≥
<|im_start|>user
What is 2 + 2?<|im_end|>
<|im_start|>assistant
2 + 2 = 4.<|im_end|>
<|endoftext|>
"""

CORPUS = _ENGLISH + _CODE + _NUMBERS + _WORLD


def train():
    """Train the BPE on CORPUS; returns a tokenizers.Tokenizer with VOCAB_SIZE entries."""
    # Single-threaded training: no dependence on thread scheduling.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per example, so that no merge spans a line break of the corpus.
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        got = tok.get_vocab_size()
        raise RuntimeError(f"trained {got} tokens, expected {VOCAB_SIZE}: enlarge the corpus")
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"{name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """tokenizer_config.json as transformers' PreTrainedTokenizerFast expects it."""
    eot = SPECIAL_TOKENS[0]
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, name in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": eot,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eot,
        "model_max_length": model_max_length,
        "pad_token": eot,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": eot,
    }


def special_tokens_map() -> dict:
    eot = SPECIAL_TOKENS[0]
    return {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": eot,
        "eos_token": eot,
        "pad_token": eot,
        "unk_token": eot,
    }


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out_dir: Path = ASSETS_DIR) -> list[Path]:
    """Write the five tokenizer files into out_dir; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train()
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    tok.model.save(str(out_dir))  # vocab.json + merges.txt
    _dump(out_dir / "tokenizer_config.json", tokenizer_config())
    _dump(out_dir / "special_tokens_map.json", special_tokens_map())
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
    return [out_dir / n for n in names]


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS_DIR):
        print(p)
