"""The benchmark scripts run at toy sizes, write their JSON, and report numbers that add up.

No timing assertions: only that each script completes, measures what it says
(both builds, the same workload for each) and that the summary tables are made
from its files. vLLM's scheduler benchmark needs the client venv and is not run here.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # on sys.path (appended) by conftest.py

from bench import benchlib, engine_bench, summarize  # noqa: E402
from bench.micro import block_table, detok, grammar, ring, scheduler  # noqa: E402


def positive(stats: dict) -> bool:
    return stats["n"] > 0 and 0 < stats["p10"] <= stats["p50"] <= stats["p90"]


def test_percentiles_match_the_reference():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    ref = statistics.quantiles(values, n=10, method="inclusive")
    s = benchlib.summarize(values, ndigits=6)
    assert s["p10"] == pytest.approx(ref[0])
    assert s["p50"] == pytest.approx(statistics.median(values))
    assert s["p90"] == pytest.approx(ref[8])
    assert s["n"] == 7


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    scheduler.main(["--quick", "--out", str(out)])
    block_table.main(["--quick", "--out", str(out)])
    detok.main(["--quick", "--out", str(out)])
    ring.main(["--quick", "--out", str(out)])
    grammar.main(["--quick", "--out", str(out)])
    engine_bench.main(["--quick", "--out", str(out), "--ckpt-dir", str(out / "ckpt")])
    return out


def load(folder: Path, name: str) -> dict:
    doc = json.loads((folder / f"{name}.json").read_text())
    assert doc["machine"]["cores"] >= 1 and len(doc["machine"]["loadavg"]) == 3
    assert doc["commit"] and doc["command"]  # recorded, whatever launched it
    return doc["results"]


def test_scheduler_bench_drives_both_builds_identically(results):
    rows = load(results, "scheduler")
    compiled = [r for r in rows if r["impl"] == "compiled"]
    twin = [r for r in rows if r["impl"] == "twin"]
    assert len(compiled) == len(twin) == 4  # batches 1, 8 x waiting 0, 10
    for c, t in zip(compiled, twin):
        assert (c["batch"], c["waiting"], c["steps"]) == (t["batch"], t["waiting"], t["steps"])
        # Same workload, same decisions: the same tokens come out of both builds.
        assert c["tokens"] == t["tokens"] > 0
        assert c["rows_per_step"] == t["rows_per_step"] == c["batch"]
        # Full depth: every token takes 4 loop steps (up to the window's edges).
        assert 3.0 <= c["steps_per_token"] <= 5.0
        assert positive(c["step_us"]) and positive(t["step_us"])
        assert c["twin_over_compiled"] > 0
        assert c["us_per_batch_token"] == pytest.approx(c["us_per_token"] * c["batch"], rel=1e-3)


def test_scheduler_bench_times_a_prefix_cache_hit_in_both_builds(results):
    rows = load(results, "scheduler_cache")
    assert [r["impl"] for r in rows] == ["compiled", "twin"]
    for r in rows:
        assert r["prompt_tokens"] == 4096 and r["hit_blocks"] == 255
        assert positive(r["lookup_allocate_us"]) and positive(r["free_us"]) and positive(r["hash_us"])


def test_block_table_bench_covers_every_operation(results):
    rows = load(results, "block_table")
    ops = {r["op"] for r in rows}
    want = {
        "allocate_noop",
        "allocate_grow",
        "alloc_free_128",
        "slot_map_1",
        "slot_map_128",
        "propagation_64",
    }
    assert ops == want
    for r in rows:
        assert positive(r["compiled_us"]) and positive(r["twin_us"])


def test_detok_bench_reports_core_and_decode_shares(results):
    rows = load(results, "detok")
    for r in rows:
        assert r["impl"] in ("compiled", "twin")
        assert positive(r["step_us"]) and r["core_fns_us"]["p50"] > 0
        # The core's own functions are part of the step, never more than it.
        assert r["core_fns_us_per_token"] <= r["us_per_token"]


def test_ring_bench_moves_every_record(results):
    res = load(results, "ring")
    for kind in ("compiled", "twin"):
        r = res[kind]
        assert positive(r["push_pop_us"]) and positive(r["ping_pong_us"])
        assert r["two_threads"]["records"] > 0 and r["two_threads"]["records_per_s"] > 0


def test_grammar_bench_times_each_fill_mode_on_the_same_rows(results):
    rows = load(results, "grammar")
    modes = ("single", "batched", "async")
    assert {(r["rows"], r["mode"]) for r in rows} == {(n, m) for n in (1, 8) for m in modes}
    for r in rows:
        assert positive(r["accept_us_per_token"])
        assert positive(r["owner_us_per_token"] if r["mode"] == "async" else r["fill_us_per_token"])


def test_engine_bench_counts_every_token(results):
    rows = load(results, "engine")
    configs = {(r["exit_threshold"], r["refill"]) for r in rows}
    assert configs == {(1.0, True), (1.0, False), (0.5, True), (0.5, False)}
    for r in rows:
        tokens = r["requests"] * r["output_len"]
        assert r["output_tokens"] == tokens == sum(r["depth_histogram"].values())
        assert 0 < r["kv_peak_blocks"] <= r["kv_total_blocks"]
        split = r["ms_per_step"]
        assert split["total"] >= split["scheduler"] + split["model"] + split["detok"] - 1e-3
        if r["exit_threshold"] == 1.0:
            assert r["mean_depth"] == 4.0  # threshold 1.0 never exits early
    # The same checkpoint and prompts give the same depths with and without refill.
    by = {(r["exit_threshold"], r["refill"]): r["depth_histogram"] for r in rows}
    assert by[(0.5, True)] == by[(0.5, False)]


def test_summary_has_the_tables(results):
    text = summarize.main([str(results)])
    assert (results / "summary.md").read_text() == text
    for title in ("Loop scheduler", "Targets", "Block tables", "Detokenization", "Request ring", "Engine"):
        assert title in text
