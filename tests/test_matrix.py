"""The serving matrix's driver and report, and the floor model they measure against (no server needed)."""

import json
import sys
import types
from argparse import ArgumentParser

import pytest

from bench import matrix
from bench.floor import H200, Shape, floor_tok_s, prefill_floor, step_floor, token_floor, wave_ttft_floor


def test_floor_model_matches_the_h200_arithmetic():
    s = Shape()
    assert s.layer_params * s.elem == pytest.approx(2.466e9, rel=1e-3)  # one loop's weights
    assert s.kv_bytes_per_position == 196_608
    # One stream at full depth: four weight passes and the lm_head, ~2.4 ms a token.
    assert token_floor(s, 1, 128, 64, 4.0) == pytest.approx(2.41e-3, rel=0.02)
    # Early exit's depth shortens the round; long contexts add K/V reads; a wide batch becomes compute-bound.
    assert token_floor(s, 1, 128, 64, 2.4) < 0.65 * token_floor(s, 1, 128, 64, 4.0)
    assert step_floor(s, 8, 3900) > 1.2 * step_floor(s, 8, 160)
    assert floor_tok_s(s, 128, 128, 64, 4.0) < 128 / (4 * step_floor(s, 1, 160))
    # A cached prefix costs no prefill arithmetic, but every step still reads its K/V.
    cold, warm = (token_floor(s, 32, 1152, 128, 4.0, cached=c) for c in (0, 1024))
    assert warm < cold and warm > token_floor(s, 32, 128, 128, 4.0)
    prefill = 32 * 2 * 1024 * 4 * s.layer_params / 128 / 789e12
    assert cold - warm == pytest.approx(prefill)


def test_ttft_floor_is_a_prompts_loops_at_the_matmul_rate_and_a_wave_waits_for_half_of_it():
    s = Shape()
    # 128 tokens through four loops of 1.24 G parameters at 789 TFLOP/s: ~1.6 ms.
    assert prefill_floor(s, 128) == pytest.approx(2 * 128 * 4 * s.layer_params / 789e12)
    assert prefill_floor(s, 128) == pytest.approx(1.60e-3, rel=0.01)
    assert prefill_floor(Shape(fp8=True), 128) == pytest.approx(prefill_floor(s, 128) / 2)
    # The median of 8 arrivals served in order finishes with the 4.5th prompt; one arrival waits for none.
    assert wave_ttft_floor(s, 8, 1024) == pytest.approx(4.5 * prefill_floor(s, 1024))
    assert wave_ttft_floor(s, 1, 128) == pytest.approx(prefill_floor(s, 128))


def fake_vllm(monkeypatch, calls):
    """A stand-in for vLLM's client modules: records each call's arguments, returns a result."""

    def add_cli_args(parser):
        for flag in ("--backend", "--endpoint", "--base-url", "--model", "--tokenizer", "--dataset-name",
                     "--random-input-len", "--random-output-len", "--random-prefix-len", "--temperature",
                     "--seed", "--request-rate",
                     "--max-concurrency", "--num-prompts", "--percentile-metrics", "--metric-percentiles",
                     "--extra-body", "--result-dir", "--result-filename"):  # fmt: skip
            parser.add_argument(flag)
        for flag in ("--ignore-eos", "--save-result", "--trust-remote-code"):
            parser.add_argument(flag, action="store_true")

    def main(args):
        calls.append(args)
        return {"completed": int(args.num_prompts), "failed": 0, "output_throughput": 100.0}

    serve = types.SimpleNamespace(add_cli_args=add_cli_args, main=main)
    utils = types.SimpleNamespace(FlexibleArgumentParser=ArgumentParser)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(benchmarks=None))
    monkeypatch.setitem(sys.modules, "vllm.benchmarks", types.SimpleNamespace(serve=serve))
    monkeypatch.setitem(sys.modules, "vllm.benchmarks.serve", serve)
    monkeypatch.setitem(sys.modules, "vllm.utils", types.SimpleNamespace(argparse_utils=utils))
    monkeypatch.setitem(sys.modules, "vllm.utils.argparse_utils", utils)


def test_run_warms_up_once_per_prompt_length_and_runs_every_workload(monkeypatch, tmp_path, capsys):
    calls = []
    fake_vllm(monkeypatch, calls)
    body = '{"exit_threshold": 0.5}'
    argv = ["matrix", "run", "--base-url", "http://h:1", "--model", "m", "--tokenizer", "t",
            "--label", "ouro-t05", "--extra-body", body, "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    matrix.main()
    runs = [a for a in calls if a.save_result]
    warmups = [a for a in calls if not a.save_result]
    assert [int(a.max_concurrency) for a in runs] == [w.concurrency for w in matrix.WORKLOADS]
    assert [int(a.num_prompts) for a in runs] == [w.prompts for w in matrix.WORKLOADS]
    assert sorted(int(a.random_input_len) for a in warmups) == [128, 1024, 3800]
    assert {a.result_filename for a in runs} == {f"ouro-t05.{w.name}.json" for w in matrix.WORKLOADS}
    assert all(a.extra_body == '{"exit_threshold": 0.5}' and a.ignore_eos for a in calls)
    # Every measured run draws prompts no run before it sent: its own seed, and others for warm-ups.
    assert len({a.seed for a in calls}) == len(calls)
    assert len(capsys.readouterr().out.strip().splitlines()) == len(matrix.WORKLOADS)
    assert all(a.random_prefix_len is None for a in calls)  # the prefix workloads run only when named


def test_prefix_workloads_share_a_prefix_and_warm_up_apart(monkeypatch, tmp_path):
    calls = []
    fake_vllm(monkeypatch, calls)
    argv = ["matrix", "run", "--base-url", "http://h:1", "--model", "m", "--tokenizer", "t",
            "--label", "ouro-full", "--workloads", "c8-128-64", "c8-p1024-128-128",
            "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    matrix.main()
    assert [(a.save_result, a.random_prefix_len) for a in calls] == [
        (False, None),
        (True, None),
        (False, "1024"),
        (True, "1024"),
    ]
    (tmp_path / "ouro-full.c8-p1024-128-128.json").write_text(json.dumps({"output_throughput": 900.0}))
    monkeypatch.setattr(sys, "argv", ["matrix", "report", str(tmp_path), "--baseline", "ouro-full"])
    matrix.main()
    row = next(r for r in (tmp_path / "summary.md").read_text().splitlines() if r.startswith("| c8-p1024"))
    # The floor takes the shared prefix as computed once; its K/V is still read at every step.
    floor = floor_tok_s(Shape(), 8, 1152, 128, 4.0, cached=1024)
    assert "| 900 | 1.00 |" in row and f"| {900 / floor:.0%} |" in row


def test_a_prefix_read_once_a_step_counts_its_kv_bytes_once_for_all_rows():
    s = Shape()
    # One row reads its prefix once either way; 32 rows read 31 fewer copies of it.
    assert step_floor(s, 1, 1216, shared=1152) == step_floor(s, 1, 1216)
    saved = step_floor(s, 32, 1216) - step_floor(s, 32, 1216, shared=1152)
    assert saved == pytest.approx(31 * 1152 * s.kv_bytes_per_position / H200.hbm_bytes_per_s)
    once = floor_tok_s(s, 32, 1152, 128, 4.0, cached=1024, prefix_once=True)
    assert once > 2 * floor_tok_s(s, 32, 1152, 128, 4.0, cached=1024)
    assert floor_tok_s(s, 32, 1152, 128, 4.0, prefix_once=True) == floor_tok_s(s, 32, 1152, 128, 4.0)


def test_fp8_weights_halve_the_weight_bytes_and_double_the_matmul_rate():
    bf16, fp8 = Shape(), Shape(fp8=True)
    assert fp8.layer_params * fp8.weight_elem * 2 == bf16.layer_params * bf16.weight_elem
    assert fp8.kv_bytes_per_position == bf16.kv_bytes_per_position  # the K/V stays bf16
    # One row is bound by the weight stream: half the bytes, half the step.
    assert step_floor(fp8, 1, 160) == pytest.approx(step_floor(bf16, 1, 160) / 2, rel=0.02)
    # A wide batch is bound by arithmetic: e4m3 runs twice as many FLOPs a second.
    wide = 4096
    assert step_floor(fp8, wide, 0) == pytest.approx(step_floor(bf16, wide, 0) / 2)
    assert token_floor(fp8, 1, 128, 64, 4.0) < 0.6 * token_floor(bf16, 1, 128, 64, 4.0)


def test_report_takes_ratios_against_the_baseline_and_fractions_of_the_floor(tmp_path, monkeypatch):
    for label, tput in (("vllm-full", 1000.0), ("ouro-full", 1500.0), ("ouro-full-fp8", 1800.0)):
        (tmp_path / f"{label}.c8-128-64.json").write_text(
            json.dumps(
                {
                    "output_throughput": tput,
                    "median_ttft_ms": 20.0,
                    "median_tpot_ms": 4.0,
                    "p99_tpot_ms": 5.0,
                    "failed": 0,
                }
            )  # fmt: skip
        )
    (tmp_path / "notes.json").write_text("{}")  # not a run: ignored
    phases = ('{"mean_queue_ms": 1.25, "mean_prefill_ms": 9.5, "run_ahead_steps": 2072, '
              '"run_ahead_rider_steps": 284, "run_ahead_shared_prefix_steps": 0, '
              '"engine_steps": 2110}')  # fmt: skip
    (tmp_path / "ouro-full.c8-128-64.phases.json").write_text(phases)
    monkeypatch.setattr(sys, "argv", ["matrix", "report", str(tmp_path)])
    matrix.main()
    rows = [r for r in (tmp_path / "summary.md").read_text().splitlines() if r.startswith("| c8-128-64")]
    assert len(rows) == 3
    ouro = next(r for r in rows if "ouro-full |" in r)
    assert "| 1,500 | 1.50 | 20.0 ms | 1.2 / 9.5 ms |" in ouro
    assert ouro.endswith("| 284 / 0 / 2,072 | 38 |")  # ouro_fast's launch counters, and its host steps
    assert "| 20.0 ms | - |" in next(r for r in rows if "vllm-full" in r)
    floor = floor_tok_s(Shape(), 8, 128, 64, 4.0)
    assert f"{1500 / floor:.0%}" in ouro
    fp8 = next(r for r in rows if "ouro-full-fp8" in r)
    assert f"| {1800 / floor_tok_s(Shape(fp8=True), 8, 128, 64, 4.0):.0%} |" in fp8


def test_phase_means_come_from_the_metrics_pages_before_and_after(monkeypatch):
    pages = iter([
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.0\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 10.0\n'
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.0\n'
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0\n'
        'ouro_fast:run_ahead_steps_total{model_name="m"} 100.0\n'
        'ouro_fast:run_ahead_rider_steps_total{model_name="m"} 7.0\n'
        'ouro_fast:engine_steps_total{model_name="m"} 104.0\n',
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 20.0\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.1",model_name="m"} 20.0\n'
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.25\n'
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 20.0\n'
        'ouro_fast:run_ahead_steps_total{model_name="m"} 160.0\n'
        'ouro_fast:run_ahead_rider_steps_total{model_name="m"} 19.0\n'
        'ouro_fast:run_ahead_shared_prefix_steps_total{model_name="m"} 30.0\n'
        'ouro_fast:engine_steps_total{model_name="m"} 170.0\n',
    ])  # fmt: skip

    class Page:
        def __init__(self, text):
            self.text = text

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return self.text.encode()

    monkeypatch.setattr(matrix.urllib.request, "urlopen", lambda url, timeout: Page(next(pages)))
    before, after = matrix.phase_totals("http://h:1"), matrix.phase_totals("http://h:1/")
    assert before == {"queue_sum": 1.0, "queue_count": 10.0, "prefill_sum": 2.0, "prefill_count": 10.0,
                      "run_ahead_steps": 100.0, "run_ahead_rider_steps": 7.0,
                      "engine_steps": 104.0}  # fmt: skip
    means = matrix.phase_means(before, after)
    # A counter the page before lacked has no increment (the server was not counting it then).
    assert means == pytest.approx({"mean_queue_ms": 50.0, "mean_prefill_ms": 25.0, "run_ahead_steps": 60,
                                   "run_ahead_rider_steps": 12, "engine_steps": 66})  # fmt: skip
    assert matrix.phase_means({}, after) == {}  # a server without the histograms before: nothing

    def refuse(url, timeout):
        raise OSError("connection refused")

    monkeypatch.setattr(matrix.urllib.request, "urlopen", refuse)
    assert matrix.phase_totals("http://h:1") == {}


def test_vllm_model_dir_has_ouros_shape_and_our_tokenizer(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(matrix.__file__).parent / "vllm" / "model_dir.py"
    spec = importlib.util.spec_from_file_location("model_dir", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ouro_fast.model.checkpoints import PRESETS
    from ouro_fast.model.tokenizer import ASSETS_DIR

    mod.write(tmp_path, ASSETS_DIR)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ouro = PRESETS["ouro-1.4b"]
    assert cfg["model_type"] == "ouro" and cfg["architectures"] == ["OuroForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "total_ut_steps", "rope_theta"):  # fmt: skip
        assert cfg[key] == getattr(ouro, key), key
    assert (tmp_path / "tokenizer.json").read_bytes() == (ASSETS_DIR / "tokenizer.json").read_bytes()
    compile((tmp_path / "configuration_ouro.py").read_text(), "configuration_ouro.py", "exec")
