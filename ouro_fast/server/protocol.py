"""The OpenAI wire format, in one place: request validation and response shapes.

Every client mistake becomes an ApiError (an HTTP 4xx in the OpenAI error shape,
naming the offending field); nothing here touches the engine. Validation is strict:
an unknown field, or a known one asking for something ouro_fast does not do
(n > 1, logprobs, penalties, ...), is a 400 rather than silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import ujson

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 1e6  # the engine keeps it as float32: bound it well inside that range
_INT32_MAX = (1 << 31) - 1
_MAX_REQUEST_ID = 4096


class ApiError(Exception):
    """An error answered as HTTP `status` with body {"error": {message, type, param, code}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "timeout_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know of the served model; fixed once the engine is ready."""

    names: tuple[str, ...]
    root: str  # the checkpoint directory (clients load the tokenizer from it)
    max_model_len: int
    max_request_tokens: int  # prompt + max_tokens limit of one request
    vocab_limit: int  # token ids must be below this
    num_loops: int
    # What closes an assistant turn in the chat template: chat replies stop there.
    end_of_turn_ids: tuple[int, ...] = ()
    # Text longer than this cannot fit max_request_tokens, whatever it holds.
    max_prompt_chars: int = 1 << 62
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str
    prompt: str | list[int]  # text (chat: the templated conversation) or token ids
    options: dict  # SamplingParams keyword arguments, max_tokens excluded
    max_tokens: int | None  # None: whatever room the context leaves (chat default)
    stream: bool
    include_usage: bool


# ---- JSON in -------------------------------------------------------------------


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying why not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(None, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise bad(None, "the request body is empty; expected a JSON object")
    try:
        value = ujson.loads(text)
    except (ValueError, OverflowError, RecursionError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    # An int is always finite; math.isfinite would convert it to float and overflow past ~1e308.
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    x = body.get(name)
    if x is not None and not (_is_int(x) and lo <= x <= hi):
        raise bad(name, f"{name} must be an integer in [{lo}, {hi}], got {_show(x)}")
    return x


def _real(body: dict, name: str, lo: float, hi: float) -> float | None:
    x = body.get(name)
    if x is not None and not (_is_real(x) and lo <= x <= hi):
        raise bad(name, f"{name} must be a number in [{lo:g}, {hi:g}], got {_show(x)}")
    return x


def _bool(body: dict, name: str) -> bool | None:
    x = body.get(name)
    if x is not None and not isinstance(x, bool):
        raise bad(name, f"{name} must be true or false, got {_show(x)}")
    return x


def _show(x: object) -> str:
    text = ujson.dumps(x, ensure_ascii=True) if not isinstance(x, float) else repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


# Fields whose only accepted values are these "off" values (null is always accepted).
_NEUTRAL = {
    "n": (1,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "min_tokens": (0,),
    "min_p": (0.0,),
    "length_penalty": (1.0,),
    "use_beam_search": (False,),
    "logit_bias": ({},),
}
_NEUTRAL_COMPLETION = {"logprobs": (), "echo": (False,), "best_of": (1,), "suffix": ()}
_NEUTRAL_CHAT = {
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
}
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "stream", "stream_options", "user",
    "min_loops", "max_loops", "exit_threshold",
}  # fmt: skip
_COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_NEUTRAL) | set(_NEUTRAL_COMPLETION)
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL) | set(_NEUTRAL_CHAT)
_CHAT_FIELDS |= {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}


def _is_neutral(x: object, allowed: tuple) -> bool:
    if x is None:
        return True
    for a in allowed:
        if isinstance(a, bool):
            if x is a:
                return True
        elif isinstance(a, (int, float)):
            if _is_real(x) and x == a:
                return True
        elif type(x) is type(a) and x == a:
            return True
    return False


def _check_fields(body: dict, known: set[str], neutral: dict) -> None:
    for name in body:
        if name not in known:
            raise bad(name, f"unknown field {_show(name)}")
    for name, allowed in neutral.items():
        if name in body and not _is_neutral(body[name], allowed):
            shown = " or ".join(_show(a) for a in (None, *allowed))
            raise bad(name, f"{name} is not supported: it may only be {shown}, got {_show(body[name])}")


def _model(body: dict, info: ModelInfo) -> str:
    model = body.get("model")
    if model is None:
        return info.names[0]
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, got {_show(model)}")
    if model not in info.names:
        raise ApiError(404, f"the model {_show(model)} does not exist", param="model", code="model_not_found")
    return model


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", f"stream_options must be an object, got {_show(opts)}")
    for key, value in opts.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise bad("stream_options", f"unknown field stream_options.{key}")
        if not isinstance(value, bool) and value is not None:
            raise bad("stream_options", f"stream_options.{key} must be true or false, got {_show(value)}")
    if opts.get("continuous_usage_stats"):
        raise bad("stream_options", "stream_options.continuous_usage_stats is not supported")
    return stream, bool(opts.get("include_usage"))


def _options(body: dict, info: ModelInfo) -> dict:
    """SamplingParams keyword arguments (max_tokens excluded); absent fields keep its defaults."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", f"user must be a string, got {_show(body['user'])}")
    opts: dict = {}
    for name, value in (
        ("temperature", _real(body, "temperature", 0.0, MAX_TEMPERATURE)),
        ("top_p", _real(body, "top_p", 0.0, 1.0)),
        ("top_k", _int(body, "top_k", -1, _INT32_MAX)),
        ("seed", _int(body, "seed", 0, (1 << 63) - 1)),
        ("ignore_eos", _bool(body, "ignore_eos")),
        ("skip_special_tokens", _bool(body, "skip_special_tokens")),
        ("min_loops", _int(body, "min_loops", 1, info.num_loops)),
        ("max_loops", _int(body, "max_loops", 1, info.num_loops)),
        ("exit_threshold", _real(body, "exit_threshold", 0.0, 1.0)),
    ):
        if value is not None:
            opts[name] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise bad("stop", f"stop must be a non-empty string or a list of them, got {_show(stop)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        opts["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        ok = isinstance(ids, list) and all(_is_int(t) and 0 <= t <= _INT32_MAX for t in ids)
        if not ok or len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                        f"token ids, got {_show(ids)}")  # fmt: skip
        opts["stop_token_ids"] = ids
    return opts


def _token_ids(ids: list, info: ModelInfo, param: str) -> list[int]:
    if not ids:
        raise bad(param, f"{param} is empty")
    for t in ids:
        if not (_is_int(t) and 0 <= t < info.vocab_limit):
            raise bad(param, f"{param} token ids must be integers in [0, {info.vocab_limit}), got {_show(t)}")
    return ids


def _prompt(body: dict, info: ModelInfo) -> str | list[int]:
    prompt = body.get("prompt")
    # A batch of exactly one prompt is that prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return _token_ids(prompt, info, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "one prompt per request: batched prompts are not supported")
    raise bad("prompt", f"prompt must be a string or a list of token ids, got {_show(prompt)}")


def parse_completion(body: dict, info: ModelInfo) -> GenerateRequest:
    """A /v1/completions body, validated."""
    _check_fields(body, _COMPLETION_FIELDS, {**_NEUTRAL, **_NEUTRAL_COMPLETION})
    model = _model(body, info)
    if "prompt" not in body:
        raise bad("prompt", "prompt is required")
    prompt = _prompt(body, info)
    stream, include_usage = _stream(body)
    max_tokens = _int(body, "max_tokens", 1, _INT32_MAX)
    return GenerateRequest(
        chat=False, model=model, prompt=prompt, options=_options(body, info),
        max_tokens=16 if max_tokens is None else max_tokens, stream=stream, include_usage=include_usage,
    )  # fmt: skip


def parse_chat(body: dict, info: ModelInfo, template: Callable[..., str]) -> GenerateRequest:
    """A /v1/chat/completions body, validated; `template` renders the messages (ValueError: a 400)."""
    _check_fields(body, _CHAT_FIELDS, {**_NEUTRAL, **_NEUTRAL_CHAT})
    model = _model(body, info)
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "messages is required")
    _check_chat_size(messages, info)
    add = _bool(body, "add_generation_prompt")
    cont = bool(_bool(body, "continue_final_message"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"chat_template_kwargs must be an object, got {_show(kwargs)}")
    taken = sorted(set(kwargs) & {"messages", "add_generation_prompt", "continue_final_message"})
    if taken:
        raise bad("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)}")
    if add is None:
        add = not cont  # continuing the last message means no new assistant turn
    try:
        prompt = template(messages, add, cont, **kwargs)
    except ValueError as e:
        raise bad("messages", str(e)) from None
    stream, include_usage = _stream(body)
    max_tokens = _int(body, "max_tokens", 1, _INT32_MAX)
    # The newer OpenAI name wins, as in OpenAI's own API.
    max_completion = _int(body, "max_completion_tokens", 1, _INT32_MAX)
    return GenerateRequest(
        chat=True, model=model, prompt=prompt, options=_options(body, info),
        max_tokens=max_completion if max_completion is not None else max_tokens,
        stream=stream, include_usage=include_usage,
    )  # fmt: skip


def check_prompt_chars(chars: int, info: ModelInfo, param: str) -> None:
    """400 for text too long to fit one request, decided from its length alone (no tokenizing)."""
    if chars > info.max_prompt_chars:
        raise bad(
            param,
            f"the {param} is {chars} characters, more than the {info.max_prompt_chars} that the "
            f"{info.max_request_tokens} tokens one request may hold can cover "
            f"(max_model_len {info.max_model_len})",
        )


def _check_chat_size(messages: object, info: ModelInfo) -> None:
    if isinstance(messages, list):
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            parts = content if isinstance(content, list) else [content]
            for part in parts:
                text = part.get("text") if isinstance(part, dict) else part
                chars += len(text) if isinstance(text, str) else 0
        check_prompt_chars(chars, info, "messages")


def sampling_params(req: GenerateRequest, prompt_len: int, info: ModelInfo):
    """The engine's SamplingParams for req, its prompt being prompt_len tokens; 400 if it cannot fit."""
    from ..engine.sampling import SamplingParams  # here, so Sanic's main process never imports torch

    where = "prompt" if not req.chat else "messages"
    if prompt_len < 1:
        raise bad(where, "the prompt is empty")
    room = info.max_request_tokens - prompt_len
    if room < 1:
        raise bad(
            where,
            f"the prompt is {prompt_len} tokens, which leaves no room to generate in the "
            f"{info.max_request_tokens} tokens one request may hold (max_model_len {info.max_model_len})",
        )
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        raise bad(
            "max_tokens",
            f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"{info.max_request_tokens} tokens one request may hold (max_model_len {info.max_model_len})",
        )
    options = req.options
    if req.chat and info.end_of_turn_ids and not options.get("ignore_eos"):
        # A chat reply ends with its turn, whatever generation_config.json lists.
        stops = list(options.get("stop_token_ids", ()))
        options = {**options, "stop_token_ids": stops + [t for t in info.end_of_turn_ids if t not in stops]}
    params = SamplingParams(max_tokens=max_tokens, **options)
    try:
        params.validate(info.num_loops)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise bad(name if name in req.options else None, str(e)) from None
    return params


def request_id(header: str | None, chat: bool) -> str:
    """The response id: the client's x-request-id when it is plain printable ASCII, else a fresh one."""
    prefix = "chatcmpl-" if chat else "cmpl-"
    if header and len(header) <= _MAX_REQUEST_ID and header.isascii() and header.isprintable():
        return prefix + header
    return prefix + uuid.uuid4().hex


def parse_tokenize(body: dict, info: ModelInfo, template: Callable[..., str]) -> str:
    """The text a /tokenize body asks about: "prompt", or "messages" rendered as a chat."""
    _check_fields(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}, {})
    _model(body, info)
    _bool(body, "add_special_tokens")  # accepted for vLLM compatibility: ouro_fast never adds specials
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "give exactly one of prompt and messages")
    if "messages" in body:
        add = _bool(body, "add_generation_prompt")
        try:
            return template(body["messages"], add is not False)
        except ValueError as e:
            raise bad("messages", str(e)) from None
    if not isinstance(body["prompt"], str):
        raise bad("prompt", f"prompt must be a string, got {_show(body['prompt'])}")
    return body["prompt"]


def parse_detokenize(body: dict, info: ModelInfo) -> list[int]:
    """The token ids of a /detokenize body."""
    _check_fields(body, {"model", "tokens"}, {})
    _model(body, info)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens", f"tokens must be a list of token ids, got {_show(tokens)}")
    return _token_ids(tokens, info, "tokens") if tokens else []


# ---- JSON out ------------------------------------------------------------------


def dumps(obj: object) -> str:
    """JSON with every non-ASCII character escaped (old clients split multibyte characters)."""
    return ujson.dumps(obj, ensure_ascii=True, escape_forward_slashes=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(rid: str, created: int, req: GenerateRequest, text: str, finish: str | None,
                        prompt_tokens: int, completion_tokens: int) -> dict:  # fmt: skip
    """The non-streaming response body."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def stream_chunk(rid: str, created: int, req: GenerateRequest, text: str, finish: str | None,
                 first: bool) -> dict:  # fmt: skip
    """One streamed text chunk; the chat role rides on the first chunk, with the first text."""
    if req.chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
    }


def usage_chunk(
    rid: str, created: int, req: GenerateRequest, prompt_tokens: int, completion_tokens: int
) -> dict:
    """The last chunk when stream_options.include_usage: no choices, only usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def models_response(info: ModelInfo) -> dict:
    """GET /v1/models: one entry per served name, `root` being the checkpoint directory."""
    data = [
        {"id": name, "object": "model", "created": info.created, "owned_by": "ouro_fast", "root": info.root,
         "parent": None, "max_model_len": info.max_model_len, "permission": []}
        for name in info.names
    ]  # fmt: skip
    return {"object": "list", "data": data}
