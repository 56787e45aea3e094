"""bench/gpu/gluon_walk_bench.py's oracle and summaries: its torch reference of the packed walk equals the
dense matmuls, and its timeline summary of the CTAs' global-timer stamps reads them right.

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


def test_timeline_summarizes_each_ctas_stamps():
    # 8 matrices, 2 CTAs; CTA c asks for matrix m's activations at 10m + c us, starts it 1 us later, ends it
    # at 10m + 5 + 2c and releases it 1.5 us after: so the CTAs end 2 us apart, and the last end is 3 us
    # before the next asks.
    m = torch.arange(8).view(8, 1)
    c = torch.arange(2).view(1, 2)
    end = 10 * m + 5 + 2 * c
    us = torch.stack([10 * m + 1 + c, end, 10 * m + c, end + 1.5], dim=-1)  # start, end, ask, released
    ts = (us * 1000).to(torch.int64) + 123_456  # ns, from an arbitrary origin
    t = gw.timeline(ts)
    assert t["end_spread"] == 2.0
    assert t["end_spread_p90"] == 1.8
    assert t["gap_median"] == 5.0  # 6 us for CTA 0, 5 for CTA 1: the lower median
    assert t["gap_after_last_end"] == 5.0
    assert t["first_start_after_last_end"] == 4.0
    assert t["first_ask_after_last_end"] == 3.0
    assert t["start_after_ask"] == 1.0
    assert t["released_after_end"] == 1.5
    assert t["first_ask_after_last_release"] == 1.5
    assert t["matrix"] == [10.0, 10.0, 10.0, 10.0]
    assert t["timer_step_ns"] == 1000
    ts[1::2, :, 3] = 0  # every other matrix not released (DEP=9): the figures of those released
    t = gw.timeline(ts)
    assert (t["released_after_end"], t["first_ask_after_last_release"]) == (1.5, 1.5)
    ts[..., 3] = 0  # nothing released (DEP=6, 7): no release figures
    assert "released_after_end" not in gw.timeline(ts)


def test_spec_fills_the_fields_left_out_with_zeros():
    assert gw._spec("256:4:1:1:0:0") == [256, 4, 1, 1, 0, 0, 0, 0, 0]
    assert gw._spec("256:6:1:1:0:0:0:0:4") == [256, 6, 1, 1, 0, 0, 0, 0, 4]


@pytest.mark.parametrize("ctas, h, ff", [(132, 1024, 1408), (7, 256, 704)])
def test_contributors_counts_the_ctas_whose_ranges_overlap_each_group(ctas, h, ff):
    # Brute force: CTA c owns tiles [c*T//G, (c+1)*T//G) of each matrix, as the kernel's _share (every
    # matrix here has at least a tile per CTA, as the ouro-1.4b shapes on 132 SMs do).
    cols = 64
    ymax = max(3 * h, 2 * ff)
    got = gw.contributors(h, ff, cols, ctas, ymax)
    down_tiles = -(-ff // h) * h // cols
    for kind, (rows, bpg) in enumerate(
        [(3 * h, h // cols), (h, h // cols), (2 * ff, h // cols), (h, down_tiles)]
    ):
        total = rows // 64 * bpg
        owner = [c for c in range(ctas) for _ in range((c + 1) * total // ctas - c * total // ctas)]
        for g in range(rows // 64):
            want = len(set(owner[g * bpg : (g + 1) * bpg]))
            assert (got[kind, g * 64 : (g + 1) * 64] == want).all(), (kind, g)
        assert not got[kind, rows:].any()
