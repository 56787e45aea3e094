"""Attention backends in plain PyTorch: the references the Triton kernels are tested against.

A backend is called per layer as `attn(layer_idx, q, k, v)` with q [N, Hq, D] and
k, v [N, Hkv, D] for the N tokens of one model call. It writes k and v into the
KV plane of each token's loop, then returns causal attention over that plane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # float8 e4m3's largest finite value


def allocate_kv_cache(cfg, num_slots: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The paged K/V of every (loop, layer) plane: [2, layers, num_slots, kv_heads, head_dim], in the
    activations' dtype or float8 e4m3 (to_cache_dtype)."""
    shape = (2, cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def to_cache_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a K/V cache of `dtype` holds it: for float8 e4m3 saturated to +-448 and rounded to nearest even
    (the Triton kernels store the same bits), else t in dtype."""
    if dtype == torch.float8_e4m3fn:
        return t.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return t.to(dtype)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """q [n, Hq, D] at positions q_start.. attends k, v [S, Hkv, D] at positions 0..S-1, causally."""
    n, hq, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 cache's values widen exactly
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    q_pos = torch.arange(q_start, q_start + n, device=q.device)[:, None]
    mask = torch.arange(s, device=q.device)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=1.0 / math.sqrt(d),
    )
    return out.transpose(0, 1).to(q.dtype)


class ContiguousAttention:
    """One sequence, one contiguous K/V tensor per (loop, layer) plane: the simplest backend.

    Set `loop` and `start` before each model call; the call's tokens are positions
    start..start+N-1, all at that loop. dtype is the cache's: the activations' or float8 e4m3.
    """

    def __init__(self, num_loops, num_layers, max_len, num_kv_heads, head_dim, dtype, device):
        shape = (num_loops, num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.loop = 0
        self.start = 0

    def __call__(self, layer_idx, q, k, v):
        end = self.start + q.shape[0]
        self.k[self.loop, layer_idx, self.start : end] = to_cache_dtype(k, self.k.dtype)
        self.v[self.loop, layer_idx, self.start : end] = to_cache_dtype(v, self.v.dtype)
        kp, vp = self.k[self.loop, layer_idx, :end], self.v[self.loop, layer_idx, :end]
        return causal_attend(q, kp, vp, self.start)


@dataclass
class PagedBatch:
    """Where each token's K/V lives for one model call (built by the runner from the scheduler's arrays).

    slot_mapping [N]: physical slot to write each token's K/V (-1: do not write).
    row_token_start/row_len/row_q_start: each row's tokens in the call and their first position.
    row_kv_slots: per row, the physical slots of positions 0..end-1 in that row's loop plane.
    """

    slot_mapping: torch.Tensor
    row_token_start: list[int]
    row_len: list[int]
    row_q_start: list[int]
    row_kv_slots: list[torch.Tensor]


class PagedTorchAttention:
    """Paged attention over loop planes, in plain PyTorch: gathers each row's K/V from its plane.

    kv_cache [2, num_layers, num_slots, Hkv, D]; a physical slot is block_id * block_size + offset. An
    FP8 cache's keys and values widen to the activations' dtype exactly before attention.
    """

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.batch: PagedBatch | None = None

    def __call__(self, layer_idx, q, k, v):
        b = self.batch
        kc, vc = self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]
        write = b.slot_mapping >= 0
        slots = b.slot_mapping[write]
        kc[slots] = to_cache_dtype(k[write], kc.dtype)
        vc[slots] = to_cache_dtype(v[write], vc.dtype)
        out = torch.empty_like(q)
        for r, start in enumerate(b.row_token_start):
            n = b.row_len[r]
            kv = b.row_kv_slots[r]
            out[start : start + n] = causal_attend(q[start : start + n], kc[kv], vc[kv], b.row_q_start[r])
        return out
