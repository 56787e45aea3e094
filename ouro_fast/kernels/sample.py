"""Greedy and temperature sampling of a logits batch in one launch (Gumbel-max with Philox noise).

The engine's Sampler takes this path when no row asks for top-k, top-p or a seed:
about a dozen small PyTorch launches (and host round trips) become one kernel at
every token boundary. Row r: argmax of logits[r, :V] when temperature[r] is below
the greedy threshold, else argmax of logits / temperature + Gumbel noise, the noise
drawn by Philox from seeds[r] and the vocabulary index (so a row's draw depends on
its seed alone, never on the batch). Ties go to the lowest index, as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_float, next_pow2
from .pdl import pdl_enter, pdl_launch
from .tuning import SAMPLE_BLOCK, SAMPLE_WARPS, SAMPLE_WIDE_BLOCK, SAMPLE_WIDE_WARPS


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, seed_ptr, gate_ptr, out_ptr, V, stride, greedy_eps,
                   BLOCK: tl.constexpr, GATED: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_enter(USE_PDL)  # the logits and the gate are earlier kernels' outputs
    row = tl.program_id(0).to(tl.int64)
    if GATED:  # noqa: SIM102 (a constexpr test: without it, the gate load must not be built)
        # A row nobody samples (a lane that does not exit) skips the vocabulary scan.
        if tl.load(gate_ptr + row) == 0:
            tl.store(out_ptr + row, -1)
            return
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    greedy = temp < greedy_eps
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(logits_ptr + row * stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if not greedy:
            # u in (0, 1): -log(-log(u)) is finite.
            u = tl.maximum(tl.rand(seed, offs), 1.0e-20)
            x = x * inv_t - tl.log(-tl.log(u))
        x = tl.where(ok, x, float("-inf"))
        m = tl.max(x, axis=0)
        idx = tl.min(tl.where(x == m, offs, V), axis=0)
        # Strictly greater: an equal maximum in a later block keeps the earlier index.
        take = m > best
        best_idx = tl.where(take, idx, best_idx)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample_gumbel(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    greedy_eps: float,
    vocab: int,
    row_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ids [R]: per row, the argmax (temperature < greedy_eps) or a softmax(logits / t) draw.

    logits [R, >= vocab] (only the first `vocab` columns count); temperature float32 [R] and
    seeds int64 [R] on logits' device. Deterministic: the same inputs give the same ids.
    row_gate (int32 [R] on the device): rows where it is 0 are not sampled and get id -1.
    """
    check_float("logits", logits)
    r = logits.shape[0]
    if logits.dim() != 2 or not 0 < vocab <= logits.shape[1]:
        raise ValueError(f"logits must be [R, >= {vocab}], got {tuple(logits.shape)}")
    if temperature.shape != (r,) or temperature.dtype != torch.float32:
        raise ValueError(
            f"temperature must be float32 [{r}], got {temperature.dtype} {tuple(temperature.shape)}"
        )
    if seeds.shape != (r,) or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be int64 [{r}], got {seeds.dtype} {tuple(seeds.shape)}")
    if row_gate is not None and (row_gate.shape != (r,) or row_gate.dtype != torch.int32):
        raise ValueError(f"row_gate must be int32 [{r}], got {row_gate.dtype} {tuple(row_gate.shape)}")
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r:
        block = min(SAMPLE_BLOCK, next_pow2(vocab))
        warps = SAMPLE_WIDE_WARPS if block >= SAMPLE_WIDE_BLOCK else SAMPLE_WARPS
        gate = row_gate if row_gate is not None else seeds  # any tensor: read only when GATED
        _sample_kernel[(r,)](
            logits, temperature, seeds, gate, out, vocab, logits.stride(0), greedy_eps, BLOCK=block,
            GATED=row_gate is not None, num_warps=warps, **pdl_launch(logits.device),
        )  # fmt: skip
    return out


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, row_mask_ptr, V, stride, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    m = tl.load(row_mask_ptr + row).to(tl.int64)
    words = tl.load(mask_ptr + m * stride_m + offs // 32, mask=ok, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ninf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride + offs, ninf, mask=ok & ~allowed)


def mask_tokens_(logits: torch.Tensor, bitmask: torch.Tensor, row_mask: torch.Tensor, vocab: int) -> None:
    """In place: logits[r, t] = -inf for every t < vocab whose bit is clear in bitmask[row_mask[r]] (int32
    [M, >= ceil(vocab / 32)]; bit t % 32 of word t // 32, xgrammar's layout). row_mask: int64 [R]."""
    check_float("logits", logits)
    r = logits.shape[0]
    if logits.dim() != 2 or not 0 < vocab <= logits.shape[1] or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-major [R, >= {vocab}], got {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or 32 * bitmask.shape[1] < vocab:
        raise ValueError(f"bitmask must be int32 [M, >= {-(-vocab // 32)}], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")  # fmt: skip
    if row_mask.shape != (r,) or row_mask.dtype != torch.int64:
        raise ValueError(f"row_mask must be int64 [{r}], got {row_mask.dtype} {tuple(row_mask.shape)}")
    if r:
        block = min(1024, next_pow2(vocab))
        _bitmask_kernel[(r, triton.cdiv(vocab, block))](
            logits, bitmask, row_mask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block, num_warps=4
        )
