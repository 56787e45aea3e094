"""The persistent loop (kernels/persistent_loop.py) against the launch-per-kernel loop.

On the CPU the kernel runs under the Triton interpreter one phase per launch (a grid
barrier cannot open there); on a GPU the one-launch kernel with its grid barriers is
also checked against the phase-per-launch one, bit for bit, eagerly and in a CUDA graph.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed")

from ouro_fast.kernels import persistent_loop as pl  # noqa: E402
from ouro_fast.model import fast_loop  # noqa: E402
from ouro_fast.model.triton_attention import TritonBatch, TritonPagedAttention  # noqa: E402
sys.path.insert(0, os.path.dirname(__file__))  # the model and schedule helpers of test_kernels
from test_kernels import BT, CFG, DEV, gen, make_model, schedule  # noqa: E402

GPU = torch.cuda.is_available()
# Decode calls of (request slot, loop, position, 1): a block boundary, GQA, padding rows and tokens.
DECODE_CALLS = [
    ([(0, 0, 7, 1)], 0),
    ([(0, 0, 7, 1), (2, 2, 0, 1), (1, 3, 4, 1)], 1),
    ([(1, 1, 11, 1), (0, 2, 8, 1), (2, 0, 3, 1), (0, 3, 9, 1), (1, 0, 2, 1)], 3),
]


def fused_model(dtype=torch.bfloat16):
    model = make_model(dtype)
    model.fuse()
    return model


def cache(dtype=torch.bfloat16, seed=7):
    shape = (2, CFG.num_hidden_layers, BT.num_blocks * 4, CFG.num_key_value_heads, CFG.head_dim)
    return (torch.randn(shape, generator=gen(seed)) * 0.5).to(DEV, dtype)


def call(rows, pad, dtype=torch.bfloat16, seed=0):
    sched, _, _ = schedule(rows, pad_rows=pad, pad_tokens=pad)
    h = torch.randn(sched.num_step_tokens, CFG.hidden_size, generator=gen(seed)).to(DEV, dtype)
    return sched, h


def run(model, kv, sched, h, persistent: bool, monkeypatch):
    monkeypatch.setattr(pl, "ENABLED", persistent)
    attn = TritonPagedAttention(kv, 4, CFG.rope_theta, 64)
    attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV, max_q_len=1)
    with torch.no_grad():
        return fast_loop.run_loop_fused(model, h.clone(), attn)


@pytest.mark.parametrize("case", range(len(DECODE_CALLS)))
def test_persistent_loop_matches_launch_per_kernel_loop(case, monkeypatch):
    rows, pad = DECODE_CALLS[case]
    model = fused_model()
    sched, h = call(rows, pad, seed=case)
    kv_ref, kv_got = cache(), cache()
    expect = run(model, kv_ref, sched, h, False, monkeypatch)
    got = run(model, kv_got, sched, h, True, monkeypatch)
    real = len(rows)  # tokens of padding rows are left as they were by both loops' attention
    # The norms' mean squares are summed in another order: equal up to a bf16 rounding or two.
    torch.testing.assert_close(got[:real], expect[:real], atol=0.05, rtol=0.02)
    torch.testing.assert_close(kv_got, kv_ref, atol=0.05, rtol=0.02)
    assert not torch.equal(kv_got, cache())  # the loop wrote its K/V


def test_deterministic_and_any_grid_size(monkeypatch):
    # Same inputs and grid: the same bits. Another grid deals the columns and norm partials to CTAs
    # differently (the sums of squares are grouped per CTA): equal up to rounding.
    rows, pad = DECODE_CALLS[2]
    model = fused_model()
    sched, h = call(rows, pad, seed=11)
    outs = []
    for programs in (4, 4, 1, 7):
        kv = cache()
        attn = TritonPagedAttention(kv, 4, CFG.rope_theta, 64)
        attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV, max_q_len=1)
        lw = pl.stack_layer_weights(model)
        out = pl.persistent_loop(h, lw, kv, attn.batch, attn.cos_sin, 4, CFG.num_attention_heads,
                                 CFG.rms_norm_eps, phased=True, programs=programs)  # fmt: skip
        outs.append((out[: len(rows)], kv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for out, kv in outs[2:]:
        torch.testing.assert_close(out, outs[0][0], atol=0.05, rtol=0.02)
        torch.testing.assert_close(kv, outs[0][1], atol=0.05, rtol=0.02)


def test_stacked_weights_are_the_layers_weights():
    model = fused_model()
    before = fused_model()
    lw = pl.stack_layer_weights(model)
    assert pl.stack_layer_weights(model) is lw  # cached: stacked once
    for i, (layer, ref) in enumerate(zip(model.model.layers, before.model.layers)):
        assert layer.self_attn.qkv_weight.data_ptr() == lw.qkv[i].data_ptr()
        assert layer.mlp.down_proj.weight.data_ptr() == lw.down[i].data_ptr()
        assert layer.post_attention_layernorm_2.weight.data_ptr() == lw.norms[i, 3].data_ptr()
        assert torch.equal(layer.self_attn.qkv_weight, ref.self_attn.qkv_weight)
        assert torch.equal(layer.self_attn.o_proj.weight, ref.self_attn.o_proj.weight)
        assert torch.equal(layer.mlp.gate_up_weight, ref.mlp.gate_up_weight)
        assert torch.equal(layer.input_layernorm_2.weight, ref.input_layernorm_2.weight)
    with pytest.raises(ValueError, match="fused"):
        pl.stack_layer_weights(make_model(torch.bfloat16))


def test_only_small_16_bit_decode_calls_are_eligible(monkeypatch):
    monkeypatch.setattr(pl, "ENABLED", True)
    h = torch.zeros(4, CFG.hidden_size, dtype=torch.bfloat16, device=DEV)

    class B:
        max_q_len = 1

    assert pl.loop_eligible(h, B, True)
    assert not pl.loop_eligible(h, B, False)  # the backend must apply RoPE
    assert not pl.loop_eligible(h.float(), B, True)
    assert not pl.loop_eligible(torch.zeros(17, CFG.hidden_size, dtype=torch.bfloat16), B, True)
    B.max_q_len = 2
    assert not pl.loop_eligible(h, B, True)  # prefill
    B.max_q_len = 1
    monkeypatch.setattr(pl, "ENABLED", False)
    assert not pl.loop_eligible(h, B, True)


def test_launch_shapes():
    # Ouro-1.4B on 132 SMs: qkv, o_proj, gate_up, down tiles of at most 32 KB of bf16.
    assert pl.tile_shape(6144, 2048, 132) == (64, 256)
    assert pl.tile_shape(2048, 2048, 132) == (16, 1024)
    assert pl.tile_shape(11264, 2048, 132) == (128, 128)
    assert pl.tile_shape(2048, 5632, 132) == (16, 512)
    assert pl.tile_shape(96, 96, 4) == (32, 32)  # the chunk divides K
    # About one attention work item per CTA, and slices of at most 1,024 positions.
    assert pl.attention_splits(1, 16, 4096, 132) == 8
    assert pl.attention_splits(8, 16, 1024, 132) == 1
    assert pl.attention_splits(8, 16, 4096, 132) == 4
    assert pl.attention_splits(1, 1, 10**6, 132) == 16


@pytest.mark.skipif(not GPU, reason="the grid barrier needs every CTA resident at once: a GPU")
def test_one_launch_equals_phase_per_launch_and_replays_in_a_graph(monkeypatch):
    rows, pad = DECODE_CALLS[2]
    model = fused_model()
    sched, h = call(rows, pad, seed=5)
    lw = pl.stack_layer_weights(model)
    results = []
    for phased in (True, False):
        kv = cache()
        attn = TritonPagedAttention(kv, 4, CFG.rope_theta, 64)
        attn.batch = TritonBatch.from_schedule(sched, BT.tables, DEV, max_q_len=1)
        args = (h, lw, kv, attn.batch, attn.cos_sin, 4, CFG.num_attention_heads, CFG.rms_norm_eps)
        results.append((pl.persistent_loop(*args, phased=phased)[: len(rows)].clone(), kv.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    # Replayed in a CUDA graph, several times (the barrier resets itself between launches).
    kv.copy_(cache())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = pl.persistent_loop(*args)
    for _ in range(3):
        kv.copy_(cache())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[: len(rows)], results[0][0]) and torch.equal(kv, results[0][1])
    assert int(pl._BARRIER[kv.device][-1].abs().sum()) == 0
