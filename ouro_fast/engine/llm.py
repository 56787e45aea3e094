"""The offline facade: LLM(model_dir).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from dataclasses import dataclass

from .engine import Engine, EngineConfig
from .sampling import SamplingParams


@dataclass
class Completion:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    exit_loops: list[int]  # 0-based loop at which each output token exited
    finish_reason: str


class LLM:
    """Runs an Engine in the calling thread until every prompt is done."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = Engine(EngineConfig(model=model, **engine_options))

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """One Completion per prompt, in order. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        eng = self.engine
        ids = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            token_ids = eng.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            key = f"llm-{id(self)}-{i}"
            eng.add_request(key, token_ids, p)
            ids[key] = i
        done: dict[int, Completion] = {}
        while len(done) < len(prompts):
            for out in eng.step():
                if out.finished:
                    req = out.request
                    done[ids[out.request_id]] = Completion(
                        prompts[ids[out.request_id]], req.text, list(req.output_ids), list(req.exit_loops),
                        out.finish_reason,
                    )  # fmt: skip
        return [done[i] for i in range(len(prompts))]
