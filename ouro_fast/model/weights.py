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
from .keys import expected_shapes, is_layer_linear
from .quantization import FP8_DTYPE, Fp8Linear, Fp8Weight, check_checkpoint_quantization

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_HEADER_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn


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
        if isinstance(raw, dict) and raw.get("quantization_config") is not None:
            check_checkpoint_quantization(raw["quantization_config"])
        return OuroConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError) as e:
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


def _scan_headers(files: Iterable[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, safetensors dtype such as "BF16") from the headers alone."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                entries = [(name, f.get_slice(name)) for name in f.keys()]  # noqa: SIM118
                entries = [(name, tuple(s.get_shape()), s.get_dtype()) for name, s in entries]
        except Exception as e:  # safetensors raises its own SafetensorError for bad headers
            raise WeightsFileError(f"{file}: not a readable safetensors file ({e})") from None
        for name, shape, dtype in entries:
            if name in found:
                raise UnexpectedTensorError(
                    f"tensor {name} is stored twice: in {found[name][0]} and in {file}"
                )
            found[name] = (file, shape, dtype)
    return found


def check_checkpoint(model_dir: str | Path, cfg: OuroConfig) -> dict[str, Path]:
    """Validate names, shapes and FP8 scales against cfg without reading weights; returns name -> file
    (the FP8 scales of a pre-quantized checkpoint included)."""
    model_dir = Path(model_dir)
    files, index_map = _weight_files(model_dir)
    found = _scan_headers(files)
    expected = expected_shapes(cfg)
    for name, file in index_map.items():
        if name not in found or found[name][0] != file:
            raise MissingTensorError(f"tensor {name} is not in {file} although {INDEX_FILE} says it is")
    scales = fp8_scale_names(found, expected)
    for name, (file, *_) in found.items():
        if name not in expected and name not in scales and not is_ignored_extra(name, cfg):
            raise UnexpectedTensorError(f"unexpected tensor {name} in {file}")
    where = ", ".join(sorted(str(f) for f in files))
    for name, shape in expected.items():
        if name not in found:
            raise MissingTensorError(f"tensor {name} is missing from {where}")
        file, got, _ = found[name]
        if got != shape:
            raise ShapeMismatchError(
                f"tensor {name} in {file} has shape {list(got)}, config.json implies {list(shape)}"
            )
    return {name: found[name][0] for name in (*expected, *scales)}


def fp8_scale_names(found: dict, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """The `<linear>.weight_scale` tensors of a pre-quantized checkpoint (compressed-tensors FP8): a layer
    linear stored as F8_E4M3 needs one, of shape [N, 1] or [N] (a scale per output row) or [] or [1]
    (one for the tensor); nothing else may be FP8 or carry a scale."""
    names = []
    for name, (file, _, dtype) in found.items():
        if dtype == FP8_HEADER_DTYPE and not (name in expected and is_layer_linear(name)):
            raise CheckpointError(
                f"tensor {name} in {file} is {dtype}: only the layers' linear weights may be"
            )
        if name.endswith(".input_scale"):
            raise CheckpointError(
                f"tensor {name} in {file}: static activation scales are not supported (FP8 weights are; "
                "activations stay in the model's dtype)"
            )
        if not name.endswith(".weight_scale"):
            continue
        weight = name.removesuffix("_scale")
        if weight not in found or found[weight][2] != FP8_HEADER_DTYPE:
            raise UnexpectedTensorError(f"tensor {name} in {file} scales no FP8 weight")
        rows, shape = expected[weight][0], found[name][1]
        if shape not in ((rows, 1), (rows,), (), (1,)):
            raise ShapeMismatchError(
                f"tensor {name} in {file} has shape {list(shape)}: a scale per output row ([{rows}, 1]) "
                "or one for the tensor ([]) is expected"
            )
        names.append(name)
    for name, (file, _, dtype) in found.items():
        if dtype == FP8_HEADER_DTYPE and name + "_scale" not in found:
            raise MissingTensorError(f"FP8 tensor {name} in {file} has no {name}_scale")
    return names


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
    scales = {name for name in location if name.endswith(".weight_scale")}
    _check_module(module, cfg, set(location) - scales)
    by_file: dict[Path, list[str]] = {}
    for name, file in location.items():
        by_file.setdefault(file, []).append(name)
    fp8: dict[str, torch.Tensor] = {}  # linear module name -> its scale, for the FP8 weights
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                tensor = f.get_tensor(name)
                if name in scales:
                    fp8[name.removesuffix(".weight_scale")] = tensor.to(device=device, dtype=torch.float32)
                    continue
                # FP8 weights stay FP8; everything else takes the requested dtype.
                tensor = tensor.to(device=device, dtype=None if tensor.dtype == FP8_DTYPE else torch_dtype)
                owner_name, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_name)
                setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
    for linear, scale in fp8.items():
        _install_fp8(module, linear, scale)
    if cfg.tie_word_embeddings and isinstance(getattr(module, "lm_head", None), nn.Module):
        module.lm_head.weight = module.get_submodule("model.embed_tokens").weight
    return module


def _install_fp8(module: nn.Module, linear: str, scale: torch.Tensor) -> None:
    """Replace the nn.Linear `linear` (FP8 weight loaded) by an Fp8Linear with one scale per output row."""
    weight = module.get_submodule(linear).weight.data
    rows = weight.shape[0]
    parent, _, leaf = linear.rpartition(".")
    per_row = scale.reshape(-1).expand(rows).contiguous()
    setattr(module.get_submodule(parent), leaf, Fp8Linear(Fp8Weight(weight.contiguous(), per_row)))
