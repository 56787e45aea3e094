"""What the kernel wrappers need to launch: input checks, launch facts and arrival counters.

Input checks raise ValueError before a launch; sm_count and interpreting say where kernels
run; next_pow2 sizes blocks; ArrivalCounters hold the int32 counters of kernels whose last
program of a group reduces the group.
"""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A K/V cache holds the activations' dtype, or float8 e4m3 (kv_cache_dtype "fp8") for any of them.
FP8_CACHE = torch.float8_e4m3fn


def tl_dtype(dtype: torch.dtype):
    """Triton's name for a float dtype of FLOAT_DTYPES (a kernel's constexpr)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless t is a bf16/fp16/fp32 tensor whose last dimension is contiguous."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def check_cache(name: str, t: torch.Tensor, act_dtype: torch.dtype) -> None:
    """Raise ValueError unless t is a K/V cache for activations of act_dtype: that dtype or float8 e4m3,
    contiguous in its last dimension."""
    if t.dtype not in (act_dtype, FP8_CACHE):
        raise ValueError(f"{name} must be {act_dtype} (the activations') or {FP8_CACHE}, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def check_fp8_weight(w: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless w is a contiguous float8_e4m3fn [N, K] and scale a float32 [N] beside it."""
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(
            f"an FP8 weight must be contiguous float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}"
        )
    if scale.dtype != torch.float32 or scale.shape != w.shape[:1] or scale.device != w.device:
        raise ValueError(
            f"an FP8 weight's scale must be float32 [{w.shape[0]}] on {w.device}, "
            f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
        )


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the same dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtypes must match, got {dtypes}")


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (132, the H200's, elsewhere: for configs chosen off the GPU)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_paged_inputs(q, k_cache, v_cache, block_tables, row_q_start, row_len, row_tok_off):
    """Validate paged-attention inputs (see paged_attention); returns (N, Hq, D, Hkv, R)."""
    check_float("q", q)
    check_cache("k_cache", k_cache, q.dtype)
    check_cache("v_cache", v_cache, q.dtype)
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv or k_cache.shape[2] != d or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    r = block_tables.shape[0]
    for name, t in (("row_q_start", row_q_start), ("row_len", row_len), ("row_tok_off", row_tok_off)):
        if t.shape != (r,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [{r}], got {t.dtype} {tuple(t.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32 with a contiguous last dimension")
    return n, hq, d, hkv, r


class ArrivalCounters:
    """Per device, int32 arrival counters for a kernel whose last program of a group reduces the group.

    Every counter is zero between launches (the last program resets its own). Buffers are
    allocated on an eager call, never while a CUDA graph is captured; a replaced buffer
    stays referenced, since a captured graph may still point at it. Index by device for
    the buffers (tests check they are all zero).
    """

    def __init__(self, owner: str, minimum: int = 8192):
        self.owner, self.minimum = owner, minimum
        self.buffers: dict[torch.device, list[torch.Tensor]] = {}

    def __getitem__(self, device: torch.device) -> list[torch.Tensor]:
        return self.buffers[device]

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """A zeroed counter buffer of at least n entries on `device`."""
        bufs = self.buffers.setdefault(device, [])
        if not bufs or bufs[-1].numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.owner}: run each shape once before CUDA-graph capture (it allocates counters)"
                )
            bufs.append(torch.zeros(max(self.minimum, n), dtype=torch.int32, device=device))
        return bufs[-1]
