"""FP8 fidelity: how far FP8 weights (and bf16) move the model from its fp32 self, and the memory they save.

Teacher-forced over one sequence of `--positions` random token ids: every variant runs the same ids
through all four loops (the PyTorch model: the Triton kernels compute the same math, which
tests/test_fp8.py checks), and at each position the full-depth logits and the exit depth are compared
with fp32's:
- top-1 agreement: the same argmax token (also of each loop's logits, to show how the difference grows
  with depth);
- mean KL(fp32 || variant) of the full-depth next-token distributions, in nats;
- exit agreement: the same exit loop under `--exit-threshold` (from the four gate logits).
Variants: bf16 (weights and activations), fp8 (FP8 weights, bf16 activations) and fp8-kv (bf16 weights
and activations, the K/V cache in float8 e4m3 as kv_cache_dtype "fp8" holds it). Memory: the weight
bytes of each, and the KV tokens (at every loop) the FP8 savings buy at the checkpoint's KV layout.

    python -m bench.fp8_fidelity --preset ouro-1.4b --device cuda     # a random-weight Ouro-1.4B
    python -m bench.fp8_fidelity --model /path/to/Ouro-1.4B           # a real checkpoint
Prints a table and writes JSON to bench/results/fp8-fidelity-<UTC time>.json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ouro_fast.model.attention import ContiguousAttention
from ouro_fast.model.checkpoints import make_checkpoint
from ouro_fast.model.exit_rule import exit_loop
from ouro_fast.model.ouro import OuroForCausalLM
from ouro_fast.model.quantization import weight_bytes
from ouro_fast.model.weights import load_config, load_weights

RESULTS = Path(__file__).resolve().parent / "results"
# name: (activations' dtype, weight quantization, K/V cache dtype or None for the activations')
VARIANTS = {
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, None, None),
    "fp8": (torch.bfloat16, "fp8", None),
    "fp8-kv": (torch.bfloat16, None, torch.float8_e4m3fn),
}


def load(model_dir: Path, dtype: torch.dtype, quantization: str | None, device: str) -> OuroForCausalLM:
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = OuroForCausalLM(cfg)
    load_weights(model, model_dir, cfg, dtype, device)
    model.quantize(quantization)
    return model.eval()


@torch.inference_mode()
def run(model: OuroForCausalLM, ids: torch.Tensor, kv_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each loop's logits [loops, P, vocab] (fp32) and gate logits [loops, P] of the teacher-forced ids."""
    cfg = model.config
    n, loops = ids.shape[0], cfg.total_ut_steps
    dtype = kv_dtype or model.model.embed_tokens.weight.dtype
    attn = ContiguousAttention(loops, cfg.num_hidden_layers, n, cfg.num_key_value_heads, cfg.head_dim,
                               dtype, ids.device)  # fmt: skip
    positions = torch.arange(n, device=ids.device)
    h, gates, logits = model.embed(ids), [], []
    for t in range(loops):
        attn.loop = t
        h = model.run_loop(h, positions, attn)
        gates.append(model.gate_logits(h))
        logits.append(model.logits(h).float())
    return torch.stack(logits), torch.stack(gates)


def compare(ref: tuple, got: tuple, vocab: int, threshold: float, cfg) -> dict:
    (ref_all, ref_gates), (all_loops, gates) = ref, got
    per_loop = (ref_all[..., :vocab].argmax(-1) == all_loops[..., :vocab].argmax(-1)).float().mean(-1)
    ref_logits, logits = ref_all[-1, :, :vocab], all_loops[-1, :, :vocab]
    top1 = per_loop[-1].item()
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1), log_target=True, reduction="none")
    exits = [
        [exit_loop(g[:, i].tolist(), threshold, 1, cfg.total_ut_steps) for i in range(g.shape[1])]
        for g in (ref_gates.cpu(), gates.cpu())
    ]
    same_exit = sum(a == b for a, b in zip(*exits)) / len(exits[0])
    rel = ((logits - ref_logits).abs().amax(-1) / ref_logits.abs().amax(-1)).mean().item()
    mean_depth = sum(exits[1]) / len(exits[1]) + 1
    return {"top1_agreement": top1, "mean_kl": kl.sum(-1).mean().item(), "exit_agreement": same_exit,
            "mean_exit_depth": mean_depth, "mean_rel_logit_error": rel,
            "top1_agreement_by_loop": [round(v, 4) for v in per_loop.tolist()]}  # fmt: skip


def kv_bytes_per_token(cfg, elem: int = 2) -> int:
    """K and V of one token at every layer of every loop's plane (bf16 by default)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem * cfg.total_ut_steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a checkpoint directory")
    src.add_argument("--preset", help="write a random-weight checkpoint of this preset first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--exit-threshold", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_checkpoint(args.preset, tmp, dtype="bfloat16", progress=False)
        cfg = load_config(model_dir)
        vocab = min(cfg.vocab_size, 49152)
        ids = torch.randint(0, vocab, (args.positions,), generator=torch.Generator().manual_seed(args.seed))
        ids = ids.to(args.device)
        outputs, sizes, seconds = {}, {}, {}
        for name, (dtype, quantization, kv_dtype) in VARIANTS.items():
            t0 = time.perf_counter()
            model = load(model_dir, dtype, quantization, args.device)
            sizes[name] = weight_bytes(model)
            outputs[name] = run(model, ids, kv_dtype)
            seconds[name] = time.perf_counter() - t0
            del model
    rows = {
        name: compare(outputs["fp32"], outputs[name], vocab, args.exit_threshold, cfg)
        for name in ("bf16", "fp8", "fp8-kv")
    }
    saved = sizes["bf16"] - sizes["fp8"]
    report = {
        "source": str(args.model) if args.model else f"preset {args.preset} (random weights, seed 0)",
        "device": args.device, "positions": args.positions, "exit_threshold": args.exit_threshold,
        "variants": rows, "weight_bytes": sizes, "fp8_saves_bytes": saved,
        "kv_tokens_per_saved_bytes": saved // kv_bytes_per_token(cfg), "seconds": seconds,
    }  # fmt: skip
    print(f"{report['source']}, {args.positions} positions on {args.device}; against fp32:")
    head = ("variant", "top-1", "mean KL", "exit agr.", "depth", "rel. err", "weights")
    print("{:8} {:>7} {:>10} {:>10} {:>6} {:>9} {:>12}".format(*head))
    for name, r in rows.items():
        print(f"{name:8} {r['top1_agreement']:7.3f} {r['mean_kl']:10.2e} {r['exit_agreement']:10.3f} "
              f"{r['mean_exit_depth']:6.2f} {r['mean_rel_logit_error']:9.2e} "
              f"{sizes[name] / 2**30:8.3f} GiB")  # fmt: skip
    for name, r in rows.items():
        print(f"{name}: top-1 agreement of each loop's logits: {r['top1_agreement_by_loop']}")
    gained = report["kv_tokens_per_saved_bytes"]
    print(f"fp8 saves {saved / 2**30:.3f} GiB: room for {gained:,} more KV tokens (bf16 KV, every loop)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"fp8-fidelity-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
