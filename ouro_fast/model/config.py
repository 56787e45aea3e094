"""OuroConfig: the fields of an Ouro checkpoint's config.json that the engine relies on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that ouro_fast cannot serve, with the reason."""


# Fields the engine relies on: a missing one is an error.
_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class OuroConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 0  # 0: same as num_attention_heads (plain MHA)
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536
    hidden_act: str = "silu"
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (0,)
    torch_dtype: str = "bfloat16"
    model_type: str = "ouro"
    architectures: tuple[str, ...] = field(default=("OuroForCausalLM",))

    def __post_init__(self):
        if self.num_key_value_heads == 0:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._validate()

    def _validate(self):
        if self.model_type != "ouro":
            raise ConfigError(f"model_type is {self.model_type!r}, expected 'ouro'")
        for name in (*_REQUIRED, "num_key_value_heads", "head_dim", "total_ut_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ConfigError(f"early_exit_threshold must be in [0, 1], got {self.early_exit_threshold}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("rope_theta and rms_norm_eps must be positive")
        if self.max_position_embeddings <= 0:
            raise ConfigError("max_position_embeddings must be positive")
        for tok in (self.bos_token_id, *self.eos_token_ids):
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"special token id {tok} is outside the vocabulary ({self.vocab_size})")

    @property
    def num_loops(self) -> int:
        return self.total_ut_steps

    @property
    def kv_bytes_per_token_per_loop(self) -> int:
        """Bytes of K and V for one token at one loop depth, all layers, in the torch_dtype."""
        elem = 4 if self.torch_dtype == "float32" else 2
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    @classmethod
    def from_dict(cls, raw: dict) -> OuroConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        model_type = raw.get("model_type")
        if model_type != "ouro":
            raise ConfigError(f"model_type is {model_type!r}, expected 'ouro'")
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        if raw.get("rope_scaling") not in (None, {}):
            raise ConfigError(f"rope_scaling {raw['rope_scaling']!r} is not supported (Ouro uses none)")
        eos = raw.get("eos_token_id", 0)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        kwargs = {
            "eos_token_ids": tuple(int(e) for e in eos_ids if e is not None),
            "architectures": tuple(raw.get("architectures") or ("OuroForCausalLM",)),
        }
        names = {f for f in cls.__dataclass_fields__} - {"eos_token_ids", "architectures"}
        for name in names:
            if name in raw and raw[name] is not None:
                kwargs[name] = raw[name]
        if kwargs.get("bos_token_id") is None:
            kwargs["bos_token_id"] = 0
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> OuroConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        """The HF-style config.json content (as Ouro-1.4B's, plus nothing we do not use)."""
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        eos = list(d.pop("eos_token_ids"))
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        d["rope_scaling"] = None
        return d
