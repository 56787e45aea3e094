"""OuroTokenizer: a thin wrapper over a directory's tokenizer.json (HF layout).

Works with the small tokenizer shipped in ouro_fast/model/assets/ and with a real
Ouro-1.4B download alike. Only the `tokenizers` library is needed (no transformers).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from .chat_template import CHATML, ChatTemplate

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
# Longer inputs (characters, or ids) go through the batch entry points, which release the GIL while they
# run: a long text tokenized in a worker thread then leaves the event loop free.
_RELEASE_GIL_ABOVE = 1024


class OuroTokenizer:
    """Byte-level BPE tokenizer with Ouro's special tokens and the checkpoint's chat template.

    Ids are those of tokenizer.json; `vocab_size` is the tokenizer's own count,
    which may be smaller than the model's vocab_size (the sampler masks the rest).
    """

    def __init__(self, raw: Tokenizer, config: dict | None = None, chat_template: ChatTemplate | None = None):
        self.raw = raw
        config = config or {}
        self.vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int = self._resolve(config.get("eos_token"), "eos_token")
        self.bos_token_id: int = self._resolve(config.get("bos_token"), "bos_token")
        self.im_start_id: int | None = raw.token_to_id(IM_START)
        self.im_end_id: int | None = raw.token_to_id(IM_END)
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in raw.get_added_tokens_decoder().items() if tok.special
        )
        self.chat_template = chat_template or ChatTemplate(CHATML)

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> OuroTokenizer:
        """Load tokenizer.json (and tokenizer_config.json when present) from a directory, with the
        directory's chat template or `chat_template` (a file's path or the template text)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        raw = Tokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        return cls(raw, config, ChatTemplate.from_dir(path, chat_template))

    @classmethod
    def default(cls) -> OuroTokenizer:
        """The small tokenizer shipped with ouro_fast (1024 tokens)."""
        return cls.from_dir(ASSETS_DIR)

    def _resolve(self, entry: str | dict | None, what: str) -> int:
        # tokenizer_config.json writes a token as a string or as {"content": ...}.
        name = entry.get("content") if isinstance(entry, dict) else entry
        token_id = self.raw.token_to_id(name) if isinstance(name, str) else None
        if token_id is None:
            token_id = self.raw.token_to_id(ENDOFTEXT)
        if token_id is None:
            raise ValueError(f"cannot find the {what} ({name!r} or {ENDOFTEXT!r}) in the tokenizer")
        return token_id

    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers: a text of n characters has at least
        n / max_token_chars() tokens, a bound that needs no tokenizing."""
        vocab = self.raw.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8")) for t in vocab), default=1)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; no BOS is added; special-token text becomes the special token."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # JSON can carry a lone surrogate ("\ud800"): no UTF-8 text holds one.
            raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None
        if len(text) > _RELEASE_GIL_ABOVE:
            return self.raw.encode_batch([text], add_special_tokens=False)[0].ids
        return self.raw.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; an incomplete UTF-8 sequence decodes to U+FFFD."""
        if len(ids) > _RELEASE_GIL_ABOVE:
            return self.raw.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.raw.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        """The conversation as prompt text, by the checkpoint's chat template (ChatTemplateError, a
        ValueError, when the messages or the template are wrong). Content may be a str or a list of
        OpenAI text parts ({"type": "text", "text": str})."""
        return self.chat_template.render(messages, add_generation_prompt, continue_final_message, **kwargs)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token the chat template closes an assistant turn with (ChatML: <|im_end|>), as a
        tuple of at most one id: chat replies stop there."""
        ids = self.raw.encode(self.chat_template.end_of_turn(), add_special_tokens=False).ids
        return (ids[0],) if ids and ids[0] in self.special_ids else ()
