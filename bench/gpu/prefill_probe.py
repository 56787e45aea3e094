"""Where a prefill step's time goes on the GPU: the host-driven steps that run a new prompt's loops.

Builds the engine on the ouro-1.4b checkpoint (generated into OURO_PROBE_CKPT on first use), then
for 1 and 8 requests of 128 prompt tokens submitted together (max_tokens 1, full depth) times
every engine step until each request has its first token, with the CUDA graphs on (as served)
and off (eager kernels). On the eager engine it also prints the torch-profiler table of the top
kernels over one request's prefill steps. Prints one JSON line per case. Usage (GPU machine):
python3 -P bench/gpu/prefill_probe.py
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.checkpoints import make_checkpoint

CKPT = os.environ.get("OURO_PROBE_CKPT", "/tmp/ck14")


def prefill_step_ms(eng: Engine, rng, conc: int, prompt_len: int = 128) -> list[float]:
    """Milliseconds of each step (synchronised) from submitting `conc` prompts until all are done."""
    for i in range(conc):
        prompt = rng.integers(3, 1000, prompt_len).tolist()
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        eng.add_request(f"p{conc}-{i}-{time.monotonic_ns()}", prompt, params)
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t))
    return times


def main() -> None:
    if not os.path.exists(os.path.join(CKPT, "model.safetensors")):
        make_checkpoint("ouro-1.4b", CKPT, seed=0, dtype="bfloat16", progress=False)
    rng = np.random.default_rng(0)
    # PREFILL_PROBE_EAGER=0: graphs only (an A/B in one call).
    for graphs in (True, False) if os.environ.get("PREFILL_PROBE_EAGER", "1") != "0" else (True,):
        eng = Engine(EngineConfig(model=CKPT, cuda_graphs=graphs))
        prefill_step_ms(eng, rng, 1)  # warm-up: compiles, allocates
        for conc in (1, 8):
            runs = [prefill_step_ms(eng, rng, conc) for _ in range(3)]
            per_step = [round(statistics.median(col), 3) for col in zip(*runs, strict=False)]
            total = round(statistics.median(sum(r) for r in runs), 2)
            row = {"graphs": graphs, "conc": conc, "median_ms_per_step": per_step, "median_total_ms": total}
            print(json.dumps(row), flush=True)
        if not graphs:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                prefill_step_ms(eng, rng, 1)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
