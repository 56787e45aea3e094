import json
import os
import time

import torch

t0 = time.time()
from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.checkpoints import make_checkpoint

out = os.environ.get("OUT", "/tmp")
ck = "/tmp/ck14"
if not os.path.exists(ck + "/model.safetensors"):
    t = time.time()
    make_checkpoint("ouro-1.4b", ck, seed=0, dtype="bfloat16", progress=False)
    print("make_checkpoint", time.time() - t, flush=True)
t = time.time()
eng = Engine(
    EngineConfig(
        model=ck, max_num_seqs=64, max_num_batched_tokens=2048, runner=os.environ.get("RUNNER", "auto")
    )
)
print("engine load", time.time() - t, "blocks", eng.bt.num_blocks, flush=True)
import numpy as np

rng = np.random.default_rng(0)
res = {}
for conc, q in [(1, 1.0), (8, 1.0), (8, 0.5)]:
    for i in range(conc):
        eng.add_request(
            f"w{conc}{q}{i}",
            rng.integers(3, 1000, 128).tolist(),
            SamplingParams(max_tokens=8, ignore_eos=True, exit_threshold=q),
        )
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    st0 = (
        eng.stats.steps,
        eng.stats.model_seconds,
        eng.stats.scheduler_seconds,
        eng.stats.detok_seconds,
        sum(eng.stats.exit_depth_histogram),
    )
    t = time.time()
    for i in range(conc):
        eng.add_request(
            f"r{conc}{q}{i}",
            rng.integers(3, 1000, 128).tolist(),
            SamplingParams(max_tokens=64, ignore_eos=True, exit_threshold=q),
        )
    ttft = None
    while eng.has_unfinished_requests():
        o = eng.step()
        if ttft is None and any(x.new_token_ids for x in o):
            ttft = time.time() - t
    torch.cuda.synchronize()
    dt = time.time() - t
    s = eng.stats
    steps = s.steps - st0[0]
    r = dict(
        conc=conc,
        q=q,
        seconds=dt,
        tok_s=conc * 64 / dt,
        steps=steps,
        ms_per_step=1000 * dt / steps,
        ttft_ms=1000 * ttft,
        model_ms_per_step=1000 * (s.model_seconds - st0[1]) / steps,
        sched_ms_per_step=1000 * (s.scheduler_seconds - st0[2]) / steps,
        detok_ms_per_step=1000 * (s.detok_seconds - st0[3]) / steps,
        hist=s.exit_depth_histogram,
    )
    print(json.dumps(r), flush=True)
    res[f"{conc}-{q}"] = r
from torch.profiler import ProfilerActivity, profile

eng.add_request("p", rng.integers(3, 1000, 128).tolist(), SamplingParams(max_tokens=16, ignore_eos=True))
for _ in range(8):
    eng.step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
json.dump(res, open(out + "/probe.json", "w"), indent=1)
print("total", time.time() - t0)
