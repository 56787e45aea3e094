"""The AIPerf wrapper's validator, manifest and helpers, on small synthetic AIPerf outputs.

No AIPerf is needed: the files are shaped like AIPerf 0.13.0's (profile_export.jsonl,
inputs.json, profile_export_aiperf.json, server_metrics_export.json) as seen in
real runs against ouro_fast.
"""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from bench.aiperf import manifest as mf
from bench.aiperf import run
from bench.aiperf.validate import (
    AIPERF_REQUIRED_METRICS,
    check_expectations,
    metric_stat,
    missing_metrics,
    requested_tokens,
    validate_artifacts,
    validate_records,
    validate_server,
    validate_summary,
)

OSL = {"s0": 16, "s1": 16, "s2": 8}


def record(session: str, phase: str = "profiling", completion: int | None = None, prompt: int = 32,
           error: dict | None = None) -> dict:  # fmt: skip
    meta = {"conversation_id": session, "turn_index": 0, "benchmark_phase": phase, "was_cancelled": False}
    if error is not None:
        return {"metadata": meta, "metrics": {}, "error": error}
    done = OSL[session] if completion is None else completion
    metrics = {"usage_completion_tokens": {"value": done, "unit": "tokens"},
               "usage_prompt_tokens": {"value": prompt, "unit": "tokens"}}  # fmt: skip
    return {"metadata": meta, "metrics": metrics}


def inputs() -> dict:
    return {"data": [{"session_id": s, "payloads": [{"prompt": "x", "max_tokens": n, "ignore_eos": True}]}
                     for s, n in OSL.items()]}  # fmt: skip


def good_records() -> list[dict]:
    return [record("s0", "warmup"), record("s0"), record("s1"), record("s2")]


def summary(**over) -> dict:
    s = {"request_count": {"unit": "requests", "avg": 3.0}, "was_cancelled": False, "is_complete": True,
         "osl_mismatch_count": {"unit": "requests", "avg": 0.0},
         "time_to_first_token": {"unit": "ms", "avg": 20.0, "p50": 19.0, "p99": 30.0},
         "inter_token_latency": {"unit": "ms", "avg": 5.0, "p50": 5.0, "p99": 6.0},
         "request_latency": {"unit": "ms", "avg": 100.0, "p50": 99.0, "p99": 120.0},
         "output_token_throughput": {"unit": "tokens/sec", "avg": 290.0}}  # fmt: skip
    s.update(over)
    return s


def server_delta(records: list[dict], **over) -> dict:
    ok = [r for r in records if "error" not in r]
    d = {"prompt_tokens": sum(r["metrics"]["usage_prompt_tokens"]["value"] for r in ok),
         "generation_tokens": sum(r["metrics"]["usage_completion_tokens"]["value"] for r in ok),
         "finished_by_reason": {"length": len(records)}, "rejected": {}, "aborted": {},
         "engine_step_failures": 0}  # fmt: skip
    d.update(over)
    return d


def export(extra: dict | None = None) -> dict:
    def gauge(mx):
        return {
            "type": "gauge",
            "series": [{"labels": {"model_name": "m"}, "stats": {"avg": mx / 2, "max": mx}}],
        }

    metrics = {name: gauge(1.0) for name in AIPERF_REQUIRED_METRICS}
    series = [{"labels": {"finished_reason": r}, "stats": {"total": n, "rate": 1.0}}
              for r, n in (("length", 3), ("stop", 1))]  # fmt: skip
    metrics["vllm:request_success"] = {"type": "counter", "series": series}
    metrics.update(extra or {})
    return {"aiperf_version": "0.13.0", "metrics": metrics}


# ---- records -----------------------------------------------------------------------------------------


def test_good_records_are_valid_and_warmup_is_checked_too():
    assert validate_records(good_records(), requested_tokens(inputs()), 3) == []
    # A warm-up record is a request the server served: its length is held to the same rule.
    bad_warmup = [record("s0", "warmup", completion=15)] + good_records()[1:]
    errs = validate_records(bad_warmup, requested_tokens(inputs()), 3)
    assert len(errs) == 1 and "('s0', 0, 16, 15)" in errs[0]


def test_an_error_record_fails_the_run_with_its_message():
    recs = good_records() + [record("s1", error={"code": 400, "type": "Bad Request", "message": "too long"})]
    errs = validate_records(recs, requested_tokens(inputs()), 4)
    assert any("1 of 5 requests failed" in e and "too long" in e for e in errs), errs


def test_a_length_mismatch_fails_the_run():
    recs = [record("s0"), record("s1", completion=12), record("s2")]
    errs = validate_records(recs, requested_tokens(inputs()), 3)
    assert len(errs) == 1 and "('s1', 0, 16, 12)" in errs[0]


def test_missing_usage_cancellation_and_count_are_errors():
    recs = good_records()
    del recs[1]["metrics"]["usage_completion_tokens"]
    recs[2]["metadata"]["was_cancelled"] = True
    errs = validate_records(recs, requested_tokens(inputs()), 4)
    assert any("lack the server's usage" in e for e in errs)
    assert any("1 requests were cancelled" in e for e in errs)
    assert any("3 profiling records, want 4" in e for e in errs)
    assert validate_records([], {}, 0) == ["profile_export.jsonl holds no records"]


def test_requested_tokens_reads_max_completion_tokens_too():
    doc = {"data": [{"session_id": "a", "payloads": [{"max_completion_tokens": 7}, {"max_tokens": 9}]}]}
    assert requested_tokens(doc) == {("a", 0): 7, ("a", 1): 9}


# ---- AIPerf's summary, the server's counters, the metrics export -------------------------------------


def test_summary_rules():
    assert validate_summary(summary(), 3) == []
    errs = validate_summary(summary(error_request_count={"avg": 2.0}, osl_mismatch_count={"avg": 1.0},
                                    was_cancelled=True, time_to_first_token=None), 4)  # fmt: skip
    text = "\n".join(errs)
    for part in ("error_request_count = 2", "osl_mismatch_count = 1", "cancelled", "request_count = 3.0",
                 "time_to_first_token"):  # fmt: skip
        assert part in text, text


def test_server_cross_check():
    recs = good_records()
    assert validate_server(server_delta(recs), recs) == []
    errs = validate_server(server_delta(recs, generation_tokens=55, aborted={"disconnect": 1}), recs)
    assert any("generated 55 tokens; the records say 56" in e for e in errs)
    assert any("aborted" in e for e in errs)
    errs = validate_server(server_delta(recs, finished_by_reason={"length": 3, "stop": 1}), recs)
    assert errs == ["the server finished {'length': 3, 'stop': 1}, want {'length': 4}"]
    assert "could not be read" in validate_server(None, recs)[0]


def test_metric_stat_and_expectations():
    series = [{"labels": {"a": "1"}, "stats": {"max": 2.0}}, {"labels": {"a": "2"}, "stats": {"max": 5.0}}]
    ex = export({"vllm:num_requests_waiting": {"type": "gauge", "series": series}})
    assert metric_stat(ex, "vllm:num_requests_waiting", "max") == 5.0  # the largest over series
    assert metric_stat(ex, "vllm:request_success", "total") == 4  # totals add up
    assert metric_stat(ex, "vllm:nothing", "max") is None
    assert (
        check_expectations(ex, ["vllm:num_requests_waiting max > 0", "vllm:request_success total == 4"]) == []
    )
    errs = check_expectations(ex, ["vllm:num_requests_waiting max <= 4", "vllm:nothing max > 0"])
    assert errs[0].endswith("AIPerf saw 5") and "exported no max of vllm:nothing" in errs[1]


def test_missing_metrics():
    assert missing_metrics(export()) == []
    ex = export()
    del ex["metrics"]["ouro_fast:loop_exits"]
    assert missing_metrics(ex) == ["ouro_fast:loop_exits"]


def write_artifacts(d: Path, records: list[dict], summ: dict, ex: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "inputs.json").write_text(json.dumps(inputs()))
    (d / "profile_export_aiperf.json").write_text(json.dumps(summ))
    (d / "server_metrics_export.json").write_text(json.dumps(ex))


def test_validate_artifacts_good_error_and_mismatch_runs(tmp_path):
    recs = good_records()
    write_artifacts(tmp_path / "good", recs, summary(), export())
    errors, facts = validate_artifacts(
        tmp_path / "good", 3, server_delta(recs), ["vllm:request_success total > 0"]
    )
    assert errors == [] and facts["records"] == 4 and facts["warmup_records"] == 1
    assert (
        facts["server_prompt_lens"] == [32] and "ouro_fast:token_exit_depth" in facts["aiperf_server_metrics"]
    )

    bad = recs + [record("s2", error={"code": 500, "message": "boom"})]
    write_artifacts(tmp_path / "err", bad, summary(error_request_count={"avg": 1.0}), export())
    errors, _ = validate_artifacts(tmp_path / "err", 4, server_delta(bad), [])
    assert any("boom" in e for e in errors) and any("error_request_count" in e for e in errors)

    short = [record("s0"), record("s1"), record("s2", completion=7)]
    write_artifacts(tmp_path / "short", short, summary(), export())
    errors, _ = validate_artifacts(tmp_path / "short", 3, server_delta(short), [])
    assert len(errors) == 1 and "('s2', 0, 8, 7)" in errors[0]

    (tmp_path / "empty").mkdir()
    errors, _ = validate_artifacts(tmp_path / "empty", 3, None, [])
    assert sum("no readable" in e for e in errors) == 4


# ---- manifest ----------------------------------------------------------------------------------------


def test_git_state_and_config_hashes(tmp_path):
    repo = tmp_path / "r"
    (repo / "bench").mkdir(parents=True)
    cfg = repo / "bench" / "x.yaml"
    cfg.write_text("a: 1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert mf.git_state(repo) == {"commit": head, "dirty": False, "dirty_paths": []}
    cfg.write_text("a: 2\n")
    assert mf.git_state(repo) == {"commit": head, "dirty": True, "dirty_paths": ["bench/x.yaml"]}
    assert mf.git_state(tmp_path / "no-git", given="abc+dirty")["commit"] == "abc"
    assert mf.git_state(tmp_path / "no-git")["dirty"] is None
    assert mf.config_hashes([cfg], root=repo) == {"bench/x.yaml": hashlib.sha256(b"a: 2\n").hexdigest()}


def test_headline_and_summary_table():
    head = mf.headline(summary())
    assert (
        head["ttft_ms"] == {"avg": 20.0, "p50": 19.0, "p99": 30.0}
        and head["output_token_throughput"] == 290.0
    )
    assert head["inter_chunk_ms"] == {"avg": None, "p50": None, "p99": None}
    manifest = {
        "model": {"served_name": "tiny", "preset": "tiny", "dtype": "float32", "device": "cpu",
                  "runner": "torch"},
        "machine": {"cpu": "X", "cores": 2, "gpu": None, "loadavg_start": [0.1], "loadavg_end": [0.2]},
        "git": {"commit": "abc", "dirty": False}, "aiperf": {"version": "0.13.0"},
        "depth_policy": mf.depth_policy(1.0), "ok": False, "errors": [],
        "scenarios": [
            {"scenario": "smoke", "requests": 4, "server_env": {}, "headline": head, "ok": True,
             "server_delta": {"mean_exit_depth": 4.0}},
            {"scenario": "queue_c8", "requests": 24, "server_env": {"OURO_FAST_MAX_NUM_SEQS": "4"},
             "headline": {}, "ok": False, "errors": ["aiperf exited 1"]},
        ],
    }  # fmt: skip
    text = mf.render_summary(manifest)
    assert "(tiny, float32, full depth)" in text and "SOME SCENARIOS INVALID" in text
    assert "| smoke | - | 4 | 290.0 | - | 20.00 / 30.00 | 5.00 / 6.00 | - | 99.00 | 4.00 | yes |" in text
    assert "| queue_c8 | MAX_NUM_SEQS=4 | 24 |" in text and "- queue_c8: aiperf exited 1" in text
    assert mf.depth_policy(0.5) == {"exit_threshold": 0.5, "label": "exit_threshold=0.5"}


# ---- the wrapper's helpers and the scenario catalogue -----------------------------------------------


def test_catalogue_configs_are_complete():
    cat = run.load_catalogue()
    wanted = {"smoke", "latency_c1", "batch_c2", "batch_c4", "decode_32_128", "prefill_512_16",
              "mixed_prefill", "queue_c8", "kv_pressure"}  # fmt: skip
    assert set(cat) == wanted
    for name, entry in cat.items():
        text = (run.HERE / "scenarios" / entry["config"]).read_text()
        for needed in ("${OURO_URL}", "${OURO_MODEL}", "${OURO_TOKENIZER}", "${OURO_ARTIFACT_DIR}",
                       "requests: ${OURO_REQUESTS}", "entries: ${OURO_REQUESTS}", "ignore_eos: true",
                       "useServerTokenCount: true", "streaming: true", "type: completions",
                       "exit_threshold: ${OURO_EXIT_THRESHOLD:1.0}", "records: [jsonl]"):  # fmt: skip
            assert needed in text, (name, needed)
        assert entry["requests"] >= 1 and all(k.startswith("OURO_FAST_") for k in entry["server_env"])
        for exp in entry["expect"]:
            metric, _stat, op, number = exp.split()
            assert (
                metric in AIPERF_REQUIRED_METRICS
                and op in ("<", "<=", ">", ">=", "==")
                and float(number) >= 0
            )
    assert cat["smoke"]["requests"] == 4
    assert "concurrency: 8" in (run.HERE / "scenarios" / "queue_c8.yaml").read_text()
    assert int(cat["queue_c8"]["server_env"]["OURO_FAST_MAX_NUM_SEQS"]) < 8


def test_select_and_server_groups():
    cat = run.load_catalogue()
    assert run.select(cat, ["smoke"]) == ["smoke"]
    every = run.select(cat, ["all"])
    assert "smoke" not in every and len(every) == len(cat) - 1
    assert run.select(cat, ["kv_pressure,smoke", "batch_c2"]) == ["smoke", "batch_c2", "kv_pressure"]
    with pytest.raises(SystemExit, match="unknown scenario"):
        run.select(cat, ["nope"])
    groups = run.server_groups(cat, every)
    assert groups[0][0] == {} and "queue_c8" not in groups[0][1] and "latency_c1" in groups[0][1]
    assert [g[1] for g in groups[1:]] == [["queue_c8"], ["kv_pressure"]]


def test_hub_cache_layout(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"x": 1}')
    (tok / "config.json").write_text('{"model_type": "gpt2"}')
    repo_id = run.hub_cache(tok, tmp_path / "hf")
    name = repo_id.removeprefix("local/")
    assert repo_id.startswith("local/ouro-") and len(name) == len("ouro-") + 12
    root = tmp_path / "hf" / "hub" / f"models--local--{name}"
    assert (root / "refs" / "main").read_text() == "0" * 40
    snap = root / "snapshots" / ("0" * 40)
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "tokenizer.json"]
    assert run.hub_cache(tok, tmp_path / "hf") == repo_id  # idempotent
    env = run.aiperf_env({"PATH": "/bin"}, {"OURO_URL": "u"}, tmp_path / "hf")
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path / "hf") and env["OURO_URL"] == "u"


def test_prune_keeps_the_summaries_and_the_log_tail(tmp_path):
    for name in ("profile_export_aiperf.json", "profile_export.jsonl", "server_metrics_export.json",
                 "inputs.json", "profile_export_console.txt"):  # fmt: skip
        (tmp_path / name).write_text("{}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "aiperf.log").write_text("".join(f"line {i}\n" for i in range(run.LOG_TAIL_LINES + 50)))
    run.prune(tmp_path, keep_all=False)
    kept = ["aiperf.log", "profile_export.jsonl", "profile_export_aiperf.json", "server_metrics_export.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    log = (tmp_path / "aiperf.log").read_text().splitlines()
    assert log[0] == "[first 50 lines dropped]" and log[-1] == f"line {run.LOG_TAIL_LINES + 49}"


def test_compare_puts_each_tool_beside_the_other(tmp_path):
    from bench.aiperf import compare

    a = tmp_path / "a"
    (a / "latency_c1").mkdir(parents=True)
    (a / "manifest.json").write_text(json.dumps({"scenarios": [{"scenario": "latency_c1"}]}))
    summ = {"input_config": {"phases": [{"concurrency": 1}]}, "output_token_throughput": {"avg": 200.0},
            "request_throughput": {"avg": 3.0}}  # fmt: skip
    (a / "latency_c1" / "profile_export_aiperf.json").write_text(json.dumps(summ))
    m = {"time_to_first_token": 12.0, "http_req_waiting": 10.0, "inter_token_latency": 4.0,
         "request_latency": 100.0, "usage_prompt_tokens": 128, "usage_completion_tokens": 4}  # fmt: skip
    metrics = {k: {"value": v} for k, v in m.items()} | {"inter_chunk_latency": {"value": [4.0, 8.0]}}
    rec = {"metadata": {"benchmark_phase": "profiling"}, "metrics": metrics}
    warm = {**rec, "metadata": {"benchmark_phase": "warmup"}}
    (a / "latency_c1" / "profile_export.jsonl").write_text(json.dumps(warm) + "\n" + json.dumps(rec) + "\n")
    v = tmp_path / "v"
    (v / "results").mkdir(parents=True)
    runs = [{"label": "full-c1", "concurrency": 1, "result_file": "results/c1.json"},
            {"label": "full-rate4", "concurrency": None, "result_file": "results/r.json"}]  # fmt: skip
    (v / "manifest.json").write_text(json.dumps({"runs": runs}))
    res = {"completed": 1, "output_throughput": 210.0, "request_throughput": 3.1, "ttfts": [0.01],
           "total_input_tokens": 130,
           "latencies": [0.1], "output_lens": [4], "itls": [[0.03] * 3]}  # fmt: skip
    (v / "results" / "c1.json").write_text(json.dumps(res))
    ai, vl = compare.aiperf_rows(a)[1], compare.vllm_rows(v)[1]
    assert ai["requests"] == 1 and ai["ttft"]["median"] == 12.0 and ai["ttfb"]["median"] == 10.0
    assert ai["text_chunks_per_token"] == 3 / 4  # 3 chunks with text for 4 tokens
    assert vl["tpot"]["median"] == pytest.approx(30.0)  # (100 - 10) ms / (4 - 1)
    assert vl["text_chunks_per_token"] == 1.0 and list(compare.vllm_rows(v)) == [1]
    table = compare.table([(a, v)])
    assert "| 1 | AIPerf (latency_c1) | 1 | 1 | 200.0 | 3.00 | 12.00 / 12.00 | 10.00 |" in table
    assert (
        "| 1 | vllm bench serve (full-c1) | 1 | 1 | 210.0 | 3.10 | 10.00 / 10.00 | - | 30.00 / 30.00 |"
        in table
    )
