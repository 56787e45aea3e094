"""skinny_linear against F.linear; on a CPU-only machine via TRITON_INTERPRET=1."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels with numpy.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (the `gpu` extra: pip install 'triton>=3.0')")

from ouro_fast.kernels import silu_and_mul, skinny_gemm, tuning  # noqa: E402
from ouro_fast.kernels.pdl import pdl_enabled, pdl_launch  # noqa: E402
from ouro_fast.kernels.skinny_gemm import (  # noqa: E402
    SKINNY_MAX_M,
    candidate_configs,
    default_config,
    skinny_config,
    skinny_linear,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def cfg(block_n, block_k, split, use_dot=True, fused=True, warps=4, stages=2) -> dict:
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "USE_DOT": use_dot,
        "FUSED_REDUCE": fused,
        "num_warps": warps,
        "num_stages": stages,
    }


# Both inner products, one and several K splits (K=200 is no multiple of any BLOCK_K, so the last
# split is short), the fused and the second-pass reduction, a tile wider than N.
CONFIGS = {
    "dot": cfg(16, 64, 1),
    "dot-split3-fused": cfg(32, 64, 3),
    "dot-split3-pass": cfg(32, 64, 3, fused=False),
    "fma": cfg(16, 32, 1, use_dot=False),
    "fma-split2": cfg(16, 64, 2, use_dot=False),
    "fma-wide": cfg(128, 64, 1, use_dot=False),
}
N, K = 70, 200


def bf16_bound(ref: torch.Tensor) -> torch.Tensor:
    # One round-to-nearest to bf16 (half an ulp <= 2^-8 |ref|) plus fp32 summation-order noise.
    return ref.abs() * 2.0**-8 + 1e-3


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m", [1, 2, 5, 9])
def test_fp32_matches_f_linear(name, m):
    x, w = randn(m, K, seed=1), randn(N, K, seed=2)
    got = skinny_linear(x, w, config=CONFIGS[name])
    assert got.shape == (m, N) and got.dtype == torch.float32
    # fp32 products, fp32 sums in another order: K=200 terms of size ~1.
    torch.testing.assert_close(got, F.linear(x, w), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dot", "dot-split3-fused", "fma-split2"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_bf16_is_one_rounding_of_the_exact_product(name, m):
    x, w = randn(m, K, dtype=torch.bfloat16, seed=3), randn(N, K, dtype=torch.bfloat16, seed=4)
    got = skinny_linear(x, w, config=CONFIGS[name])
    assert got.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float())
    assert ((got.float() - ref).abs() <= bf16_bound(ref)).all()
    # Documented tolerance against torch's bf16 matmul (itself one rounding of an fp32 sum):
    # two results at most one bf16 ulp apart (2^-7 relative), outputs here of size ~sqrt(K).
    torch.testing.assert_close(got, F.linear(x, w), atol=2e-2, rtol=2**-7)


def test_fp16_default_config():
    x, w = randn(4, K, dtype=torch.float16, seed=5), randn(N, K, dtype=torch.float16, seed=6)
    got = skinny_linear(x, w)
    ref = F.linear(x.float(), w.float())
    # One fp16 rounding (2^-11 relative) of an fp32 sum.
    assert ((got.float() - ref).abs() <= ref.abs() * 2.0**-11 + 1e-3).all()


@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "fma"])
def test_whole_chunks_and_empty_trailing_splits(use_dot):
    # K = 128 in 64-wide chunks (the unmasked path) over 4 splits: splits 2 and 3 own no chunk,
    # so their first-chunk load (issued before the PDL wait) must contribute zeros.
    x, w = randn(5, 128, seed=21), randn(N, 128, seed=22)
    got = skinny_linear(x, w, config=cfg(16, 64, 4, use_dot=use_dot))
    torch.testing.assert_close(got, F.linear(x, w), atol=2e-5, rtol=1e-5)


def test_split_reductions_are_bit_identical_and_counters_reset():
    x, w = randn(6, K, dtype=torch.bfloat16, seed=7), randn(N, K, dtype=torch.bfloat16, seed=8)
    fused = skinny_linear(x, w, config=CONFIGS["dot-split3-fused"])
    # Same summation order in both reductions, and no dependence on which program finishes last.
    assert torch.equal(fused, skinny_linear(x, w, config=CONFIGS["dot-split3-pass"]))
    assert torch.equal(fused, skinny_linear(x, w, config=CONFIGS["dot-split3-fused"]))
    # The last program of each tile leaves its counter at zero for the next launch.
    assert all(int(buf.abs().sum()) == 0 for buf in skinny_gemm._COUNTERS[x.device])


def test_strided_x_and_out_view():
    # x a column slice of a wider activation, out a column window of a wider buffer.
    m = 3
    wide = randn(m, K + 24, seed=9)
    x, w = wide[:, 8 : 8 + K], randn(N, K, seed=10)
    buf = torch.full((m, N + 30), 7.0, device=DEV)
    out = buf[:, 10 : 10 + N]
    got = skinny_linear(x, w, out=out, config=CONFIGS["dot-split3-fused"])
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, F.linear(x, w), atol=2e-5, rtol=1e-5)
    assert (buf[:, :10] == 7.0).all() and (buf[:, 10 + N :] == 7.0).all()


def test_large_m_falls_back_to_f_linear_and_edge_shapes(monkeypatch):
    x, w = randn(SKINNY_MAX_M + 1, 32, seed=11), randn(20, 32, seed=12)
    assert torch.equal(skinny_linear(x, w), F.linear(x, w))
    out = torch.empty(SKINNY_MAX_M + 1, 20, device=DEV)
    assert skinny_linear(x, w, out=out) is out and torch.equal(out, F.linear(x, w))
    expect = F.linear(x, w)
    with monkeypatch.context() as mp:
        # An explicit config runs the kernel at any M: no cuBLAS call.
        mp.setattr(skinny_gemm, "F", None)
        mp.setattr(skinny_gemm.torch, "matmul", None)
        got = skinny_linear(x, w, config=CONFIGS["dot-split3-fused"])
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=1e-5)
    assert skinny_linear(x[:0], w).shape == (0, 20)
    assert torch.equal(skinny_linear(x[:2, :0], w[:, :0]), torch.zeros(2, 20, device=DEV))


def test_rejects_bad_inputs():
    x, w = randn(2, 32, seed=13), randn(20, 32, seed=14)
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="need x"):
        skinny_linear(x, w[:, :16])
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x, w, out=torch.empty(2, 21, device=DEV))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_prologue_equals_two_launches(name, dtype):
    # The fused input is rounded exactly as silu_and_mul rounds it, so the results are bit-equal.
    gu = randn(5, 2 * K, dtype=dtype, seed=21) * 3
    w = randn(N, K, dtype=dtype, seed=22)
    fused = skinny_linear(gu, w, config=CONFIGS[name], silu_mul=True)
    assert torch.equal(fused, skinny_linear(silu_and_mul(gu), w, config=CONFIGS[name]))
    # And it is the matmul of torch's own F.silu(gate) * up, up to the output rounding.
    act = F.silu(gu[:, :K]) * gu[:, K:]
    ref = F.linear(act.float(), w.float())
    assert ((fused.float() - ref).abs() <= bf16_bound(ref)).all()


def test_silu_mul_default_config_fallback_and_shape_errors():
    gu, w = randn(3, 2 * K, seed=23), randn(N, K, seed=24)
    assert torch.equal(skinny_linear(gu, w, silu_mul=True), skinny_linear(silu_and_mul(gu), w))
    big = randn(SKINNY_MAX_M + 1, 2 * K, seed=25)
    assert torch.equal(skinny_linear(big, w, silu_mul=True), F.linear(silu_and_mul(big), w))
    with pytest.raises(ValueError, match=f"need x \\[M, {2 * K}\\]"):
        skinny_linear(gu[:, :K], w, silu_mul=True)


def test_pdl_is_off_where_unsupported():
    cpu = torch.device("cpu")
    assert not pdl_enabled(cpu) and pdl_launch(cpu) == {"USE_PDL": False}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_enabled(dev) == hopper
        assert pdl_launch(dev) == ({"USE_PDL": True, "launch_pdl": True} if hopper else {"USE_PDL": False})


@pytest.mark.parametrize("n, k", [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (50, 100)])
def test_default_and_candidate_configs(n, k):
    for m in (1, 2, 8, 16):
        c = default_config(n, k, m)
        # Enough programs to cover 132 SMs twice, unless K ranges would drop below two chunks.
        progs = -(-n // c["BLOCK_N"]) * c["SPLIT_K"]
        assert progs >= 2 * 132 or k // c["SPLIT_K"] < 4 * c["BLOCK_K"]
        cands = candidate_configs(n, k, m)
        assert cands[0] == c
        assert len({tuple(sorted(d.items())) for d in cands}) == len(cands)
        assert any(not d["USE_DOT"] for d in cands) == (m <= 2)


def test_tuned_configs_are_keyed_by_power_of_two_rows(monkeypatch):
    tuned = cfg(32, 64, 2)
    keys = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_DOT", "FUSED_REDUCE", "num_warps", "num_stages")
    monkeypatch.setitem(tuning.SKINNY_CONFIGS, (N, K, 8), tuple(tuned[k] for k in keys))
    assert skinny_config(N, K, 5) == tuned and skinny_config(N, K, 8) == tuned
    assert skinny_config(N, K, 9) == default_config(N, K, 9)
    x, w = randn(7, K, seed=15), randn(N, K, seed=16)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_with_new_inputs():
    x, w = randn(4, 512, dtype=torch.bfloat16, seed=17), randn(300, 512, dtype=torch.bfloat16, seed=18)
    out = torch.empty(4, 300, device=DEV, dtype=torch.bfloat16)
    configs = [cfg(64, 128, 4), cfg(64, 128, 4, fused=False), cfg(32, 128, 1)]
    for c in configs:  # warm-up: compiles and allocates the counters outside capture
        skinny_linear(x, w, out=out, config=c)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_linear(x, w, config=c) for c in configs]
    for seed in (19, 20):
        x.copy_(randn(4, 512, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        ref = F.linear(x.float(), w.float())
        for got in outs:
            assert ((got.float() - ref).abs() <= bf16_bound(ref)).all()


@pytest.mark.parametrize("name", ["dot", "dot-split3-fused", "fma"])
def test_row_gate_skips_the_launch_only_when_no_row_needs_it(name):
    x, w = randn(3, K, seed=23), randn(N, K, seed=24)
    gate = torch.zeros(3, dtype=torch.int32, device=DEV)
    out = torch.full((3, N), 7.0, device=DEV)
    skinny_linear(x, w, out=out, config=CONFIGS[name], row_gate=gate)
    assert bool((out == 7.0).all())  # nothing read, nothing written
    gate[1] = 1  # one row needs its output: every row is computed
    skinny_linear(x, w, out=out, config=CONFIGS[name], row_gate=gate)
    torch.testing.assert_close(out, F.linear(x, w), atol=2e-5, rtol=1e-5)
    if CONFIGS[name]["SPLIT_K"] > 1:
        assert all(int(buf.abs().sum()) == 0 for buf in skinny_gemm._COUNTERS[x.device])


def test_row_gate_errors():
    x, w = randn(2, K, seed=25), randn(N, K, seed=26)
    with pytest.raises(ValueError, match="int32"):
        skinny_linear(x, w, row_gate=torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="Triton kernel"):
        big = randn(SKINNY_MAX_M + 1, K, seed=27)
        skinny_linear(big, w, row_gate=torch.ones(SKINNY_MAX_M + 1, dtype=torch.int32, device=DEV))
    ones = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="FUSED_REDUCE"):
        skinny_linear(x, w, config=CONFIGS["dot-split3-pass"], row_gate=ones)
