"""The GPU engine probe's closed loop, run on the CPU engine: every request ends, each finished
request is replaced at once, and every engine call is counted under one kind (no GPU needed)."""

import numpy as np
import torch

from bench.gpu import engine_probe
from ouro_fast.engine.engine import Engine, EngineConfig


def test_closed_loop_replaces_finished_requests_and_times_every_call(model_dir, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    engine = Engine(
        EngineConfig(model=model_dir, dtype="float32", device="cpu", runner="torch", max_num_seqs=4)
    )
    steps0 = engine.stats.steps
    result = engine_probe.run_closed(engine, np.random.default_rng(0), conc=3, q=0.5, prompts=7)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    calls = result["calls"]
    assert calls["admit"]["n"] == 7  # three at the start, then one per finished request
    # Every engine step falls under exactly one kind; the torch runner never runs ahead.
    assert sum(c["n"] for k, c in calls.items() if k != "admit") == engine.stats.steps - steps0
    assert calls["host_prefill"]["n"] >= 4 and "lanes" not in calls and result["run_ahead_runs"] == 0
    assert result["run_ahead_riders"] == 0
    assert sum(result["exit_depth_histogram"]) == 7 * 64  # 64 tokens each, ignore_eos
    assert 1.0 <= result["mean_depth"] < 4.0 and result["tok_s"] > 0
