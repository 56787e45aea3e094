"""Offline engine benchmark (no HTTP): a fixed workload under several exit policies, refill vs no-refill.

The workload: N requests (default 64) of random prompt ids (fixed seed), L_in
tokens in and L_out out (default 128 / 64), ignore_eos, greedy, all queued at
once. The model is a random-weight checkpoint from make_checkpoint (preset,
dtype and gate bias chosen by flags; cached under --ckpt-dir) whose exit gate
logit is about N(gate_bias, 1.5^2), so thresholds below 1.0 give a spread of
depths. Each configuration gets a fresh Engine and a short warm-up workload
(not measured).

Reported per configuration: output tokens/s (wall), steps, time per step split
into scheduler / model (propagation, the loop, the gate, lm_head and sampling)
/ sampling (the sampler call alone, inside model) / detokenization (stop checks
and the incremental detokenizer), the loop-depth histogram of generated tokens,
the mean depth, rows per loop, and KV utilisation (peak blocks in use / pool).

Run: python -m bench.engine_bench [--preset tiny] [--device cpu] [--dtype float32] [--out bench/results/DIR]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import torch

from bench.benchlib import start_run, write_result
from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.checkpoints import make_checkpoint


def checkpoint(ckpt_dir: Path, preset: str, dtype: str, gate_bias: float, seed: int) -> Path:
    """The generated checkpoint for these settings, made once and reused (a marker file says it is whole)."""
    out = ckpt_dir / f"{preset}-{dtype}-bias{gate_bias:g}-seed{seed}"
    done = out / ".complete"
    if not done.exists():
        make_checkpoint(preset, out, seed=seed, dtype=dtype, gate_bias=gate_bias, progress=False)
        done.write_text("ok\n")
    return out


class TimedSampler:
    """Forwards to the runner's sampler, adding up the seconds spent in it (synchronised on CUDA)."""

    def __init__(self, inner, device: torch.device):
        self.inner = inner
        self.cuda = device.type == "cuda"
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)  # the runner reads the sampler's settings too


def workload(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, input_len).tolist() for _ in range(n)]


def drain(engine: Engine, peak: list[int]) -> int:
    """Step until every request finished; returns the steps taken, tracking peak KV blocks in use."""
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak[0] = max(peak[0], engine.stats.kv_blocks_used)
    return steps


def run_config(args, model_dir: Path, threshold: float, refill: bool) -> dict:
    cfg = EngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        refill=refill,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
    )
    engine = Engine(cfg)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, exit_threshold=threshold
    )
    vocab = engine.vocab_limit
    for i, p in enumerate(workload(4, 16, vocab, args.seed + 1)):
        engine.add_request(f"warm-{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    drain(engine, [0])
    timed = TimedSampler(engine.runner.sampler, engine.device)
    engine.runner.sampler = timed
    engine.stats = type(engine.stats)(num_loops=engine.num_loops)
    prompts = workload(args.num_requests, args.input_len, vocab, args.seed)
    gc.collect()
    peak = [0]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = drain(engine, peak)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = engine.stats
    tokens = st.total_exits
    if tokens != args.num_requests * args.output_len:
        raise RuntimeError(f"generated {tokens} tokens, expected {args.num_requests * args.output_len}")
    hist = st.exit_depth_histogram  # index t: tokens that exited after loop t, i.e. depth t + 1
    mean_depth = sum((t + 1) * c for t, c in enumerate(hist)) / tokens
    ms = 1e3 / steps
    return {
        "exit_threshold": threshold,
        "refill": refill,
        "requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "steps": steps,
        "steps_per_token_per_request": round(steps * args.max_num_seqs / tokens, 3),
        "ms_per_step": {
            "total": round(wall * ms, 4),
            "scheduler": round(st.scheduler_seconds * ms, 4),
            "model": round(st.model_seconds * ms, 4),
            "sampling_in_model": round(timed.seconds * ms, 4),
            "detok": round(st.detok_seconds * ms, 4),
            "other": round((wall - st.scheduler_seconds - st.model_seconds - st.detok_seconds) * ms, 4),
        },
        "depth_histogram": {str(t + 1): c for t, c in enumerate(hist)},
        "mean_depth": round(mean_depth, 3),
        "rows_per_loop": st.total_rows_per_loop,
        "refills": st.total_refills,
        "preemptions": st.total_preemptions,
        "kv_peak_blocks": peak[0],
        "kv_total_blocks": engine.scheduler.num_blocks,
        "kv_utilisation": round(peak[0] / engine.scheduler.num_blocks, 4),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="make_checkpoint preset (tiny, ouro-1.4b, ouro-2.6b)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (weights and compute)")
    p.add_argument(
        "--gate-bias", type=float, default=1.0, help="mean exit-gate logit of the random checkpoint"
    )
    p.add_argument("--thresholds", default="1.0,0.9,0.7,0.5", help="exit_threshold values, comma-separated")
    p.add_argument("--refill", default="both", choices=("both", "on", "off"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: the engine's)")
    p.add_argument(
        "--cpu-threads", type=int, default=1, help="torch threads on CPU (the engine's default is 1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ckpt-dir", default="/tmp/ouro_fast-bench-ckpt", help="where generated checkpoints are cached"
    )
    p.add_argument("--quick", action="store_true", help="toy sizes (smoke test)")
    p.add_argument("--out", default=None, help="result file or folder (JSON); default: print only")
    p.add_argument("--name", default="engine", help="the result file's name in an --out folder")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.input_len, args.output_len, args.max_num_seqs = 4, 16, 8, 4
        args.thresholds = "1.0,0.5"
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    meta = start_run()
    model_dir = checkpoint(Path(args.ckpt_dir), args.preset, args.dtype, args.gate_bias, args.seed)
    meta.update(
        {
            "preset": args.preset,
            "device": args.device,
            "dtype": args.dtype,
            "gate_bias": args.gate_bias,
            "torch": torch.__version__,
            "torch_threads": args.cpu_threads,
        }
    )
    refills = {"both": (True, False), "on": (True,), "off": (False,)}[args.refill]
    out = []
    for threshold in (float(x) for x in args.thresholds.split(",")):
        for refill in refills:
            r = run_config(args, model_dir, threshold, refill)
            out.append(r)
            s = r["ms_per_step"]
            print(
                f"q={threshold:<4g} refill={'on ' if refill else 'off'}: "
                f"{r['output_tokens_per_s']:8.1f} tok/s, "
                f"{r['steps']:5d} steps, {s['total']:.3f} ms/step (sched {s['scheduler']:.3f}, model "
                f"{s['model']:.3f} [sampling {s['sampling_in_model']:.3f}], detok {s['detok']:.3f}), "
                f"mean depth {r['mean_depth']:.2f}, hist {list(r['depth_histogram'].values())}, "
                f"KV peak {r['kv_peak_blocks']}/{r['kv_total_blocks']}",
                flush=True,
            )
    meta["max_num_seqs"] = args.max_num_seqs
    write_result(meta, out, args.out, args.name)
    return out


if __name__ == "__main__":
    main()
