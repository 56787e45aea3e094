"""Random-weight checkpoint generation, the presets, the CLI and the embedded default."""

from __future__ import annotations

import argparse
import json
import logging
import math
import threading

import pytest
import torch
from safetensors import safe_open

from ouro_fast.model import checkpoints as ck
from ouro_fast.model.config import OuroConfig
from ouro_fast.model.keys import expected_shapes
from ouro_fast.model.tokenizer import ASSETS_DIR, OuroTokenizer


def _read_all(path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    return ck.make_checkpoint(
        "tiny", tmp_path_factory.mktemp("tiny") / "ckpt", dtype="float32", progress=False
    )


def test_tiny_preset():
    cfg = ck.PRESETS["tiny"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 4, 16)
    assert (cfg.vocab_size, cfg.total_ut_steps, cfg.max_position_embeddings) == (1100, 4, 2048)
    assert cfg.vocab_size > OuroTokenizer.default().vocab_size


def test_large_presets_match_spec():
    big = ck.PRESETS["ouro-1.4b"]
    spec = {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "vocab_size": 49152,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "hidden_act": "silu",
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
        "model_type": "ouro",
        "architectures": ["OuroForCausalLM"],
        "rope_scaling": None,
    }
    d = big.to_dict()
    assert {k: d[k] for k in spec} == spec
    assert ck.PRESETS["ouro-2.6b"] == OuroConfig(**{**big.__dict__, "num_hidden_layers": 48})


def test_files_and_config(tiny_f32):
    names = {p.name for p in tiny_f32.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "tokenizer",
    }
    raw = json.loads((tiny_f32 / "config.json").read_text())
    for extra in (
        "use_cache",
        "max_window_layers",
        "use_sliding_window",
        "attention_dropout",
        "initializer_range",
    ):
        assert extra in raw
    assert raw["transformers_version"] == "4.56.0" and raw["torch_dtype"] == "float32"
    cfg = OuroConfig.from_file(tiny_f32)
    assert cfg == OuroConfig(**{**ck.PRESETS["tiny"].__dict__, "torch_dtype": "float32"})
    gen = json.loads((tiny_f32 / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 0)
    tok_cfg = json.loads((tiny_f32 / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == 2048 and tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    sub = tiny_f32 / "tokenizer"
    assert json.loads((sub / "config.json").read_text())["model_type"] == "gpt2"
    assert (sub / "tokenizer.json").read_bytes() == (ASSETS_DIR / "tokenizer.json").read_bytes()
    assert OuroTokenizer.from_dir(tiny_f32).encode("hi there") == OuroTokenizer.default().encode("hi there")


def test_tensors_names_shapes_and_values(tiny_f32):
    cfg = ck.PRESETS["tiny"]
    tensors = _read_all(tiny_f32 / "model.safetensors")
    shapes = expected_shapes(cfg)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
    assert all(t.dtype == torch.float32 for t in tensors.values())
    for name, t in tensors.items():
        if name.endswith(("norm.weight", "norm_2.weight")):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name == "model.early_exit_gate.bias":
            assert t.tolist() == [ck.DEFAULT_GATE_BIAS]
        else:
            # The simple reference: one generator per tensor, seeded from (seed, name).
            std = ck.gate_weight_std(cfg.hidden_size) if "early_exit_gate" in name else 0.02
            gen = torch.Generator().manual_seed(ck.tensor_seed(0, name))
            ref = torch.empty(t.numel()).normal_(0.0, std, generator=gen).view(t.shape)
            assert torch.equal(t, ref), name
    assert abs(tensors["lm_head.weight"].std().item() - 0.02) < 0.001
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_deterministic_and_seeded(tiny_f32, tmp_path):
    again = ck.make_checkpoint("tiny", tmp_path / "a", dtype="float32", progress=False)
    assert (again / "model.safetensors").read_bytes() == (tiny_f32 / "model.safetensors").read_bytes()
    other = ck.make_checkpoint("tiny", tmp_path / "b", seed=1, dtype="float32", gate_bias=2.5, progress=False)
    a, b = _read_all(tiny_f32 / "model.safetensors"), _read_all(other / "model.safetensors")
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"])
    assert b["model.early_exit_gate.bias"].tolist() == [2.5]
    assert json.loads((other / "config.json").read_text())["ouro_fast_random_init"]["seed"] == 1


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_dtypes_are_rounded_float32(tiny_f32, tmp_path, dtype, torch_dtype):
    half = ck.make_checkpoint("tiny", tmp_path / dtype, dtype=dtype, progress=False)
    ref, got = _read_all(tiny_f32 / "model.safetensors"), _read_all(half / "model.safetensors")
    for name, t in got.items():
        assert t.dtype == torch_dtype
        assert torch.equal(t, ref[name].to(torch_dtype)), name
    assert OuroConfig.from_file(half).torch_dtype == dtype


def test_chunked_generation(monkeypatch, tmp_path):
    # Tensors larger than one chunk are streamed in pieces from the same generator.
    monkeypatch.setattr(ck, "_CHUNK_ELEMS", 1000)
    out = ck.make_checkpoint("tiny", tmp_path / "c", dtype="float32", progress=False)
    t = _read_all(out / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    gen = torch.Generator().manual_seed(ck.tensor_seed(0, "model.layers.1.mlp.down_proj.weight"))
    pieces = [
        torch.empty(min(1000, t.numel() - s)).normal_(0, 0.02, generator=gen)
        for s in range(0, t.numel(), 1000)
    ]
    assert torch.equal(t.flatten(), torch.cat(pieces))


def test_gate_logit_spread():
    cfg = ck.PRESETS["ouro-1.4b"]
    (w,) = ck._tensor_chunks("model.early_exit_gate.weight", (1, 2048), cfg, 0, -1.0, torch.float32)
    h = torch.randn(4000, 2048, generator=torch.Generator().manual_seed(0))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))  # what model.norm (weight ones) produces
    logit = h @ w - 1.0
    assert abs(logit.mean().item() + 1.0) < 0.15
    assert abs(logit.std().item() - ck.GATE_LOGIT_STD) < 0.15
    assert ck.gate_weight_std(2048) == pytest.approx(1.5 / math.sqrt(2048))


def test_progress_bar(tmp_path, capsys):
    ck.make_checkpoint("tiny", tmp_path / "p", progress=True)
    err = capsys.readouterr().err
    assert "model.safetensors [" in err and "100%" in err and err.endswith("\n")
    ck.make_checkpoint("tiny", tmp_path / "q", progress=False)
    assert capsys.readouterr().err == ""


def test_plan_matches_written_header(tiny_f32):
    def header(blob: bytes) -> dict:
        n = int.from_bytes(blob[:8], "little")
        assert n % 8 == 0
        return json.loads(blob[8 : 8 + n])

    meta = {"preset": "tiny"}
    prefix, total = ck.plan_safetensors(expected_shapes(ck.PRESETS["tiny"]), "float32", meta)
    data = (tiny_f32 / "model.safetensors").read_bytes()
    planned, written = header(prefix), header(data)
    assert planned.pop("__metadata__") == {"format": "pt", "preset": "tiny"}
    assert written.pop("__metadata__")["format"] == "pt"
    assert planned == written
    assert total - len(prefix) == len(data) - 8 - int.from_bytes(data[:8], "little")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        ck.make_checkpoint("ouro-9b", tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        ck.make_checkpoint("tiny", tmp_path, dtype="int8")


def _parse(argv):
    parser = argparse.ArgumentParser()
    ck.add_make_checkpoint_args(parser)
    return parser.parse_args(argv)


def test_cli(tmp_path, capsys):
    args = _parse(["--preset", "tiny", "--out", str(tmp_path / "cli"), "--seed", "3", "--gate-bias", "0.5"])
    assert (args.dtype, args.quiet) == ("bfloat16", False)
    assert args.func(args) == 0
    raw = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert raw["ouro_fast_random_init"]["seed"] == 3 and raw["ouro_fast_random_init"]["gate_bias"] == 0.5
    assert raw["torch_dtype"] == "bfloat16"
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    (tmp_path / "file").write_text("x")
    args = _parse(["--preset", "tiny", "--out", str(tmp_path / "file"), "--quiet"])
    assert args.func(args) == 2
    with pytest.raises(SystemExit):
        _parse(["--preset", "gpt-5", "--out", "x"])


def test_default_model_dir(monkeypatch, tmp_path, caplog, tiny_f32):
    monkeypatch.setenv("OURO_FAST_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ouro_fast"):
        path = ck.default_model_dir()
    assert "randomly initialised" in caplog.text
    assert path.parent == tmp_path and path.name.startswith("tiny-float32-seed0-v")
    assert (path / "model.safetensors").read_bytes() == (tiny_f32 / "model.safetensors").read_bytes()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ck.default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not regenerated
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp folders left


def test_default_model_dir_lost_race(monkeypatch, tmp_path):
    # Another process renames its copy into place while we are generating ours.
    monkeypatch.setenv("OURO_FAST_CACHE", str(tmp_path))
    real = ck.make_checkpoint
    final_box = []

    def racing(preset, out_dir, **kw):
        real(preset, out_dir, **kw)
        final = tmp_path / out_dir.name.split(".")[1]  # the temp folder is ".<final name>.<random>"
        final_box.append(final)
        real(preset, final, **kw)
        return out_dir

    monkeypatch.setattr(ck, "make_checkpoint", racing)
    path = ck.default_model_dir()
    assert path == final_box[0] and (path / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_model_dir_concurrent(monkeypatch, tmp_path):
    monkeypatch.setenv("OURO_FAST_CACHE", str(tmp_path))
    results, errors = [], []

    def use():
        try:
            results.append(ck.default_model_dir())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert OuroConfig.from_file(results[0]).vocab_size == 1100
