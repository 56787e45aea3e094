"""The exit gate's logit and the log-survival update of a token, in one small kernel.

After each loop the engine needs, per row, log S_t = log S_{t-1} + logsigmoid(-g_t) with
g_t = h . w + b (model/exit_rule.py). In PyTorch that is a cuBLAS dot, a reduction, a
cast and five elementwise launches (~12 us of kernels a launch on the H200, plus their
gaps); here one program per row does the dot in fp32, rounds g to the model's dtype as
the Linear would, and applies the update. The host-driven step (gate_log_survival) and
the decode lanes (engine/gpu/lane_kernels.py, fused into their exit decision) share
`log_survival`, so both paths compute the same bits and run-ahead replays the host's
exits exactly. logsigmoid(t) = min(t, 0) - log1p(exp(-|t|)), torch's formula, with
log1p from log alone (Goldberg's correction), so it also runs under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreting, next_pow2
from .rounding import round_to
from .tuning import EXIT_GATE_BLOCK, SMALL_KERNEL_WARPS


@triton.jit
def _log1p(e):
    # log(1 + e) for e in [0, 1]: log(u) * e / (u - 1), exact where u = 1 + e rounds to 1.
    u = 1.0 + e
    exact = u == 1.0
    return tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def log_survival(x_row_ptr, w_ptr, b_ptr, carried, HIDDEN, BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):
    """carried + logsigmoid(-g) in fp32, g = x_row . w + b rounded to x's dtype (the gate Linear's output)."""
    acc = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, HIDDEN, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        m = offs < HIDDEN
        x = tl.load(x_row_ptr + offs, mask=m, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.sum(acc, axis=0) + tl.load(b_ptr).to(tl.float32)
    t = -(round_to(g, x_row_ptr.dtype.element_ty, INTERPRETED).to(tl.float32))
    return carried + (tl.minimum(t, 0.0) - _log1p(tl.exp(-tl.abs(t))))


@triton.jit
def _gate_kernel(x_ptr, stride_x, last_ptr, prev_ptr, ls_prev_ptr, w_ptr, b_ptr, out_ptr, HIDDEN,
                 BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    last = tl.load(last_ptr + r).to(tl.int64)
    prev = tl.load(prev_ptr + r)
    # A row's first loop starts from survival 1 (log 0); later loops carry the previous loop's value.
    carried = tl.where(prev >= 0, tl.load(ls_prev_ptr + tl.maximum(prev, 0)), 0.0)
    ls = log_survival(x_ptr + last * stride_x, w_ptr, b_ptr, carried, HIDDEN, BLOCK_H, INTERPRETED)
    tl.store(out_ptr + r, ls)


def gate_log_survival(x: torch.Tensor, last: torch.Tensor, prev: torch.Tensor, ls_prev: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """float32 [R]: row r's log-survival after this loop, from token x[last[r]] ([N, H], the loop's
    output) and the carried value ls_prev[prev[r]] (0 where prev[r] < 0). weight [1, H] or [H] and
    bias [1] are the gate Linear's, in x's dtype. Graph-capturable (no host reads)."""
    r, hidden = last.shape[0], x.shape[1]
    if x.dim() != 2 or x.stride(1) != 1 or weight.numel() != hidden or bias.numel() != 1:
        raise ValueError(f"x must be [N, {hidden}] with contiguous rows, weight [{hidden}], bias [1]")
    if prev.shape != (r,) or ls_prev.dtype != torch.float32:
        raise ValueError("prev must be [R] like last, and ls_prev float32")
    out = torch.empty(r, dtype=torch.float32, device=x.device)
    if r:
        _gate_kernel[(r,)](
            x, x.stride(0), last, prev, ls_prev, weight, bias, out, hidden,
            BLOCK_H=min(EXIT_GATE_BLOCK, next_pow2(hidden)), INTERPRETED=interpreting(),
            num_warps=SMALL_KERNEL_WARPS,
        )  # fmt: skip
    return out
