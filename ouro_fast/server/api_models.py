"""The request shapes of the OpenAI/vLLM API, declared once as pydantic models: this is the table of the
parameters ouro_fast accepts.

Validation is strict about types (a bool is no number, "5" is no integer) and, as in vLLM's server,
lenient about names: a field no model declares is ignored, and the server logs it. A declared field
whose feature the engine does not have yet accepts only its neutral value (NEUTRAL); anything else is a
400 that names the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TEMPERATURE = 1e6  # the engine keeps it as float32: bound it well inside that range
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        """The request's fields that no model declares (vLLM ignores them too)."""
        return sorted(self.model_extra or ())


class StreamOptions(ApiModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(ApiModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(ApiModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(ApiModel):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar (EBNF) and json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool | None = None  # JSON is always generated without free whitespace


class SamplingFields(ApiModel):
    """What completions and chat share: the sampler, the stop conditions, streaming, Ouro's exit policy."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-_INT64_MAX, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    n: int | None = Field(None, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_tokens: int | None = Field(None, ge=0, le=_INT32_MAX)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    length_penalty: float | None = None
    use_beam_search: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM fields that change what is generated: refused, not ignored, so nobody gets unconstrained text.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Ouro's exit policy: the loops a token may run, and the exit gate's threshold.
    min_loops: int | None = Field(None, ge=1, le=64)
    max_loops: int | None = Field(None, ge=1, le=64)
    exit_threshold: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them"
            )
        if any(not 0 <= t <= _INT32_MAX for t in self.stop_token_ids or ()):
            raise ValueError("stop_token_ids must be token ids")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=_INT32_MAX)  # 0: with echo, the prompt alone
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[Any]  # each checked as the chat template renders it
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


class TokenizeRequest(ApiModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None  # accepted as vLLM does: ouro_fast never adds specials
    add_generation_prompt: bool | None = None


class DetokenizeRequest(ApiModel):
    model: str | None = None
    tokens: list[int] | None = None  # required: checked after the model, whose 404 comes first


# Declared fields whose feature the engine does not have yet: the values that ask nothing of it.
NEUTRAL: dict[str, tuple] = {
    "length_penalty": (1.0,),
    "use_beam_search": (False,),
    "suffix": (),
    "tools": ([],),
    "tool_choice": ("none",),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
}


def unsupported(req: SamplingFields) -> tuple[str, Any] | None:
    """The first field that asks for something the engine does not do yet, with its value."""
    for name, allowed in NEUTRAL.items():
        value = getattr(req, name, None)
        if value is not None and value not in allowed:
            return name, value
    return None
