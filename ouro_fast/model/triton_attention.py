"""Paged attention backend on the Triton kernels: same call as PagedTorchAttention, tensor metadata.

Per model call the runner sets `batch` (a TritonBatch of device tensors). A
decode-only call (max_q_len 1) on a backend that owns RoPE costs ONE launch per
layer (kernels/decode_attention.py: RoPE, K/V write, split-context attention and
its merge); otherwise a layer costs the K/V write (fused with RoPE when the backend
owns RoPE) and the paged attention (decode-only calls: kernels/split_kv_attention.py,
a split-context launch and a merge; others: kernels/prefill_attention.py). No
per-layer host work, no device-to-host syncs, and launch grids that depend only on
tensor shapes and max_q_len, so the call can be captured in a CUDA graph at fixed
padded shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import (
    fused_decode_attention,
    paged_attention,
    paged_decode_attention,
    rope_cos_sin_table,
    rope_write_kv,
)
from ..kernels.cascade_attention import SharedPrefixes


@dataclass
class TritonBatch:
    """Where each token's K/V lives for one model call, all on the device.

    slot_mapping [N] int64: the slot each token's K/V is written to (-1: no write); in a
    decode-only call, a row's slot of its position, and -1 for tokens of no row (the
    fused decode kernel writes only rows' tokens and reads their K/V from registers).
    positions [N] int64: each token's position (read only when the backend applies RoPE).
    block_tables [R, MB] int32: row r's block table for ITS loop (-1 beyond its blocks).
    row_q_start, row_len, row_tok_off [R] int32: row r is tokens tok_off .. tok_off+len-1
    of the call at positions q_start ..; len 0 marks a padding row.
    max_q_len: a fixed bound on row_len (1 for decode-only calls); it shapes the grid.
    prefixes: one-token rows grouped by a shared prefix, read once for each group
    (kernels/cascade_attention.py; decode-only calls take it on a backend that applies RoPE, calls
    with longer rows always); None: every row reads its whole context.
    """

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    row_q_start: torch.Tensor
    row_len: torch.Tensor
    row_tok_off: torch.Tensor
    max_q_len: int
    prefixes: SharedPrefixes | None = None

    @classmethod
    def from_schedule(cls, sched, tables: np.ndarray, device, max_q_len: int | None = None) -> TritonBatch:
        """Build from a LoopScheduler step (row_* and token arrays) and BlockTable.tables.

        max_q_len defaults to the step's token count (always a valid bound); pass a
        fixed bucket instead when the launch must be graph-capturable.
        """
        r, n = sched.num_rows, sched.num_step_tokens
        tables_of_rows = tables[sched.row_kv_slot[:r], sched.row_loop[:r]]

        def dev(a: np.ndarray, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device, non_blocking=True)

        return cls(
            slot_mapping=dev(sched.slot_mapping[:n], np.int64),
            positions=dev(sched.positions[:n], np.int64),
            block_tables=dev(tables_of_rows, np.int32),
            row_q_start=dev(sched.row_start[:r], np.int32),
            row_len=dev(sched.row_len[:r], np.int32),
            row_tok_off=dev(sched.row_tok_off[:r], np.int32),
            max_q_len=max(1, int(n) if max_q_len is None else max_q_len),
        )


class TritonPagedAttention:
    """Paged attention over loop planes on the Triton kernels.

    kv_cache [2, num_layers, num_slots, Hkv, D]; a slot is block_id * block_size + offset.
    With rope_theta and max_positions the backend applies RoPE itself (applies_rope is
    True) and expects UNROTATED q and k; otherwise q and k arrive rotated, as
    OuroForCausalLM.run_loop passes them today. dtype: the activations' (default the cache's); the cache
    may be float8 e4m3 for any of them (rounding.as_cached says what it holds).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_size: int,
        rope_theta: float | None = None,
        max_positions: int | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.kv_cache = kv_cache
        self.dtype = dtype or kv_cache.dtype
        self.block_size = block_size
        self.batch: TritonBatch | None = None
        self.applies_rope = rope_theta is not None
        self.cos_sin = None
        if self.applies_rope:
            if not max_positions:
                raise ValueError("max_positions is needed when the backend applies RoPE")
            self.cos_sin = rope_cos_sin_table(max_positions, kv_cache.shape[-1], rope_theta, kv_cache.device)

    def takes_partials(self) -> bool:
        """True when this call's q, k, v may be the qkv matmul's fp32 partial products [S, N, H, D]
        (the fused decode kernel adds them)."""
        return self.batch.max_q_len == 1 and self.applies_rope

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        kc, vc = self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]
        meta = (b.block_tables, b.row_q_start, b.row_len, b.row_tok_off, self.block_size)
        scale = 1.0 / math.sqrt(q.shape[-1])
        if q.dim() == 4 and not self.takes_partials():
            raise ValueError("partial q, k, v are taken only by decode calls with RoPE (takes_partials)")
        if self.takes_partials():
            # Decode-only call: one launch instead of three (each launch costs ~2-3 us of latency).
            rope = (b.slot_mapping, b.positions, self.cos_sin)
            opts = {"prefixes": b.prefixes, "dtype": self.dtype}
            return fused_decode_attention(q, k, v, kc, vc, *rope, *meta, scale, **opts)
        positions = b.positions if self.applies_rope else None
        # Rotating in place is safe: q is a fresh projection output owned by this call.
        q = rope_write_kv(q, k, v, kc, vc, b.slot_mapping, positions, self.cos_sin, q_out=q)
        if b.max_q_len == 1:
            # Decode-only call: split the context over more programs than rows x heads.
            return paged_decode_attention(q, kc, vc, *meta, scale)
        return paged_attention(q, kc, vc, *meta, b.max_q_len, scale, prefixes=b.prefixes)
