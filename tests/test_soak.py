"""The CI version of bench/soak.py: 200 requests at concurrency 16 against a real server,
with the same mix of client disconnects, a burst past the admission bound, stalled readers and a
fault injected at every stage of the engine step; every request must be accounted for, at most 10%
of them 429s, and the server left clean (no KV held, nothing in flight, no thread left behind)."""

from __future__ import annotations

from bench.soak import BATCH_STAGES, FAULTS, SoakConfig, run_soak


def test_short_soak_loses_nothing_and_leaks_nothing():
    cfg = SoakConfig(requests=200, concurrency=16, burst=32, slow_clients=2, max_waiting=16, seed=1234,
                     request_timeout_s=30.0, time_limit_s=60.0)  # fmt: skip
    s = run_soak(cfg)
    assert s["problems"] == [], s
    assert s["requests_total"] == 200 + 32 + 2 + len(FAULTS)
    out = s["outcomes"]
    # Nothing silent or hung; every outcome of the mix really happened.
    assert set(out) <= {"completed", "rejected_429", "cancelled", "failed"}, out
    assert out["completed"] >= 40 and out["cancelled"] >= 20 and out["rejected_429"] >= 1, out
    assert out["rejected_429"] <= 0.1 * s["requests_total"], out
    # Each stage's fault ended its request; only the batch stages failed a step.
    assert s["outcomes_by_kind"]["fault"] == {"failed": len(FAULTS)}
    assert set(s["faults"]) == set(FAULTS) and all(v.startswith("failed") for v in s["faults"].values())
    assert s["server_step_failures"] == len(BATCH_STAGES)
    assert s["server_aborted"]['ouro_fast:requests_aborted_total{reason="slow_client"}'] == 2
    assert s["server_aborted"]['ouro_fast:requests_aborted_total{reason="disconnect"}'] >= 1
    assert s["unaccounted"] == 0
    assert s["server_after"] == {"running": 0, "waiting": 0, "in_flight": 0, "kv_blocks_used": 0}
    assert s["process_after"]["Threads"] <= s["process_before"]["Threads"]
    assert s["health_after"] == 200
