"""ServerMetrics: the figures behind GET /metrics, kept in a per-server prometheus_client registry.

Request-level figures (latencies, tokens, outcomes) are counters and histograms
updated on the event loop as outputs arrive; engine figures are read from the
owner's latest EngineSnapshot when the page is scraped. Metrics that vLLM also
exports keep vLLM's names (vllm:...), so scrapers that know vLLM (AIPerf) find
them; Ouro-specific ones are ouro_fast:...
"""

from __future__ import annotations

from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest

from .owner import STEP_ROW_BUCKETS, EngineSnapshot

# Only the documented series: no *_created twin per counter and histogram (a process-wide switch).
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
# vLLM's buckets for per-request token counts (1, 2, 5 x powers of ten).
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
# Label values each labelled counter shows from the start (others still appear when counted).
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("invalid", "overload", "error", "unavailable")
ABORT_REASONS = ("disconnect", "slow_client", "shutdown")
CONNECTION_CLOSE_REASONS = ("limit", "header_timeout", "body_timeout", "idle")
_EXITS_HELP = "Generated tokens that exited after loop `loop` (0-based), i.e. ran loop+1 loops."


class _ByReason:
    """A counter labelled by reason, its children bound once: labels() costs more than inc()."""

    def __init__(self, counter: Counter, model_name: str, known: tuple[str, ...]):
        self.counter, self.model_name = counter, model_name
        # The known reasons show at zero from the start, so a scraper's first delta already sees them.
        self.bound = {reason: counter.labels(model_name, reason) for reason in known}

    def inc(self, reason: str, amount: float = 1) -> None:
        child = self.bound.get(reason)
        if child is None:
            child = self.bound[reason] = self.counter.labels(self.model_name, reason)
        child.inc(amount)


class ServerMetrics:
    """The server's metrics registry; all methods run on the event loop thread."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = EngineSnapshot()  # read at scrape time, like in_flight and ready
        self.in_flight = 0
        self.ready = False
        self.prompt_tokens = self._counter("vllm:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("vllm:generation_tokens_total", "Generated tokens.")
        self.output_batches = self._counter(
            "ouro_fast:output_batches_total", "Output batches the owner handed to the event loop."
        )
        self._finished = self._by_reason(
            "vllm:request_success_total",
            "Finished requests by finish reason.",
            "finished_reason",
            FINISH_REASONS,
        )
        self._rejected = self._by_reason(
            "ouro_fast:requests_rejected_total",
            "Requests refused before admission.",
            "reason",
            REJECT_REASONS,
        )
        self._aborted = self._by_reason(
            "ouro_fast:requests_aborted_total", "Requests the server aborted.", "reason", ABORT_REASONS
        )
        self._connections_closed = self._by_reason(
            "ouro_fast:connections_closed_total",
            "Connections the server refused (limit) or closed at a deadline.",
            "reason",
            CONNECTION_CLOSE_REASONS,
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first token.", LATENCY_BUCKETS
        )
        self.tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Decode time per output token after the first.",
            TPOT_BUCKETS,
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the final output.", LATENCY_BUCKETS
        )
        # The engine's phases of a finished request, as vLLM splits them.
        self.queue_time, self.prefill_time, self.decode_time, self.inference_time = (
            self._histogram(f"vllm:request_{name}_time_seconds", help, LATENCY_BUCKETS)
            for name, help in (
                ("queue", "Time from the engine's arrival to the first step that runs the prompt."),
                ("prefill", "Time from that step to the first token."),
                ("decode", "Time from the first token to the last."),
                ("inference", "Time from the first step that runs the prompt to the last token."),
            )
        )
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.registry.register(self)  # collect() adds the figures read at scrape time

    # ---- recording (event loop) ---------------------------------------------------

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def request_done(self, reason: str, prompt_tokens: int, completion_tokens: int, e2e: float,
                     decode_seconds: float | None) -> None:  # fmt: skip
        """A request's final output; decode_seconds is first-to-last token time (None: < 2 tokens)."""
        self._finished.inc(reason)
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)
        self.e2e.observe(e2e)
        if decode_seconds is not None and completion_tokens > 1:
            self.tpot.observe(decode_seconds / (completion_tokens - 1))

    def request_phases(self, arrival: float, scheduled: float | None, first_token: float | None,
                       finished: float | None) -> None:  # fmt: skip
        """A finished request's engine times (one monotonic clock; None for a phase never reached)."""
        if scheduled is None:
            return
        self.queue_time.observe(scheduled - arrival)
        if first_token is not None:
            self.prefill_time.observe(first_token - scheduled)
            if finished is not None:
                self.decode_time.observe(finished - first_token)
        if finished is not None:
            self.inference_time.observe(finished - scheduled)

    def output_batch(self, generated_tokens: int) -> None:
        """One hand-off of outputs from the owner, routed; generated_tokens is what its outputs carried."""
        self.output_batches.inc()
        # Once per batch, not per output: the counter takes a lock on every inc().
        self.generation_tokens.inc(generated_tokens)

    def rejected(self, reason: str) -> None:
        self._rejected.inc(reason)

    def aborted(self, reason: str, requests: int = 1) -> None:
        self._aborted.inc(reason, requests)

    def connection_closed(self, reason: str) -> None:
        self._connections_closed.inc(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- scrape time ----------------------------------------------------------------

    def collect(self):
        """The registry's hook: families built per scrape from the latest snapshot and the server's state."""
        eng = self.engine
        yield from (self._family(GaugeMetricFamily, *g) for g in self._gauges(eng))
        yield from (self._family(CounterMetricFamily, *c) for c in _engine_counters(eng))
        yield self._per_loop("ouro_fast:loop_rows_total", "Rows run at each loop index (0-based).",
                             eng.rows_per_loop)  # fmt: skip
        yield self._per_loop("ouro_fast:loop_exits_total", _EXITS_HELP, eng.exit_depth)
        depth_sum = sum((d + 1) * n for d, n in enumerate(eng.exit_depth))
        yield self._bucketed("ouro_fast:token_exit_depth", "Loops each generated token ran before it exited.",
                             range(1, len(eng.exit_depth) + 1), [*eng.exit_depth, 0], depth_sum)  # fmt: skip
        if eng.step_rows:
            yield self._bucketed("ouro_fast:step_rows", "Rows (requests) batched in one engine step.",
                                 STEP_ROW_BUCKETS, eng.step_rows, eng.rows_total)  # fmt: skip

    def _gauges(self, eng: EngineSnapshot) -> tuple:
        usage = eng.kv_blocks_used / eng.kv_blocks_total if eng.kv_blocks_total else 0.0
        return (
            ("vllm:num_requests_running", "Requests holding KV in the engine.", eng.running),
            ("vllm:num_requests_waiting", "Requests queued in the engine scheduler.", eng.waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", usage),
            ("ouro_fast:kv_blocks_used", "KV blocks in use, all loop planes together.", eng.kv_blocks_used),
            ("ouro_fast:kv_blocks_total", "KV blocks in the pool.", eng.kv_blocks_total),
            ("ouro_fast:requests_in_flight", "Requests admitted by the server and not yet finished.",
             self.in_flight),
            ("ouro_fast:ready", "1 once the first internal inference succeeded.", int(self.ready)),
            ("ouro_fast:engine_out_of_service", "1 if the engine could not recover from a failure.",
             int(eng.broken is not None)),
        )  # fmt: skip

    # ---- construction helpers ---------------------------------------------------------

    def _counter(self, name: str, help_text: str):
        return Counter(name, help_text, ["model_name"], registry=self.registry).labels(self.model_name)

    def _by_reason(self, name: str, help_text: str, key: str, known: tuple[str, ...]) -> _ByReason:
        counter = Counter(name, help_text, ["model_name", key], registry=self.registry)
        return _ByReason(counter, self.model_name, known)

    def _histogram(self, name: str, help_text: str, bounds: tuple):
        hist = Histogram(name, help_text, ["model_name"], buckets=bounds, registry=self.registry)
        return hist.labels(self.model_name)

    def _family(self, kind, name: str, help_text: str, value: float):
        family = kind(name, help_text, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _per_loop(self, name: str, help_text: str, counts: list[int]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=["model_name", "loop"])
        for loop, n in enumerate(counts):
            family.add_metric([self.model_name, str(loop)], n)
        return family

    def _bucketed(self, name: str, help_text: str, bounds, counts: list[int], total: float):
        """A histogram from per-bucket counts (+Inf last); the exposition wants them cumulative."""
        family = HistogramMetricFamily(name, help_text, labels=["model_name"])
        cumulative = zip([*map(str, bounds), "+Inf"], accumulate(counts))
        family.add_metric([self.model_name], list(cumulative), total)
        return family


def _engine_counters(eng: EngineSnapshot) -> tuple:
    """The owner's running totals, exported as counters (name, help, value)."""
    return (
        ("ouro_fast:engine_steps_total", "Engine steps run (one loop over the scheduled rows).", eng.steps),
        ("ouro_fast:engine_step_failures_total", "Engine steps that raised.", eng.step_failures),
        ("ouro_fast:refills_total", "Rows that joined a batch at a loop boundary.", eng.refills),
        ("ouro_fast:preemptions_total", "Requests preempted to free KV.", eng.preemptions),
        ("ouro_fast:prefill_tokens_total",
         "Prompt tokens computed: a prompt its choices share counts its whole blocks once, recomputations "
         "after preemption again.", eng.prefill_tokens),
        ("ouro_fast:run_ahead_steps_total",
         "Engine steps launched by run-ahead decode (before the last step's exits were read).",
         eng.run_ahead_steps),
        ("ouro_fast:run_ahead_runs_total",
         "Times run-ahead decode started; steps over runs is the mean run length.", eng.run_ahead_runs),
        ("ouro_fast:run_ahead_riders_total",
         "Prompts that ran their loops in run-ahead launches (arrivals that did not end a run).",
         eng.run_ahead_riders),
        ("ouro_fast:run_ahead_exit_steps_total",
         "Run-ahead steps where some row exited; the others skip the lm_head's weight stream.",
         eng.run_ahead_exit_steps),
        ("ouro_fast:run_ahead_rider_steps_total",
         "Run-ahead steps that carried riders' prompts (run as the step graph).", eng.run_ahead_rider_steps),
        ("ouro_fast:run_ahead_shared_prefix_steps_total",
         "Run-ahead steps, with riders or without, whose lanes read a shared prompt prefix once for all "
         "of them.",
         eng.run_ahead_shared_prefix_steps),
        ("vllm:num_preemptions_total", "Requests preempted to free KV (vLLM's name).", eng.preemptions),
        ("vllm:prefix_cache_queries_total",
         "Prefix cache queries, in tokens: the known tokens of each admission that looked the cache up.",
         eng.prefix_cache_queries),
        ("vllm:prefix_cache_hits_total",
         "Prefix cache hits, in tokens: prompt tokens whose K/V admissions reused (every loop's plane).",
         eng.prefix_cache_hits),
        ("ouro_fast:owner_wakeups_total", "Loop iterations of the engine-owner thread.", eng.wakeups),
    )  # fmt: skip
