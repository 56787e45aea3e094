"""Skinny matmul for decode: out = x @ w.T for a few rows of x, reading the weight once.

At decode a matmul has M = 1..16 rows and is bound by streaming the weight from
HBM. Each program owns BLOCK_N output columns for ALL M rows and walks its share
of K in BLOCK_K chunks, so the weight is read exactly once whatever M is. With
SPLIT_K > 1, K is cut into SPLIT_K ranges (more programs in flight); their fp32
partial tiles go to a workspace and are summed in a fixed order, either by the
last program of each column tile to arrive (FUSED_REDUCE: one launch, an int32
arrival counter per tile that the last program resets to zero) or by a second
small kernel. Both orders are the same, so both give bit-identical results, and
results do not depend on scheduling.

Two inner products: USE_DOT runs tl.dot with the roles swapped (w tile
[BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 16]: rows padded to the tensor-core minimum,
which costs nothing while the weight stream is the bound); otherwise a CUDA-core
multiply-add into a [BLOCK_M, BLOCK_N, BLOCK_K] register tile reduced once at
the end (for M = 1 or 2).

Launch grids depend only on shapes and the config, so calls are CUDA-graph
capturable; the counters are allocated on the first eager call (warm-up), never
during capture. Calls that share the counters must be ordered (one stream).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import (
    ArrivalCounters,
    check_float,
    check_fp8_weight,
    check_same_dtype,
    interpreting,
    next_pow2,
    sm_count,
)
from .pdl import pdl_enter, pdl_launch
from .rounding import round_to
from .swiglu import silu_and_mul, silu_mul
from .tuning import (
    SKINNY_CONFIGS,
    SKINNY_DEFAULT_BLOCK_K,
    SKINNY_DEFAULT_BLOCK_N,
    SKINNY_DEFAULT_PROGRAMS_PER_SM,
    SKINNY_DEFAULT_STAGES,
    SKINNY_DEFAULT_WARPS,
    SKINNY_MAX_M,
    SKINNY_REDUCE_BLOCK,
    SKINNY_REDUCE_WARPS,
)

# One counter per column tile; BLOCK_N >= 8 covers N up to 65,536 without growing.
_MIN_COUNTERS = 8192
# Split-K factors the GPU benchmark sweeps for the Ouro-1.4B shapes (N, K): qkv, o_proj, gate_up, down.
CANDIDATE_SPLITS: dict[tuple[int, int], tuple[int, ...]] = {
    (6144, 2048): (1, 2, 4, 8),
    (2048, 2048): (2, 4, 8, 16),
    (11264, 2048): (1, 2, 4),
    (2048, 5632): (4, 8, 16),
}
# (BLOCK_N, BLOCK_K, num_warps) of the tl.dot kernel that the benchmark sweeps.
_DOT_TILES = ((64, 128, 4), (64, 256, 4), (128, 128, 8), (32, 256, 4))


@triton.jit
def _load(ptrs, mask):
    # mask None: an unmasked load (triton takes no `other` without a mask).
    if mask is None:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_x(x_ptrs, mask, SILU_MUL_OFF: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    # The activation chunk; with SILU_MUL_OFF = F > 0 it is silu(x[:, k]) * x[:, F + k] rounded as
    # silu_and_mul rounds it, so the fused matmul equals the two launches bit for bit.
    x = _load(x_ptrs, mask)
    if SILU_MUL_OFF > 0:
        x = silu_mul(x.to(tl.float32), _load(x_ptrs + SILU_MUL_OFF, mask).to(tl.float32), DTYPE, INTERPRETED)
    return x


@triton.jit
def _dot_partial(w_first, w_ptrs, x_ptrs, k_start, k_end, K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_UPCAST: tl.constexpr, SILU_MUL_OFF: tl.constexpr,
                 INTERPRETED: tl.constexpr):  # fmt: skip
    # w_ptrs [BLOCK_N, BLOCK_K], x_ptrs [BLOCK_K, BLOCK_M] (x transposed); returns fp32 [BLOCK_M, BLOCK_N].
    # w_first: the first weight chunk, loaded by the caller (before the PDL wait).
    offs_k = tl.arange(0, BLOCK_K)
    xt = _load_x(x_ptrs, (k_start + offs_k < k_end)[:, None], SILU_MUL_OFF, w_first.dtype, INTERPRETED)
    acc = _dot(w_first, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION, DOT_UPCAST)
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs).to(w_first.dtype)
            xt = _load_x(x_ptrs, None, SILU_MUL_OFF, w.dtype, INTERPRETED)
        else:
            k_ok = k + offs_k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(w_first.dtype)
            xt = _load_x(x_ptrs, k_ok[:, None], SILU_MUL_OFF, w.dtype, INTERPRETED)
        acc = _dot(w, xt, acc, DOT_PRECISION, DOT_UPCAST)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.trans(acc)


@triton.jit
def _dot(w, xt, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:
        # The interpreter's numpy dot cannot take bf16; products of 16-bit floats are exact in fp32.
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, xt, acc, input_precision=DOT_PRECISION)


@triton.jit
def _fma_partial(w_first, w_ptrs, x_ptrs, k_start, k_end, K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SILU_MUL_OFF: tl.constexpr,
                 INTERPRETED: tl.constexpr):  # fmt: skip
    # w_ptrs [BLOCK_N, BLOCK_K], x_ptrs [BLOCK_M, BLOCK_K]; returns fp32 [BLOCK_M, BLOCK_N].
    # Products accumulate elementwise; the cross-thread sum over K happens once, after the loop.
    offs_k = tl.arange(0, BLOCK_K)
    x = _load_x(x_ptrs, (k_start + offs_k < k_end)[None, :], SILU_MUL_OFF, w_first.dtype, INTERPRETED)
    acc = x.to(tl.float32)[:, None, :] * w_first.to(tl.float32)[None, :, :]
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs).to(w_first.dtype)
            x = _load_x(x_ptrs, None, SILU_MUL_OFF, w.dtype, INTERPRETED)
        else:
            k_ok = k + offs_k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(w_first.dtype)
            x = _load_x(x_ptrs, k_ok[None, :], SILU_MUL_OFF, w.dtype, INTERPRETED)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.sum(acc, axis=2)


@triton.jit
def _load_first_w(w_ptrs, k_start, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # The CTA's first weight chunk (zeros for an empty K range). With EVEN_K a chunk is wholly in or
    # out, so the mask is uniform along K and the load stays vectorised. FP8 weights stay FP8 here:
    # the caller widens them after the PDL wait is issued.
    if EVEN_K:
        return tl.load(w_ptrs, mask=(tl.full([BLOCK_K], 0, tl.int32) + k_start < k_end)[None, :], other=0.0)
    else:
        return tl.load(w_ptrs, mask=(k_start + tl.arange(0, BLOCK_K) < k_end)[None, :], other=0.0)


# M is not specialised (M == 1, M % 16 == 0 would each compile the kernel again).
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    ws_ptr,
    cnt_ptr,
    gate_ptr,
    scale_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SILU_MUL_OFF: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_PDL: tl.constexpr,
    GATED: tl.constexpr,
    SCALED: tl.constexpr,
):
    # One program: BLOCK_N output columns of every row, over K range pid_k.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows and columns re-read valid ones (stores are masked), so loads need no N/M mask.
    w_rows = (offs_n % N).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_start + offs_k)[None, :]
    # No kernel writes the weight: its first chunk streams in while the previous kernel finishes.
    if GATED:
        # Rows with gate 0 need no output: when no row needs one, skip the weight stream entirely.
        pdl_enter(USE_PDL)
        if tl.max(tl.load(gate_ptr + offs_m, mask=offs_m < M, other=0), axis=0) == 0:
            return
        w_first = _load_first_w(w_ptrs, k_start, k_end, BLOCK_K, EVEN_K)
    else:
        w_first = _load_first_w(w_ptrs, k_start, k_end, BLOCK_K, EVEN_K)
        pdl_enter(USE_PDL)
    # FP8 weights are widened to the activations' dtype (exactly: e4m3 fits bf16, fp16 and fp32).
    w_first = w_first.to(x_ptr.dtype.element_ty)
    x_rows = tl.minimum(offs_m, M - 1)
    if USE_DOT:
        x_ptrs = x_ptr + x_rows[None, :] * stride_xm + (k_start + offs_k)[:, None]
        acc = _dot_partial(w_first, w_ptrs, x_ptrs, k_start, k_end, K, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K,
                           DOT_PRECISION, DOT_UPCAST, SILU_MUL_OFF, INTERPRETED)  # fmt: skip
    else:
        x_ptrs = x_ptr + x_rows[:, None] * stride_xm + (k_start + offs_k)[None, :]
        acc = _fma_partial(w_first, w_ptrs, x_ptrs, k_start, k_end, K, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K,
                           SILU_MUL_OFF, INTERPRETED)  # fmt: skip

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SCALED:
        # One scale per output column (FP8 weights): it factors out of the sum over K.
        acc = acc * tl.load(scale_ptr + offs_n % N)[None, :]
    o_ptrs = o_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, round_to(acc, o_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=mask)
        if FUSED_REDUCE:
            # Every thread's partial is stored before the (release) arrival is counted.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    # .cg: read L2, never a stale L1 line.
                    total += tl.load(ws_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(o_ptrs, round_to(total, o_ptr.dtype.element_ty, INTERPRETED), mask=mask)
                # Ready for the next launch: every program of this tile has arrived.
                tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _split_reduce_kernel(ws_ptr, o_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                         INTERPRETED: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    # Sums the SPLIT_K partials of one row in the same order as the fused reduction.
    row = tl.program_id(1)
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    tl.store(o_ptr + row * stride_om + offs, round_to(total, o_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def default_config(n: int, k: int, m: int, num_sms: int = 132) -> dict:
    """A shape-only config: tl.dot on tuning's default weight tiles, K split until about
    tuning.SKINNY_DEFAULT_PROGRAMS_PER_SM programs an SM.

    Each K range keeps at least two BLOCK_K chunks so the loads still pipeline.
    """
    block_n, block_k = SKINNY_DEFAULT_BLOCK_N, SKINNY_DEFAULT_BLOCK_K
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split < SKINNY_DEFAULT_PROGRAMS_PER_SM * num_sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return _config(block_n, block_k, split, True, True, SKINNY_DEFAULT_WARPS, SKINNY_DEFAULT_STAGES)


def skinny_config(n: int, k: int, m: int, num_sms: int = 132) -> dict:
    """The config skinny_linear uses for w [n, k] and m rows: tuning.SKINNY_CONFIGS, else default_config."""
    tuned = SKINNY_CONFIGS.get((n, k, next_pow2(m)))
    return _config(*tuned) if tuned else default_config(n, k, m, num_sms)


def candidate_configs(n: int, k: int, m: int) -> list[dict]:
    """Configs for the GPU benchmark to sweep at this shape, without repeats: default_config, tl.dot
    tiles x splits x stages, the second-pass reduction for the first tile, for m <= 2 the CUDA-core kernel."""
    splits = CANDIDATE_SPLITS.get((n, k)) or tuple(s for s in (1, 2, 4, 8, 16) if s == 1 or k // s >= 256)
    out = [default_config(n, k, m)]
    for split in splits:
        for i, (block_n, block_k, warps) in enumerate(_DOT_TILES):
            for stages in (2, 4):
                cfg = _config(block_n, block_k, split, True, True, warps, stages)
                out.append(cfg)
                if split > 1 and i == 0:
                    out.append({**cfg, "FUSED_REDUCE": False})
        if m <= 2:
            # CUDA-core tiles of 8,192 products: 64 fp32 accumulators per thread at 4 warps.
            bm = next_pow2(m)
            for block_n in (16, 32, 64):
                block_k = min(1024, max(64, 8192 // (bm * block_n)))
                for stages in (1, 3):
                    out.append(_config(block_n, block_k, split, False, True, 4, stages))
    return [c for i, c in enumerate(out) if c not in out[:i]]


def _config(block_n, block_k, split, use_dot, fused, warps, stages) -> dict:
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "USE_DOT": use_dot,
        "FUSED_REDUCE": fused,
        "num_warps": warps,
        "num_stages": stages,
    }


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    silu_mul: bool = False,
    row_gate: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> out [M, N] in x's dtype, fp32 accumulation, rounded once.

    x, w (and out) share one dtype (bf16, fp16 or fp32), each with a contiguous last
    dimension (any row stride: x may be a column slice, out a view into a wider
    buffer). M <= SKINNY_MAX_M runs the Triton kernel with skinny_config; larger M
    falls back to cuBLAS (F.linear / torch.matmul). An explicit `config` runs the
    kernel at any M (for benchmarks). Deterministic: the same inputs give the same
    bits, whatever the scheduling. With silu_mul, x is [M, 2K] (gate then up) and the
    matmul's input is silu_and_mul(x), computed as the chunks are loaded (bit-equal
    to the two launches). row_gate (int32 [M], on the device, Triton kernel only): when
    every entry is 0 the launch reads no weight and `out` is left as it was, else it is
    computed for every row; so a captured launch can skip work no row needs.
    w_scale (fp32 [N]): w is FP8 (float8_e4m3fn) and column n of the product is scaled by w_scale[n]
    before the rounding (Triton kernel only: a larger M is fp8.fp8_linear's).
    """
    check_float("x", x)
    if w_scale is None:
        check_float("w", w)
        check_same_dtype(x=x, w=w)
    else:
        check_fp8_weight(w, w_scale)
    k_in = 2 * w.shape[-1] if silu_mul else w.shape[-1]
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != k_in:
        raise ValueError(f"need x [M, {k_in}] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    if out is not None:
        check_float("out", out)
        check_same_dtype(x=x, out=out)
        if out.shape != (m, n):
            raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    if row_gate is not None and (row_gate.shape != (m,) or row_gate.dtype != torch.int32):
        raise ValueError(f"row_gate must be int32 [{m}], got {row_gate.dtype} {tuple(row_gate.shape)}")
    if m > SKINNY_MAX_M and config is None:
        if w_scale is not None:
            raise ValueError(f"FP8 weights need the Triton kernel here: at most {SKINNY_MAX_M} rows, got {m}")
        if row_gate is not None:
            raise ValueError(f"row_gate needs the Triton kernel: at most {SKINNY_MAX_M} rows, got {m}")
        a = silu_and_mul(x) if silu_mul else x
        return F.linear(a, w) if out is None else torch.matmul(a, w.t(), out=out)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or skinny_config(n, k, m, sm_count(x.device))
    if row_gate is not None and cfg["SPLIT_K"] > 1 and not cfg["FUSED_REDUCE"]:
        raise ValueError("row_gate needs SPLIT_K 1 or FUSED_REDUCE (a second pass would not see the gate)")
    _launch(x, w, out, cfg, k if silu_mul else 0, row_gate, w_scale)
    return out


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict, silu_mul_off: int,
            gate: torch.Tensor | None, w_scale: torch.Tensor | None) -> None:  # fmt: skip
    m, (n, k) = x.shape[0], w.shape
    block_n, block_k, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    use_dot, fused = cfg["USE_DOT"], cfg["FUSED_REDUCE"]
    # tl.dot needs every dimension >= 16; the padding rows are clamped re-reads, never stored.
    block_m = max(16, next_pow2(m)) if use_dot else next_pow2(m)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    n_tiles = triton.cdiv(n, block_n)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counters = _COUNTERS.get(x.device, n_tiles) if split > 1 and fused else out
    interp, pdl = interpreting(), pdl_launch(x.device)
    _skinny_kernel[(n_tiles, split)](
        x, w, out, ws, counters, out if gate is None else gate, out if w_scale is None else w_scale,
        m, n, k, k_per_split,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, EVEN_K=k % block_k == 0,
        USE_DOT=use_dot, FUSED_REDUCE=fused,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_UPCAST=use_dot and interp and x.dtype != torch.float32, SILU_MUL_OFF=silu_mul_off,
        INTERPRETED=interp, GATED=gate is not None, SCALED=w_scale is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl,
    )  # fmt: skip
    if split > 1 and not fused:
        block = min(SKINNY_REDUCE_BLOCK, next_pow2(n))
        _split_reduce_kernel[(triton.cdiv(n, block), m)](
            ws, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block, INTERPRETED=interp,
            num_warps=SKINNY_REDUCE_WARPS, **pdl,
        )  # fmt: skip


# Per device: the arrival counters (all zero between launches).
_COUNTERS = ArrivalCounters("skinny_linear", _MIN_COUNTERS)
