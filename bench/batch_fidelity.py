"""Correctness at every batch size: greedy top-1 and exit agreement with the fp32 dense reference, one row
at a time against all rows in one batch.

The engine generates greedily for `--prompts` random prompts twice: one request at a time (every step has
one row) and all at once (`--prompts` rows a step). For each generated token the fp32 dense reference
(model/reference.py) runs the same token stream teacher-forced: top-1 agreement is the fraction of
positions where the engine's token is the reference's argmax given the same prefix; exit agreement the
fraction where the engine's exit loop is the one the gate rule picks in the reference. Batching must not
cost agreement: the one-batch figures may be lower than the one-row ones by at most TOLERANCE (the
docs' bound; tests/test_batch_fidelity.py holds the engine to it on the tiny preset).

    python -m bench.batch_fidelity --preset ouro-1.4b --device cuda               # bf16, 64 rows
    python -m bench.batch_fidelity --model DIR --prompts 32 --threshold 0.5
    python -m bench.batch_fidelity --model DIR --quantization fp8   # FP8 weights against the fp32 model
Prints one JSON line; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.checkpoints import make_checkpoint
from ouro_fast.model.ouro import OuroForCausalLM
from ouro_fast.model.reference import DenseReference
from ouro_fast.model.tokenizer import OuroTokenizer
from ouro_fast.model.weights import load_config, load_weights

# How much lower the one-batch agreement may be than the one-row agreement (a fraction of positions).
TOLERANCE = 0.02


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams, together: bool) -> list:
    """(token ids, exit loops) per prompt: all queued at once, or each after the one before finished."""
    out = {}

    def drain():
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.request for o in engine.step() if o.finished})

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        if not together:
            drain()
    drain()
    return [(out[str(i)].output_ids, out[str(i)].exit_loops) for i in range(len(prompts))]


def agreement(ref: DenseReference, prompts: list, results: list, threshold: float) -> dict:
    """Top-1 and exit agreement of the engine's results with the teacher-forced fp32 reference."""
    same_top1 = same_exit = total = 0
    for prompt, (ids, loops) in zip(prompts, results):
        argmax: list[int] = []

        def follow(logits, tokens, ids=ids, argmax=argmax):
            argmax.append(int(logits.argmax()))
            return ids[len(tokens)]  # the engine's token: the reference continues its stream

        want = ref.generate(prompt, len(ids), threshold=threshold, choose=follow)
        same_top1 += sum(a == b for a, b in zip(argmax, ids))
        same_exit += sum(a == b for a, b in zip(want.exit_loops, loops))
        total += len(ids)
    return {"top1_agreement": round(same_top1 / total, 4), "exit_agreement": round(same_exit / total, 4),
            "positions": total}  # fmt: skip


def measure(model_dir: str, prompts: list[list[int]], max_tokens: int, threshold: float, **engine) -> dict:
    """Agreement one row at a time and all rows in one batch, and whether batching kept it in TOLERANCE."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, exit_threshold=threshold, ignore_eos=True)
    eng = Engine(EngineConfig(model=model_dir, max_num_seqs=max(len(prompts), 1), **engine))
    longest = max(len(p) for p in prompts) + max_tokens
    device = engine.get("device", "cpu")  # the reference runs beside the engine, in fp32
    ref = DenseReference(fp32_weights(model_dir), eng.model_config, longest, eng.vocab_limit, device)
    one_row = agreement(ref, prompts, generate(eng, prompts, params, together=False), threshold)
    batched = agreement(ref, prompts, generate(eng, prompts, params, together=True), threshold)
    ok = all(batched[k] >= one_row[k] - TOLERANCE for k in ("top1_agreement", "exit_agreement"))
    return {"threshold": threshold, "rows": len(prompts), "one_row": one_row, "batched": batched,
            "within_tolerance": ok}  # fmt: skip


def fp32_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in float32 on the CPU, by their checkpoint names (the reference's input)."""
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = OuroForCausalLM(cfg)
    return dict(load_weights(model, model_dir, cfg, torch.float32, "cpu").state_dict())


def vocab_limit(model_dir: str) -> int:
    """Ids a prompt may use: those both the tokenizer and the model know."""
    return min(OuroTokenizer.from_dir(model_dir).vocab_size, load_config(model_dir).vocab_size)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory")
    src.add_argument("--preset", help="write a random-weight checkpoint of this preset first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threshold", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none", help="the engine's weights")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(make_checkpoint(args.preset, tmp, dtype="bfloat16", progress=False))
        prompts = random_prompts(args.prompts, args.prompt_len, vocab_limit(model_dir))
        for threshold in args.threshold:
            engine = dict(device=args.device, dtype=args.dtype)
            if args.quantization != "none":  # the reference stays the fp32 checkpoint
                engine["quantization"] = args.quantization
            print(json.dumps(measure(model_dir, prompts, args.max_tokens, threshold, **engine)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
