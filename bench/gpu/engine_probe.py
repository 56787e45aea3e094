"""Engine-only probe on the GPU: 128-in / 64-out decode at concurrency 1 and 8, full depth and threshold 0.5.

Generates the ouro-1.4b preset (random bf16 weights) on first use, warms up,
then prints per configuration: tokens/s, ms per loop step, TTFT, and the split of
a step into scheduler / model / detokenization, plus a torch-profiler table of
the top kernels. Usage (GPU machine): python3 bench/gpu/engine_probe.py [RUNNER]
where RUNNER is auto (default), triton or torch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.checkpoints import make_checkpoint

CKPT = os.environ.get("OURO_PROBE_CKPT", "/tmp/ck14")


def run_case(eng: Engine, rng, conc: int, q: float) -> dict:
    def submit(tag: str, n_out: int) -> None:
        for i in range(conc):
            prompt = rng.integers(3, 1000, 128).tolist()
            eng.add_request(f"{tag}{conc}-{q}-{i}", prompt, SamplingParams(max_tokens=n_out, ignore_eos=True,
                                                                            exit_threshold=q))  # fmt: skip

    submit("warm", 8)
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    s = eng.stats
    before = (s.steps, s.model_seconds, s.scheduler_seconds, s.detok_seconds)
    t0 = time.perf_counter()
    submit("run", 64)
    ttft = None
    while eng.has_unfinished_requests():
        outs = eng.step()
        if ttft is None and any(o.new_token_ids for o in outs):
            ttft = time.perf_counter() - t0
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    steps = s.steps - before[0]
    per_step = lambda total, i: round(1000 * (total - before[i]) / steps, 4)  # noqa: E731
    return {
        "conc": conc, "threshold": q, "seconds": round(dt, 4), "tok_s": round(conc * 64 / dt, 1),
        "steps": steps, "ms_per_step": round(1000 * dt / steps, 4), "ttft_ms": round(1000 * ttft, 2),
        "model_ms_per_step": per_step(s.model_seconds, 1),
        "sched_ms_per_step": per_step(s.scheduler_seconds, 2),
        "detok_ms_per_step": per_step(s.detok_seconds, 3),
        "exit_depth_histogram": list(s.exit_depth_histogram),
    }  # fmt: skip


def main() -> None:
    runner = sys.argv[1] if len(sys.argv) > 1 else "auto"
    if not os.path.exists(os.path.join(CKPT, "model.safetensors")):
        make_checkpoint("ouro-1.4b", CKPT, seed=0, dtype="bfloat16", progress=False)
    t = time.perf_counter()
    eng = Engine(EngineConfig(model=CKPT, max_num_seqs=64, max_num_batched_tokens=2048, runner=runner))
    print(f"engine ready in {time.perf_counter() - t:.2f}s, {eng.bt.num_blocks} KV blocks", flush=True)
    rng = np.random.default_rng(0)
    results = [run_case(eng, rng, conc, q) for conc, q in ((1, 1.0), (8, 1.0), (8, 0.5))]
    for r in results:
        print(json.dumps(r), flush=True)
    prompt = rng.integers(3, 1000, 128).tolist()
    eng.add_request("profile", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(8):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "engine_probe.json"), "w") as f:
        json.dump({"runner": runner, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
