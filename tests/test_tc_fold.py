"""The sandwich norm folded into the tensor-core matmul (kernels/tc_fold.py): its plan on the CPU, the
kernel on a Hopper GPU against the norm kernel + tc_linear and float64, and the engine with it on.

Gluon has no interpreter, so the kernel runs only where CUDA with compute capability 9.0+ is.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as the other kernel tests set it
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.kernels import add_rms_norm, tc_fold, tc_gemm  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU")
EPS = 1e-6


def test_ring_fits_the_budget_with_two_chunks_a_slot():
    for ntok, budget in [(8, 225 * 1024), (8, tc_gemm.WHOLE_SMEM)]:
        nbuf = tc_fold.ring_slots(256, ntok, 4, budget)
        assert 2 <= nbuf <= 4 and nbuf * (64 * 256 + 2 * ntok * 256) * 2 + 2048 <= budget
    assert tc_fold.ring_slots(256, 8, 4, 10_000) == 2


def test_rows_and_partials_it_takes(monkeypatch):
    monkeypatch.setattr(tc_fold, "FOLD_ROWS", 4)
    assert tc_fold.takes_rows(torch.zeros(4, 8)) and not tc_fold.takes_rows(torch.zeros(5, 8))
    monkeypatch.setattr(tc_fold, "FOLD_ROWS", 16)
    assert not tc_fold.takes_rows(torch.zeros(9, 8))  # the builder's tile holds 8 rows
    monkeypatch.setattr(tc_fold, "ENABLED", False)
    assert not tc_fold.takes_rows(torch.zeros(1, 8))
    if HOPPER:
        monkeypatch.setattr(tc_fold, "ENABLED", True)
        h = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(6144, 2048, device="cuda", dtype=torch.bfloat16)
        assert tc_fold.supported(h, torch.zeros(5, 2, 2048, device="cuda"), w)
        assert not tc_fold.supported(h, torch.zeros(2, 2048, device="cuda"), w)  # not partial products
        assert not tc_fold.supported(h, torch.zeros(5, 3, 2048, device="cuda"), w)


def inputs(m: int, n: int, parts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = 2048

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    h = randn(m, k).to(torch.bfloat16)
    d = 0.3 * randn(parts, m, k)  # partial products of a matmul output
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
@pytest.mark.parametrize("n, partial", [(6144, True), (11264, False), (2048, False)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_fold_matches_norm_then_matmul(n, partial, m):
    h, d, w2, w_in, w = inputs(m, n, parts=5, seed=n + m)
    h_ref, x_ref = add_rms_norm(h, d, w2, w_in, EPS)  # today's path: the norm kernel, then the matmul
    y_ref = tc_gemm.tc_linear(x_ref, w).float()
    y, h_new = tc_fold.tc_fold_linear(h, d, w2, w_in, w, EPS, partial=partial)
    # The residual is the norm kernel's, to the rounding of one reduction order.
    assert float((h_new.float() - h_ref.float()).abs().max()) <= 2**-7 * float(h_ref.float().abs().max())
    assert float((h_new.float() - h_ref.float()).ne(0).float().mean()) < 0.01
    # The output against float64 from the same inputs: no worse than the norm kernel's double rounding.
    x64 = h_ref.double() * torch.rsqrt(h_ref.double().pow(2).mean(-1, keepdim=True) + EPS) * w_in.double()
    truth = x64 @ w.double().T
    got = summed(y, partial)
    scale = float(truth.abs().max())
    err, err_ref = float((got - truth).abs().max()) / scale, float((y_ref - truth).abs().max()) / scale
    assert err <= max(1.25 * err_ref, 2e-3), (err, err_ref)
    y2, h2 = tc_fold.tc_fold_linear(h, d, w2, w_in, w, EPS, partial=partial)
    assert torch.equal(y2, y) and torch.equal(h2, h_new)  # no atomics in the fold: the same bits every call
    one = (h[:1].contiguous(), d[:, :1].contiguous(), w2, w_in, w, EPS)
    y1, h1 = tc_fold.tc_fold_linear(*one, partial=partial)
    assert torch.equal(summed(y1, partial), got[:1]) and torch.equal(h1, h_new[:1])  # rows independent


@needs_hopper
def test_mutated_scale_is_caught():
    # The comparison above can fail: the fold with the wrong w2 (so a wrong s * B term) is far off.
    h, d, w2, w_in, w = inputs(2, 6144, parts=5, seed=7)
    _, x_ref = add_rms_norm(h, d, w2, w_in, EPS)
    y_ref = tc_gemm.tc_linear(x_ref, w).float()
    y_bad, _ = tc_fold.tc_fold_linear(h, d, (2 * w2.float()).to(torch.bfloat16), w_in, w, EPS)
    assert float((y_bad.float() - y_ref).abs().max()) > 0.1 * float(y_ref.abs().max())


@needs_hopper
def test_engine_with_the_fold_matches_fp32_dense_reference(tmp_path, monkeypatch):
    from ouro_fast.engine.engine import Engine, EngineConfig
    from ouro_fast.engine.sampling import SamplingParams
    from ouro_fast.model.checkpoints import PRESETS, make_checkpoint
    from ouro_fast.model.reference import DenseReference

    cfg = dataclasses.replace(PRESETS["tiny"], hidden_size=512, intermediate_size=768, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=128)  # fmt: skip
    model_dir = str(make_checkpoint(cfg, tmp_path, seed=5, dtype="float32", progress=False))
    monkeypatch.setattr(tc_fold, "ENABLED", True)
    calls = []
    real = tc_fold.tc_fold_linear
    monkeypatch.setattr(tc_fold, "tc_fold_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fp32 = Engine(EngineConfig(model=model_dir, dtype="float32", runner="torch", device="cpu"))
    ref = DenseReference(dict(fp32.model.state_dict()), fp32.model_config, 128, fp32.vocab_limit)
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", runner="triton", keep_logits=True,
                                 dataflow=False, max_num_batched_tokens=16))  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=1.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 30))]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.request for o in engine.step() if o.finished})
    assert calls, "the engine never ran the folded matmul"
    v = engine.vocab_limit
    for i, prompt in enumerate(prompts):
        want, got = ref.generate(prompt, 6, threshold=1.0), done[str(i)]
        assert got.output_ids[0] == want.tokens[0]
        for k, (a, b) in enumerate(zip(got.logits, want.logits)):  # while the two streams agree
            err = float((a[:v].float().cpu() - b[:v]).abs().max() / b[:v].abs().max())
            assert err <= 0.04, (i, k, err)  # test_gpu_runner's BF16_REL_TOL
            if got.output_ids[k] != want.tokens[k]:
                break
