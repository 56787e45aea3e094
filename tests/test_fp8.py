"""FP8 weights: the quantization, the kernels against the PyTorch reference, the model and the engine.

On a CPU-only machine the kernels run under TRITON_INTERPRET=1; on a Hopper GPU the same tests run the
compiled kernels, and the engine test also captures and replays their CUDA graphs.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.engine.engine import Engine, EngineConfig  # noqa: E402
from ouro_fast.engine.sampling import SamplingParams  # noqa: E402
from ouro_fast.kernels import silu_and_mul  # noqa: E402
from ouro_fast.kernels.fp8 import (  # noqa: E402
    fp8_linear,
    quantize_rows,
    scaled_mm_fp8_linear,
    scaled_mm_rowwise,
    tiled_fp8_linear,
)
from ouro_fast.kernels.skinny_gemm import SKINNY_MAX_M, skinny_linear  # noqa: E402
from ouro_fast.model.checkpoints import PRESETS  # noqa: E402
from ouro_fast.model.ouro import OuroForCausalLM  # noqa: E402
from ouro_fast.model.quantization import (  # noqa: E402
    FP8_MAX,
    Fp8Linear,
    Fp8Weight,
    quantize_fp8,
    reference_linear,
    w8a8_reference_linear,
    weight_bytes,
)
from ouro_fast.server.config import ConfigError, ServerConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 70, 200  # K is no multiple of any BLOCK_K: the last chunk is masked


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


def weight(n=N, k=K, seed=2) -> Fp8Weight:
    # Rows of very different magnitudes: each gets its own scale.
    rows = torch.logspace(-3, 1, n)[:, None]
    return quantize_fp8((torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * rows).to(DEV))


# ---- quantization ----


def test_each_row_is_scaled_to_the_format_range_and_rounds_to_nearest():
    w = randn(N, K, seed=1) * torch.logspace(-4, 2, N, device=DEV)[:, None]
    q = quantize_fp8(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (N, K) and q.scale.shape == (N,)
    # Each row's largest magnitude lands on e4m3's largest value, so it comes back (nearly) exactly.
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((N,), FP8_MAX, device=DEV))
    torch.testing.assert_close(q.dequantize().abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6, atol=0)
    # Round to nearest with 3 mantissa bits: half an ulp is 2^-4 relative for normal values; values
    # below e4m3's smallest normal (2^-6 times the scale) have an absolute step of 2^-9 times the scale.
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(w.abs() * 2.0**-4, q.scale[:, None] * 2.0**-10) * (1 + 1e-6)
    assert (err <= bound).all()


def test_zero_rows_and_dtypes():
    w = randn(4, 32, dtype=torch.bfloat16, seed=3)
    w[2] = 0
    q = quantize_fp8(w)
    assert torch.equal(q.data[2].float(), torch.zeros(32, device=DEV)) and q.scale[2] > 0
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert q.nbytes == 4 * 32 + 4 * 4


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match=r"float weight \[N, K\]"):
        quantize_fp8(torch.zeros(8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match=r"scale must be float32 \[4\]"):
        Fp8Weight(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(3))


# ---- kernels against reference_linear ----


def bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # One rounding to the output dtype plus fp32 summation-order noise (K terms of size ~|ref|).
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    return ref.abs() * ulp + ref.abs().amax() * 1e-5 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 7, SKINNY_MAX_M, SKINNY_MAX_M + 1, 90])
def test_fp8_linear_matches_the_reference(m, dtype):
    w, x = weight(), randn(m, K, dtype=dtype, seed=4)
    got = fp8_linear(x, w.data, w.scale)
    assert got.shape == (m, N) and got.dtype == dtype
    want = F.linear(x.float(), w.data.float()) * w.scale
    assert ((got.float() - want).abs() <= bound(want, dtype)).all()
    # reference_linear is the same math, rounded once.
    assert ((got.float() - reference_linear(x, w).float()).abs() <= 2 * bound(want, dtype)).all()


@pytest.mark.parametrize("m", [3, 40])
def test_silu_mul_prologue(m):
    w, x = weight(), randn(m, 2 * K, dtype=torch.bfloat16, seed=5)
    got = fp8_linear(x, w.data, w.scale, silu_mul=True)
    want = F.linear(silu_and_mul(x).float(), w.data.float()) * w.scale
    assert ((got.float() - want).abs() <= bound(want, torch.bfloat16)).all()


@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 3, "USE_DOT": True, "FUSED_REDUCE": True},
        {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 3, "USE_DOT": True, "FUSED_REDUCE": False},
        {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "USE_DOT": False, "FUSED_REDUCE": True},
    ],
    ids=["split-fused", "split-pass", "fma-split"],
)
def test_split_k_scales_every_partial(config):
    # The scale multiplies each K range's partial sum: the split results agree with the unsplit one.
    w, x = weight(), randn(5, K, dtype=torch.float32, seed=6)
    got = skinny_linear(x, w.data, config={**config, "num_warps": 4, "num_stages": 2}, w_scale=w.scale)
    whole = fp8_linear(x, w.data, w.scale)
    assert ((got - whole).abs() <= bound(whole, torch.float32)).all()


def test_row_gate_and_out_buffer():
    w, x = weight(), randn(4, K, dtype=torch.bfloat16, seed=7)
    out = torch.full((4, N), 7.0, dtype=torch.bfloat16, device=DEV)
    closed = torch.zeros(4, dtype=torch.int32, device=DEV)
    fp8_linear(x, w.data, w.scale, out=out, row_gate=closed)
    assert (out == 7).all()  # no row needed it: the launch read no weight and wrote nothing
    fp8_linear(x, w.data, w.scale, out=out, row_gate=closed + 1)
    assert torch.equal(out, fp8_linear(x, w.data, w.scale))


def test_kernel_inputs_are_checked():
    w, x = weight(), randn(3, K, seed=8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        skinny_linear(x, w.data.float(), w_scale=w.scale)
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_linear(x, w.data, w.scale.double())
    with pytest.raises(ValueError, match="row_gate needs at most"):
        fp8_linear(randn(20, K), w.data, w.scale, row_gate=torch.ones(20, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"need x \[M, 200\]"):
        tiled_fp8_linear(randn(20, K + 1), w.data, w.scale)


# ---- W8A8: the tensor-core kernel's math (tests/test_tc_gemm.py holds the kernel to it) ----


def test_w8a8_equals_weight_only_where_the_activations_are_e4m3_values():
    # Chunks whose largest magnitude is 2 and whose values are +-0.5, 1, 2 scale to +-112, 224, 448:
    # e4m3 values, so activation quantization loses nothing.
    w = weight(n=40, k=512)
    g = torch.Generator().manual_seed(3)
    x = (torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (5, 512), generator=g)]
         * torch.where(torch.rand(5, 512, generator=g) < 0.5, -1.0, 1.0))  # fmt: skip
    x[:, ::256] = 2.0  # every chunk holds its maximum
    x = x.to(DEV)
    torch.testing.assert_close(w8a8_reference_linear(x, w), reference_linear(x, w), rtol=1e-5, atol=1e-6)


def test_w8a8_scales_each_row_and_chunk_on_its_own():
    w, x = weight(n=40, k=512), randn(4, 512, seed=5)
    base = w8a8_reference_linear(x, w)
    exact = F.linear(x.float(), w.dequantize())
    assert float((base - exact).abs().max()) <= 0.05 * float(exact.abs().max())  # 3 mantissa bits
    big = x.clone()
    big[2, 256:] *= 1000.0  # one row's second chunk: that row moves, the others keep their bits
    out = w8a8_reference_linear(big, w)
    assert torch.equal(out[[0, 1, 3]], base[[0, 1, 3]]) and not torch.equal(out[2], base[2])
    # Scaling a whole chunk by a power of two scales its e4m3 values' scale, not the values.
    halved = x.clone()
    halved[:, :256] *= 0.5
    want = w8a8_reference_linear(
        torch.cat([x[:, :256] * 0.5, torch.zeros_like(x[:, 256:])], 1), w
    ) + w8a8_reference_linear(torch.cat([torch.zeros_like(x[:, :256]), x[:, 256:]], 1), w)
    torch.testing.assert_close(w8a8_reference_linear(halved, w), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 256"):
        w8a8_reference_linear(randn(2, K), weight())


# ---- W8A8 prompt chunks: rows quantized to e4m3, then torch.nn.functional.scaled_mm ----


def e4m3_rows(m, k, seed, zero_row=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, its exact e4m3 values): each row e4m3 values with largest magnitude 448, times 2^(row - 3), so
    that quantize_rows has nothing to round (the CPU interpreter's own float8 rounding is not CUDA's)."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(m, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    v[torch.arange(m), torch.randint(0, k, (m,), generator=g)] = 448.0
    if zero_row is not None:
        v[zero_row] = 0.0
    x = v * 2.0 ** (torch.arange(m)[:, None] - 3.0)
    return x.to(torch.bfloat16).to(DEV), v.to(DEV)


def test_quantize_rows_maps_each_row_s_largest_magnitude_to_448():
    x, v = e4m3_rows(6, 320, seed=1, zero_row=4)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float(), v)
    want = 2.0 ** (torch.arange(6.0, device=DEV) - 3.0)
    want[4] = 1e-30 / 448.0  # an all-zero row: zeros, and the smallest scale
    torch.testing.assert_close(scale[:, 0], want, rtol=1e-6, atol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="rounding as CUDA rounds: on the GPU")
def test_quantize_rows_rounds_to_nearest_on_the_gpu():
    x = randn(64, 5632, dtype=torch.bfloat16, seed=2)
    q, scale = quantize_rows(x)
    xs = x.float() / scale
    assert float(xs.abs().amax()) <= 448.0 * (1 + 1e-6)
    assert ((q.float() - xs).abs() <= xs.abs() * 2.0**-4 + 2.0**-10).all()  # half an e4m3 step at most


def test_scaled_mm_fp8_linear_is_w8a8_with_one_chunk_a_row():
    w = weight(n=48, k=512)
    x, _ = e4m3_rows(5, 512, seed=3)
    got = scaled_mm_fp8_linear(x, w.data, w.scale)
    want = w8a8_reference_linear(x, w, chunk=512)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    # cuBLASLt sums in its own order and rounds once: two bf16 steps of the largest output at most (a wrong
    # scale or layout is off by the outputs' own size).
    assert float((got.float() - want.float()).abs().max()) <= 2.0**-6 * float(want.float().abs().max())


def test_prompt_chunks_take_w8a8_where_the_device_multiplies_with_row_scales():
    w = weight(n=48, k=512)
    x = randn(40, 512, dtype=torch.bfloat16, seed=9)
    got = fp8_linear(x, w.data, w.scale)
    if scaled_mm_rowwise(x.device):  # Hopper
        want = w8a8_reference_linear(x, w, chunk=512)
        assert float((got.float() - want.float()).abs().max()) <= 0.01 * float(want.float().abs().max())
    else:  # weight-only, the tiled kernel
        assert torch.equal(got, tiled_fp8_linear(x, w.data, w.scale))
    assert not scaled_mm_rowwise(torch.device("cpu"))


# ---- the model ----


def test_quantize_replaces_the_layer_weights_and_nothing_else():
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    plain, fused = OuroForCausalLM(cfg), OuroForCausalLM(cfg)
    fused.load_state_dict(plain.state_dict())
    fused.fuse()
    before = weight_bytes(plain)
    x = torch.randn(3, cfg.hidden_size)
    ref = plain.model.layers[0].mlp(x)
    plain.quantize("fp8")
    fused.quantize("fp8")
    for layer in plain.model.layers:
        for mod in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
            assert isinstance(mod, Fp8Linear)
    for layer in fused.model.layers:
        assert isinstance(layer.self_attn.qkv_weight, Fp8Weight) and isinstance(
            layer.mlp.gate_up_weight, Fp8Weight
        )
        assert isinstance(layer.self_attn.o_proj.weight, Fp8Weight)
    # Embedding, lm_head, norms and the exit gate keep their dtype.
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    linear_params = sum(
        cfg.num_hidden_layers * n * k
        for n, k in [(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)] * 2
        + [(cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)] * 2
        + [(cfg.intermediate_size, cfg.hidden_size)] * 3
    )
    # Each fp32 weight (4 bytes) became one FP8 byte, plus a 4-byte scale per output row.
    assert before - weight_bytes(plain) == 3 * linear_params - _scale_bytes(cfg)
    assert weight_bytes(fused) == weight_bytes(plain)
    # The quantized MLP is close to the fp32 one: e4m3's 2^-4 relative step, averaged over K terms.
    got = plain.model.layers[0].mlp(x)
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        plain.quantize("int4")


def _scale_bytes(cfg) -> int:
    rows = cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
    rows += 2 * cfg.intermediate_size + 2 * cfg.hidden_size  # q, k, v; gate, up; o and down
    return 4 * cfg.num_hidden_layers * rows


# ---- the engine and its options ----

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 40))]


def generate(engine, params):
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.request for o in engine.step() if o.finished})
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    return [(done[str(i)].output_ids, done[str(i)].exit_loops) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_triton_runner_with_fp8_weights_matches_the_torch_runner(model_dir, threshold):
    # The 30-token prompt runs in chunks of 24: the tiled kernel; decode steps run the skinny one.
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=threshold, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", quantization="fp8", max_num_batched_tokens=24)
    want = generate(Engine(EngineConfig(runner="torch", device="cpu", **opts)), params)
    engine = Engine(EngineConfig(runner="triton", **opts))
    assert isinstance(engine.model.model.layers[0].self_attn.qkv_weight, Fp8Weight)
    assert generate(engine, params) == want


def test_fp8_engine_equals_the_model_with_the_rounded_weights(model_dir):
    # The quantization is the only change: an unquantized engine whose layer weights are replaced by
    # the FP8 values times their scales gives the same logits (up to fp32 summation order).
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    opts = dict(model=model_dir, dtype="float32", runner="torch", device="cpu", keep_logits=True)
    fp8, rounded = Engine(EngineConfig(quantization="fp8", **opts)), Engine(EngineConfig(**opts))
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for quantized, plain in zip(fp8.model.model.layers, rounded.model.model.layers):
        for block in ("self_attn", "mlp"):
            for name in names:
                if hasattr(getattr(plain, block), name):
                    w = getattr(getattr(quantized, block), name).weight.dequantize()
                    assert not torch.equal(w, getattr(getattr(plain, block), name).weight)
                    getattr(getattr(plain, block), name).weight.data.copy_(w)
    out = []
    for engine in (fp8, rounded):
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.request for o in engine.step() if o.finished})
        out.append([(done[str(i)].output_ids, torch.stack(done[str(i)].logits)) for i in range(len(PROMPTS))])
    for (ids, got), (ids_ref, ref) in zip(*out):
        assert ids == ids_ref
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert fp8.weight_bytes < rounded.weight_bytes


def test_llm_takes_the_option(model_dir):
    from ouro_fast import LLM

    llm = LLM(model_dir, quantization="fp8", runner="torch", device="cpu", dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert isinstance(llm.engine.model.model.layers[0].mlp.down_proj.weight, Fp8Weight)


def test_engine_and_server_options():
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        Engine(EngineConfig(quantization="int8", runner="torch", device="cpu"))
    assert ServerConfig.from_env({"OURO_FAST_QUANTIZATION": "fp8"}).engine_options()["quantization"] == "fp8"
    assert ServerConfig.from_env({}).engine_options()["quantization"] is None
    with pytest.raises(ConfigError, match="OURO_FAST_QUANTIZATION must be fp8"):
        ServerConfig.from_env({"OURO_FAST_QUANTIZATION": "awq"})


# ---- checkpoints stored in FP8 (compressed-tensors) ----

COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}


def write_fp8_checkpoint(src, dst, per_tensor=False, edit=None):
    """src's checkpoint with every layer linear stored as FP8 and its weight_scale, as llm-compressor
    writes it; `edit(tensors, config)` may spoil it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ouro_fast.model.keys import is_layer_linear

    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(f"{dst}/model.safetensors").items():
        if not is_layer_linear(name):
            tensors[name] = t
            continue
        if per_tensor:
            scale = t.float().abs().amax() / FP8_MAX
            tensors[name] = (t.float() / scale).to(torch.float8_e4m3fn)
            tensors[name + "_scale"] = scale.reshape(())
        else:
            q = quantize_fp8(t)
            tensors[name], tensors[name + "_scale"] = q.data, q.scale[:, None]
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = COMPRESSED_TENSORS
    if edit is not None:
        edit(tensors, config)
    save_file(tensors, f"{dst}/model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def first_logits(engine) -> torch.Tensor:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.request for o in engine.step() if o.finished})
    return torch.stack([torch.stack(done[str(i)].logits) for i in range(len(PROMPTS))])


def test_an_fp8_checkpoint_loads_as_load_time_quantization(model_dir, tmp_path):
    stored = write_fp8_checkpoint(model_dir, tmp_path / "fp8")
    opts = dict(dtype="float32", runner="torch", device="cpu", keep_logits=True)
    engine = Engine(EngineConfig(model=stored, **opts))  # no option needed: the checkpoint says FP8
    assert isinstance(engine.model.model.layers[1].self_attn.k_proj, Fp8Linear)
    assert engine.quantization == "fp8"
    assert Engine(EngineConfig(model=model_dir, **opts)).quantization is None
    assert engine.model.model.embed_tokens.weight.dtype == torch.float32
    want = first_logits(Engine(EngineConfig(model=model_dir, quantization="fp8", **opts)))
    assert torch.equal(first_logits(engine), want)
    # Asking for fp8 again changes nothing; the fused model concatenates the stored scales.
    again = Engine(EngineConfig(model=stored, quantization="fp8", **opts))
    assert torch.equal(first_logits(again), want)
    again.model.fuse()
    qkv = again.model.model.layers[0].self_attn.qkv_weight
    assert isinstance(qkv, Fp8Weight) and qkv.scale.shape == (qkv.shape[0],)


def test_an_fp8_checkpoint_on_the_triton_runner(model_dir, tmp_path):
    stored = write_fp8_checkpoint(model_dir, tmp_path / "fp8")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    opts = dict(model=stored, dtype="float32", max_num_batched_tokens=24)
    want = generate(Engine(EngineConfig(runner="torch", device="cpu", **opts)), params)
    assert generate(Engine(EngineConfig(runner="triton", **opts)), params) == want


def test_a_scale_for_the_whole_tensor(model_dir, tmp_path):
    stored = write_fp8_checkpoint(model_dir, tmp_path / "fp8", per_tensor=True)
    engine = Engine(EngineConfig(model=stored, dtype="float32", runner="torch", device="cpu"))
    w = engine.model.model.layers[0].mlp.up_proj.weight
    assert w.scale.shape == (w.shape[0],) and torch.unique(w.scale).numel() == 1


def _drop_scale(tensors, config):
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]


def _bad_scale(tensors, config):
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(3, 1)


def _static_input(tensors, config):
    tensors["model.layers.0.self_attn.q_proj.input_scale"] = torch.ones(())


def _fp8_norm(tensors, config):
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)


def _int8_config(tensors, config):
    config["quantization_config"] = {
        **COMPRESSED_TENSORS,
        "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}},
    }


def _awq_config(tensors, config):
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (_drop_scale, "MissingTensorError", "has no model.layers.0.self_attn.q_proj.weight_scale"),
        (_bad_scale, "ShapeMismatchError", r"weight_scale .* has shape \[3, 1\]"),
        (_static_input, "CheckpointError", "static activation scales are not supported"),
        (_fp8_norm, "CheckpointError", "only the layers' linear weights may be"),
        (_int8_config, "ConfigFileError", "FP8 weights .* are supported"),
        (_awq_config, "ConfigFileError", "quant_method 'awq' is not supported"),
    ],
)
def test_fp8_checkpoints_the_loader_refuses(model_dir, tmp_path, edit, error, match):
    from ouro_fast.model import weights

    stored = write_fp8_checkpoint(model_dir, tmp_path / "fp8", edit=edit)
    with pytest.raises(getattr(weights, error), match=match):
        Engine(EngineConfig(model=stored, dtype="float32", runner="torch", device="cpu"))
