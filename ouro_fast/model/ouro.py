"""The native Ouro model: one call runs ONE loop (all layers) for a batch of tokens.

Parameter names are exactly the checkpoint's keys. Attention is delegated to a
backend (see attention.py) that knows which KV plane each token reads and
writes, so rows at different loop depths can share one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import OuroConfig
from .quantization import Fp8Linear, Fp8Weight, cat_weights, check_quantization, linear, quantize_fp8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim] in float32 for split-half rotary embeddings."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by position; computed in float32, returned in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class OuroAttention(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.qkv_weight: torch.Tensor | Fp8Weight | None = None  # set by fuse(): one matmul instead of three

    def fuse(self) -> None:
        """Replace q/k/v projections by one concatenated weight (same results, fewer kernels)."""
        self.qkv_weight = cat_weights((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, attn, layer_idx: int) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:
            q, k, v = linear(x, self.qkv_weight).split((hq, hkv, hkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if cos is not None:  # None: the attention backend applies RoPE itself (fused with its K/V write)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class OuroMLP(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.gate_up_weight: torch.Tensor | Fp8Weight | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_weight = cat_weights((self.gate_proj.weight, self.up_proj.weight))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class OuroDecoderLayer(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = OuroAttention(cfg)
        self.mlp = OuroMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, eps)

    def forward(self, h, cos, sin, attn, layer_idx: int) -> torch.Tensor:
        # Sandwich norms: each sub-block's output is normed again before the residual add.
        a = self.self_attn(self.input_layernorm(h), cos, sin, attn, layer_idx)
        h = h + self.input_layernorm_2(a)
        m = self.mlp(self.post_attention_layernorm(h))
        return h + self.post_attention_layernorm_2(m)


class OuroModel(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class OuroForCausalLM(nn.Module):
    """Ouro with the loop exposed: embed -> run_loop (x T) -> gate_logits / logits."""

    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.config = cfg
        self.model = OuroModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def fuse(self) -> None:
        """Concatenate each layer's q/k/v and gate/up weights (after loading; names then differ)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def quantize(self, scheme: str | None) -> None:
        """Quantize every layer's q/k/v/o and gate/up/down weights (model/quantization.py); None: no-op.
        Call after loading (and fuse(), which it keeps). The replaced weights are freed."""
        check_quantization(scheme)
        if scheme is None:
            return
        attn_parts, mlp_parts = (
            ("q_proj", "k_proj", "v_proj", "o_proj"),
            ("gate_proj", "up_proj", "down_proj"),
        )
        for layer in self.model.layers:
            for block, fused, parts in ((layer.self_attn, "qkv_weight", attn_parts),
                                        (layer.mlp, "gate_up_weight", mlp_parts)):  # fmt: skip
                # Weights a pre-quantized checkpoint loaded as FP8 already stay as they are.
                w = getattr(block, fused)
                if w is not None and not isinstance(w, Fp8Weight):
                    setattr(block, fused, quantize_fp8(w))
                for name in parts:
                    if hasattr(block, name) and not isinstance(getattr(block, name), Fp8Linear):
                        setattr(block, name, Fp8Linear(quantize_fp8(getattr(block, name).weight)))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def run_loop(self, h: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """One loop over all layers for N tokens h [N, hidden]; returns the normed hidden state.

        `attn(layer_idx, q, k, v)` writes each token's K/V into its own loop's plane and
        returns the attention output [N, heads, head_dim].
        """
        cos = sin = None
        if not getattr(attn, "applies_rope", False):
            cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, attn, i)
        # The final norm runs after every loop and its output feeds the next loop.
        return self.model.norm(h)

    def gate_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Exit-gate logit per token [N], in float32."""
        return self.model.early_exit_gate(h).squeeze(-1).float()

    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the lm_head's weight (the embedding's when the two are tied)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head_weight())
