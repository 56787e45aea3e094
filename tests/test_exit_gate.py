"""The exit gate's log-survival kernel against the float64 formula and the torch ops it replaced.

On a CPU-only machine the kernel runs under TRITON_INTERPRET=1.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from ouro_fast.kernels.exit_gate import gate_log_survival  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(dtype, hidden=48, tokens=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(1, hidden, generator=g) * 0.3).to(dtype)
    b = torch.tensor([0.25]).to(dtype)
    last = torch.tensor([5, 0, 3, 2], dtype=torch.int64)
    prev = torch.tensor([-1, 2, 0, -1], dtype=torch.int32)
    ls_prev = torch.tensor([-0.5, -1e-7, -3.0], dtype=torch.float32)
    return x, w, b, last, prev, ls_prev


def run(x, w, b, last, prev, ls_prev):
    on = [t.to(DEV) for t in (x, last, prev, ls_prev, w, b)]
    return gate_log_survival(*on).cpu()


def expected(x, w, b, last, prev, ls_prev):
    # The engine's old ops: the gate Linear in x's dtype, then carried + logsigmoid(-g) in float32.
    gate = F.linear(x[last], w, b).squeeze(-1).float()
    carried = torch.where(prev >= 0, ls_prev[prev.clamp(min=0).long()], torch.zeros_like(gate))
    return carried + F.logsigmoid(-gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [48, 2048])
def test_log_survival_matches_the_torch_ops(dtype, hidden):
    inputs = case(dtype, hidden, seed=hidden)
    got = run(*inputs)
    want = expected(*inputs)
    assert got.dtype == torch.float32 and got.shape == (4,)
    # fp32: only the dot's summation order differs; bf16: the gate rounds to bf16 as the Linear's output
    # does, so a different fp32 sum can land one bf16 step away.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("gate", [-60.0, -20.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 60.0])
def test_logsigmoid_is_accurate_across_the_gates_range(gate):
    # The weight picks one input, so the gate logit is exactly `gate`; against float64 logsigmoid(-gate).
    x = torch.zeros(1, 8)
    x[0, 0] = gate
    w, b = torch.zeros(1, 8), torch.zeros(1)
    w[0, 0] = 1.0
    got = run(x, w, b, torch.zeros(1, dtype=torch.int64), torch.full((1,), -1, dtype=torch.int32),
              torch.zeros(1))  # fmt: skip
    want = F.logsigmoid(torch.tensor(-gate, dtype=torch.float64))
    torch.testing.assert_close(got[0].double(), want, rtol=2e-7, atol=1e-30)
    if gate < -15:
        assert got[0] < 0  # log(1 - tiny) stays below 0: no survival rounded to exactly 1


def test_rejects_bad_inputs():
    x, w, b, last, prev, ls_prev = case(torch.float32)
    with pytest.raises(ValueError, match="weight"):
        run(x, w[:, :4], b, last, prev, ls_prev)
    with pytest.raises(ValueError, match="prev"):
        run(x, w, b, last, prev[:2], ls_prev)
    with pytest.raises(ValueError, match="ls_prev"):
        run(x, w, b, last, prev, ls_prev.double())
