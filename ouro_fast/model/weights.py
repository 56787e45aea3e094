"""Strict loading of an Ouro checkpoint (model.safetensors or shards) into a module.

Every tensor of keys.expected_shapes(cfg) must be present exactly once with its
shape; anything else is an error, except the known harmless extras below. The
checks read only the safetensors headers, so a bad checkpoint fails before any
weight is read. Tensors are then read, converted and placed one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .config import ConfigError, OuroConfig
from .keys import expected_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint ouro_fast cannot load; the message names the tensor and/or file."""


class WeightsFileError(CheckpointError):
    """No weights file, an unreadable shard or a malformed index."""


class ConfigFileError(CheckpointError, ConfigError):
    """config.json is missing, unreadable or not a servable Ouro config."""


class MissingTensorError(CheckpointError):
    """An expected tensor is absent (or absent from the shard the index names)."""


class UnexpectedTensorError(CheckpointError):
    """A tensor the model does not have, or one stored in two shards."""


class ShapeMismatchError(CheckpointError):
    """A tensor whose shape differs from what config.json implies."""


def is_ignored_extra(name: str, cfg: OuroConfig) -> bool:
    """Tensors some exporters add that carry nothing we need."""
    if name.endswith(".rotary_emb.inv_freq"):
        return True
    # A tied checkpoint may still store the head; the embedding is used instead.
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def load_generation_eos(model_dir: str | Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list) as a tuple; () when the file or field is
    absent. ConfigFileError when it is there but malformed."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigFileError(f"{path}: cannot read it as a JSON object ({e})") from None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigFileError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def load_config(model_dir: str | Path) -> OuroConfig:
    """OuroConfig of model_dir/config.json; errors name the file."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigFileError(f"{path}: cannot read it as JSON ({e})") from None
    try:
        return OuroConfig.from_dict(raw)
    except (ConfigError, TypeError) as e:
        raise ConfigFileError(f"{path}: {e}") from None


def _resolve_dtype(dtype: str | torch.dtype | None, cfg: OuroConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    name = cfg.torch_dtype if dtype in (None, "auto") else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {name!r}")
    return _DTYPES[name]


def _weight_files(model_dir: Path) -> tuple[list[Path], dict[str, Path]]:
    """(files to read, index's name -> file); the map is empty for a single file."""
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single], {}
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise WeightsFileError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise WeightsFileError(f"{index}: not a valid index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise WeightsFileError(f"{index}: weight_map must map tensor names to file names")
    by_name = {name: model_dir / file for name, file in weight_map.items()}
    for name, file in by_name.items():
        if not file.is_file():
            raise WeightsFileError(f"{index}: tensor {name} is mapped to {file.name}, which does not exist")
    return sorted(set(by_name.values())), by_name


def _scan_headers(files: Iterable[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers alone."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                entries = [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]  # noqa: SIM118
        except Exception as e:  # safetensors raises its own SafetensorError for bad headers
            raise WeightsFileError(f"{file}: not a readable safetensors file ({e})") from None
        for name, shape in entries:
            if name in found:
                raise UnexpectedTensorError(
                    f"tensor {name} is stored twice: in {found[name][0]} and in {file}"
                )
            found[name] = (file, shape)
    return found


def check_checkpoint(model_dir: str | Path, cfg: OuroConfig) -> dict[str, Path]:
    """Validate names and shapes against cfg without reading weights; returns name -> file."""
    model_dir = Path(model_dir)
    files, index_map = _weight_files(model_dir)
    found = _scan_headers(files)
    expected = expected_shapes(cfg)
    for name, file in index_map.items():
        if name not in found or found[name][0] != file:
            raise MissingTensorError(f"tensor {name} is not in {file} although {INDEX_FILE} says it is")
    for name, (file, _) in found.items():
        if name not in expected and not is_ignored_extra(name, cfg):
            raise UnexpectedTensorError(f"unexpected tensor {name} in {file}")
    where = ", ".join(sorted(str(f) for f in files))
    for name, shape in expected.items():
        if name not in found:
            raise MissingTensorError(f"tensor {name} is missing from {where}")
        file, got = found[name]
        if got != shape:
            raise ShapeMismatchError(
                f"tensor {name} in {file} has shape {list(got)}, config.json implies {list(shape)}"
            )
    return {name: found[name][0] for name in expected}


def _check_module(module: nn.Module, cfg: OuroConfig, expected: Iterable[str]) -> None:
    """The module's parameters must be exactly the checkpoint's (a tied lm_head aside)."""
    names = {name for name, _ in module.named_parameters()}
    expected = set(expected)
    missing = sorted(expected - names)
    extra = sorted(names - expected - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing or extra:
        raise ValueError(
            f"the module does not match config.json: it lacks {missing[:3]} and has extra {extra[:3]}"
        )


def load_weights(
    module: nn.Module,
    model_dir: str | Path,
    cfg: OuroConfig,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Fill module's parameters from model_dir's safetensors, strictly; returns module.

    dtype: "float32", "bfloat16", "float16", a torch dtype, or "auto"/None for the
    config's torch_dtype. Each parameter is replaced by nn.Parameter(t,
    requires_grad=False) on device, so a module built on the meta device works
    and peak memory stays about one model plus one tensor.
    """
    torch_dtype = _resolve_dtype(dtype, cfg)
    location = check_checkpoint(model_dir, cfg)
    _check_module(module, cfg, location)
    by_file: dict[Path, list[str]] = {}
    for name, file in location.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                tensor = f.get_tensor(name).to(device=device, dtype=torch_dtype)
                owner_name, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_name)
                setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
    if cfg.tie_word_embeddings and isinstance(getattr(module, "lm_head", None), nn.Module):
        module.lm_head.weight = module.get_submodule("model.embed_tokens").weight
    return module
