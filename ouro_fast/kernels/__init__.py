"""Triton kernels for the Ouro forward step (needs the `gpu` extra: triton).

Each kernel takes bf16, fp16 or fp32 tensors and accumulates in fp32. Every
launch grid depends only on tensor shapes and compile-time constants, so a
CUDA graph captured at fixed padded shapes stays valid when the metadata
tensors' contents change. On a machine without CUDA, set TRITON_INTERPRET=1
before importing triton to run them on the CPU (slowly: tests only).

The decode attention is one launch (decode_attention.py); split_kv_attention.py is
its three-launch reference with rope_kv.py, and prefill_attention.py serves prompt
chunks. cascade_attention.py reads a prefix that rows share once for all of them, before
either attention. Every launch-tuning default (tiles, splits, warps, register caps, ring,
pacing) is in tuning.py. This package imports nothing from the rest of ouro_fast.
"""

from .decode_attention import fused_decode_attention
from .norm import add_rms_norm, rms_norm
from .prefill_attention import paged_attention
from .propagate import propagate_kv
from .rope_kv import rope_cos_sin_table, rope_write_kv
from .split_kv_attention import paged_decode_attention
from .swiglu import silu_and_mul

__all__ = [
    "add_rms_norm",
    "fused_decode_attention",
    "paged_attention",
    "paged_decode_attention",
    "propagate_kv",
    "rms_norm",
    "rope_cos_sin_table",
    "rope_write_kv",
    "silu_and_mul",
]
