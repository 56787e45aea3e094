"""o_proj that merges the decode attention's split partials itself: one dependent round a layer less.

The fused decode attention (kernels/fused_decode.py) splits a row's context over NUM_SPLITS programs, and the
last of them to arrive merges their partial softmaxes: a fence, a counter and a round of loads on the loop's
chain, which cost the H200 loop ~1.7 us a layer at 1-2 rows (docs/benchmarks.md, thirtieth session).
With `defer_merge` the attention only stores its partials (a DeferredMerge); here every program of o_proj
merges the partials of its heads itself, with merge_partials' arithmetic element for element (so its o is the
attention's merged output bit for bit), and multiplies them by its rows of the weight (a tensor-core dot, the
rows padded to 16). Program (i, j) owns output features [i BN, (i + 1) BN) over heads
[j HPP, (j + 1) HPP); its product is slot j of the fp32 partial products [KS, N, hidden] that add_rms_norm
adds in slot order, as it adds the tensor-core o_proj's.

The weight depends on no kernel of the step, so it is asked for before the PDL wait (W_MODE): 1 asks L2 for
its lines (holds no registers; the loads after the wait hit L2), 2 loads it into registers, 0 loads it only
after the wait. Every program re-merges its heads for its feature block: at BN 128, 16 reads of each head's
partials (~2 MB of L2 reads a layer at one row).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._util import interpreting
from .pdl import pdl_enter, pdl_launch
from .rounding import round_to


@dataclass
class DeferredMerge:
    """A decode attention's unmerged output: fp32 partials per (row, head, split) and the rows' metadata."""

    acc: torch.Tensor  # [R * Hq * S * D] fp32, unnormalised
    m: torch.Tensor  # [R * Hq * S] fp32, each slice's running max (log2 domain)
    lsum: torch.Tensor  # [R * Hq * S] fp32, each slice's softmax denominator (0: empty slice)
    row_len: torch.Tensor  # [R] int32: 0 marks a padding row (nothing stored for it)
    row_tok_off: torch.Tensor  # [R] int32: the token of row r's query
    tokens: int  # N, the call's token count
    heads: int
    head_dim: int
    splits: int
    dtype: torch.dtype  # the attention output's dtype: the merged o is rounded to it


@triton.jit
def _prefetch_l2(ptrs):
    # prefetch.global.L2: a hint that holds no registers; its dummy result keeps the side-effecting asm alive.
    tl.inline_asm_elementwise(
        "{ prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _merged_o(acc_ptr, m_ptr, l_ptr, rows, r_ok, head, d, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              NUM_SPLITS: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    # The merged attention output [R16, K] in DTYPE of rows `rows` at (head, d): merge_partials and
    # _merge_group's rounding, element for element (rows past r_ok: 0). .cg loads read L2, never a stale L1.
    base = (rows[:, None] * NUM_HEADS + head[None, :]) * NUM_SPLITS
    ok = r_ok[:, None] & (head >= 0)[None, :]
    m_max = tl.load(m_ptr + base, mask=ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s, mask=ok, other=0.0, cache_modifier=".cg"))
    total = tl.zeros_like(m_max)
    acc = tl.zeros_like(m_max)
    for s in tl.static_range(NUM_SPLITS):
        l_s = tl.load(l_ptr + base + s, mask=ok, other=0.0, cache_modifier=".cg")
        acc_ptrs = acc_ptr + (base + s) * HEAD_DIM + d[None, :]
        acc_s = tl.load(acc_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
        # An empty slice (l = 0) weighs 0 and its unwritten acc is selected away.
        m_s = tl.load(m_ptr + base + s, mask=ok, other=0.0, cache_modifier=".cg")
        w = tl.where(l_s > 0.0, tl.exp2(m_s - m_max), 0.0)
        total += w * l_s
        acc += w * tl.where(l_s > 0.0, acc_s, 0.0)
    out = acc / tl.where(total > 0.0, total, 1.0)
    return round_to(out, DTYPE, INTERPRETED)


@triton.jit
def _merge_o_proj_kernel(w_ptr, acc_ptr, m_ptr, l_ptr, len_ptr, tok_ptr, out_ptr, N, stride_w, stride_os,
                         stride_ot, ROWS: tl.constexpr, RP2: tl.constexpr, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HPP: tl.constexpr,
                         BN: tl.constexpr, W_MODE: tl.constexpr, LINE: tl.constexpr, DTYPE: tl.constexpr,
                         IEEE: tl.constexpr, INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    K: tl.constexpr = HPP * HEAD_DIM
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + pid_k * K
    # The weight: before the PDL wait (no kernel writes it), as W_MODE says.
    if W_MODE == 2:
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        pdl_enter(USE_PDL)
    else:
        if W_MODE == 1:  # noqa: SIM102 (INTERPRETED must not be tested unless W_MODE is 1)
            if not INTERPRETED:  # the interpreter has no PTX (and a hint changes no result)
                _prefetch_l2(w_rows + (tl.arange(0, K // LINE) * LINE)[None, :])
        pdl_enter(USE_PDL)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
    # Rows merged at their power of two RP2, then tiled to 16 for the tensor cores' dot (row i is row i % RP2;
    # only rows below ROWS are stored). Merging at 16 rows held 16x the loads in flight: spills.
    rows = tl.arange(0, RP2)
    r_ok = rows < ROWS
    n_q = tl.load(len_ptr + rows, mask=r_ok, other=0)
    tok = tl.load(tok_ptr + rows, mask=r_ok, other=0).to(tl.int64)
    o = _merged_o(acc_ptr, m_ptr, l_ptr, rows, r_ok, pid_k * HPP + offs_k // HEAD_DIM, offs_k % HEAD_DIM,
                  NUM_HEADS, HEAD_DIM, NUM_SPLITS, DTYPE, INTERPRETED)  # fmt: skip
    o = tl.reshape(tl.broadcast_to(o[None, :, :], [16 // RP2, RP2, K]), [16, K])
    if IEEE or INTERPRETED:  # fp32: full fp32 products (tf32 would round o); the interpreter: its bf16 dot
        # multiplies the storage bits, and bf16 products are exact in fp32 anyway
        y = tl.dot(w.to(tl.float32), tl.trans(o.to(tl.float32)), input_precision="ieee")
    else:
        y = tl.dot(w, tl.trans(o))
    # Columns below RP2 are rows 0 .. RP2 - 1; a padding row stored no partials and owns no token: not stored.
    y = tl.reshape(y, [BN, 16 // RP2, RP2])
    y = tl.sum(tl.where((tl.arange(0, 16 // RP2) == 0)[None, :, None], y, 0.0), axis=1)
    keep = n_ok[:, None] & (r_ok & (n_q > 0))[None, :]
    tl.store(out_ptr + pid_k * stride_os + tok[None, :] * stride_ot + offs_n[:, None], y, mask=keep)


def merged_o_proj(parts: DeferredMerge, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """o_proj of the merged attention output as fp32 partial products [Hq / HPP, N, out_features].

    parts: fused_decode_attention(..., defer_merge=True)'s result; w [out_features, Hq * D] (o_proj's weight).
    Slot j holds heads [j HPP, (j + 1) HPP)'s share; tokens of no row (and of padding rows) are left
    unwritten, as the attention leaves their output. config overrides BN, HPP, W_MODE and num_warps
    (defaults: CONFIG)."""
    cfg = {**CONFIG, **(config or {})}
    hpp, bn = cfg["HPP"], cfg["BN"]
    hq, d, s = parts.heads, parts.head_dim, parts.splits
    rows = parts.row_len.shape[0]
    n_out = w.shape[0]
    if w.dim() != 2 or w.shape[1] != hq * d or w.stride(1) != 1:
        raise ValueError(f"w must be [out, {hq * d}] with contiguous rows, got {tuple(w.shape)}")
    if d & (d - 1) or hq % hpp or s < 2:
        raise ValueError(f"needs a power-of-two head_dim, heads a multiple of HPP, 2+ splits: {d}, {hq}, {s}")
    out = torch.empty(hq // hpp, parts.tokens, n_out, dtype=torch.float32, device=w.device)
    if rows == 0 or parts.tokens == 0:
        return out
    _merge_o_proj_kernel[(triton.cdiv(n_out, bn), hq // hpp)](
        w, parts.acc, parts.m, parts.lsum, parts.row_len, parts.row_tok_off, out, n_out, w.stride(0),
        out.stride(0), out.stride(1),
        ROWS=rows, RP2=triton.next_power_of_2(rows), NUM_HEADS=hq, HEAD_DIM=d, NUM_SPLITS=s,
        HPP=hpp, BN=bn, W_MODE=cfg["W_MODE"], LINE=max(1, 128 // w.element_size()), DTYPE=_TL[parts.dtype],
        IEEE=parts.dtype == torch.float32, INTERPRETED=interpreting(), num_warps=cfg["num_warps"],
        **pdl_launch(w.device, "merge_o_proj"),
    )  # fmt: skip
    return out


def applies(rows: int) -> bool:
    """Whether a decode call of `rows` rows defers its attention's merge to o_proj (OURO_FAST_MERGE_O_PROJ:
    the most rows; 0, the default until measured faster on the GPU, never)."""
    return 0 < rows <= MAX_ROWS


def _config(spec: str) -> dict:
    # "BN:HPP:W_MODE:WARPS" (A/B runs), each field optional from the left.
    keys, vals = ("BN", "HPP", "W_MODE", "num_warps"), [64, 2, 2, 8]
    for i, v in enumerate(spec.split(":") if spec else []):
        vals[i] = int(v)
    return dict(zip(keys, vals, strict=True))


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_ROWS = int(os.environ.get("OURO_FAST_MERGE_O_PROJ", "0"))
CONFIG = _config(os.environ.get("OURO_FAST_MERGE_O_PROJ_CONFIG", ""))
