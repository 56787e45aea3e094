"""bench/gpu/attn_timeline.py: stamps reach the right kernels' calls, and the summary measures each event from
the end of the kernel before it, at nanosecond resolution (the global timer's ~1.7e18 ns would round to 256 ns
in a double)."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, as every kernel test file does
pytest.importorskip("triton", reason="the bench imports the Triton kernels")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
import attn_timeline  # noqa: E402

T0 = 1_700_000_000_000_000_000  # a global-timer-like origin (ns)


def layer(st: attn_timeline.Stamps, i: int, t: int) -> None:
    """Layer i from t (ns): qkv done at t + 1000; two attention programs (the second merges); o_proj; norm."""
    st.qkv[i, 0] = torch.tensor([t, t + 100, t + 200, t + 900])
    st.qkv[i, 1] = torch.tensor([t, t + 150, t + 250, t + 1000])
    st.attn[i, 0, :5] = torch.tensor([t + 300, t + 310, t + 1500, t + 2500, t + 3000])
    st.attn[i, 1, :6] = torch.tensor([t + 320, t + 330, t + 1700, t + 2700, t + 3100, t + 4001])
    st.o[i, 0] = torch.tensor([t + 400, t + 5000, t + 5100, t + 6000])
    st.norm[i, 0, :3] = torch.tensor([t + 4500, t + 6750, t + 7000])


def test_summary_measures_events_from_the_kernel_before():
    st = attn_timeline.Stamps(layers=3, rows=1, programs=4, ctas=4, device="cpu")
    for i in range(3):
        layer(st, i, T0 + 10_000 * i)
    got = attn_timeline.summarize(st)
    assert got["attn_first_start"] == -0.7  # 300 ns after the layer's t, qkv done at t + 1000
    assert got["attn_first_wait_over"] == 0.5
    assert got["attn_median_wait_over"] == 0.5  # torch's median of two is the lower
    assert got["attn_last_wait_over"] == 0.7
    assert got["attn_last_counted"] == 2.1
    assert got["attn_first_merged"] == got["attn_last_merged"] == 3.001
    assert got["o_first_wait_over_after_attn"] == 0.999  # o waits from the merger's end, t + 4001
    assert got["o_last_done_after_attn"] == 1.999
    assert got["norm_first_wait_over_after_o"] == 0.75
    assert got["norm_last_done_after_o"] == 1.0
    assert got["qkv_last_done_after_qkv_first_wait_over"] == 0.9


def test_patch_routes_stamps_to_qkv_o_attention_and_the_first_norm(monkeypatch):
    calls = []
    fake = lambda name: lambda *a, **kw: calls.append((name, kw.get("stamps")))  # noqa: E731
    monkeypatch.setattr(attn_timeline.tc_gemm, "tc_linear", fake("linear"))
    monkeypatch.setattr(attn_timeline.triton_attention, "fused_decode_attention", fake("attn"))
    monkeypatch.setattr(attn_timeline.fast_loop, "add_rms_norm", fake("norm"))
    st = attn_timeline.Stamps(layers=2, rows=1, programs=4, ctas=4, device="cpu")
    restore = attn_timeline.patch(st, hidden=8)
    x = torch.zeros(1, 8)
    for _ in range(2):  # a layer's calls in the loop's order
        attn_timeline.tc_gemm.tc_linear(x, torch.zeros(24, 8), partial=True)  # qkv
        attn_timeline.triton_attention.fused_decode_attention(x)
        attn_timeline.tc_gemm.tc_linear(x, torch.zeros(8, 8), partial=True)  # o_proj
        attn_timeline.fast_loop.add_rms_norm(x, x)
        attn_timeline.tc_gemm.tc_linear(x, torch.zeros(32, 8), swiglu_out=True)  # gate_up
        attn_timeline.tc_gemm.tc_linear(x, torch.zeros(8, 16), partial=True)  # down
        attn_timeline.fast_loop.add_rms_norm(x, x)
    restore()
    stamped = [(name, s is not None) for name, s in calls]
    layer_calls = [("linear", True), ("attn", True), ("linear", True), ("norm", True), ("linear", False),
                   ("linear", False), ("norm", False)]  # fmt: skip
    assert stamped == layer_calls * 2
    assert calls[0][1].data_ptr() == st.qkv[0].data_ptr() and calls[7][1].data_ptr() == st.qkv[1].data_ptr()
    assert calls[2][1].data_ptr() == st.o[0].data_ptr() and calls[3][1].data_ptr() == st.norm[0].data_ptr()
    assert attn_timeline.tc_gemm.tc_linear is not None and attn_timeline.fast_loop.add_rms_norm is not None
