"""One Ouro loop on the Triton kernels: the same math as OuroForCausalLM.run_loop, fewer launches.

Needs a fused model (OuroForCausalLM.fuse(): one qkv and one gate_up matmul per
layer) and an attention backend that applies RoPE (TritonPagedAttention with
rope_theta). Per layer: the qkv matmul (its input norm fused in: the previous
layer's residual add + RMSNorm runs in the matmul's prologue), attention (one
launch for decode: RoPE, K/V write, attention), o_proj, the gate_up matmul with
the attention residual add + both RMSNorms fused in the same way, and the down
matmul with SiLU-and-mul fused in. The loop's first norm and its last add +
final norm are separate launches. Up to 16 tokens the matmuls are the skinny
Triton kernel (so on Hopper every kernel of the loop is a PDL launch); beyond,
cuBLAS with separate norm launches.
"""

from __future__ import annotations

import torch

from ..kernels import add_rms_norm, rms_norm
from ..kernels.skinny_gemm import skinny_add_rms_linear, skinny_linear
from .ouro import OuroForCausalLM


def run_loop_fused(model: OuroForCausalLM, h: torch.Tensor, attn) -> torch.Tensor:
    """h [N, hidden] -> the loop's normed output [N, hidden] (which feeds the next loop)."""
    cfg = model.config
    layers, eps = model.model.layers, cfg.rms_norm_eps
    n, hq, hkv, d = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = skinny_linear(rms_norm(h, layers[0].input_layernorm.weight, eps), layers[0].self_attn.qkv_weight)
    for i, layer in enumerate(layers):
        sa, mlp = layer.self_attn, layer.mlp
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        o = attn(i, q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)).reshape(n, hq * d)
        a = skinny_linear(o, sa.o_proj.weight)
        w_a, w_m = layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight
        h, gate_up = skinny_add_rms_linear(h, a, w_a, w_m, eps, mlp.gate_up_weight)
        out = skinny_linear(gate_up, mlp.down_proj.weight, silu_mul=True)
        w_out = layer.post_attention_layernorm_2.weight
        if i + 1 < len(layers):
            # This layer's MLP residual, the next layer's input norm and its qkv matmul: one launch.
            nxt = layers[i + 1]
            h, qkv = skinny_add_rms_linear(
                h, out, w_out, nxt.input_layernorm.weight, eps, nxt.self_attn.qkv_weight
            )
    _, x = add_rms_norm(h, out, w_out, model.model.norm.weight, eps)
    return x
