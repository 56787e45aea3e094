"""The exact tensor names and shapes of an Ouro checkpoint (see docs/model.md)."""

from __future__ import annotations

from .config import OuroConfig

_LAYER_MATS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)


_LINEARS = (*(f"self_attn.{m}" for m in _LAYER_MATS), "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def is_layer_linear(name: str) -> bool:
    """Whether `name` is a layer's q/k/v/o or gate/up/down weight (the ones FP8 may replace)."""
    parts = name.split(".")
    return (
        len(parts) == 6
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and ".".join(parts[3:5]) in _LINEARS
        and parts[5] == "weight"
    )


def expected_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, name -> shape, in file order."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * cfg.head_dim
    kv_out = cfg.num_key_value_heads * cfg.head_dim
    out_dims = {"q_proj": (q_out, d), "k_proj": (kv_out, d), "v_proj": (kv_out, d), "o_proj": (d, q_out)}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for m in _LAYER_MATS:
            shapes[f"{p}self_attn.{m}.weight"] = out_dims[m]
        shapes[f"{p}mlp.gate_proj.weight"] = (f, d)
        shapes[f"{p}mlp.up_proj.weight"] = (f, d)
        shapes[f"{p}mlp.down_proj.weight"] = (d, f)
        for n in _LAYER_NORMS:
            shapes[f"{p}{n}.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    shapes["model.early_exit_gate.weight"] = (1, d)
    shapes["model.early_exit_gate.bias"] = (1,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes
