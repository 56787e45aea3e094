"""The OpenAI wire format: requests validated against the models of api_models.py, and response shapes.

Every client mistake becomes an ApiError (an HTTP 4xx in the OpenAI error shape, naming the
offending field); nothing here touches the engine. Types are checked strictly; a field that no
model declares is ignored and logged, as vLLM does; a declared field asking for something the
engine does not do yet is a 400.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import ujson
from pydantic import ValidationError

from .api_models import (
    ApiModel,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    unsupported,
)

# A client's x-request-id is echoed only in this form: it lands in response ids, headers and logs.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
M = TypeVar("M", bound=ApiModel)
logger = logging.getLogger("ouro_fast.server")


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
    prompts: list[str | list[int]]  # each: text (chat: the templated conversation) or token ids
    options: dict  # SamplingParams keyword arguments, max_tokens excluded
    max_tokens: int | None  # None: whatever room the context leaves (chat default)
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top log-probabilities per token to report; None: no logprobs
    n: int = 1  # choices per prompt
    echo: bool = False  # the reply starts with the prompt (and its logprobs, with logprobs)
    prompt_logprobs: int | None = None  # vLLM's field: each prompt token's logprobs, in the choice
    generate: bool = True  # False (max_tokens 0 with echo): the prompt alone, nothing generated
    continuous_usage: bool = False  # every stream chunk carries the usage so far


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


def _show(x: object) -> str:
    text = ujson.dumps(x, ensure_ascii=True) if not isinstance(x, float) else repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _validate(model_cls: type[M], body: dict) -> M:
    """The body as `model_cls`, or a 400 naming the first field that is wrong."""
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if loc:
            got = "" if err["type"] == "missing" else f", got {_show(err.get('input'))}"
            raise bad(str(err["loc"][0]), f"{loc}: {message}{got}") from None
        named = [f for f in model_cls.model_fields if message.startswith(f)]
        param = max(named, key=len, default=None)  # "stream_options ..." names stream_options, not stream
        raise bad(param, message) from None
    ignored = req.ignored_fields()
    if ignored:
        logger.warning(
            "the request's fields %s are not parameters of this endpoint: ignored", ", ".join(ignored)
        )
    return req


def _model(name: str | None, info: ModelInfo) -> str:
    if name is None:
        return info.names[0]
    if name not in info.names:
        raise ApiError(404, f"the model {_show(name)} does not exist", param="model", code="model_not_found")
    return name


def _check_supported(req: SamplingFields) -> None:
    found = unsupported(req)
    if found is not None:
        name, value = found
        if name.startswith("guided_"):
            raise bad(name, f"{name} is not supported: use structured_outputs, which replaced it in vLLM")
        raise bad(name, f"{name} {_show(value)} is not supported yet")


def _options(req: SamplingFields) -> dict:
    """SamplingParams keyword arguments (max_tokens excluded); absent fields keep its defaults."""
    names = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "skip_special_tokens", "min_loops",
             "max_loops", "exit_threshold", "stop_token_ids", "include_stop_str_in_output")  # fmt: skip
    opts = {name: getattr(req, name) for name in names if getattr(req, name) is not None}
    for name, off in _PROCESSORS_OFF.items():  # the neutral values ask nothing of the processors
        if getattr(req, name) not in (None, off):
            opts[name] = getattr(req, name)
    if req.seed is not None and req.seed < 0:
        raise bad("seed", f"seed must be >= 0, got {req.seed}")
    if req.stop is not None:
        opts["stop"] = req.stop_strings()
    if req.logit_bias:
        if not all(k.isdigit() for k in req.logit_bias):
            raise bad("logit_bias", "logit_bias keys must be token ids")
        opts["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    logprobs = _logprobs(req)
    if logprobs is not None:
        opts["logprobs"] = logprobs
    structured = _structured(req)
    if structured is not None:
        opts["structured"] = structured
    return opts


def _structured(req: SamplingFields) -> tuple[str, str] | None:
    """(kind, spec) of what the output must match, from response_format or structured_outputs (not both)."""
    fmt, so = req.response_format, req.structured_outputs
    wanted = None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            wanted = ("json_object", "")
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad("response_format", "response_format json_schema needs json_schema.schema")
            wanted = ("json", json.dumps(fmt.json_schema.schema_))
        else:
            raise bad("response_format", f"response_format type must be text, json_object or json_schema, "
                                         f"got {_show(fmt.type)}")  # fmt: skip
    if so is None:
        return wanted
    if so.structural_tag is not None:
        raise bad("structured_outputs", "structured_outputs.structural_tag is not supported yet")
    fields = (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
              ("json_object", so.json_object or None))  # fmt: skip
    given = [(kind, value) for kind, value in fields if value is not None]
    if len(given) != 1 or wanted is not None:
        why = "give one of structured_outputs' json, regex, choice, grammar, json_object; no response_format"
        raise bad("structured_outputs", why)
    kind, value = given[0]
    if kind == "json_object":
        return kind, ""
    if kind == "choice" and (not value or not all(value)):
        raise bad("structured_outputs", "structured_outputs.choice must be a list of non-empty strings")
    return kind, value if isinstance(value, str) and kind != "choice" else json.dumps(value)


_PROCESSORS_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                   "min_tokens": 0}  # fmt: skip


def _logprobs(req: SamplingFields) -> int | None:
    """How many top log-probabilities a token reports: completions ask with an int, chat with
    logprobs true and top_logprobs."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs true")
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _token_ids(ids: list[int], info: ModelInfo, param: str) -> list[int]:
    if not ids:
        raise bad(param, f"{param} is empty")
    for t in ids:
        if not 0 <= t < info.vocab_limit:
            raise bad(param, f"{param} token ids must be integers in [0, {info.vocab_limit}), got {_show(t)}")
    return ids


def _prompts(prompt: str | list, info: ModelInfo) -> list[str | list[int]]:
    """A completion's prompts: one text, one list of token ids, or a list of either."""
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    out = []
    for p in batch:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "prompt is empty")
            out.append(p)
        else:
            out.append(_token_ids(p, info, "prompt"))
    return out


def _choices(req: SamplingFields) -> int:
    n = req.n or 1
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of must equal n ({n}): ouro_fast returns every sequence it generates")
    return n


def _stream(req: SamplingFields) -> tuple[bool, bool]:
    opts = req.stream_options
    return bool(req.stream), bool(opts is not None and opts.include_usage)


def _continuous_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options is not None and req.stream_options.continuous_usage_stats)


def parse_completion(body: dict, info: ModelInfo) -> GenerateRequest:
    """A /v1/completions body, validated."""
    req = _validate(CompletionRequest, body)
    _check_supported(req)
    model = _model(req.model, info)
    prompts = _prompts(req.prompt, info)
    stream, include_usage = _stream(req)
    echo = bool(req.echo)
    if req.max_tokens == 0 and not echo:
        raise bad("max_tokens", "max_tokens 0 needs echo: a reply of no tokens is the prompt alone")
    if stream and (req.prompt_logprobs is not None or (echo and req.logprobs is not None)):
        raise bad("prompt_logprobs" if req.prompt_logprobs is not None else "echo",
                  "prompt logprobs are not streamed yet: ask without stream")  # fmt: skip
    options = _options(req)
    wanted = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if echo else None
    if wanted is not None:
        options["prompt_logprobs"] = wanted
    max_tokens = 16 if req.max_tokens is None else max(req.max_tokens, 1)
    return GenerateRequest(
        chat=False, model=model, prompts=prompts, options=options, max_tokens=max_tokens, stream=stream,
        include_usage=include_usage, logprobs=req.logprobs, n=_choices(req), echo=echo,
        prompt_logprobs=req.prompt_logprobs, generate=req.max_tokens != 0,
        continuous_usage=_continuous_usage(req),
    )  # fmt: skip


def parse_chat(body: dict, info: ModelInfo, template: Callable[..., str]) -> GenerateRequest:
    """A /v1/chat/completions body, validated; `template` renders the messages (ValueError: a 400)."""
    req = _validate(ChatCompletionRequest, body)
    _check_supported(req)
    model = _model(req.model, info)
    _check_chat_size(req.messages, info)
    cont = bool(req.continue_final_message)
    add = not cont if req.add_generation_prompt is None else req.add_generation_prompt
    kwargs = req.chat_template_kwargs or {}
    taken = sorted(set(kwargs) & {"messages", "add_generation_prompt", "continue_final_message"})
    if taken:
        raise bad("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)}")
    try:
        prompt = template(req.messages, add, cont, **kwargs)
    except ValueError as e:
        raise bad("messages", str(e)) from None
    stream, include_usage = _stream(req)
    # The newer OpenAI name wins, as in OpenAI's own API.
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return GenerateRequest(
        chat=True, model=model, prompts=[prompt], options=_options(req), max_tokens=max_tokens,
        stream=stream, include_usage=include_usage, logprobs=_logprobs(req), n=_choices(req),
        continuous_usage=_continuous_usage(req),
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
    bias = req.options.get("logit_bias") or {}
    if any(t >= info.vocab_limit for t in bias):
        raise bad("logit_bias", f"logit_bias token ids must be below {info.vocab_limit}")
    options = req.options
    if req.chat and info.end_of_turn_ids and not options.get("ignore_eos"):
        # A chat reply ends with its turn, whatever generation_config.json lists.
        stops = list(options.get("stop_token_ids", ()))
        options = {**options, "stop_token_ids": stops + [t for t in info.end_of_turn_ids if t not in stops]}
    if "structured" in options:
        from ..engine.structured import StructuredOutput

        options = {**options, "structured": StructuredOutput(*options["structured"])}
    params = SamplingParams(max_tokens=max_tokens, **options)
    try:
        params.validate(info.num_loops)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise bad(name if name in req.options else None, str(e)) from None
    return params


def request_id(header: str | None) -> str:
    """The client's x-request-id when it is 1 to 128 characters of [A-Za-z0-9._:-], else a fresh id."""
    if header is not None and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def response_id(request_id: str, chat: bool) -> str:
    """The `id` of a completion (cmpl-) or chat completion (chatcmpl-) response."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def parse_tokenize(body: dict, info: ModelInfo, template: Callable[..., str]) -> str:
    """The text a /tokenize body asks about: "prompt", or "messages" rendered as a chat."""
    req = _validate(TokenizeRequest, body)
    _model(req.model, info)
    if (req.prompt is None) == (req.messages is None):
        raise bad("prompt", "give exactly one of prompt and messages")
    # Text no request could hold is refused from its length, before it costs a render or tokenizing.
    if req.messages is not None:
        _check_chat_size(req.messages, info)
        try:
            return template(req.messages, req.add_generation_prompt is not False)
        except ValueError as e:
            raise bad("messages", str(e)) from None
    check_prompt_chars(len(req.prompt), info, "prompt")
    return req.prompt


def parse_detokenize(body: dict, info: ModelInfo) -> list[int]:
    """The token ids of a /detokenize body."""
    req = _validate(DetokenizeRequest, body)
    _model(req.model, info)
    if req.tokens is None:
        raise bad("tokens", "tokens is required")
    return _token_ids(req.tokens, info, "tokens") if req.tokens else []


# ---- JSON out ------------------------------------------------------------------


def dumps(obj: object) -> str:
    """JSON with every non-ASCII character escaped (old clients split multibyte characters)."""
    return ujson.dumps(obj, ensure_ascii=True, escape_forward_slashes=False)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose K/V came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprobs_body(req: GenerateRequest, tokens: list[int], lps: list, decode: Callable[[int], str],
                  offset: int = 0) -> dict | None:  # fmt: skip
    """The OpenAI `logprobs` of a choice's tokens (TokenLogprobs each): the chat shape ({"content": [...]}) or
    the completions one (tokens, token_logprobs, top_logprobs, text_offset from `offset`); None when the
    request asked for none."""
    if req.logprobs is None:
        return None
    if req.chat:
        content = []
        for t, lp in zip(tokens, lps):
            text = decode(t)
            top = [{"token": decode(i), "logprob": v, "bytes": list(decode(i).encode())}
                   for i, v in zip(lp.top_ids, lp.top_logprobs)]  # fmt: skip
            content.append(
                {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top}
            )
        return {"content": content, "refusal": None}
    texts = [decode(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = []
    for text, lp in zip(texts, lps):
        if lp is None:  # an echoed prompt's first token: nothing came before it
            top.append(None)
            continue
        entry = {decode(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
        entry.setdefault(text, lp.logprob)
        top.append(entry)
    token_logprobs = [None if lp is None else lp.logprob for lp in lps]
    return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_body(prompt: list[int], lps: list, decode: Callable[[int], str]) -> list:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, None for the first, else token id -> its
    {logprob, rank, decoded_token}, with the top ones."""
    out: list = [None]
    for token, lp in zip(prompt[1:], lps):
        entry = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": decode(i)}
                 for r, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs))}  # fmt: skip
        entry[str(token)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode(token)}
        out.append(entry)
    return out


def choice(req: GenerateRequest, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    """One choice of a non-streaming response."""
    if req.chat:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_response(
    rid: str, created: int, req: GenerateRequest, choices: list[dict], usage: dict
) -> dict:
    """The non-streaming response body."""
    return {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": usage,
    }


def stream_chunk(rid: str, created: int, req: GenerateRequest, index: int, text: str, finish: str | None,
                 first: bool, logprobs: dict | None = None) -> dict:  # fmt: skip
    """One streamed chunk of choice `index`; the chat role rides on its first chunk, with the first text."""
    if req.chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
    }


def usage_chunk(rid: str, created: int, req: GenerateRequest, usage: dict) -> dict:
    """The last chunk when stream_options.include_usage: no choices, only usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [],
        "usage": usage,
    }


def models_response(info: ModelInfo) -> dict:
    """GET /v1/models: one entry per served name, `root` being the checkpoint directory."""
    data = [
        {"id": name, "object": "model", "created": info.created, "owned_by": "ouro_fast", "root": info.root,
         "parent": None, "max_model_len": info.max_model_len, "permission": []}
        for name in info.names
    ]  # fmt: skip
    return {"object": "list", "data": data}
