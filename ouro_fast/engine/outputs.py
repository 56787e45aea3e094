"""What the engine hands back: per-request outputs and per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepOutput:
    """News of one request from one step. `text_delta` concatenated over a request is its text."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    prompt_tokens: int
    completion_tokens: int
    exit_loops: list[int]  # 0-based exit loop of each new token
    error: str | None = None
    request: Any = None  # the finished Request (full text, ids, exit loops); None until finished
    logprobs: list | None = None  # TokenLogprobs of each new token, when the request asked for them
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass
class StepStats:
    """The last step's figures and running totals."""

    num_loops: int
    steps: int = 0
    rows: int = 0
    tokens: int = 0
    exits: int = 0
    refills: int = 0
    preemptions: int = 0
    # Tokens of prompt chunks run: a shared prompt's blocks count once; recomputations count again.
    prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    rows_per_loop: list[int] = field(default_factory=list)  # last step
    total_rows_per_loop: list[int] = field(default_factory=list)
    total_exits: int = 0
    total_refills: int = 0
    total_preemptions: int = 0
    total_prefill_tokens: int = 0
    # vLLM's prefix-cache counters, in tokens: known tokens of admissions that looked up, tokens reused.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    exit_depth_histogram: list[int] = field(default_factory=list)  # tokens by loops run (1..T)
    scheduler_seconds: float = 0.0
    model_seconds: float = 0.0
    detok_seconds: float = 0.0
    failed_steps: int = 0  # steps that raised: their requests holding KV ended with an error
    last_failure: str | None = None  # why the last failed step failed

    def __post_init__(self):
        self.total_rows_per_loop = [0] * self.num_loops
        self.exit_depth_histogram = [0] * self.num_loops

    def record(self, plan, events, scheduler, sched_s: float, model_s: float, detok_s: float) -> None:
        """Count one applied step: its StepPlan, its TokenEvents, the pool after it, and where time went."""
        self.steps += 1
        self.rows, self.tokens, self.exits = plan.num_rows, plan.num_tokens, len(events)
        self.refills, self.preemptions = plan.num_refills, plan.num_preempted
        self.prefill_tokens = plan.num_prefill_tokens
        self.total_prefill_tokens += plan.num_prefill_tokens
        self.prefix_cache_queries = scheduler.prefix_cache_queries
        self.prefix_cache_hits = scheduler.prefix_cache_hits
        self.kv_blocks_free = scheduler.num_free_blocks
        self.kv_blocks_used = scheduler.num_blocks - scheduler.num_free_blocks
        per_loop = np.bincount(plan.loop, minlength=self.num_loops)
        self.rows_per_loop = per_loop.tolist()
        for t in range(self.num_loops):
            self.total_rows_per_loop[t] += int(per_loop[t])
        for loop in events.loop.tolist():
            self.exit_depth_histogram[loop] += 1
        self.total_exits += len(events)
        self.total_refills += plan.num_refills
        self.total_preemptions += plan.num_preempted
        self.scheduler_seconds += sched_s
        self.model_seconds += model_s
        self.detok_seconds += detok_s
