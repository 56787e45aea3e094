"""The engine's own score of each (context, continuation) pair, tokenized as lm-eval does (the pair encoded
whole, the context's tokens cut off): JSON pairs on stdin, JSON log-likelihoods on stdout.

Run by run.py as `python -P score.py MODEL_DIR` outside the repository, so that it imports the installed
package with its compiled core rather than the source tree."""

from __future__ import annotations

import json
import sys

from ouro_fast import LLM, SamplingParams


def loglikelihoods(model_dir: str, pairs: list[tuple[str, str]]) -> list[float]:
    llm = LLM(model_dir, device="cpu")
    tok = llm.engine.tokenizer
    prompts, spans = [], []
    for context, continuation in pairs:
        whole, ctx = tok.encode(context + continuation), tok.encode(context)
        prompts.append({"prompt_token_ids": whole})
        spans.append(len(ctx))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    scores = []
    for out, start in zip(outs, spans):
        scored = zip(out.prompt_token_ids[start:], out.prompt_logprobs[start:])
        scores.append(sum(entry[token].logprob for token, entry in scored))
    return scores


if __name__ == "__main__":
    json.dump(loglikelihoods(sys.argv[1], json.load(sys.stdin)), sys.stdout)
