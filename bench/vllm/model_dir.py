"""An Ouro-1.4B-shaped model directory for `vllm serve --load-format dummy`: the side-by-side baseline.

vLLM runs OuroForCausalLM with random weights (all 4 loops, no early exit); the directory holds the config,
a config class for transformers (which has no native "ouro" type), and ouro_fast's own tokenizer files, so
that `vllm bench serve` sends both servers the same prompts.

    python3 bench/vllm/model_dir.py OUT_DIR [--tokenizer DIR]     # DIR: ouro_fast's tokenizer files
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

CONFIG = {
    "architectures": ["OuroForCausalLM"],
    "model_type": "ouro",
    "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig"},
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 24,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}

# A transformers config class for the "ouro" model type: the fields vLLM's Ouro model reads.
CONFIG_CLASS = """from transformers import PretrainedConfig


class OuroConfig(PretrainedConfig):
    model_type = "ouro"

    def __init__(self, vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=16, head_dim=128, hidden_act="silu",
                 max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
                 tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                 max_window_layers=24, total_ut_steps=4, early_exit_threshold=1.0, attention_dropout=0.0,
                 initializer_range=0.02, use_cache=True, layer_types=None, rope_parameters=None, **kwargs):
        for name, value in list(locals().items()):
            if name not in ("self", "kwargs", "__class__"):
                setattr(self, name, value)
        self.sliding_window = sliding_window if use_sliding_window else None
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": rope_theta}
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
"""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def write(out: Path, tokenizer: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (out / "configuration_ouro.py").write_text(CONFIG_CLASS)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, out / name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    default = Path(__file__).resolve().parents[2] / "ouro_fast" / "model" / "assets"
    p.add_argument(
        "--tokenizer", type=Path, default=default, help="tokenizer files (default: ouro_fast's own)"
    )
    args = p.parse_args()
    write(args.out, args.tokenizer)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
