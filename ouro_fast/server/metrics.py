"""ServerMetrics: the figures behind GET /metrics, rendered as Prometheus text (format 0.0.4).

Request-level figures (latencies, tokens, outcomes) are recorded on the event
loop as outputs arrive; engine figures come from the owner's latest
EngineSnapshot. Metrics that vLLM also exports keep vLLM's names (vllm:...), so
scrapers that know vLLM (AIPerf) find them; Ouro-specific ones are ouro_fast:...
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .owner import STEP_ROW_BUCKETS, EngineSnapshot

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM's buckets for per-request token counts (1, 2, 5 x powers of ten).
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
# Label values each labelled counter shows from the start (others still appear when counted).
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("invalid", "overload", "error", "unavailable")
ABORT_REASONS = ("disconnect", "slow_client", "shutdown")
TPOT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


@dataclass
class Histogram:
    """Cumulative-on-render histogram: counts[i] holds observations in (bounds[i-1], bounds[i]]."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {
        k: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()
    }
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class _Text:
    """Accumulates exposition lines, one HELP/TYPE header per metric family."""

    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, labels: dict | None = None) -> None:
        self.lines.append(f"{name}{_labels(labels or {})} {value:.17g}")

    def histogram(self, name: str, help_text: str, bounds, counts, total: float, labels: dict) -> None:
        self.family(name, "histogram", help_text)
        cumulative = 0
        for bound, count in zip([*map(str, bounds), "+Inf"], counts):
            cumulative += count
            self.sample(f"{name}_bucket", cumulative, {**labels, "le": bound})
        self.sample(f"{name}_sum", total, labels)
        self.sample(f"{name}_count", cumulative, labels)


class ServerMetrics:
    """Counters and histograms of the server; all methods run on the event loop thread."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # finish reason -> requests
        self.rejected: Counter[str] = Counter()  # why -> requests answered 429/503 before admission
        self.aborted: Counter[str] = Counter()  # why -> requests the server aborted
        self.engine = EngineSnapshot()
        self.in_flight = 0
        self.ready = False
        self.output_batches = 0  # thread-safe wake-ups of the event loop by the owner

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def request_done(self, reason: str, prompt_tokens: int, completion_tokens: int, e2e: float,
                     decode_seconds: float | None) -> None:  # fmt: skip
        """A request's final output; decode_seconds is first-to-last token time (None: < 2 tokens)."""
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)
        self.e2e.observe(e2e)
        if decode_seconds is not None and completion_tokens > 1:
            self.tpot.observe(decode_seconds / (completion_tokens - 1))

    def render(self) -> str:
        t, lab, eng = _Text(), self.labels, self.engine
        gauges = (
            ("vllm:num_requests_running", "Requests holding KV in the engine.", eng.running),
            ("vllm:num_requests_waiting", "Requests queued in the engine scheduler.", eng.waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
             eng.kv_blocks_used / eng.kv_blocks_total if eng.kv_blocks_total else 0.0),
            ("ouro_fast:kv_blocks_used", "KV blocks in use, all loop planes together.", eng.kv_blocks_used),
            ("ouro_fast:kv_blocks_total", "KV blocks in the pool.", eng.kv_blocks_total),
            ("ouro_fast:requests_in_flight", "Requests admitted by the server and not yet finished.",
             self.in_flight),
            ("ouro_fast:ready", "1 once the first internal inference succeeded.", int(self.ready)),
            ("ouro_fast:engine_out_of_service", "1 if the engine could not recover from a failure.",
             int(eng.broken is not None)),
        )  # fmt: skip
        for name, help_text, value in gauges:
            t.family(name, "gauge", help_text)
            t.sample(name, value, lab)
        counters = (
            ("vllm:prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("vllm:generation_tokens_total", "Generated tokens.", self.generation_tokens),
            (
                "ouro_fast:engine_steps_total",
                "Engine steps run (one loop over the scheduled rows).",
                eng.steps,
            ),
            ("ouro_fast:engine_step_failures_total", "Engine steps that raised.", eng.step_failures),
            ("ouro_fast:refills_total", "Rows that joined a batch at a loop boundary.", eng.refills),
            ("ouro_fast:preemptions_total", "Requests preempted to free KV.", eng.preemptions),
            (
                "ouro_fast:run_ahead_steps_total",
                "Engine steps launched by run-ahead decode (before the last step's exits were read).",
                eng.run_ahead_steps,
            ),
            (
                "ouro_fast:run_ahead_runs_total",
                "Times run-ahead decode started; steps over runs is the mean run length.",
                eng.run_ahead_runs,
            ),
            (
                "ouro_fast:run_ahead_riders_total",
                "Prompts that ran their loops in run-ahead launches (arrivals that did not end a run).",
                eng.run_ahead_riders,
            ),
            (
                "ouro_fast:run_ahead_exit_steps_total",
                "Run-ahead steps where some row exited; the others skip the lm_head's weight stream.",
                eng.run_ahead_exit_steps,
            ),
            ("vllm:num_preemptions_total", "Requests preempted to free KV (vLLM's name).", eng.preemptions),
            ("ouro_fast:owner_wakeups_total", "Loop iterations of the engine-owner thread.", eng.wakeups),
            (
                "ouro_fast:output_batches_total",
                "Output batches the owner handed to the event loop.",
                self.output_batches,
            ),
        )
        for name, help_text, value in counters:
            t.family(name, "counter", help_text)
            t.sample(name, value, lab)
        self._labelled(t, "vllm:request_success_total", "Finished requests by finish reason.",
                       "finished_reason", self.finished, FINISH_REASONS)  # fmt: skip
        self._labelled(t, "ouro_fast:requests_rejected_total", "Requests refused before admission.",
                       "reason", self.rejected, REJECT_REASONS)  # fmt: skip
        self._labelled(t, "ouro_fast:requests_aborted_total", "Requests the server aborted.",
                       "reason", self.aborted, ABORT_REASONS)  # fmt: skip
        t.family("ouro_fast:loop_rows_total", "counter", "Rows run at each loop index (0-based).")
        for loop, n in enumerate(eng.rows_per_loop):
            t.sample("ouro_fast:loop_rows_total", n, {**lab, "loop": str(loop)})
        exits_help = "Generated tokens that exited after loop `loop` (0-based), i.e. ran loop+1 loops."
        t.family("ouro_fast:loop_exits_total", "counter", exits_help)
        for loop, n in enumerate(eng.exit_depth):
            t.sample("ouro_fast:loop_exits_total", n, {**lab, "loop": str(loop)})
        depth_total = sum((d + 1) * n for d, n in enumerate(eng.exit_depth))
        t.histogram("ouro_fast:token_exit_depth", "Loops each generated token ran before it exited.",
                    range(1, len(eng.exit_depth) + 1), [*eng.exit_depth, 0], depth_total, lab)  # fmt: skip
        if eng.step_rows:
            t.histogram("ouro_fast:step_rows", "Rows (requests) batched in one engine step.",
                        STEP_ROW_BUCKETS, eng.step_rows, eng.rows_total, lab)  # fmt: skip
        for name, help_text, h in (
            ("vllm:time_to_first_token_seconds", "Time from arrival to the first token.", self.ttft),
            ("vllm:request_time_per_output_token_seconds", "Decode time per output token after the first.",
             self.tpot),
            ("vllm:e2e_request_latency_seconds", "Time from arrival to the final output.", self.e2e),
            ("vllm:request_prompt_tokens", "Prompt tokens per finished request.", self.request_prompt_tokens),
            ("vllm:request_generation_tokens", "Generated tokens per finished request.",
             self.request_generation_tokens),
        ):  # fmt: skip
            t.histogram(name, help_text, h.bounds, h.counts, h.total, lab)
        return "\n".join(t.lines) + "\n"

    def _labelled(
        self, t: _Text, name: str, help_text: str, key: str, counts: Counter, known: tuple[str, ...]
    ) -> None:
        t.family(name, "counter", help_text)
        for value in sorted(set(known) | set(counts)):
            t.sample(name, counts[value], {**self.labels, key: value})
