"""vLLM 0.33.0's own v1 Scheduler on pure-decode batches: schedule() + update_from_output() per step.

Runs in the client venv (bench/setup_vllm_client.sh), CPU only; it imports
nothing of ouro_fast. The set-up follows vLLM's own scheduler tests: a
SchedulerConfig, a ModelConfig over a local config-only model folder (no
weights, no tokenizer), a CacheConfig with vLLM's defaults (prefix caching on,
sha256 block hashes) and a KVCacheConfig of one full-attention group. B
requests with 128-token prompts are prefilled; then every step schedules B
decode tokens. The fake runner output (one sampled id per request) is built
between the two calls and not timed. Extra requests wait in the queue; they
cannot be admitted (max_num_seqs = B).

Run: VLLM_TARGET_DEVICE=cpu $CLIENT_VENV/bin/python -m bench.vllm_scheduler_bench --out bench/results/DIR
"""

from __future__ import annotations

import gc
import json
import logging
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from bench.benchlib import bench_args, start_run, summarize, write_result  # noqa: E402

PROMPT = 128
BLOCK_SIZE = 16
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1100,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


def model_dir() -> str:
    """A config-only model folder: ModelConfig reads config.json and nothing else."""
    d = Path(tempfile.gettempdir()) / "ouro_fast-vllm-sched-model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(d)


def make_scheduler(batch: int, num_blocks: int, prefix_caching: bool):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = MODEL_CONFIG["max_position_embeddings"]
    sched_cfg = SchedulerConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    model_cfg = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="float32", seed=0)
    cache_cfg = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    vllm_cfg = VllmConfig(scheduler_config=sched_cfg, model_config=model_cfg, cache_config=cache_cfg)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16, dtype=torch.float32)
    kv_cfg = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    cache_cfg.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_cfg,
        kv_cache_config=kv_cfg,
        structured_output_manager=StructuredOutputManager(vllm_cfg),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def make_requests(n: int, start: int, max_tokens: int, prefix_caching: bool, rng) -> list:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hasher = None
    if prefix_caching:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return [
        Request(
            request_id=str(start + i),
            prompt_token_ids=[rng.randrange(3, 1000) for _ in range(PROMPT)],
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        for i in range(n)
    ]


def fake_output(sched_out):
    """What the model runner would return: one sampled id per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7]] * len(ids)
    )


def measure(batch: int, waiting: int, steps: int, prefix_caching: bool = True) -> dict:
    import random

    rng = random.Random(0)
    need = (PROMPT + steps + 64 + BLOCK_SIZE - 1) // BLOCK_SIZE
    sched = make_scheduler(batch, batch * need + 16, prefix_caching)
    for req in make_requests(batch, 0, steps + 64, prefix_caching, rng):
        sched.add_request(req)
    # Prefill, then a few decode steps.
    for _ in range(64):
        out = sched.schedule()
        sched.update_from_output(out, fake_output(out))
        if out.total_num_scheduled_tokens == batch and len(sched.running) == batch:
            break
    for _ in range(8):
        out = sched.schedule()
        sched.update_from_output(out, fake_output(out))
    for req in make_requests(waiting, batch, 64, prefix_caching, rng):
        sched.add_request(req)
    step_us, sched_us, upd_us = [], [], []
    gc.collect()
    clock = time.perf_counter_ns
    for _ in range(steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        mro = fake_output(out)
        t2 = clock()
        sched.update_from_output(out, mro)
        t3 = clock()
        if out.total_num_scheduled_tokens != batch:
            raise RuntimeError("the measured window was not steady decode")
        sched_us.append((t1 - t0) / 1e3)
        upd_us.append((t3 - t2) / 1e3)
        step_us.append((t1 - t0 + t3 - t2) / 1e3)
    total = sum(step_us)
    step = summarize(step_us)
    return {
        "impl": "vllm-0.33.0",
        "prefix_caching": prefix_caching,
        "batch": batch,
        "waiting": waiting,
        "steps": steps,
        "tokens": steps * batch,
        "steps_per_token": 1.0,
        "step_us": step,
        "schedule_us": summarize(sched_us),
        "update_us": summarize(upd_us),
        # One token per request per step: per token = the median step / batch.
        "us_per_token": round(step["p50"] / batch, 4),
        "us_per_batch_token": step["p50"],
        "mean_us_per_token": round(total / (steps * batch), 4),
    }


def run(quick: bool = False, batches=(1, 8, 64, 256), waitings=(0, 10, 1000, 10000)) -> list[dict]:
    if quick:
        batches, waitings = (1, 8), (0, 10)
    out = []
    for prefix_caching in (True, False):
        for batch in batches:
            for waiting in waitings:
                if not prefix_caching and waiting not in (0,):
                    continue  # the queue costs nothing either way; one column suffices
                steps = 16 if quick else max(100, min(2000, 40_000 // batch))
                res = measure(batch, waiting, steps, prefix_caching)
                out.append(res)
                print(
                    f"vllm prefix_caching={prefix_caching!s:5} batch {batch:4d} waiting {waiting:5d}: "
                    f"{res['step_us']['p50']:9.1f} us/step (p10 {res['step_us']['p10']:.1f}, "
                    f"p90 {res['step_us']['p90']:.1f}), {res['us_per_token']:.2f} us/token",
                    flush=True,
                )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = bench_args(__doc__, argv)
    logging.disable(logging.WARNING)
    meta = start_run()
    import vllm

    meta["vllm_version"] = vllm.__version__
    res = run(args.quick)
    write_result(meta, res, args.out, "vllm_scheduler")
    return res


if __name__ == "__main__":
    main()
