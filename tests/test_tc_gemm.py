"""The tensor-core skinny matmul (kernels/tc_gemm.py): its partition on the CPU, the kernel on a Hopper GPU.

Gluon has no interpreter, so the kernel itself runs only where CUDA with compute capability 9.0+ is:
against F.linear in fp32, bit for bit from call to call and from batch to single row, with its partial
products, and inside the engine against the fp32 dense reference.
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as the other kernel tests set it
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.kernels import tc_gemm  # noqa: E402
from ouro_fast.kernels.tuning import (  # noqa: E402
    TC_MAX_ROWS,
    TC_PACE_BESIDE,
    TC_SILU_MUL_MAX_ROWS,
    TC_SMEM_BUDGET,
    TC_TOKEN_TILES,
    TC_WHOLE_GROUP_SMEM,
)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU")
SHAPES = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]  # Ouro-1.4B: qkv, o, gate_up, down


def ranges(tiles: int, ctas: int) -> list[range]:
    return [range(c * tiles // ctas, (c + 1) * tiles // ctas) for c in range(ctas)]


@pytest.mark.parametrize("n, k", SHAPES + [(640, 768)])
@pytest.mark.parametrize("ctas", [132, 7, 1])
def test_owner_and_contributors_match_the_ranges(n, k, ctas):
    kt, tiles = k // 256, (n // 64) * (k // 256)
    ctas = min(ctas, tiles)
    rs = ranges(tiles, ctas)
    assert sorted(t for r in rs for t in r) == list(range(tiles))  # every tile once
    for t in range(0, tiles, 7):
        assert t in rs[tc_gemm.owner(t, tiles, ctas)]
    for g in range(n // 64):
        holders = [c for c, r in enumerate(rs) if any(g * kt <= t < (g + 1) * kt for t in r)]
        assert tc_gemm.contributors(g, kt, tiles, ctas) == (holders[0], len(holders))


@pytest.mark.parametrize("n, k", SHAPES + [(640, 768)])
@pytest.mark.parametrize("ctas", [132, 7, 1])
def test_slots_for_is_the_most_ctas_sharing_a_group(n, k, ctas):
    kt, tiles = k // 256, (n // 64) * (k // 256)
    rs = ranges(tiles, min(ctas, tiles))
    most = max(sum(1 for r in rs if any(g * kt <= t < (g + 1) * kt for t in r)) for g in range(n // 64))
    assert tc_gemm.slots_for(n, k, 256, ctas) == most
    if ctas == 132:  # Ouro-1.4B at 132 SMs: qkv 3, o 5, gate_up 2, down 5 slots
        assert most == {(6144, 2048): 3, (2048, 2048): 5, (11264, 2048): 2, (2048, 5632): 5}.get((n, k), most)


def test_launch_plan_gives_gate_up_a_cta_per_row_group():
    # gate_up's 176 row groups on 132 SMs: one CTA each, two an SM with half the shared memory, so that no
    # group is split between CTAs; partial outputs and shapes with fewer groups than SMs keep the ranges.
    ctas, budget = tc_gemm.launch_plan(11264, 2048, 256, 132, 1, partial=False)
    assert (ctas, budget) == (176, TC_WHOLE_GROUP_SMEM) and 2 * (budget + 1024) <= 228 * 1024
    assert tc_gemm.ring_slots(256, 8, False, 4, budget) == 3
    assert tc_gemm.launch_plan(11264, 2048, 256, 132, 1, partial=True) == (132, TC_SMEM_BUDGET)
    assert tc_gemm.launch_plan(6144, 2048, 256, 132, 1, partial=False) == (132, TC_SMEM_BUDGET)
    assert tc_gemm.launch_plan(11264, 2048, 256, 64, 1, partial=False)[0] == 64  # over twice the SMs


def test_token_tile_is_the_smallest_that_holds_the_rows():
    assert [tc_gemm.token_tile(m) for m in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    assert TC_TOKEN_TILES[-1] == TC_MAX_ROWS and TC_SILU_MUL_MAX_ROWS <= TC_MAX_ROWS
    with pytest.raises(StopIteration):
        tc_gemm.token_tile(TC_MAX_ROWS + 1)


def test_gate_up_takes_whole_groups_two_an_sm_at_every_token_tile():
    # Each CTA's ring (two slots at least), with the SwiGLU buffer, fits half an SM's shared memory.
    assert tc_gemm.launch_plan(11264, 2048, 256, 132, 1, False) == (176, TC_WHOLE_GROUP_SMEM)
    for ntok in TC_TOKEN_TILES:
        nbuf = tc_gemm.ring_slots(256, ntok, False, 4, TC_WHOLE_GROUP_SMEM, swiglu=True)
        used = 1024 + 64 * ntok * 2 + nbuf * (64 * 256 + ntok * 256) * 2
        assert nbuf >= 2 and used <= TC_WHOLE_GROUP_SMEM and 2 * used <= 228 * 1024


def test_a_grown_workspace_keeps_the_one_captured_graphs_point_at():
    ws = tc_gemm._Workspace()
    dev = torch.device("cpu")
    part, cnt = ws.get(dev, 1 << 21, 1024)
    assert ws.get(dev, 1 << 20, 100) == (part, cnt)  # big enough: the same buffers
    bigger, _ = ws.get(dev, (1 << 21) + 1, 1024)
    assert bigger.numel() > part.numel() and any(t is part for t in ws.outgrown)
    assert any(t is cnt for t in ws.outgrown)


def test_ring_fits_the_budget_and_keeps_two_slots():
    cases = [(256, 8, False), (256, 16, True), (128, 16, False), (256, 32, False)]
    for tc, ntok, silu in cases:
        nbuf = tc_gemm.ring_slots(tc, ntok, silu, most=8, budget=225 * 1024)
        nx = 2 if silu else 1
        used = nbuf * (64 * tc + nx * ntok * tc) * 2 + (ntok * tc * 2 if silu else 0)
        assert nbuf >= 2 and used <= 225 * 1024
    assert tc_gemm.ring_slots(256, 16, True, most=4, budget=10_000) == 2
    # FP8 weight tiles take half the bytes: more of them fit (16 KB + a 4 KB x chunk a slot at 8 tokens).
    assert tc_gemm.ring_slots(256, 8, False, most=16, budget=100 * 1024, w_bytes=1) == 4
    assert tc_gemm.ring_slots(256, 8, False, most=16, budget=100 * 1024) == 2


def test_ring_never_has_more_slots_than_a_cta_has_tiles():
    # o_proj's 256 tiles on 132 CTAs: 2 a CTA at most, so 2 slots (freeing the SM for gate_up's CTAs);
    # qkv (768 tiles) and down (704) keep the budget's 4; gate_up's whole groups (8 tiles) keep 3.
    assert tc_gemm.slots_used(2048, 2048, 256, 132, 4) == 2
    assert tc_gemm.slots_used(6144, 2048, 256, 132, 4) == 4
    assert tc_gemm.slots_used(2048, 5632, 256, 132, 4) == 4
    assert tc_gemm.slots_used(11264, 2048, 256, 176, 3) == 3
    assert tc_gemm.slots_used(64, 256, 256, 132, 4) == 1  # one tile in all


def test_decode_mlp_paces_gate_up_but_not_down(monkeypatch):
    # gate_up starts beside o_proj and the attention (paced); down streams while gate_up still streams (not).
    from types import SimpleNamespace

    from ouro_fast.model import triton_loop

    calls = []

    def fake(x, w, silu_mul=False, partial=False, swiglu_out=False, pace=0, w_scale=None):
        calls.append((tuple(w.shape), swiglu_out, partial, pace))
        return torch.zeros(x.shape[0], w.shape[0] // 2 if swiglu_out else w.shape[0])

    monkeypatch.setattr(tc_gemm, "supported", lambda *a, **k: True)
    monkeypatch.setattr(tc_gemm, "tc_linear", fake)
    down = SimpleNamespace(weight=torch.zeros(32, 64))
    mlp = SimpleNamespace(gate_up_weight=torch.zeros(128, 32), down_proj=down)
    triton_loop.mlp_partial(torch.zeros(2, 32), mlp)
    assert calls == [((128, 32), True, False, TC_PACE_BESIDE), ((32, 64), False, True, 0)]
    assert TC_PACE_BESIDE in (1, 2, 3, 4)  # the kernel's pause takes 1-4 (x 500 ns)
    triton_loop.linear(torch.zeros(2, 32), torch.zeros(16, 32), pace=2)
    assert calls[-1] == ((16, 32), False, False, 2)


def test_swiglu_epilogue_buffer_is_counted_and_two_gate_up_ctas_still_fit_a_sm():
    # gate_up with swiglu_out keeps its 176 CTAs two a SM: the group's [64, NTOK] buffer fits the budget.
    for ntok in (8, 16):
        nbuf = tc_gemm.ring_slots(256, ntok, False, 4, TC_WHOLE_GROUP_SMEM, swiglu=True)
        used = nbuf * (64 * 256 + ntok * 256) * 2 + 64 * ntok * 2 + 1024
        assert nbuf >= 2 and used <= TC_WHOLE_GROUP_SMEM
    for budget in range(60 * 1024, 200 * 1024, 4096):  # the buffer comes out of the ring's share
        with_buf = tc_gemm.ring_slots(256, 8, False, 8, budget, swiglu=True)
        assert with_buf <= tc_gemm.ring_slots(256, 8, False, 8, budget)
        assert with_buf == tc_gemm.ring_slots(256, 8, False, 8, budget - 64 * 8 * 2)


def test_not_supported_off_hopper_or_for_odd_shapes():
    x, w = torch.zeros(1, 2048, dtype=torch.bfloat16), torch.zeros(2048, 2048, dtype=torch.bfloat16)
    if not HOPPER:
        assert not tc_gemm.supported(x, w)
    else:
        cuda = {"device": "cuda", "dtype": torch.bfloat16}
        assert tc_gemm.supported(torch.zeros(1, 2048, **cuda), torch.zeros(2048, 2048, **cuda))
        w = torch.zeros(2048, 2048, **cuda)
        assert tc_gemm.supported(torch.zeros(TC_MAX_ROWS, 2048, **cuda), w)
        assert not tc_gemm.supported(torch.zeros(TC_MAX_ROWS + 1, 2048, **cuda), w)
        rows = TC_SILU_MUL_MAX_ROWS + 1  # down's SiLU prologue holds its chunks in registers: fewer rows
        assert not tc_gemm.supported(torch.zeros(rows, 4096, **cuda), torch.zeros(2048, 2048, **cuda), True)
        assert not tc_gemm.supported(torch.zeros(1, 2000, **cuda), torch.zeros(2048, 2000, **cuda))
        assert not tc_gemm.supported(
            torch.zeros(1, 2048, device="cuda"), torch.zeros(2048, 2048, device="cuda")
        )


@needs_hopper
@pytest.mark.parametrize("n, k", [(11264, 2048), (1536, 512)])  # Ouro-1.4B's gate_up; groups split over CTAs
@pytest.mark.parametrize("m", [1, 5, 8, 16, 17, 24, 32])
def test_swiglu_out_is_silu_and_mul_of_the_product_bit_for_bit(n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    assert tc_gemm.supported(x, w, swiglu_out=True)
    gu = tc_gemm.tc_linear(x, w)  # [gate; up] in bf16, as the down projection's SILU_MUL reads it
    f = n // 2
    want = (F.silu(gu[:, :f].float()).to(gu.dtype).float() * gu[:, f:].float()).to(gu.dtype)
    got = tc_gemm.tc_linear(x, w, swiglu_out=True)
    assert got.shape == (m, f) and torch.equal(got, want)
    first = next(t for t in (1, 9, 17) if tc_gemm.token_tile(t) == tc_gemm.token_tile(m))
    assert torch.equal(tc_gemm.tc_linear(x[:first].contiguous(), w, swiglu_out=True), got[:first])


@needs_hopper
@pytest.mark.parametrize("pace", [1, 2, 3, 4])
def test_paced_loads_change_no_bit(pace):
    # pace only delays the loader's first tiles while the PDL wait lasts: plain, partial and SwiGLU outputs
    # are the unpaced ones.
    gen = torch.Generator(device="cuda").manual_seed(pace)
    x = torch.randn(8, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    for n in (6144, 2048, 11264):
        w = (0.02 * torch.randn(n, 2048, device="cuda", generator=gen)).to(torch.bfloat16)
        assert torch.equal(tc_gemm.tc_linear(x, w, pace=pace), tc_gemm.tc_linear(x, w))
        paced = tc_gemm.tc_linear(x, w, partial=True, pace=pace)
        assert torch.equal(paced, tc_gemm.tc_linear(x, w, partial=True))
    got = tc_gemm.tc_linear(x, w, swiglu_out=True, pace=pace)
    assert torch.equal(got, tc_gemm.tc_linear(x, w, swiglu_out=True))


@needs_hopper
def test_mlp_partial_is_the_silu_mul_path_bit_for_bit():
    # gate_up's SwiGLU epilogue against gate_up's plain product fed to down's SiLU prologue.
    from types import SimpleNamespace

    from ouro_fast.model import triton_loop

    gen = torch.Generator(device="cuda").manual_seed(7)
    rnd = lambda *s: (0.02 * torch.randn(*s, device="cuda", generator=gen)).to(torch.bfloat16)  # noqa: E731
    mlp = SimpleNamespace(gate_up_weight=rnd(11264, 2048), down_proj=SimpleNamespace(weight=rnd(2048, 5632)))
    for m in (1, 8, 16):
        x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        fused = triton_loop.mlp_partial(x, mlp)
        gate_up = triton_loop.linear(x, mlp.gate_up_weight)
        plain = triton_loop.linear(gate_up, mlp.down_proj.weight, silu_mul=True, partial=True)
        assert torch.equal(fused.sum(0), plain.sum(0)) and fused.shape[1:] == plain.shape[1:]


def reference(x, w, silu_mul):
    if silu_mul:  # silu_and_mul's rounding: the silu in bf16, then the product
        f = x.shape[1] // 2
        x = (F.silu(x[:, :f].float()).to(x.dtype).float() * x[:, f:].float()).to(x.dtype)
    return F.linear(x.float(), w.float())


@needs_hopper
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8, 16, 17, 24, 32])
@pytest.mark.parametrize("partial", [False, True])
def test_matches_linear_bit_stable_and_row_independent(n, k, m, partial):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    silu = k == 5632 and m <= TC_SILU_MUL_MAX_ROWS  # down: its input is the fused gate/up output
    assert tc_gemm.supported(torch.zeros(m, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16),
                             torch.zeros(n, k, device="cuda", dtype=torch.bfloat16), silu)  # fmt: skip
    w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).to(torch.bfloat16)
    x = torch.randn(m, 2 * k if silu else k, device="cuda", generator=gen).to(torch.bfloat16)

    def run(rows):
        y = tc_gemm.tc_linear(rows, w, silu, partial=partial)
        if not partial:
            return y.float()
        total = y[0].clone()
        for s in y[1:]:  # in slot order, as the consumers add them
            total += s
        return total

    got, want = run(x), reference(x, w, silu)
    # fp32 accumulation in another order, plus one bf16 rounding of the output (none for partials).
    assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())
    assert torch.equal(run(x), got)  # no atomics: the same bits every call
    # Within a token tile a row's result does not depend on the others (fewest rows of m's tile).
    first = next(t for t in (1, 9, 17) if tc_gemm.token_tile(t) == tc_gemm.token_tile(m))
    assert torch.equal(run(x[:first].contiguous()), got[:first])


@needs_hopper
def test_engine_on_tensor_cores_matches_fp32_dense_reference(tmp_path, monkeypatch):
    from ouro_fast.engine.engine import Engine, EngineConfig
    from ouro_fast.engine.sampling import SamplingParams
    from ouro_fast.model.checkpoints import PRESETS, make_checkpoint
    from ouro_fast.model.reference import DenseReference

    # The smallest shapes the kernel takes: hidden and intermediate multiples of 256, heads of 128.
    cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=512, intermediate_size=768, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=128)  # fmt: skip
    model_dir = str(make_checkpoint(cfg, tmp_path, seed=3, dtype="float32", progress=False))
    calls = []
    real = tc_gemm.tc_linear
    monkeypatch.setattr(tc_gemm, "tc_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fp32 = Engine(EngineConfig(model=model_dir, dtype="float32", runner="torch", device="cpu"))
    ref = DenseReference(dict(fp32.model.state_dict()), fp32.model_config, 128, fp32.vocab_limit)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", runner="triton", keep_logits=True,
                                 max_num_batched_tokens=16))  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=1.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 30))]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.request for o in engine.step() if o.finished})
    assert calls, "the engine never ran the tensor-core matmul"
    v = engine.vocab_limit
    for i, prompt in enumerate(prompts):
        want, got = ref.generate(prompt, 6, threshold=1.0), done[str(i)]
        assert got.output_ids[0] == want.tokens[0]
        for k, (a, b) in enumerate(zip(got.logits, want.logits)):  # while the two streams agree
            err = float((a[:v].float().cpu() - b[:v]).abs().max() / b[:v].abs().max())
            assert err <= 0.04, (i, k, err)  # test_gpu_runner's BF16_REL_TOL
            if got.output_ids[k] != want.tokens[k]:
                break


def fp8_weight(n, k, gen):
    from ouro_fast.model.quantization import quantize_fp8

    return quantize_fp8(0.02 * torch.randn(n, k, device="cuda", generator=gen))


@needs_hopper
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 8, 16, 32])
@pytest.mark.parametrize("partial", [False, True])
def test_fp8_weights_run_w8a8_as_the_reference_computes_it(n, k, m, partial):
    from ouro_fast.model.quantization import w8a8_reference_linear

    gen = torch.Generator(device="cuda").manual_seed(n + k + m + 1)
    w = fp8_weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    assert tc_gemm.supported(x, w.data)

    def run(rows):
        y = tc_gemm.tc_linear(rows, w.data, partial=partial, w_scale=w.scale)
        return y.float() if not partial else sum(y[1:], y[0].clone())

    got, want = run(x), w8a8_reference_linear(x, w).float()
    # The same math in another summation order: one bf16 rounding apart at most, 2^-7 of the largest output.
    assert float((got - want).abs().max()) <= 2.0**-7 * float(want.abs().max())
    exact = F.linear(x.float(), w.dequantize(torch.float32))  # e4m3 activations: 3 mantissa bits
    assert float((got - exact).abs().max()) <= 0.04 * float(exact.abs().max())
    assert torch.equal(run(x), got)
    first = next(t for t in (1, 9, 17) if tc_gemm.token_tile(t) == tc_gemm.token_tile(m))
    assert torch.equal(run(x[:first].contiguous()), got[:first])
    with pytest.raises(ValueError, match="w_scale"):
        tc_gemm.tc_linear(x, w.data)


@needs_hopper
@pytest.mark.parametrize("n, k", [(11264, 2048), (1536, 512)])
@pytest.mark.parametrize("m", [1, 16, 32])
def test_fp8_swiglu_out_scales_gate_and_up_rows_by_their_own_scales(n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(n + m + 2)
    w = fp8_weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    gu = tc_gemm.tc_linear(x, w.data, w_scale=w.scale)
    f = n // 2
    want = (F.silu(gu[:, :f].float()).to(gu.dtype).float() * gu[:, f:].float()).to(gu.dtype)
    assert torch.equal(tc_gemm.tc_linear(x, w.data, swiglu_out=True, w_scale=w.scale), want)


@needs_hopper
def test_fp8_engine_on_tensor_cores_matches_the_fp32_fp8_engine(tmp_path):
    from ouro_fast.engine.engine import Engine, EngineConfig
    from ouro_fast.engine.sampling import SamplingParams
    from ouro_fast.model.checkpoints import PRESETS, make_checkpoint

    cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=512, intermediate_size=768, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=128)  # fmt: skip
    model_dir = str(make_checkpoint(cfg, tmp_path, seed=4, dtype="float32", progress=False))
    calls = []
    real = tc_gemm.tc_linear
    fp8_calls = lambda *a, **kw: calls.append(kw.get("w_scale") is not None) or real(*a, **kw)  # noqa: E731
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=1.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 30))]
    results = []
    cpu, gpu = dict(dtype="float32", runner="torch", device="cpu"), dict(dtype="bfloat16", runner="triton")
    for opts in (cpu, gpu):
        if opts["runner"] == "triton":  # before the engine captures its graphs
            tc_gemm.tc_linear = fp8_calls
        try:
            engine = Engine(EngineConfig(model=model_dir, quantization="fp8", keep_logits=True,
                                         max_num_batched_tokens=16, **opts))  # fmt: skip
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o.request for o in engine.step() if o.finished})
        finally:
            tc_gemm.tc_linear = real
        results.append(done)
    assert calls and all(calls), "the FP8 engine never ran the tensor-core matmul with its scales"
    v = engine.vocab_limit
    for i in range(len(prompts)):
        want, got = results[0][str(i)], results[1][str(i)]
        for k, (a, b) in enumerate(zip(got.logits, want.logits)):  # while the two streams agree
            err = float((a[:v].float().cpu() - b[:v].float()).abs().max() / b[:v].float().abs().max())
            # e4m3 activations: the torch engine with w8a8_reference_linear in bf16 is 0.10-0.15 from this
            # fp32 weight-only one; a wrong scale would be off by the logits' own size.
            assert err <= 0.3, (i, k, err)
            if got.output_ids[k] != want.output_ids[k]:
                break
