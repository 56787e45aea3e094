"""EngineConfig: every setting of the engine, with its default and meaning.

The server exposes each field as a command-line flag and an OURO_FAST_* variable
(server/config.py); the offline LLM takes them as keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class EngineConfig:
    """How to build an Engine. `model` None serves the embedded tiny default (random weights)."""

    model: str | None = None  # a checkpoint directory (config.json, safetensors, tokenizer files)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU; or float32, bfloat16, float16
    device: str = "auto"  # auto: cuda when available, else cpu
    max_num_seqs: int = 256  # rows per step = requests holding KV at once (vLLM's default too)
    max_num_batched_tokens: int = 512  # tokens per step (prefill chunks included)
    max_waiting: int = 1024  # requests queued beyond the running ones
    max_model_len: int | None = None  # default: the config's max_position_embeddings
    block_size: int = 16  # positions per KV block
    kv_cache_bytes: int | None = None  # default: 256 MiB on CPU, 85% of free memory on CUDA
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes
    # Reuse the K/V of prompt blocks seen before (every loop's plane at once); unheld ones evicted LRU.
    enable_prefix_caching: bool = True
    refill: bool = True  # False: a batch drains to its slowest row before new rows join (for comparisons)
    seed: int = 0  # seeds the sampler of unseeded requests
    keep_logits: bool = False  # keep each output token's logits on its request (tests; no run-ahead)
    runner: str = "auto"  # "torch" (the reference), "triton" (kernels + CUDA graphs); auto: triton on CUDA
    cuda_graphs: bool = True  # capture every step shape at start-up (triton runner on CUDA)
    cpu_threads: int | None = 1  # torch threads on CPU (None: torch's default); leaves a core to HTTP
    run_ahead: bool = True  # triton runner: decode-only batches launch ahead of their exit read-back
    # Also at full depth, where it hides the host's per-step work instead of an exit read-back.
    run_ahead_full_depth: bool = True
    run_ahead_depth: int = 1  # launches queued ahead of the one whose records the host reads (1..3)
    # Triton runner: decode lanes that share a prompt prefix (cache hits) read its K/V once a step for all.
    cascade_attention: bool = True
    compile_threads: int | None = None  # start-up kernel compiles in parallel; None: the CPUs, at most 16
    # "fp8": the layers' linear weights in float8 e4m3, a scale per output row (model/quantization.py).
    quantization: str | None = None
    # "auto": K/V in the activations' dtype; "fp8": float8 e4m3, saturated at +-448 (half the bytes).
    kv_cache_dtype: str = "auto"
    # TEST-ONLY: "STAGE:SEED@TOKENS,..." makes a step stage raise for chosen requests (engine/faults.py).
    test_faults: str = ""
    # Seconds a request may wait before its first step; then it ends "abort" with an error. None: forever.
    queue_timeout: float | None = None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {self.dtype!r}")
        return dtypes[self.dtype]

    def resolved_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The K/V cache's dtype for activations of `dtype`."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {choices}; got {self.kv_cache_dtype!r}")
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else dtype

    def resolved_runner(self, device: torch.device) -> str:
        kind = self.runner
        if kind == "auto":
            kind = "triton" if device.type == "cuda" else "torch"
        if kind not in ("torch", "triton"):
            raise ValueError(f"runner must be auto, torch or triton; got {kind!r}")
        return kind
