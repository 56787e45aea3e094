"""/metrics as AIPerf's server-metrics collection reads it: vLLM's names, ouro_fast's own, valid text format.

AIPerf parses the page with prometheus_client's parser (a counter's family name
loses its _total suffix) and reports deltas of counters over its profiling
window, so a labelled series must exist before the window starts.
"""

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.aiperf.validate import AIPERF_REQUIRED_METRICS
from ouro_fast.server import engine_client as client
from ouro_fast.server.metrics import ABORT_REASONS, FINISH_REASONS, REJECT_REASONS, ServerMetrics
from ouro_fast.server.owner import EngineSnapshot

_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)$'
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def strict_parse(text: str) -> dict[str, dict]:
    """{family: {"type", "samples": [(name, labels, value)]}}; AssertionError on any text-format violation."""
    families: dict[str, dict] = {}
    current = None
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in families, f"family {name} declared twice"
            families[name] = {"type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == current and kind in ("counter", "gauge", "histogram"), line
            families[name]["type"] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"malformed sample line {line!r}"
            name, labels, value = m.group(1), dict(_LABEL.findall(m.group(3) or "")), float(m.group(4))
            fam = families[current]
            suffixes = ("_bucket", "_sum", "_count") if fam["type"] == "histogram" else ("",)
            assert any(name == current + s for s in suffixes), f"{name} outside its family {current}"
            fam["samples"].append((name, labels, value))
    for name, fam in families.items():
        keys = [(n, tuple(sorted(lab.items()))) for n, lab, _ in fam["samples"]]
        assert len(keys) == len(set(keys)), f"duplicate samples in {name}"
        if fam["type"] == "counter":
            assert name.endswith("_total") and all(v >= 0 for _, _, v in fam["samples"]), name
        if fam["type"] == "histogram":
            check_histogram(name, fam["samples"])
    return families


def check_histogram(name: str, samples: list) -> None:
    """Buckets ascending by le, cumulative, ending at +Inf == _count, per label set."""
    by_set: dict[tuple, list] = {}
    for n, labels, v in samples:
        rest = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
        by_set.setdefault(rest, []).append((n, labels.get("le"), v))
    for rest, rows in by_set.items():
        buckets = [(le, v) for n, le, v in rows if n.endswith("_bucket")]
        count = [v for n, _, v in rows if n.endswith("_count")]
        assert buckets[-1][0] == "+Inf" and count == [buckets[-1][1]], (name, rest)
        bounds = [float(le) for le, _ in buckets[:-1]]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), name
        values = [v for _, v in buckets]
        assert values == sorted(values), f"{name} buckets not cumulative"


def aiperf_names(families: dict) -> set[str]:
    # prometheus_client's parser (AIPerf's) names a counter family without its _total suffix.
    return {n.removesuffix("_total") if f["type"] == "counter" else n for n, f in families.items()}


def busy_metrics() -> ServerMetrics:
    m = ServerMetrics("m")
    m.first_token(0.02)
    m.request_done("length", 5, 3, 0.5, 0.1)
    m.request_done("stop", 300, 1, 0.2, None)
    m.output_batch(4)
    m.rejected("overload")
    m.rejected("overload")
    m.engine = EngineSnapshot(running=2, waiting=3, kv_blocks_used=40, kv_blocks_total=160, preemptions=7,
                              run_ahead_steps=11, run_ahead_runs=2, run_ahead_riders=3,
                              run_ahead_exit_steps=5, run_ahead_rider_steps=4,
                              run_ahead_shared_prefix_steps=6,
                              rows_per_loop=[9, 8, 6, 5], exit_depth=[4, 0, 3, 2], step_rows=[1] + [0] * 10,
                              rows_total=1)  # fmt: skip
    return m


def test_text_format_is_valid_idle_and_busy():
    for m in (ServerMetrics("idle"), busy_metrics()):
        fams = strict_parse(m.render().decode())
        assert fams["vllm:num_requests_running"]["type"] == "gauge"


def test_aiperf_finds_every_required_name():
    missing = set(AIPERF_REQUIRED_METRICS) - aiperf_names(strict_parse(busy_metrics().render().decode()))
    assert not missing, missing


def values(text: str, name: str, key: str | None = None, family: str | None = None) -> dict:
    """{label `key`'s value (None without a key): value} of the samples called `name`."""
    fam = strict_parse(text)[family or name]
    return {(lab.get(key) if key else None): v for n, lab, v in fam["samples"] if n == name}


def test_labelled_counters_exist_at_zero_before_anything_happens():
    text = ServerMetrics("m").render().decode()
    assert values(text, "vllm:request_success_total", "finished_reason") == dict.fromkeys(FINISH_REASONS, 0)
    assert values(text, "ouro_fast:requests_rejected_total", "reason") == dict.fromkeys(REJECT_REASONS, 0)
    assert values(text, "ouro_fast:requests_aborted_total", "reason") == dict.fromkeys(ABORT_REASONS, 0)
    busy = busy_metrics()
    busy.aborted("a_new_reason")  # a reason not listed in advance still shows up
    text = busy.render().decode()
    assert values(text, "vllm:request_success_total", "finished_reason") == {
        "stop": 1,
        "length": 1,
        "abort": 0,
        "error": 0,
    }
    assert values(text, "ouro_fast:requests_rejected_total", "reason")["overload"] == 2
    assert values(text, "ouro_fast:requests_aborted_total", "reason") == {
        **dict.fromkeys(ABORT_REASONS, 0), "a_new_reason": 1}  # fmt: skip


def test_the_listed_reasons_are_the_ones_the_server_uses():
    # Reasons the server counts (engine_client.py, generate.py) are listed in advance, so their series never
    # appear mid-run.
    assert set(client._REJECTION_REASONS.values()) <= set(REJECT_REASONS)
    src = "".join((Path(client.__file__).parent / f).read_text() for f in ("engine_client.py", "generate.py"))
    used = set(re.findall(r'abort\(handle, "(\w+)"\)', src)) | set(re.findall(r'aborted\("(\w+)"', src))
    assert used and used <= set(ABORT_REASONS), used


def test_exits_per_loop_preemptions_and_request_token_histograms():
    text = busy_metrics().render().decode()
    assert values(text, "ouro_fast:loop_exits_total", "loop") == {"0": 4, "1": 0, "2": 3, "3": 2}
    # The exit-depth histogram says the same, cumulatively: depth d = loop index d - 1.
    depth = values(text, "ouro_fast:token_exit_depth_bucket", "le", family="ouro_fast:token_exit_depth")
    assert depth == {"1": 4, "2": 4, "3": 7, "4": 9, "+Inf": 9}
    assert (
        values(text, "vllm:num_preemptions_total") == values(text, "ouro_fast:preemptions_total") == {None: 7}
    )
    assert values(text, "ouro_fast:run_ahead_steps_total") == {None: 11}
    assert values(text, "ouro_fast:run_ahead_runs_total") == {None: 2}
    assert values(text, "ouro_fast:run_ahead_riders_total") == {None: 3}
    assert values(text, "ouro_fast:run_ahead_exit_steps_total") == {None: 5}
    assert values(text, "ouro_fast:run_ahead_rider_steps_total") == {None: 4}
    assert values(text, "ouro_fast:run_ahead_shared_prefix_steps_total") == {None: 6}
    fams = strict_parse(text)
    buckets = lambda name: {float(lab["le"]): v for _, lab, v in fams[name]["samples"] if "le" in lab}
    prompt, gen = buckets("vllm:request_prompt_tokens"), buckets("vllm:request_generation_tokens")
    assert [prompt[b] for b in (2, 5, 200, 500, float("inf"))] == [0, 1, 1, 2, 2]
    assert [gen[b] for b in (1, 2, 5)] == [1, 1, 2]
    sums = {n: v for n, lab, v in fams["vllm:request_generation_tokens"]["samples"] if "le" not in lab}
    assert sums == {"vllm:request_generation_tokens_sum": 4, "vllm:request_generation_tokens_count": 2}


# Every family on the page, named as prometheus_client's parser names it (a counter without _total).
FAMILIES = {
    **dict.fromkeys(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "ouro_fast:kv_blocks_used", "ouro_fast:kv_blocks_total", "ouro_fast:requests_in_flight",
                     "ouro_fast:ready", "ouro_fast:engine_out_of_service"), "gauge"),
    **dict.fromkeys(("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                     "vllm:num_preemptions", "ouro_fast:requests_rejected", "ouro_fast:requests_aborted",
                     "ouro_fast:engine_steps", "ouro_fast:engine_step_failures", "ouro_fast:refills",
                     "ouro_fast:preemptions", "ouro_fast:prefill_tokens", "ouro_fast:run_ahead_steps",
                     "ouro_fast:run_ahead_runs", "ouro_fast:run_ahead_riders",
                     "ouro_fast:run_ahead_exit_steps", "ouro_fast:run_ahead_rider_steps",
                     "ouro_fast:run_ahead_shared_prefix_steps", "ouro_fast:owner_wakeups",
                     "ouro_fast:output_batches",
                     "ouro_fast:loop_rows", "ouro_fast:loop_exits",
                     "ouro_fast:connections_closed", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"),
                    "counter"),
    **dict.fromkeys(("vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                     "vllm:request_generation_tokens", "ouro_fast:token_exit_depth", "ouro_fast:step_rows",
                     "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                     "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"),
                    "histogram"),
}  # fmt: skip


def parsed(m: ServerMetrics) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} as prometheus_client's parser reads the page."""
    fams = text_string_to_metric_families(m.render().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_prometheus_parser_finds_every_family_with_its_type():
    busy = {f.name: f for f in text_string_to_metric_families(busy_metrics().render().decode())}
    assert {name: f.type for name, f in busy.items()} == FAMILIES
    assert all(s.labels["model_name"] == "m" for f in busy.values() for s in f.samples)
    idle = {f.name: f.type for f in text_string_to_metric_families(ServerMetrics("m").render().decode())}
    # The batch-size histogram appears with the engine's first step.
    assert idle == {name: kind for name, kind in FAMILIES.items() if name != "ouro_fast:step_rows"}


def test_counters_move_when_a_request_completes():
    m = busy_metrics()
    before = parsed(m)
    m.first_token(0.01)
    m.output_batch(3)
    m.request_done("stop", 7, 3, 0.2, 0.05)
    after = parsed(m)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": "m", **labels}.items())))
        return after[key] - before[key]

    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 0
    assert delta("vllm:prompt_tokens_total") == 7 and delta("vllm:generation_tokens_total") == 3
    assert delta("ouro_fast:output_batches_total") == 1
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):  # fmt: skip
        assert delta(name + "_count") == 1, name
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.025)
    assert delta("vllm:e2e_request_latency_seconds_bucket", le="0.1") == 0
    assert delta("vllm:e2e_request_latency_seconds_bucket", le="0.25") == 1


def test_request_phases_split_the_engine_time_as_vllm_does():
    m = busy_metrics()
    before = parsed(m)
    m.request_phases(10.0, 10.003, 10.05, 10.3)  # queued 3 ms, prefill 47 ms, decode 250 ms
    m.request_phases(20.0, None, None, 20.1)  # aborted while waiting: no phase
    m.request_phases(30.0, 30.5, None, 31.0)  # scheduled, ended before its first token
    after = parsed(m)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": "m", **labels}.items())))
        return after[key] - before[key]

    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:request_queue_time_seconds_sum") == pytest.approx(0.503)
    assert delta("vllm:request_prefill_time_seconds_count") == 1
    assert delta("vllm:request_prefill_time_seconds_bucket", le="0.04") == 0
    assert delta("vllm:request_prefill_time_seconds_bucket", le="0.06") == 1
    assert delta("vllm:request_decode_time_seconds_sum") == pytest.approx(0.25)
    assert delta("vllm:request_inference_time_seconds_count") == 2
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(0.297 + 0.5)


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics("a"), ServerMetrics("b")  # the same metric names twice in one process
    a.output_batch(5)
    assert parsed(a)[("vllm:generation_tokens_total", (("model_name", "a"),))] == 5
    assert parsed(b)[("vllm:generation_tokens_total", (("model_name", "b"),))] == 0
