"""The serving benchmark's validation: synthetic client result files and /metrics pages, no server, no vLLM.

A clean run must validate with no errors, and each way a run can be wrong
(a failed request, a short output, a prompt the client and the server tokenize
differently, a token-count disagreement with the server's counters, a missing
percentile, unreadable counters) must be reported.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import serve_bench as sb

N, OUT_LEN = 4, 8
INPUT_LENS = [128, 129, 128, 127]


def clean_result() -> dict:
    """A result as `vllm bench serve --save-result --save-detailed` writes it for a clean run."""
    r = {
        "completed": N,
        "failed": 0,
        "total_input_tokens": sum(INPUT_LENS),
        "total_output_tokens": N * OUT_LEN,
        "input_lens": list(INPUT_LENS),
        "output_lens": [OUT_LEN] * N,
        "ttfts": [0.01, 0.012, 0.011, 0.013],
        "itls": [[0.002] * (OUT_LEN - 1) for _ in range(N)],
        "errors": [""] * N,
        "output_throughput": 123.4,
    }
    for m in sb.PERCENTILE_METRICS:
        for s in sb.STATS:
            r[f"{s}_{m}_ms"] = 1.5
    return r


def clean_server() -> dict:
    """The server's counters over the same run (what metrics_delta returns)."""
    return {
        "prompt_tokens": sum(INPUT_LENS),
        "generation_tokens": N * OUT_LEN,
        "finished_by_reason": {"length": N},
        "rejected": {},
        "aborted": {},
        "engine_step_failures": 0,
    }


def errors_after(change) -> list[str]:
    result, server = clean_result(), clean_server()
    change(result, server)
    return sb.validate_result(result, N, OUT_LEN, server, list(INPUT_LENS))


def test_a_clean_run_is_valid():
    assert sb.validate_result(clean_result(), N, OUT_LEN, clean_server(), list(INPUT_LENS)) == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda r, s: r.update(failed=1, completed=N - 1, errors=["boom", "", "", ""]), "failed = 1"),
        (lambda r, s: r.update(completed=N - 1), "completed = 3"),
        (lambda r, s: r["output_lens"].__setitem__(2, OUT_LEN - 1), "output_lens != 8"),
        (lambda r, s: r.pop("output_lens"), "output_lens missing"),
        (lambda r, s: r.update(input_lens=INPUT_LENS[:3]), "input_lens missing"),
        (lambda r, s: r["input_lens"].__setitem__(0, 130), "sum(input_lens)"),
        (lambda r, s: r.update(total_output_tokens=N * OUT_LEN - 1), "total_output_tokens"),
        (lambda r, s: r.pop("p99_itl_ms"), "p99_itl_ms"),
        (lambda r, s: r.update(median_tpot_ms=math.nan), "median_tpot_ms"),
        (lambda r, s: r.update(mean_e2el_ms=None), "mean_e2el_ms"),
        (lambda r, s: r.update(ttfts=[0.01, 0.0, 0.01, 0.01]), "ttfts"),
        (lambda r, s: r.update(itls=[[] for _ in range(N)]), "itls empty"),
        (lambda r, s: s.update(prompt_tokens=sum(INPUT_LENS) + 1), "server counted 513 prompt tokens"),
        (lambda r, s: s.update(generation_tokens=N * OUT_LEN + 4), "server generated 36"),
        (lambda r, s: s.update(finished_by_reason={"length": N - 1, "abort": 1}), "server finished"),
        (lambda r, s: s.update(rejected={"overload": 2}), "rejected"),
        (lambda r, s: s.update(aborted={"disconnect": 1}), "aborted"),
        (lambda r, s: s.update(engine_step_failures=1), "engine steps raised"),
    ],
)
def test_each_defect_is_reported(change, needle):
    errors = errors_after(change)
    assert any(needle in e for e in errors), errors


def test_unreadable_server_counters_are_an_error():
    errors = sb.validate_result(clean_result(), N, OUT_LEN, None, list(INPUT_LENS))
    assert len(errors) == 1 and "/metrics" in errors[0]


def test_prompt_lengths_are_compared_per_request():
    # The server counted one prompt a token longer and another a token shorter: the totals agree.
    server_lens = [128, 130, 128, 126]
    result, server = clean_result(), clean_server()
    result["input_lens"] = server_lens
    assert sum(server_lens) == result["total_input_tokens"] == server["prompt_tokens"]
    errors = sb.validate_result(result, N, OUT_LEN, server, list(INPUT_LENS))
    assert (
        len(errors) == 1 and "2 prompts tokenized differently" in errors[0] and "(1, 129, 130)" in errors[0]
    )
    assert sb.validate_result(clean_result(), N, OUT_LEN, server, INPUT_LENS[:3])  # a short list too
    errors = sb.validate_result(clean_result(), N, OUT_LEN, server, None)
    assert len(errors) == 1 and "own prompt lengths are unknown" in errors[0]


def test_result_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(clean_result()))
    assert sb.validate_file(good, N, OUT_LEN, clean_server(), list(INPUT_LENS)) == []
    # The same file judged against a different request: every prompt count and length disagrees.
    assert sb.validate_file(good, N + 1, OUT_LEN, clean_server(), list(INPUT_LENS))
    assert (
        "no readable result file"
        in sb.validate_file(tmp_path / "missing.json", N, OUT_LEN, clean_server(), list(INPUT_LENS))[0]
    )
    (tmp_path / "bad.json").write_text("{not json")
    assert (
        "no readable result file"
        in sb.validate_file(tmp_path / "bad.json", N, OUT_LEN, clean_server(), list(INPUT_LENS))[0]
    )
    (tmp_path / "list.json").write_text("[]")
    assert (
        "JSON object"
        in sb.validate_file(tmp_path / "list.json", N, OUT_LEN, clean_server(), list(INPUT_LENS))[0]
    )


def page(prompt: int, gen: int, length: int, depth_counts: list[int], aborted: int = 0) -> str:
    """A /metrics page in the server's format, the depth histogram cumulative as Prometheus writes it."""
    lab = 'model_name="m"'
    lines = [
        "# HELP vllm:prompt_tokens_total Prompt tokens of finished requests.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{lab}}} {prompt}",
        f"vllm:generation_tokens_total{{{lab}}} {gen}",
        f'vllm:request_success_total{{{lab},finished_reason="length"}} {length}',
        f"ouro_fast:engine_step_failures_total{{{lab}}} 0",
        f"ouro_fast:engine_steps_total{{{lab}}} {gen * 4}",
        f"ouro_fast:run_ahead_steps_total{{{lab}}} {gen * 3}",
        f"ouro_fast:run_ahead_runs_total{{{lab}}} {length}",
        f"ouro_fast:run_ahead_riders_total{{{lab}}} {2 * length}",
        f"ouro_fast:run_ahead_exit_steps_total{{{lab}}} {gen}",
        f"ouro_fast:requests_in_flight{{{lab}}} 0",
    ]
    if aborted:
        lines.append(f'ouro_fast:requests_aborted_total{{{lab},reason="disconnect"}} {aborted}')
    cum = 0
    for d, c in enumerate(depth_counts, start=1):
        cum += c
        lines.append(f'ouro_fast:token_exit_depth_bucket{{{lab},le="{d}"}} {cum}')
    lines.append(f'ouro_fast:token_exit_depth_bucket{{{lab},le="+Inf"}} {cum}')
    total = sum(d * c for d, c in enumerate(depth_counts, start=1))
    lines += [
        f"ouro_fast:token_exit_depth_sum{{{lab}}} {total}",
        f"ouro_fast:token_exit_depth_count{{{lab}}} {cum}",
    ]
    return "\n".join(lines) + "\n"


def test_metrics_delta_against_hand_counts():
    before = sb.parse_metrics(page(100, 10, 2, [0, 0, 0, 11]))
    after = sb.parse_metrics(page(612, 42, 6, [10, 12, 6, 15], aborted=1))
    d = sb.metrics_delta(before, after)
    assert d["prompt_tokens"] == 512 and d["generation_tokens"] == 32
    assert d["finished_by_reason"] == {"length": 4}
    assert d["aborted"] == {"disconnect": 1} and d["rejected"] == {}
    assert d["exit_depth_histogram"] == {"1": 10, "2": 12, "3": 6, "4": 4}
    assert d["exit_depth_tokens"] == 32
    assert (d["engine_steps"], d["run_ahead_steps"], d["run_ahead_runs"]) == (128, 96, 4)
    assert d["run_ahead_riders"] == 8 and d["run_ahead_exit_steps"] == 32
    assert d["mean_exit_depth"] == pytest.approx((10 + 24 + 18 + 16) / 32, abs=1e-3)
    # The delta as validation sees it: the abort is reported, the counts agree.
    server = {**d, "finished_by_reason": {"length": N}}
    errors = sb.validate_result(clean_result(), N, OUT_LEN, server, list(INPUT_LENS))
    assert errors == ["server aborted requests during the run: {'disconnect': 1}"]


def test_metrics_parsing_rejects_garbage_and_reads_escaped_labels():
    with pytest.raises(ValueError):
        sb.parse_metrics("this is not a metric line at all\n")
    samples = sb.parse_metrics('x_total{model_name="a\\"b",k="v"} 3\n# comment\n\nx_total{k="w"} 4.5\n')
    assert sb.metric_sum(samples, "x_total") == 7.5
    assert sb.metric_sum(samples, "x_total", k="v") == 3
    assert samples[0][1]["model_name"] == 'a\\"b'


def test_commit_dirty_trusts_git_only_for_the_named_commit():
    assert sb.commit_dirty("abc1234+dirty", "") is True
    assert sb.commit_dirty("abc1234", "abc1234def+dirty") is True  # git sees that commit, changed
    assert sb.commit_dirty("abc1234", "abc1234def") is False
    # A copy without .git inside another repository: git's answer is about that other tree.
    assert sb.commit_dirty("abc1234", "fff0000+dirty") is None
    assert sb.commit_dirty("abc1234", "") is None
