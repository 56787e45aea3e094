"""One Ouro loop on the Triton kernels: the same math as OuroForCausalLM.run_loop, fewer launches.

Needs a fused model (OuroForCausalLM.fuse(): one qkv and one gate_up matmul per
layer) and an attention backend that applies RoPE (TritonPagedAttention with
rope_theta). Per layer: qkv matmul, attention (decode: one launch that also
applies RoPE and writes K/V; prefill: RoPE + K/V write, then attention), o_proj,
fused add + two RMSNorms, gate_up and down matmuls with SiLU-and-mul fused into one
of them (gate_up's epilogue on tensor cores, else down's prologue), fused add +
RMSNorm (of the next layer's input, or the final norm after the last layer). Up to
32 tokens (tuning.TC_MAX_ROWS) the matmuls are, on Hopper with bf16, the tensor-core
kernel (kernels/tc_gemm.py, which streams its weights before its PDL wait), elsewhere
the skinny Triton kernel (so on Hopper every kernel of the loop is a PDL launch);
beyond, cuBLAS. FP8 weights (model/quantization.py) take the tensor-core kernel where it applies, else
kernels/fp8.py's matmuls. On
tensor cores qkv (in decode calls), o_proj and down hand out fp32
partial products, which the decode attention and the norms add: no matmul sums between
its CTAs.
"""

from __future__ import annotations

import torch

from ..kernels import add_rms_norm, rms_norm, tc_gemm
from ..kernels.fp8 import fp8_linear
from ..kernels.skinny_gemm import skinny_linear
from ..kernels.tuning import TC_PACE_BESIDE
from .ouro import OuroForCausalLM
from .quantization import Fp8Weight


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, silu_mul: bool = False, partial: bool = False,
           pace: int = 0) -> torch.Tensor:  # fmt: skip
    """x @ w.T (of silu(gate) * up with silu_mul): tensor cores on Hopper (bf16 or FP8 weights), else the
    skinny kernel, or kernels/fp8.py's kernels for FP8 weights.

    partial: where the tensor-core kernel takes the call, return its fp32 partial products [S, M, N]
    instead (for the consumer to add in slot order; no sums between CTAs inside the matmul).
    pace: the tensor-core kernel's pause between its first weight tiles (tc_linear)."""
    data, scale = (w.data, w.scale) if isinstance(w, Fp8Weight) else (w, None)
    if tc_gemm.supported(x, data, silu_mul):
        return tc_gemm.tc_linear(x, data, silu_mul, partial=partial, pace=pace, w_scale=scale)
    if scale is not None:
        return fp8_linear(x, data, scale, silu_mul=silu_mul)
    return skinny_linear(x, w, silu_mul=silu_mul)


def mlp_partial(m: torch.Tensor, mlp) -> torch.Tensor:
    """down(silu(gate(m)) * up(m)) as down's fp32 partial products where the tensor-core kernel takes it.

    On tensor cores gate_up hands down silu(gate) * up (tc_gemm's swiglu_out), the bits down's own SiLU
    prologue would compute, so down multiplies a plain input."""
    w = mlp.gate_up_weight
    data, scale = (w.data, w.scale) if isinstance(w, Fp8Weight) else (w, None)
    if tc_gemm.supported(m, data, swiglu_out=True):
        gu = tc_gemm.tc_linear(m, data, swiglu_out=True, pace=TC_PACE_BESIDE, w_scale=scale)
        return linear(gu, mlp.down_proj.weight, partial=True)
    return linear(linear(m, mlp.gate_up_weight), mlp.down_proj.weight, silu_mul=True, partial=True)


def run_loop_fused(model: OuroForCausalLM, h: torch.Tensor, attn) -> torch.Tensor:
    """h [N, hidden] -> the loop's normed output [N, hidden] (which feeds the next loop)."""
    cfg = model.config
    layers, eps = model.model.layers, cfg.rms_norm_eps
    n, hq, hkv, d = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv_partial = getattr(attn, "takes_partials", lambda: False)()  # the fused decode attention adds them
    x = rms_norm(h, layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(layers):
        sa, mlp = layer.self_attn, layer.mlp
        # qkv, o_proj and gate_up start beside a running kernel: their first tiles are paced (tc_linear).
        qkv = linear(x, sa.qkv_weight, partial=qkv_partial, pace=TC_PACE_BESIDE)
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        lead = qkv.shape[:-1]  # [N], or [S, N] for partial products
        o = attn(i, q.view(*lead, hq, d), k.view(*lead, hkv, d), v.view(*lead, hkv, d)).reshape(n, hq * d)
        a = linear(o, sa.o_proj.weight, partial=True, pace=TC_PACE_BESIDE)
        h, m = add_rms_norm(h, a, layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight, eps)
        out = mlp_partial(m, mlp)
        w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
        h, x = add_rms_norm(h, out, layer.post_attention_layernorm_2.weight, w_next, eps)
    return x
