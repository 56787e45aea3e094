"""The riders' benchmarks (rider_gemm_bench.py, prefill_attention_bench.py): what runs without a GPU."""

import pytest
import torch

from bench.gpu.rider_gemm_bench import split_views, variants


def test_variants_pad_only_upwards_and_split_only_where_partials_are_taken():
    got = variants("down", 136, [128, 144, 256], [2, 4])
    assert got == ["linear", "nn", "pad144", "pad256", "splitk2", "splitk4"]
    assert variants("qkv", 200, [144, 256], [2]) == ["linear", "nn", "pad256"]


@pytest.mark.parametrize("s", [1, 2, 4, 8])
def test_split_views_are_views_whose_batched_product_sums_to_the_matmul(s):
    g = torch.Generator().manual_seed(s)
    x, w = torch.randn(9, 64, generator=g), torch.randn(24, 64, generator=g)
    xs, ws = split_views(x, w, s)
    assert xs.shape == (s, 9, 64 // s) and ws.shape == (s, 64 // s, 24)
    assert xs.data_ptr() == x.data_ptr() and ws.data_ptr() == w.data_ptr()  # no copy of the weight
    torch.testing.assert_close(torch.bmm(xs, ws).sum(0), x @ w.T, rtol=1e-5, atol=1e-5)


def test_prefill_attention_bench_configs_start_with_the_default():
    from types import SimpleNamespace

    from bench.gpu.prefill_attention_bench import configs, label

    args = SimpleNamespace(block_q=[16, 64], block_n=[64], warps=[4], stages=[2, 3])
    got = configs(args)
    assert got[0] is None and len(got) == 5 and label(got[0]) == "default"
    assert [label(c) for c in got[1:]] == ["q16 n64 w4 s2", "q16 n64 w4 s3", "q64 n64 w4 s2", "q64 n64 w4 s3"]
