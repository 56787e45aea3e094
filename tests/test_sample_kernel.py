"""The fused sampling kernel (Gumbel-max, Philox noise) and the Sampler's fused path, against torch.

On a CPU-only machine the kernel runs under TRITON_INTERPRET=1.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.engine.sampling import GREEDY_EPS, Sampler  # noqa: E402
from ouro_fast.kernels import sample as sample_mod  # noqa: E402
from ouro_fast.kernels.sample import sample_gumbel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(logits, temps, seeds, vocab=None):
    r = logits.shape[0]
    t = torch.as_tensor(temps, dtype=torch.float32).expand(r).contiguous().to(DEV)
    s = torch.as_tensor(seeds, dtype=torch.int64).expand(r).contiguous().to(DEV)
    return sample_gumbel(logits.to(DEV), t, s, GREEDY_EPS, vocab or logits.shape[1]).cpu()


def test_greedy_rows_are_argmax_of_the_first_vocab_columns_lowest_index_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    logits[1, 7] = logits[1, 250] = 100.0  # a tie across blocks: the lower index wins
    logits[2, 290:] = 1000.0  # beyond the vocabulary: never chosen
    got = run(logits, 0.0, 123, vocab=280)
    assert got.tolist() == logits[:, :280].argmax(dim=-1).tolist()
    assert got[1] == 7


def test_temperature_draws_follow_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    for temperature in (0.7,):  # one temperature: each row is a program in the CPU interpreter
        expected = (logits / temperature).softmax(-1)
        n = 2000
        got = run(logits.expand(n, 6).contiguous(), temperature, torch.arange(n) * 7919 + 1)
        counts = torch.bincount(got, minlength=6).double()
        chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
        assert chi2 < 25.0  # 5 degrees of freedom: p < 1e-4 of a false alarm


def test_draws_depend_on_the_seed_alone():
    logits = torch.zeros(64, 50)
    seeds = torch.arange(64) + 5
    a = run(logits, 1.0, seeds)
    assert torch.equal(a, run(logits, 1.0, seeds))  # deterministic
    assert not torch.equal(a, run(logits, 1.0, seeds + 1000))
    # Row 3's draw is the same alone as in its batch.
    assert run(logits[3:4], 1.0, seeds[3:4]).item() == a[3].item()


def test_row_gate_samples_only_the_gated_rows_with_the_same_draws():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g).to(DEV)
    t = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.7, 1.0], device=DEV)
    s = (torch.arange(6) + 11).to(DEV)
    gate = torch.tensor([1, 0, 1, 0, 1, 1], dtype=torch.int32, device=DEV)
    full = sample_gumbel(logits, t, s, GREEDY_EPS, 280).cpu()
    got = sample_gumbel(logits, t, s, GREEDY_EPS, 280, row_gate=gate).cpu()
    on = gate.cpu().bool()
    assert torch.equal(got[on], full[on])  # a gated row's draw is its ungated draw
    assert got[~on].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="row_gate"):
        sample_gumbel(logits, t, s, GREEDY_EPS, 280, row_gate=gate.long())


def test_rejects_bad_inputs():
    logits = torch.zeros(2, 10, device=DEV)
    t, s = torch.ones(2, device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="logits"):
        sample_gumbel(logits, t, s, GREEDY_EPS, 11)
    with pytest.raises(ValueError, match="temperature"):
        sample_gumbel(logits, t.double(), s, GREEDY_EPS, 10)
    with pytest.raises(ValueError, match="seeds"):
        sample_gumbel(logits, t, s.int(), GREEDY_EPS, 10)


def _call(sampler, logits, temperature, top_p=1.0, top_k=0, seeds=None):
    r = logits.shape[0]
    return sampler(
        logits.to(DEV),
        torch.full((r,), float(temperature)),
        torch.full((r,), float(top_p)),
        torch.full((r,), int(top_k), dtype=torch.int64),
        seeds or [None] * r,
        [0] * r,
    ).cpu()


def test_sampler_takes_the_fused_path_only_for_plain_rows(monkeypatch):
    calls = []
    real = sample_mod.sample_gumbel
    monkeypatch.setattr(sample_mod, "sample_gumbel", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    fused, plain = Sampler(40, DEV, seed=1, fused=True), Sampler(40, DEV, seed=1)
    # Greedy: the same ids either way.
    assert torch.equal(_call(fused, logits, 0.0), _call(plain, logits, 0.0)) and len(calls) == 1
    # Unseeded temperature sampling: fused, and reproducible from the sampler seed.
    a = _call(fused, logits, 1.0)
    assert len(calls) == 2
    again = Sampler(40, DEV, seed=1, fused=True)
    _call(again, logits, 0.0)  # the same call sequence gives the same draws
    assert torch.equal(_call(again, logits, 1.0), a)
    # top-k, top-p or a seed: the torch path.
    n = len(calls)
    _call(fused, logits, 1.0, top_k=5)
    _call(fused, logits, 1.0, top_p=0.5)
    _call(fused, logits, 1.0, seeds=[1, None, None, None])
    assert len(calls) == n
    # Filters on greedy rows do not matter: still fused.
    _call(fused, logits, 0.0, top_k=5)
    assert len(calls) == n + 1


def test_mask_tokens_clears_exactly_the_tokens_whose_bits_are_clear():
    g = torch.Generator().manual_seed(3)
    vocab, words = 70, 3  # the last word is partly beyond the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=g, dtype=torch.int32)
    bitmask[3] = -1  # all allowed
    rows = torch.tensor([2, 0, 3, 2, 1], dtype=torch.int64)
    logits = torch.randn(5, 80, generator=g).to(torch.bfloat16)
    got = logits.clone().to(DEV)
    sample_mod.mask_tokens_(got, bitmask.to(DEV), rows.to(DEV), vocab)
    bits = (bitmask[rows][:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = torch.ones(5, 80, dtype=torch.bool)
    allowed[:, :vocab] = bits.reshape(5, -1)[:, :vocab] != 0
    want = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(got.cpu(), want)
    assert torch.isinf(got[2]).sum() == 0 and torch.isinf(got.cpu()).any()
    with pytest.raises(ValueError, match="bitmask"):
        sample_mod.mask_tokens_(got, bitmask[:, :2].contiguous().to(DEV), rows.to(DEV), vocab)
    with pytest.raises(ValueError, match="row_mask"):
        sample_mod.mask_tokens_(got, bitmask.to(DEV), rows.int().to(DEV), vocab)
