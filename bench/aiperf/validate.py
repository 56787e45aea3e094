"""Validation of one AIPerf run against ouro_fast, from AIPerf's own output files.

A run is valid only if every rule holds (each function returns the reasons it is
not, an empty list meaning valid):

- records (profile_export.jsonl, warm-up and profiling records alike): none
  carries an error or was cancelled; every one has the server's
  usage.completion_tokens (--use-server-token-count) and it equals the
  max_tokens that AIPerf sent for that request (inputs.json): with ignore_eos the
  server must return exactly what was asked; the profiling phase has the
  requested number of records;
- AIPerf's summary (profile_export_aiperf.json): complete, not cancelled, no
  error requests, no output-length mismatch, the requested request count;
- the server's own counters (/metrics before and after the whole AIPerf run,
  bench.serve_bench.metrics_delta): generated and prompt tokens equal the sums of
  the records' usage, every request finished for length, nothing rejected or
  aborted, no failed engine step;
- AIPerf's server-metrics export (server_metrics_export.json) lists every
  metric in AIPERF_REQUIRED_METRICS and meets the scenario's expectations.

Pure standard library: it runs in the project's environment without AIPerf.
"""

from __future__ import annotations

import json
import math
import operator
from pathlib import Path

# What AIPerf must find in /metrics (its export strips a counter's _total suffix, as
# prometheus_client's parser does): the vLLM names it knows, and ouro_fast's own.
AIPERF_REQUIRED_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "ouro_fast:token_exit_depth",
    "ouro_fast:loop_exits",
    "ouro_fast:loop_rows",
    "ouro_fast:kv_blocks_used",
    "ouro_fast:kv_blocks_total",
)
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq}
# Series statistics that add up over series (counters' totals, histograms' counts and sums).
_ADDITIVE = {"total", "count", "sum"}


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, blank lines skipped."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _metric(record: dict, name: str) -> float | None:
    m = (record.get("metrics") or {}).get(name)
    return m.get("value") if isinstance(m, dict) else None


def _key(record: dict) -> tuple[str, int]:
    meta = record.get("metadata") or {}
    return str(meta.get("conversation_id")), int(meta.get("turn_index") or 0)


def requested_tokens(inputs: dict) -> dict[tuple[str, int], int | None]:
    """(session id, turn index) -> the max_tokens (or max_completion_tokens) AIPerf sent, from inputs.json."""
    out = {}
    for session in inputs.get("data") or []:
        for turn, payload in enumerate(session.get("payloads") or []):
            want = payload.get("max_tokens", payload.get("max_completion_tokens"))
            out[(str(session.get("session_id")), turn)] = want
    return out


def validate_records(records: list[dict], requested: dict, profiling_requests: int) -> list[str]:
    """Errors, cancellations and output-length mismatches among the per-request records."""
    errors = []
    if not records:
        return ["profile_export.jsonl holds no records"]
    failed = [r for r in records if r.get("error")]
    if failed:
        first = failed[0]["error"]
        msg = first.get("message", first) if isinstance(first, dict) else first
        errors.append(f"{len(failed)} of {len(records)} requests failed; first error: {str(msg)[:300]}")
    cancelled = [r for r in records if (r.get("metadata") or {}).get("was_cancelled")]
    if cancelled:
        errors.append(f"{len(cancelled)} requests were cancelled")
    no_usage, wrong = [], []
    for r in records:
        if r.get("error"):
            continue
        got = _metric(r, "usage_completion_tokens")
        want = requested.get(_key(r))
        if got is None:
            no_usage.append(_key(r))
        elif want is None or got != want:
            wrong.append((*_key(r), want, got))
    if no_usage:
        errors.append(
            f"{len(no_usage)} records lack the server's usage.completion_tokens "
            f"(--use-server-token-count and stream_options.include_usage?), first: {no_usage[:3]}"
        )
    if wrong:
        errors.append(
            f"{len(wrong)} requests returned a token count other than their max_tokens (ignore_eos), "
            f"first (session, turn, requested, server-counted): {wrong[:5]}"
        )
    profiled = sum(1 for r in records if (r.get("metadata") or {}).get("benchmark_phase") == "profiling")
    if profiled != profiling_requests:
        errors.append(f"{profiled} profiling records, want {profiling_requests}")
    return errors


def _summary_value(summary: dict, key: str) -> float | None:
    v = summary.get(key)
    return v.get("avg") if isinstance(v, dict) else v


def validate_summary(summary: dict, profiling_requests: int) -> list[str]:
    """AIPerf's own verdict in profile_export_aiperf.json: complete, no errors, no length mismatch."""
    errors = []
    if summary.get("was_cancelled"):
        errors.append("AIPerf reports the run as cancelled")
    if summary.get("is_complete") is False:
        errors.append("AIPerf reports the run as incomplete")
    for key in ("error_request_count", "osl_mismatch_count"):
        n = _summary_value(summary, key)
        if n:
            errors.append(f"AIPerf's {key} = {n:g} (want 0)")
    if summary.get("error_summary"):
        errors.append(f"AIPerf's error_summary: {json.dumps(summary['error_summary'])[:300]}")
    count = _summary_value(summary, "request_count")
    if count != profiling_requests:
        errors.append(f"AIPerf's request_count = {count}, want {profiling_requests}")
    for key in ("time_to_first_token", "inter_token_latency", "request_latency", "output_token_throughput"):
        v = _summary_value(summary, key)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            errors.append(f"AIPerf's {key} is missing or not a positive number: {v!r}")
    return errors


def validate_server(server: dict | None, records: list[dict]) -> list[str]:
    """The server's /metrics deltas over the whole AIPerf run against the records' usage sums."""
    if server is None:
        return ["the server's /metrics could not be read around the run: token counts not cross-checked"]
    ok = [r for r in records if not r.get("error")]
    gen = sum(_metric(r, "usage_completion_tokens") or 0 for r in ok)
    prompt = sum(_metric(r, "usage_prompt_tokens") or 0 for r in ok)
    errors = []
    if server["generation_tokens"] != gen:
        errors.append(f"the server generated {server['generation_tokens']} tokens; the records say {gen}")
    if server["prompt_tokens"] != prompt:
        errors.append(f"the server counted {server['prompt_tokens']} prompt tokens; the records say {prompt}")
    finished, want = server["finished_by_reason"], {"length": len(records)}
    if finished != want:
        errors.append(f"the server finished {finished}, want {want}")
    for key in ("rejected", "aborted"):
        if server.get(key):
            errors.append(f"the server {key} requests during the run: {server[key]}")
    if server.get("engine_step_failures"):
        errors.append(f"{server['engine_step_failures']} engine steps raised during the run")
    return errors


def metric_stat(export: dict, name: str, stat: str) -> float | None:
    """A statistic of one metric in server_metrics_export.json: summed over its series for totals,
    counts and sums, else the largest over series; None if AIPerf did not export it."""
    series = ((export.get("metrics") or {}).get(name) or {}).get("series") or []
    values = [s["stats"][stat] for s in series if isinstance((s.get("stats") or {}).get(stat), (int, float))]
    if not values:
        return None
    return sum(values) if stat in _ADDITIVE else max(values)


def check_expectations(export: dict, expectations: list[str]) -> list[str]:
    """Each '<metric> <stat> <op> <number>' (e.g. 'vllm:num_requests_waiting max > 0') that does not hold."""
    errors = []
    for exp in expectations:
        name, stat, op, number = exp.split()
        got = metric_stat(export, name, stat)
        if got is None:
            errors.append(f"expected {exp!r}, but AIPerf exported no {stat} of {name}")
        elif not _OPS[op](got, float(number)):
            errors.append(f"expected {exp!r}, AIPerf saw {got:g}")
    return errors


def missing_metrics(export: dict, required: tuple[str, ...] = AIPERF_REQUIRED_METRICS) -> list[str]:
    """The required metric names AIPerf's server-metrics export does not list."""
    found = set(export.get("metrics") or {})
    return [name for name in required if name not in found]


def validate_artifacts(
    artifact_dir: str | Path, profiling_requests: int, server: dict | None, expectations: list[str]
) -> tuple[list[str], dict]:
    """Every rule above over one AIPerf artifact folder; (errors, facts for the manifest)."""
    d = Path(artifact_dir)
    errors: list[str] = []
    facts: dict = {}

    def load(name: str, reader):
        try:
            return reader(d / name)
        except (OSError, ValueError) as e:
            errors.append(f"no readable {name}: {e}")
            return None

    records = load("profile_export.jsonl", read_jsonl)
    inputs = load("inputs.json", lambda p: json.loads(p.read_text()))
    summary = load("profile_export_aiperf.json", lambda p: json.loads(p.read_text()))
    export = load("server_metrics_export.json", lambda p: json.loads(p.read_text()))
    if records is not None and inputs is not None:
        errors += validate_records(records, requested_tokens(inputs), profiling_requests)
        errors += validate_server(server, records)
        facts["records"] = len(records)
        facts["warmup_records"] = sum(
            1 for r in records if (r.get("metadata") or {}).get("benchmark_phase") == "warmup"
        )
        lens = sorted({_metric(r, "usage_prompt_tokens") for r in records if not r.get("error")} - {None})
        facts["server_prompt_lens"] = lens[:20]
    if summary is not None:
        errors += validate_summary(summary, profiling_requests)
    if export is not None:
        missing = missing_metrics(export)
        if missing:
            errors.append(f"AIPerf's server-metrics export lacks {missing}")
        errors += check_expectations(export, expectations)
        facts["aiperf_server_metrics"] = sorted(export.get("metrics") or {})
        facts["expectations"] = {e: metric_stat(export, e.split()[0], e.split()[1]) for e in expectations}
    return errors, facts
