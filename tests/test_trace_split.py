"""bench/gpu/trace_split.py: overlapping kernels are charged what they add to the completion frontier, the
charges and the idle time partition the span, and the loop's matmuls get distinct labels."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
import trace_split  # noqa: E402


def kernel(name: str, ts: float, dur: float, grid: int = 132) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": [grid, 1, 1]}}


# A PDL chain: norm, then a matmul that starts during it, then an attention after an idle gap; plus a CPU
# event that must be ignored. The matmul runs 5-20 but adds only 12-20 (the norm ends at 12).
EVENTS = [
    kernel("_add_rms_norm_kernel", 0.0, 12.0, grid=1),
    kernel("_tc_gemm_kernel", 5.0, 15.0),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 100.0},
    kernel("void at::native::vectorized_elementwise_kernel<4, Foo>(int, Foo)", 23.0, 2.0, grid=8),
    kernel("_tc_gemm_kernel", 24.0, 1.0),  # wholly inside the one before: adds nothing
]


def test_short_names_drop_namespaces_templates_and_arguments():
    long = "void at::native::(anonymous namespace)::indexSelect<float, 2>(at::cuda::Info<float, int>, int)"
    assert trace_split.short_name(long) == "indexSelect"
    lam = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<{lambda(int)#1}> >(int, F)"
    assert trace_split.short_name(lam) == "elementwise_kernel"
    assert (
        trace_split.short_name("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN")
        == "nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN"
    )


def test_overlapping_kernels_are_charged_their_frontier_increment(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    result = trace_split.split(trace_split.load_kernels(str(path)))
    rows = result["rows"]
    assert result["span_us"] == 25.0 and result["idle_us"] == 3.0
    assert rows["_add_rms_norm_kernel/1 after start"]["added_us"] == 12.0
    mm = rows["_tc_gemm_kernel/132 after _add_rms_norm_kernel"]
    assert (mm["added_us"], mm["own_us"]) == (8.0, 15.0)
    assert rows["vectorized_elementwise_kernel/8 after _tc_gemm_kernel"]["added_us"] == 2.0
    assert rows["_tc_gemm_kernel/132 after vectorized_elementwise_kernel"]["added_us"] == 0.0
    assert sum(r["added_us"] for r in rows.values()) + result["idle_us"] == result["span_us"]


def test_the_command_prints_a_table_and_writes_json(tmp_path, capsys):
    path, out = tmp_path / "trace.json", tmp_path / "split.json"
    path.write_text(json.dumps(EVENTS))  # a bare event list, as some exporters write
    assert trace_split.main([str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "span 25.0 us, idle 3.0 us (12.0%)" in printed
    assert printed.index("_add_rms_norm_kernel/1") < printed.index("_tc_gemm_kernel/132 after _add")
    assert json.loads(out.read_text())["span_us"] == 25.0
