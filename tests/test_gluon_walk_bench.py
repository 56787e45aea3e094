"""bench/gpu/gluon_walk_bench.py's oracle: its torch reference of the packed walk equals the dense matmuls.

The Gluon kernel itself needs a Hopper GPU (Gluon has no interpreter); on the GPU the benchmark checks it
against this reference. Here the reference is checked on the CPU against the unpacked matrices.
"""

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="triton with Gluon is not installed")

from bench.gpu import gluon_walk_bench as gw  # noqa: E402


def test_reference_equals_the_dense_matmuls():
    h, ff, layers = 32, 40, 2  # down: two chunks of 32 columns, the second partly padding
    rpl, chunks = gw.packed_rows(h, ff)
    assert (rpl, chunks) == (4 * h + 2 * ff + 2 * h, 2)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(layers * rpl, h, generator=g)
    x = torch.zeros(layers, 4, chunks * h)
    x[:, :3, :h] = torch.randn(layers, 3, h, generator=g)
    x[:, 3, :ff] = torch.randn(layers, ff, generator=g)
    y = gw.reference(w, x, h, ff, layers)
    for layer in range(layers):
        lw = w[layer * rpl : (layer + 1) * rpl]
        torch.testing.assert_close(y[layer, 0, : 3 * h], lw[: 3 * h] @ x[layer, 0, :h])
        torch.testing.assert_close(y[layer, 1, :h], lw[3 * h : 4 * h] @ x[layer, 1, :h])
        torch.testing.assert_close(y[layer, 2, : 2 * ff], lw[4 * h : 4 * h + 2 * ff] @ x[layer, 2, :h])
        # down is stored as column chunks stacked as rows: chunk c's rows multiply x[c*h : (c+1)*h]
        down = lw[4 * h + 2 * ff :].view(chunks, h, h).permute(1, 0, 2).reshape(h, chunks * h)
        torch.testing.assert_close(y[layer, 3, :h], down @ x[layer, 3, : chunks * h])
        assert not y[layer, 3, h:].any()  # nothing past down's outputs
