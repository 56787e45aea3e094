"""The offline API, in vLLM's shape: LLM(model=...).generate(prompts, sampling_params) and LLM.chat(messages).

from ouro_fast import LLM, SamplingParams
llm = LLM(model="/path/to/Ouro-1.4B", dtype="bfloat16")
for out in llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0)):
    print(out.prompt, out.outputs[0].text, out.outputs[0].finish_reason)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import EngineConfig
from .engine import Engine
from .sampling import SamplingParams


@dataclass
class Logprob:
    """One token's log-probability (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None  # 1 + how many tokens were likelier; None where not computed
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    exit_loops: list[int] = field(default_factory=list)  # the 0-based loop each token exited at
    stop_reason: int | str | None = None  # the stop token id that ended it, when one did
    cumulative_logprob: float | None = None  # the sum of the tokens' log-probabilities, when asked for
    logprobs: list[dict[int, Logprob]] | None = None  # per token: its id and the top ones -> Logprob


@dataclass
class RequestOutput:
    """A finished request (vLLM's RequestOutput): its prompt and its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None  # why the engine ended it, for finish_reason "error"
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first, else its id and the top ones.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
Prompt = str | Sequence[int] | dict


class LLM:
    """Runs an Engine in the calling thread until every request of a call is done."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()  # request ids are never reused, whatever a call raised

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A request the engine refuses raises ValueError before
        anything runs; the engine stays usable."""
        prompts = [prompts] if _is_single(prompts) else list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, params)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, prompted by the checkpoint's chat template
        (or `chat_template`: a file's path or the template text). Replies stop at the end of their turn."""
        from ..model.chat_template import ChatTemplate, template_source

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _params_per_prompt(sampling_params, len(conversations))
        tok = self.engine.tokenizer
        template = ChatTemplate(template_source(chat_template)) if chat_template else tok.chat_template
        kwargs = chat_template_kwargs or {}
        texts = [
            template.render(c, add_generation_prompt, continue_final_message, **kwargs) for c in conversations
        ]
        end_of_turn = tok.raw.encode(template.end_of_turn(), add_special_tokens=False).ids[:1]
        end_of_turn = [t for t in end_of_turn if t in tok.special_ids]
        params = [_with_stops(p, end_of_turn) for p in params]
        return self._run([(t, tok.encode(t)) for t in texts], params)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids'")
        return None, list(prompt)

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        eng = self.engine
        keys = [f"llm-{next(self._ids)}" for _ in encoded]
        added = []
        groups: dict[tuple, list[int]] = {}  # identical prompts share their KV: queued together
        for i, (_, ids) in enumerate(encoded):
            groups.setdefault(tuple(ids) if all(isinstance(t, int) for t in ids) else i, []).append(i)
        try:
            for members in groups.values():
                ids = encoded[members[0]][1]
                eng.add_requests([keys[i] for i in members], ids, [params[i] for i in members])
                added += [keys[i] for i in members]
        except Exception:
            for key in added:  # all or nothing: the requests queued so far leave with the error
                eng.abort_request(key)
            eng.step()  # hands back the aborts' finals
            raise
        done: dict[str, RequestOutput] = {}
        slot = dict(zip(keys, range(len(keys))))
        while len(done) < len(keys):
            for out in eng.step():
                if out.finished and out.request_id in slot:
                    prompt = encoded[slot[out.request_id]][0]
                    done[out.request_id] = _request_output(out, prompt, eng.tokenizer)
        return [done[k] for k in keys]


def _is_single(prompts) -> bool:
    return isinstance(prompts, (str, dict)) or (bool(prompts) and isinstance(prompts[0], int))


def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"give one SamplingParams, or one per prompt ({n}); got {len(params)}")
    return params


def _with_stops(params: SamplingParams, ids: list[int]) -> SamplingParams:
    if params.ignore_eos or not ids:
        return params
    from dataclasses import replace

    return replace(
        params, stop_token_ids=[*params.stop_token_ids, *(t for t in ids if t not in params.stop_token_ids)]
    )


def _request_output(out, prompt: str | None, tokenizer) -> RequestOutput:
    req = out.request
    ids = list(req.output_ids)
    stop = ids[-1] if out.finish_reason == "stop" and ids and ids[-1] in req.eos_ids else None
    completion = CompletionOutput(
        index=0, text=req.text, token_ids=ids, finish_reason=out.finish_reason,
        exit_loops=list(req.exit_loops), stop_reason=stop,
    )  # fmt: skip
    if req.params.logprobs is not None:
        completion.logprobs = [_logprob_dict(t, lp, tokenizer) for t, lp in zip(ids, req.logprobs)]
        completion.cumulative_logprob = sum(lp.logprob for lp in req.logprobs)
    result = RequestOutput(out.request_id, prompt, list(req.prompt_ids), [completion], error=out.error)
    if req.params.prompt_logprobs is not None:
        pairs = zip(req.prompt_ids[1:], req.prompt_logprobs)
        result.prompt_logprobs = [None] + [_logprob_dict(t, lp, tokenizer) for t, lp in pairs]
    return result


def _logprob_dict(token: int, lp, tokenizer) -> dict[int, Logprob]:
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    entries = {t: Logprob(v, i + 1, text(t)) for i, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs))}
    entries[token] = Logprob(lp.logprob, lp.rank, text(token))
    return entries
