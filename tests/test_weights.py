"""The strict checkpoint loader: round trips, shards, tying and every kind of bad checkpoint."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ouro_fast.model import checkpoints as ck
from ouro_fast.model.config import ConfigError
from ouro_fast.model.keys import expected_shapes
from ouro_fast.model.ouro import OuroForCausalLM
from ouro_fast.model.weights import (
    CheckpointError,
    ConfigFileError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    WeightsFileError,
    check_checkpoint,
    load_config,
    load_weights,
)


def _read_all(path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _meta_model(cfg) -> nn.Module:
    with torch.device("meta"):
        return OuroForCausalLM(cfg)


def _plain_module(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A module with exactly these parameters on meta, nested by the dotted names."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta")))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ck.make_checkpoint("tiny", tmp_path_factory.mktemp("w") / "tiny", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def tiny_tensors(tiny):
    return _read_all(tiny / "model.safetensors")


@pytest.fixture
def copy_of(tiny, tmp_path):
    """A writable copy of the tiny checkpoint with model.safetensors replaced by `tensors`."""

    def make(tensors: dict[str, torch.Tensor] | None = None):
        out = tmp_path / "ckpt"
        shutil.copytree(tiny, out)
        if tensors is not None:
            save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out

    return make


@pytest.mark.parametrize("dtype, torch_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_round_trip_real_model(tiny, tiny_tensors, dtype, torch_dtype):
    cfg = load_config(tiny)
    model = _meta_model(cfg)
    assert load_weights(model, tiny, cfg, dtype) is model
    params = dict(model.named_parameters())
    assert set(params) == set(tiny_tensors)
    for name, p in params.items():
        assert p.device.type == "cpu" and p.dtype == torch_dtype and not p.requires_grad
        assert torch.equal(p, tiny_tensors[name].to(torch_dtype)), name


def test_loaded_model_runs(tiny, tiny_tensors):
    cfg = load_config(tiny)
    model = load_weights(_meta_model(cfg), tiny, cfg, torch.float32)
    h = model.model.norm(torch.randn(3, cfg.hidden_size))
    expected_gate = (
        h @ tiny_tensors["model.early_exit_gate.weight"][0] + tiny_tensors["model.early_exit_gate.bias"]
    )
    torch.testing.assert_close(model.gate_logits(h), expected_gate)
    assert model.logits(h).shape == (3, 1100)


def test_auto_dtype_and_materialised_module(tiny, tiny_tensors, tmp_path):
    half = ck.make_checkpoint("tiny", tmp_path / "bf16", dtype="bfloat16", progress=False)
    cfg = load_config(half)
    model = OuroForCausalLM(cfg)  # real (random) parameters, replaced by the loader
    load_weights(model, half, cfg, "auto")
    emb = model.model.embed_tokens.weight
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, tiny_tensors["model.embed_tokens.weight"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        load_weights(_meta_model(cfg), half, cfg, "int8")


def test_round_trip_plain_module(tiny, tiny_tensors):
    cfg = load_config(tiny)
    module = _plain_module(expected_shapes(cfg))
    load_weights(module, tiny, cfg, "float32")
    for name, p in module.named_parameters():
        assert torch.equal(p, tiny_tensors[name]), name


def test_sharded_checkpoint(tiny, tiny_tensors, copy_of):
    out = copy_of()
    (out / "model.safetensors").unlink()
    names = list(tiny_tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for file, part in shards.items():
        save_file({n: tiny_tensors[n] for n in part}, out / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = load_config(out)
    location = check_checkpoint(out, cfg)
    assert {n: p.name for n, p in location.items()} == weight_map
    model = load_weights(_meta_model(cfg), out, cfg, "float32")
    for name, p in model.named_parameters():
        assert torch.equal(p, tiny_tensors[name]), name


def test_tied_embeddings(tmp_path):
    cfg = dataclasses.replace(ck.PRESETS["tiny"], tie_word_embeddings=True)
    out = ck.make_checkpoint(cfg, tmp_path / "tied", dtype="float32", progress=False)
    tensors = _read_all(out / "model.safetensors")
    assert "lm_head.weight" not in tensors
    cfg = load_config(out)
    assert cfg.tie_word_embeddings
    model = load_weights(_meta_model(cfg), out, cfg, "float32")
    h = torch.randn(2, cfg.hidden_size)
    torch.testing.assert_close(model.logits(h), h @ tensors["model.embed_tokens.weight"].T)
    # A module that has its own lm_head gets it tied to the loaded embedding.
    module = _plain_module(expected_shapes(cfg))
    module.add_module("lm_head", nn.Module())
    module.lm_head.weight = nn.Parameter(torch.empty(1100, 64, device="meta"))
    load_weights(module, out, cfg, "float32")
    assert module.lm_head.weight is module.model.embed_tokens.weight
    # A tied checkpoint that still stores the head loads too (the head is ignored).
    save_file({**tensors, "lm_head.weight": torch.zeros(1100, 64)}, out / "model.safetensors")
    model = load_weights(_meta_model(cfg), out, cfg, "float32")
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_module_must_match(tiny):
    cfg = load_config(tiny)
    shapes = expected_shapes(cfg)
    with pytest.raises(ValueError, match="lacks.*model.norm.weight"):
        load_weights(_plain_module({k: v for k, v in shapes.items() if k != "model.norm.weight"}), tiny, cfg)
    with pytest.raises(ValueError, match="extra.*model.extra.weight"):
        load_weights(_plain_module({**shapes, "model.extra.weight": (3,)}), tiny, cfg)


def test_ignores_rotary_inv_freq(tiny_tensors, copy_of):
    out = copy_of({**tiny_tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    cfg = load_config(out)
    load_weights(_meta_model(cfg), out, cfg, "float32")


def _expect(error, tensor: str | None, file: str, fn):
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)
    if tensor is not None:
        assert tensor in message, message
    assert file in message, message
    return message


def _loader(out):
    def run():
        cfg = load_config(out)
        model = _meta_model(cfg)
        try:
            load_weights(model, out, cfg, "float32")
        finally:
            # Validation precedes loading: a failed load leaves the module untouched.
            assert all(p.is_meta for p in model.parameters())

    return run


def test_missing_tensor(tiny_tensors, copy_of):
    name = "model.layers.1.mlp.up_proj.weight"
    out = copy_of({k: v for k, v in tiny_tensors.items() if k != name})
    _expect(MissingTensorError, name, str(out / "model.safetensors"), _loader(out))


def test_unexpected_tensor(tiny_tensors, copy_of):
    name = "model.layers.2.mlp.up_proj.weight"
    out = copy_of({**tiny_tensors, name: torch.zeros(128, 64)})
    _expect(UnexpectedTensorError, name, str(out / "model.safetensors"), _loader(out))


def test_wrong_shape(tiny_tensors, copy_of):
    name = "model.layers.0.self_attn.k_proj.weight"
    out = copy_of({**tiny_tensors, name: torch.zeros(32, 64)})
    message = _expect(ShapeMismatchError, name, str(out / "model.safetensors"), _loader(out))
    assert "[32, 64]" in message and "[64, 64]" in message


def test_config_disagreeing_with_weights(copy_of):
    out = copy_of()
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "vocab_size": 1024}))
    _expect(ShapeMismatchError, "model.embed_tokens.weight", str(out / "model.safetensors"), _loader(out))


def test_missing_weights_file(copy_of):
    out = copy_of()
    (out / "model.safetensors").unlink()
    _expect(WeightsFileError, None, str(out), _loader(out))


def test_corrupt_weights_file(copy_of):
    out = copy_of()
    (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _expect(WeightsFileError, None, str(out / "model.safetensors"), _loader(out))


def _shard(out, tensors, weight_map):
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "shard-1.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_index_pointing_at_missing_shard(tiny_tensors, copy_of):
    out = copy_of()
    weight_map = dict.fromkeys(tiny_tensors, "shard-1.safetensors")
    weight_map["lm_head.weight"] = "shard-2.safetensors"
    _shard(out, tiny_tensors, weight_map)
    _expect(WeightsFileError, "lm_head.weight", "shard-2.safetensors", _loader(out))


def test_index_naming_the_wrong_shard(tiny_tensors, copy_of):
    out = copy_of()
    name = "model.norm.weight"
    weight_map = dict.fromkeys(tiny_tensors, "shard-1.safetensors")
    weight_map[name] = "shard-0.safetensors"
    save_file({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, out / "shard-0.safetensors")
    _shard(out, tiny_tensors, weight_map)
    _expect(MissingTensorError, name, "shard-0.safetensors", _loader(out))


def test_tensor_in_two_shards(tiny_tensors, copy_of):
    out = copy_of()
    name = "model.norm.weight"
    weight_map = dict.fromkeys(tiny_tensors, "shard-1.safetensors")
    weight_map["model.layers.0.self_attn.rotary_emb.inv_freq"] = "shard-0.safetensors"  # lists shard-0
    save_file({name: torch.ones(64)}, out / "shard-0.safetensors")
    _shard(out, tiny_tensors, weight_map)
    message = _expect(UnexpectedTensorError, name, "shard-0.safetensors", _loader(out))
    assert "shard-1.safetensors" in message


@pytest.mark.parametrize("content", ["{not json", '{"metadata": {}}', '{"weight_map": {"a": 3}}', "[]"])
def test_bad_index(tiny_tensors, copy_of, content):
    out = copy_of()
    _shard(out, tiny_tensors, {})
    (out / "model.safetensors.index.json").write_text(content)
    _expect(WeightsFileError, None, "model.safetensors.index.json", _loader(out))


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda raw: {**raw, "model_type": "llama"}, "model_type"),
        (lambda raw: {k: v for k, v in raw.items() if k != "hidden_size"}, "hidden_size"),
        (lambda raw: {**raw, "num_attention_heads": 5}, "num_attention_heads"),
        (lambda raw: {**raw, "rope_scaling": {"type": "yarn"}}, "rope_scaling"),
        (lambda raw: {**raw, "bogus_field_we_ignore": 1, "hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_config(copy_of, edit, fragment):
    out = copy_of()
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edit(raw)))
    message = _expect(ConfigFileError, None, str(out / "config.json"), lambda: load_config(out))
    assert fragment in message


def test_unreadable_or_missing_config(copy_of):
    out = copy_of()
    (out / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=re.escape(str(out / "config.json"))):
        load_config(out)
    (out / "config.json").unlink()
    _expect(ConfigFileError, None, str(out / "config.json"), lambda: load_config(out))


def _spec_shapes() -> dict[str, tuple[int, ...]]:
    """The Ouro-1.4B tensor table, transcribed from docs (independently of keys.py)."""
    d, f, v = 2048, 5632, 49152
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(24):
        p = f"model.layers.{i}."
        for m in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{m}_proj.weight"] = (d, d)
        shapes[f"{p}mlp.gate_proj.weight"] = (f, d)
        shapes[f"{p}mlp.up_proj.weight"] = (f, d)
        shapes[f"{p}mlp.down_proj.weight"] = (d, f)
        for n in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            shapes[f"{p}{n}.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    shapes["model.early_exit_gate.weight"] = (1, d)
    shapes["model.early_exit_gate.bias"] = (1,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def test_ouro_1_4b_layout_without_weights(tmp_path):
    cfg = ck.PRESETS["ouro-1.4b"]
    spec = _spec_shapes()
    assert len(spec) == 269
    assert expected_shapes(cfg) == spec
    with torch.device("meta"):
        assert {n: tuple(p.shape) for n, p in OuroForCausalLM(cfg).named_parameters()} == spec
    # The header the generator would write, on a sparse file of the real size: the
    # safetensors library and the loader's checks accept it without reading data.
    prefix, total = ck.plan_safetensors(expected_shapes(cfg), "bfloat16")
    assert 2.86e9 < total < 2.88e9
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(prefix)
        f.truncate(total)
    location = check_checkpoint(tmp_path, cfg)
    assert list(location) == list(spec)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        sl = f.get_slice("lm_head.weight")
        assert (sl.get_dtype(), sl.get_shape()) == ("BF16", [49152, 2048])
