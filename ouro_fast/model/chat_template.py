"""A checkpoint's chat template, rendered as transformers renders it: Jinja2 in a sandbox.

The template comes from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` in the
checkpoint directory, or from an override (a file, or the template text itself). Rendering takes the
same variables transformers passes (messages, add_generation_prompt, the special tokens, extra
keyword arguments), so a real checkpoint is prompted as it was trained.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# ChatML, for checkpoints that ship no template (Ouro's own is ChatML).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
_SENTINEL = "\x00ouro-fast-end-of-turn\x00"


class ChatTemplateError(ValueError):
    """A conversation the template cannot render, or a template that fails: a client error."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: JSON without HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """Renders OpenAI-style messages into the prompt text the checkpoint was trained on."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, path: str | Path, override: str | None = None) -> ChatTemplate:
        """The directory's template (chat_template.jinja, else tokenizer_config.json's), or ChatML when it
        ships none; `override` is a template file's path or the template text itself."""
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        specials = {
            k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        specials = {k: v for k, v in specials.items() if v is not None}
        if override is not None:
            source = template_source(override)
        elif (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            source = _named_default(config.get("chat_template")) or CHATML
        return cls(source, specials)

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        """The prompt text. continue_final_message: the last message stays open (no end of turn), so the
        model continues it; it excludes add_generation_prompt. kwargs reach the template as variables."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
        messages = normalize_messages(messages)
        variables = {**self.special_tokens, **kwargs}
        try:
            text = self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if continue_final_message:
            final = messages[-1]["content"]
            if not final or final not in text:
                raise ChatTemplateError(
                    "continue_final_message needs a final message whose text the template keeps"
                )
            text = text[: text.rindex(final) + len(final)]
        return text

    def end_of_turn(self) -> str:
        """The text the template puts right after an assistant message's content ('' when none)."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except ChatTemplateError:
            return ""
        cut = text.rfind(_SENTINEL)
        return text[cut + len(_SENTINEL) :] if cut >= 0 else ""


def normalize_messages(messages: object) -> list[dict]:
    """Messages with their content as one string (OpenAI text parts joined, null as ''), roles checked."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    return [_normalize(i, m) for i, m in enumerate(messages)]


def _normalize(i: int, message: object) -> dict:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise ChatTemplateError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None and role in ("assistant", "tool"):
        content = ""  # an assistant turn that only called tools
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ChatTemplateError(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise ChatTemplateError(f"messages[{i}].content must be a string, got {type(content).__name__}")
    return {**message, "content": content}


def _token_text(entry) -> str | None:
    # tokenizer_config.json writes a token as a string or as {"content": ...}.
    return entry.get("content") if isinstance(entry, dict) else entry if isinstance(entry, str) else None


def _named_default(entry) -> str | None:
    # A list of named templates: the one named "default", as transformers picks it.
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        return named.get("default")
    return entry if isinstance(entry, str) else None


def template_source(override: str) -> str:
    """The template text an override names: a file's content, or the override itself when it is a template."""
    path = Path(override)
    try:
        if len(override) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    if "{{" not in override and "{%" not in override:
        raise ValueError(f"--chat-template {override!r} is neither a readable file nor a Jinja template")
    return override
