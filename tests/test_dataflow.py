"""The one-launch dataflow decode loop against run_loop_fused (the launch-per-kernel loop).

On a CPU-only machine the kernel runs under TRITON_INTERPRET=1 in its SERIAL form: one program
runs every role in dependency order, with the streamers' tile walk and the same arithmetic.
"""

import dataclasses
import logging
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed")

from ouro_fast.core_py.block_table import BlockTable  # noqa: E402
from ouro_fast.kernels.dataflow import DataflowLoop, pack_weights, supported  # noqa: E402
from ouro_fast.model.config import OuroConfig  # noqa: E402
from ouro_fast.model.fast_loop import run_loop_fused  # noqa: E402
from ouro_fast.model.ouro import OuroForCausalLM  # noqa: E402
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention  # noqa: E402
from tests.test_model import make_model as random_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Intermediate 320 is 2.5 x hidden: down's last column chunk is partly padding.
CFG = OuroConfig(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=97, total_ut_steps=4, rope_theta=10000.0)  # fmt: skip
PAGE = 4


def make_model(cfg=CFG):
    model = random_model(cfg).to(device=DEV, dtype=torch.bfloat16)
    model.fuse()
    return model


def decode_batch(rows, bt):
    """TritonBatch of decode rows (request slot, loop, position): one token each, in row order."""
    slots = np.zeros(len(rows), dtype=np.int64)
    for r, (slot, loop, pos) in enumerate(rows):
        s = np.zeros(1, dtype=np.int64)
        bt.fill_slot_mapping(slot, loop, pos, 1, s, 0)
        slots[r] = s[0]

    def dev(values, dtype):
        return torch.tensor(np.asarray(values), dtype=dtype, device=DEV)

    return TritonBatch(
        slot_mapping=dev(slots, torch.int64),
        positions=dev([p for *_, p in rows], torch.int64),
        block_tables=dev(np.stack([bt.tables[s, lp] for s, lp, _ in rows]), torch.int32),
        row_q_start=dev([p for *_, p in rows], torch.int32),
        row_len=dev([1] * len(rows), torch.int32),
        row_tok_off=dev(list(range(len(rows))), torch.int32),
        max_q_len=1,
    )


# One token runs the ONE_ROW path (products on CUDA cores) unless one_row is off. With splits > 1 each
# head's context is cut into slices of 4 positions (block_n 4), merged by the last slice to arrive.
@pytest.mark.parametrize(
    "streamers, tiles, tokens, one_row, splits",
    [(1, 2, 4, True, 1), (3, 2, 4, True, 3), (3, 4, 4, True, 1), (3, 2, 1, True, 1), (2, 4, 1, True, 4),
     (3, 2, 1, False, 2)],
)  # fmt: skip
def test_dataflow_loop_matches_run_loop_fused(streamers, tiles, tokens, one_row, splits):
    model = make_model()
    bt = BlockTable(64, PAGE, 4, 3, 6)
    for slot in range(3):
        assert bt.allocate(slot, 20)
    # Contexts of 1 to 20 positions at different loops, one of them a page boundary.
    rows = [(1, 2, 19), (0, 0, 7), (2, 3, 0), (0, 1, 4)][:tokens]
    batch = decode_batch(rows, bt)
    shape = (2, CFG.num_hidden_layers, 64 * PAGE, CFG.num_key_value_heads, CFG.head_dim)
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    attn = TritonPagedAttention(cache.clone(), PAGE, CFG.rope_theta, 64)
    attn.batch = batch
    h = torch.randn(len(rows), CFG.hidden_size, generator=torch.Generator().manual_seed(2)).to(
        DEV, torch.bfloat16
    )
    loop = DataflowLoop(model, streamers=streamers, tiles=tiles, one_row=one_row, splits=splits,
                        block_n=4 if splits > 1 else 64)  # fmt: skip
    got_cache = cache.clone()
    with torch.no_grad():
        expect = run_loop_fused(model, h.clone(), attn)
        got = loop(h, got_cache, attn.cos_sin, batch, PAGE)
    if DEV == "cpu":  # fp32 sums of these short rows round to the same bf16 values in both (seeded)
        assert torch.equal(got, expect) and torch.equal(got_cache, attn.kv_cache)
    else:  # the GPU's dot sums in another order than the skinny matmul: bf16 rounding apart
        torch.testing.assert_close(got, expect, atol=0.05, rtol=0.02)
        torch.testing.assert_close(got_cache, attn.kv_cache, atol=0.05, rtol=0.02)
    written = batch.slot_mapping
    assert not torch.equal(got_cache[:, :, written], cache[:, :, written])  # the new K/V was written


@pytest.mark.skipif(DEV != "cuda", reason="needs a 16 GiB KV cache")
def test_layer_offsets_past_2_31_elements():
    # A full KV pool (the 1.4B preset on the H200) has layer strides just under 2**31 elements: from layer 2
    # on, layer * stride overflows 32 bits. Four layers of 2**30 elements each reach it here.
    cfg = dataclasses.replace(CFG, num_hidden_layers=4)
    model = make_model(cfg)
    bt = BlockTable(64, PAGE, 4, 3, 6)
    for slot in range(3):
        assert bt.allocate(slot, 20)
    batch = decode_batch([(1, 2, 19)], bt)
    slots_per_layer = 2**30 // (cfg.num_key_value_heads * cfg.head_dim)
    cache = torch.empty((2, 4, slots_per_layer, cfg.num_key_value_heads, cfg.head_dim), dtype=torch.bfloat16,
                        device=DEV)  # fmt: skip
    assert cache[0].stride(0) < 2**31 <= 2 * cache[0].stride(0)
    cache[:, :, : 64 * PAGE] = torch.randn(cache[:, :, : 64 * PAGE].shape, device=DEV).to(torch.bfloat16)
    attn = TritonPagedAttention(cache, PAGE, cfg.rope_theta, 64)
    attn.batch = batch
    h = torch.randn(1, cfg.hidden_size, device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        got = DataflowLoop(model, block_n=4)(h, cache, attn.cos_sin, batch, PAGE)
        written = cache[:, :, batch.slot_mapping].clone()
        # The reference writes the same new slots before it reads them: the same cache serves both.
        expect = run_loop_fused(model, h.clone(), attn)
    torch.testing.assert_close(got, expect, atol=0.05, rtol=0.02)
    torch.testing.assert_close(written, cache[:, :, batch.slot_mapping], atol=0.05, rtol=0.02)


def test_pack_weights_layout():
    model = make_model()
    w, norms = pack_weights(model)
    h, inter = CFG.hidden_size, CFG.intermediate_size
    per_layer = 3 * h + h + 2 * inter + 3 * h
    assert w.shape == (CFG.num_hidden_layers * per_layer, h)
    lay = model.model.layers[1]
    base = per_layer
    assert torch.equal(w[base : base + 3 * h], lay.self_attn.qkv_weight)
    gu = w[base + 4 * h : base + 4 * h + 2 * inter]
    gate, up = lay.mlp.gate_up_weight.split(inter)
    assert torch.equal(gu[16 * 3 : 16 * 3 + 8], gate[24:32]) and torch.equal(
        gu[16 * 3 + 8 : 16 * 4], up[24:32]
    )
    down = w[base + 4 * h + 2 * inter : base + per_layer]
    assert torch.equal(down[2 * h : 3 * h, : inter - 2 * h], lay.mlp.down_proj.weight[:, 2 * h :])
    assert not down[2 * h :, inter - 2 * h :].any()
    assert torch.equal(norms[-1], model.model.norm.weight)


def test_supported_shapes():
    assert supported(CFG) is None
    gqa = OuroConfig(hidden_size=128, intermediate_size=320, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=97)  # fmt: skip
    assert "MHA" in supported(gqa)
    with pytest.raises(ValueError, match="MHA"):
        DataflowLoop(OuroForCausalLM(gqa).to(torch.bfloat16))


def test_bad_inputs_are_clear_errors():
    model = make_model()
    loop = DataflowLoop(model, streamers=1)
    bt = BlockTable(64, PAGE, 4, 3, 6)
    assert bt.allocate(0, 20)
    batch = decode_batch([(0, 0, 3)], bt)
    cache = torch.zeros(2, CFG.num_hidden_layers, 64 * PAGE, CFG.num_key_value_heads, CFG.head_dim,
                        dtype=torch.bfloat16, device=DEV)  # fmt: skip
    cos_sin = TritonPagedAttention(cache, PAGE, CFG.rope_theta, 64).cos_sin
    with pytest.raises(ValueError, match="at most 8 tokens"):
        loop(torch.zeros(9, CFG.hidden_size, dtype=torch.bfloat16, device=DEV), cache, cos_sin, batch, PAGE)
    with pytest.raises(ValueError, match="contiguous bf16"):
        loop(torch.zeros(1, CFG.hidden_size, device=DEV), cache, cos_sin, batch, PAGE)


def test_run_loop_fused_hands_one_token_steps_to_an_attached_loop():
    model = make_model()
    bt = BlockTable(64, PAGE, 4, 3, 6)
    for slot in range(3):
        assert bt.allocate(slot, 20)
    cache = torch.randn((2, CFG.num_hidden_layers, 64 * PAGE, CFG.num_key_value_heads, CFG.head_dim),
                        generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)  # fmt: skip
    h = torch.randn(2, CFG.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEV, torch.bfloat16)
    calls = []

    class Spy(DataflowLoop):
        def __call__(self, *args, **kwargs):
            calls.append(args[0].shape[0])
            return super().__call__(*args, **kwargs)

    expect = {}
    with torch.no_grad():
        for rows in ([(1, 2, 19)], [(1, 2, 19), (0, 0, 7)]):
            attn = TritonPagedAttention(cache.clone(), PAGE, CFG.rope_theta, 64)
            attn.batch = decode_batch(rows, bt)
            expect[len(rows)] = run_loop_fused(model, h[: len(rows)].clone(), attn)
        model.dataflow = Spy(model, streamers=2, tiles=2, block_n=4, splits=2)
        for rows in ([(1, 2, 19)], [(1, 2, 19), (0, 0, 7)]):
            attn = TritonPagedAttention(cache.clone(), PAGE, CFG.rope_theta, 64)
            attn.batch = decode_batch(rows, bt)
            got = run_loop_fused(model, h[: len(rows)].clone(), attn)
            if DEV == "cpu":
                assert torch.equal(got, expect[len(rows)])
            else:
                torch.testing.assert_close(got, expect[len(rows)], atol=0.05, rtol=0.02)
    assert calls == [1]  # the one-token step ran the dataflow loop; the two-token step did not


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory):
    """A checkpoint of CFG (the shapes the dataflow loop supports) in float32."""
    from ouro_fast.model.checkpoints import make_checkpoint  # noqa: PLC0415

    return str(make_checkpoint(CFG, tmp_path_factory.mktemp("mha"), seed=1, dtype="float32", progress=False))


def engine(model_dir, **kw):
    from ouro_fast.engine.engine import Engine, EngineConfig  # noqa: PLC0415

    opts = dict(model=model_dir, runner="triton", num_kv_blocks=256, max_num_batched_tokens=16)
    return Engine(EngineConfig(**{**opts, **kw}))


def generate(eng, prompt, n):
    from ouro_fast.engine.sampling import SamplingParams  # noqa: PLC0415

    eng.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o if o.finished else out
    return out


def test_engine_dataflow_off_with_a_warning_where_unsupported(mha_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="ouro_fast"):
        eng = engine(mha_dir, dtype="float32", dataflow=True)
    assert "dataflow decode loop off: needs CUDA and bfloat16" in caplog.text
    assert getattr(eng.model, "dataflow", None) is None
    assert len(generate(eng, [5, 6, 7], 3).request.output_ids) == 3
    assert eng.bt.num_free_blocks == eng.bt.num_blocks


def test_engine_dataflow_default_is_quiet_where_unsupported(mha_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ouro_fast"):
        eng = engine(mha_dir, dtype="float32")  # the default: on where supported
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "dataflow decode loop off: needs CUDA and bfloat16" in caplog.text  # said at INFO
    assert getattr(eng.model, "dataflow", None) is None


@pytest.mark.skipif(DEV != "cuda", reason="the dataflow loop runs in the engine only on CUDA (bf16)")
def test_engine_dataflow_default_is_off_with_the_tensor_core_matmuls(mha_dir, monkeypatch):
    from ouro_fast.kernels import tc_gemm  # noqa: PLC0415

    monkeypatch.setattr(tc_gemm, "ENABLED", True)
    assert getattr(engine(mha_dir, dtype="bfloat16").model, "dataflow", None) is None


@pytest.mark.skipif(DEV != "cuda", reason="the dataflow loop runs in the engine only on CUDA (bf16)")
@pytest.mark.parametrize("dataflow", [True, None])
def test_engine_dataflow_serves_one_token_steps(mha_dir, monkeypatch, dataflow):
    from ouro_fast.kernels import tc_gemm  # noqa: PLC0415

    monkeypatch.setattr(tc_gemm, "ENABLED", False)  # the default (None) attaches it only without them
    calls, call = [], DataflowLoop.__call__

    def counted(loop, *args, **kwargs):
        calls.append(1)
        return call(loop, *args, **kwargs)

    monkeypatch.setattr(DataflowLoop, "__call__", counted)
    eng = engine(mha_dir, dtype="bfloat16", dataflow=dataflow)  # asked for, or by default without tc_gemm
    assert isinstance(eng.model.dataflow, DataflowLoop)
    out = generate(eng, [5, 6, 7], 8)
    assert len(out.request.output_ids) == 8 and calls  # called at least when the one-row graphs were captured
    assert eng.bt.num_free_blocks == eng.bt.num_blocks  # every block back after the request
