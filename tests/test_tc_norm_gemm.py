"""The sandwich norm in the tensor-core matmul's prologue (kernels/tc_norm_gemm.py): its plan on the CPU,
the kernel on a Hopper GPU against add_rms_norm + tc_linear, and the engine with it on.

Gluon has no interpreter, so the kernel runs only where CUDA with compute capability 9.0+ is.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as the other kernel tests set it
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.kernels import add_rms_norm, tc_gemm, tc_norm_gemm  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU")
EPS = 1e-6


def test_ring_fits_the_budget_beside_the_row():
    for budget, want in [(225 * 1024, 4), (tc_gemm.WHOLE_SMEM, 2)]:  # qkv's and gate_up's budgets
        nbuf = tc_norm_gemm.ring_slots(256, 2048, 8, 4, budget)
        assert nbuf == want and nbuf * 64 * 256 * 2 + tc_norm_gemm.smem_fixed(2048, 8) <= budget
    assert tc_norm_gemm.ring_slots(256, 2048, 8, 4, 10_000) == 2


def test_rows_and_partials_it_takes(monkeypatch):
    monkeypatch.setattr(tc_norm_gemm, "ENABLED", True)
    assert tc_norm_gemm.takes_rows(torch.zeros(1, 8)) and not tc_norm_gemm.takes_rows(torch.zeros(2, 8))
    monkeypatch.setattr(tc_norm_gemm, "ENABLED", False)
    assert not tc_norm_gemm.takes_rows(torch.zeros(1, 8))
    if HOPPER:
        monkeypatch.setattr(tc_norm_gemm, "ENABLED", True)
        h = torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(6144, 2048, device="cuda", dtype=torch.bfloat16)
        assert tc_norm_gemm.supported(h, torch.zeros(5, 1, 2048, device="cuda"), w)
        assert not tc_norm_gemm.supported(h, torch.zeros(1, 2048, device="cuda"), w)  # not partial products
        assert not tc_norm_gemm.supported(h, torch.zeros(5, 2, 2048, device="cuda"), w)


def inputs(n: int, k: int, parts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    h = randn(1, k).to(torch.bfloat16)
    d = 0.3 * randn(parts, 1, k)  # partial products of a matmul's output
    w2, w_in = ((1.0 + 0.1 * randn(k)).to(torch.bfloat16) for _ in range(2))
    w = (0.02 * randn(n, k)).to(torch.bfloat16)
    return h, d, w2, w_in, w


def summed(y: torch.Tensor, partial: bool) -> torch.Tensor:
    if not partial:
        return y.float()
    total = y[0].clone()
    for s in y[1:]:  # in slot order, as the consumers add them
        total += s
    return total


@needs_hopper
@pytest.mark.parametrize("n, k, partial", [(6144, 2048, True), (11264, 2048, False), (2048, 2048, False),
                                           (1536, 512, True)])  # fmt: skip
@pytest.mark.parametrize("parts", [1, 5])
def test_matches_the_norm_kernel_then_the_matmul(n, k, partial, parts):
    h, d, w2, w_in, w = inputs(n, k, parts, seed=n + k + parts)
    h_ref, x_ref = add_rms_norm(h, d, w2, w_in, EPS)  # today's path: the norm kernel, then the matmul
    y_ref = summed(tc_gemm.tc_linear(x_ref, w, partial=partial), partial)
    y, h_new = tc_norm_gemm.tc_norm_linear(h, d, w2, w_in, w, EPS, partial=partial)
    # The same arithmetic; only the two row sums may add in another order (an ulp of s or r).
    assert float((h_new.float() - h_ref.float()).abs().max()) <= 2**-7 * float(h_ref.float().abs().max())
    assert float(h_new.ne(h_ref).float().mean()) < 0.01
    got = summed(y, partial)
    assert float((got - y_ref).abs().max()) <= 0.01 * float(y_ref.abs().max())
    y2, h2 = tc_norm_gemm.tc_norm_linear(h, d, w2, w_in, w, EPS, partial=partial)
    assert torch.equal(y2, y) and torch.equal(h2, h_new)  # the same bits every call


@needs_hopper
def test_a_wrong_norm_weight_is_caught():
    # The comparison above can fail: the prologue with w2 doubled is far off.
    h, d, w2, w_in, w = inputs(6144, 2048, 5, seed=7)
    _, x_ref = add_rms_norm(h, d, w2, w_in, EPS)
    y_ref = tc_gemm.tc_linear(x_ref, w).float()
    y_bad, _ = tc_norm_gemm.tc_norm_linear(h, d, (2 * w2.float()).to(torch.bfloat16), w_in, w, EPS)
    assert float((y_bad.float() - y_ref).abs().max()) > 0.1 * float(y_ref.abs().max())


@needs_hopper
def test_engine_with_norms_in_matmuls_matches_fp32_dense_reference(tmp_path, monkeypatch):
    from ouro_fast.engine.engine import Engine, EngineConfig
    from ouro_fast.engine.sampling import SamplingParams
    from ouro_fast.model.checkpoints import PRESETS, make_checkpoint
    from ouro_fast.model.reference import DenseReference

    cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=512, intermediate_size=768, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=128)  # fmt: skip
    model_dir = str(make_checkpoint(cfg, tmp_path, seed=5, dtype="float32", progress=False))
    monkeypatch.setattr(tc_norm_gemm, "ENABLED", True)
    calls = []
    real = tc_norm_gemm.tc_norm_linear
    monkeypatch.setattr(tc_norm_gemm, "tc_norm_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fp32 = Engine(EngineConfig(model=model_dir, dtype="float32", runner="torch", device="cpu"))
    ref = DenseReference(dict(fp32.model.state_dict()), fp32.model_config, 128, fp32.vocab_limit)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", runner="triton", keep_logits=True,
                                 dataflow=False, max_num_batched_tokens=16))  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=1.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    done = {}
    for i, p in enumerate(prompts):  # one at a time: its decode steps have one row
        engine.add_request(str(i), p, params)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.request for o in engine.step() if o.finished})
    assert calls, "the engine never ran the matmul with the norm in its prologue"
    v = engine.vocab_limit
    for i, prompt in enumerate(prompts):
        want, got = ref.generate(prompt, 6, threshold=1.0), done[str(i)]
        assert got.output_ids[0] == want.tokens[0]
        for k, (a, b) in enumerate(zip(got.logits, want.logits)):  # while the two streams agree
            err = float((a[:v].float().cpu() - b[:v]).abs().max() / b[:v].abs().max())
            assert err <= 0.04, (i, k, err)  # test_gpu_runner's BF16_REL_TOL
            if got.output_ids[k] != want.tokens[k]:
                break
