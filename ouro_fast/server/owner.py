"""EngineOwner: the one thread that builds and drives the Engine.

It alone calls add_request / abort_request / step / abort_all. Work reaches it
through the RequestRing (records of op and int key; the payload of a SUBMIT sits
in a shared dict, filled before the push). It sleeps on a threading.Event while
the engine is idle and the ring is empty, and posts all outputs of one loop
iteration (one engine step plus the rejections of newly drained submissions)
back with a single call to `post`, so the event loop wakes once per step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("ouro_fast.server")

SUBMIT, ABORT, ABORT_ALL = 1, 2, 3
# Rows-per-step histogram bucket bounds (the last bucket is +Inf).
STEP_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WARMUP_ID = "ouro-fast-warmup"
# Failed steps with no successful one between them after which the engine is declared out of service.
MAX_FAILURES_IN_A_ROW = 3
_DRAIN_BATCH = 1024


@dataclass
class Rejected:
    """A submission the engine refused: answered with HTTP `status` before any response starts."""

    request_id: str
    status: int  # 400 (bad request), 429 (scheduler full), 503 (engine broken), 500
    message: str


@dataclass
class ReadyInfo:
    """The served model's fixed facts, reported once when the first inference succeeded."""

    model_dir: str
    max_model_len: int
    max_request_tokens: int
    vocab_limit: int
    num_loops: int
    num_kv_blocks: int
    load_seconds: float
    warmup_seconds: float
    tokenizer: object  # an OuroTokenizer of the event loop's own, not shared with the engine
    grammars: object  # the engine's GrammarCache (any thread): handlers compile requests' grammars into it


@dataclass
class EngineSnapshot:
    """Engine figures after one loop iteration of the owner (running totals are cumulative)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: int = 0
    step_failures: int = 0
    refills: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (a prompt that choices share counts its blocks once)
    prefix_cache_queries: int = 0  # known tokens of admissions that looked the prefix cache up
    prefix_cache_hits: int = 0  # tokens those admissions reused from it
    run_ahead_steps: int = 0  # steps the device drove (decode lanes launched before their exits were read)
    run_ahead_runs: int = 0  # times run-ahead started
    run_ahead_riders: int = 0  # prompts that rode in run-ahead lanes (their arrival did not end the run)
    run_ahead_exit_steps: int = 0  # run-ahead steps where some row exited (they ran the lm_head)
    run_ahead_rider_steps: int = 0  # run-ahead steps that carried riders' prompts (the step graph)
    run_ahead_shared_prefix_steps: int = 0  # run-ahead steps that read shared prefixes once for their lanes
    rows_per_loop: list[int] = field(default_factory=list)  # rows run at loop t, summed over steps
    exit_depth: list[int] = field(default_factory=list)  # tokens by loops run (1..T)
    step_rows: list[int] = field(default_factory=list)  # steps per STEP_ROW_BUCKETS bucket (+Inf last)
    rows_total: int = 0  # rows over all steps
    wakeups: int = 0  # owner loop iterations: stays put while idle (the owner sleeps, never spins)
    broken: str | None = None  # why the engine stopped serving, when it did


def parse_owner_faults(spec: str) -> dict[int, str]:
    """TEST-ONLY owner faults, OURO_FAST_TEST_OWNER_FAULTS="die@SEED,stall@SEED".

    When the owner takes in a request whose sampling seed is SEED, "die" makes its loop raise
    outside the engine step (the thread ends), and "stall" holds its next step until stop().
    Never set it in production.
    """
    faults = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, seed = part.partition("@")
        try:
            if kind not in ("die", "stall"):
                raise ValueError(kind)
            faults[int(seed)] = kind
        except ValueError:
            raise ValueError(f"OURO_FAST_TEST_OWNER_FAULTS: {part!r} is not die@SEED or stall@SEED") from None
    return faults


class OwnerFault(RuntimeError):
    """Raised outside the engine step by the test-only owner fault hook."""


class EngineOwner:
    """Builds the Engine in its own thread, then serves the ring until stop().

    `post(outputs, snapshot)` and `on_ready(info, error)` are called from the owner
    thread and must be thread-safe (the server passes loop.call_soon_threadsafe wrappers).
    """

    def __init__(
        self,
        engine_options: dict,
        ring,
        payloads: dict,
        post: Callable[[list, EngineSnapshot], None],
        on_ready: Callable[[ReadyInfo | None, str | None], None],
        chat_template: str | None = None,
        owner_faults: dict[int, str] | None = None,
    ):
        self.engine_options = engine_options
        self.chat_template = chat_template  # the server's override, else the checkpoint's
        self.ring = ring
        self.payloads = payloads
        self.post = post
        self.on_ready = on_ready
        self.engine = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ouro-engine-owner", daemon=True)
        self._live: dict[str, int] = {}  # request id -> prompt tokens
        self._step_rows = [0] * (len(STEP_ROW_BUCKETS) + 1)
        self._steps = self._failures = self._rows_total = self._wakeups = 0
        self._failures_in_a_row = 0
        self._broken: str | None = None
        self.owner_faults = owner_faults or {}
        self._stall_next_step = False
        # Written by this thread, read by the event loop's watchdog.
        self.busy_since: float | None = None  # when the running iteration started; None asleep or building
        self.died: str | None = None  # what ended the loop
        self._serving = False

    # ---- called from the event loop thread ----------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Called after every push: the owner may be asleep."""
        self._wake.set()

    def stop(self) -> None:
        """Ask the thread to end (after aborting whatever is still in flight)."""
        self._stopping = True
        self._wake.set()

    def join(self, timeout: float) -> bool:
        """True when the thread has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def failure(self, stall_limit: float) -> str | None:
        """Why the owner can serve no more, or None: its loop died, its thread ended unasked, or one
        iteration has run longer than stall_limit seconds."""
        if self.died is not None:
            return f"the engine owner thread died: {self.died}"
        if self._serving and not self._stopping and not self._thread.is_alive():
            return "the engine owner thread ended"
        since = self.busy_since
        busy = 0.0 if since is None else time.monotonic() - since
        if busy > stall_limit:
            return f"the engine owner made no progress for {busy:.1f}s (limit {stall_limit:g}s)"
        return None

    # ---- the owner thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            info = self._build()
        except BaseException as e:
            logger.exception("the engine could not be prepared")
            self.on_ready(None, f"{type(e).__name__}: {e}")
            return
        self._serving = True
        try:
            self.on_ready(info, None)
            self._post([])
            self._serve()
        except BaseException as e:
            # Whatever the loop was doing (drain, submit, step, post), the watchdog takes it from here.
            self.died = f"{type(e).__name__}: {e}"
            logger.exception("the engine owner thread died")

    def _serve(self) -> None:
        while True:
            self.busy_since = time.monotonic()
            self._wakeups += 1
            # Cleared before draining: a push after the drain sets it again, so the wait returns.
            self._wake.clear()
            batch = self._drain()
            if self._stopping:
                self._finish(batch)
                self.busy_since = None
                return
            idle = self._broken is not None or not self.engine.has_unfinished_requests()
            if not idle:
                batch += self._step()
            if batch:
                self._post(batch)
            elif idle and not len(self.ring):
                self.busy_since = None
                self._wake.wait()

    def _build(self) -> ReadyInfo:
        from ..engine.engine import Engine, EngineConfig
        from ..engine.sampling import SamplingParams
        from ..model.tokenizer import OuroTokenizer

        t0 = time.monotonic()
        eng = self.engine = Engine(EngineConfig(**self.engine_options))
        load = time.monotonic() - t0
        prompt = eng.tokenizer.encode("Hello") or [0]
        eng.add_request(WARMUP_ID, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        final = None
        for _ in range(100_000):
            final = next((o for o in eng.step() if o.finished), None)
            if final is not None:
                break
        if final is None or final.finish_reason != "length" or final.completion_tokens != 1:
            raise RuntimeError(f"the first inference did not produce one token: {final}")
        return ReadyInfo(
            model_dir=str(eng.model_dir), max_model_len=eng.max_model_len,
            max_request_tokens=eng.max_request_tokens, num_loops=eng.model_config.total_ut_steps,
            vocab_limit=min(eng.tokenizer.vocab_size, eng.model_config.vocab_size),
            num_kv_blocks=eng.scheduler.num_blocks, load_seconds=load,
            warmup_seconds=time.monotonic() - t0 - load,
            tokenizer=OuroTokenizer.from_dir(eng.model_dir, self.chat_template),
            grammars=eng.grammar_cache,
        )  # fmt: skip

    def _drain(self) -> list:
        """Apply every queued record; returns the outputs they produced (rejections, aborts)."""
        out: list = []
        while records := self.ring.pop_many(_DRAIN_BATCH):
            for op, key in records:
                if op == SUBMIT and isinstance(self.payloads[key][1], list):
                    out += self._submit_choices(key, self.payloads.pop(key))
                elif op == SUBMIT:
                    rejected = self._submit(str(key), self.payloads.pop(key))
                    if rejected is not None:
                        out.append(rejected)
                elif op == ABORT:
                    self.engine.abort_request(str(key))
                elif op == ABORT_ALL:
                    out += self._abort_all("abort", "the server is shutting down")
        return out

    def _submit(self, rid: str, payload: tuple) -> Rejected | None:
        prompt_ids, params = payload
        refused = self._add([rid], prompt_ids, [params])
        return refused[0] if refused else None

    def _submit_choices(self, key: int, payload: tuple) -> list[Rejected]:
        """Requests of one prompt under keys key, key + 1, ...: queued together, sharing the prompt's KV."""
        prompt_ids, params = payload
        return self._add([str(key + j) for j in range(len(params))], prompt_ids, params)

    def _add(self, rids: list[str], prompt_ids: list[int], params: list) -> list[Rejected]:
        """Queue requests of one prompt in the engine, all or none; returns each one's refusal, if refused."""
        if self._broken is not None:
            return [Rejected(rid, 503, f"the engine is out of service: {self._broken}") for rid in rids]
        try:
            if len(rids) == 1:
                self.engine.add_request(rids[0], prompt_ids, params[0])
            else:
                self.engine.add_requests(rids, prompt_ids, params)
        except ValueError as e:
            return [Rejected(rid, 400, str(e)) for rid in rids]
        except OverflowError as e:
            return [Rejected(rid, 429, f"the scheduler is full: {e}") for rid in rids]
        except Exception as e:
            logger.exception("add_request failed")
            return [Rejected(rid, 500, f"the engine could not accept the request: {e}") for rid in rids]
        for rid, p in zip(rids, params):
            self._live[rid] = len(prompt_ids)
            self._owner_fault(p.seed)
        return []

    def _owner_fault(self, seed: int | None) -> None:
        kind = self.owner_faults.get(seed)
        if kind == "die":
            raise OwnerFault(f"injected owner fault for seed {seed} (OURO_FAST_TEST_OWNER_FAULTS)")
        self._stall_next_step = self._stall_next_step or kind == "stall"

    def _hold_until_stopped(self) -> None:
        """The injected stall: a step that makes no progress until the server stops the owner."""
        self._stall_next_step = False
        while not self._stopping:
            time.sleep(0.01)

    def _step(self) -> list:
        """One engine step. A failed step ended the requests it touched itself; one whose failure
        escaped the engine ends every request in flight."""
        if self._stall_next_step:
            self._hold_until_stopped()
        stats = self.engine.stats
        steps_before, failed_before = stats.steps, stats.failed_steps
        try:
            outs = self.engine.step()
        except Exception as e:
            logger.exception("an engine step failed beyond its own recovery: ending every request in flight")
            outs = self._abort_all("error", f"the engine step failed: {type(e).__name__}: {e}")
            return self._track(outs + self._failed(f"{type(e).__name__}: {e}"))
        if stats.failed_steps != failed_before:
            return self._track(outs + self._failed(stats.last_failure))
        self._failures_in_a_row = 0
        if self.engine.stats.steps != steps_before:
            self._steps += 1
            rows = self.engine.stats.rows
            self._rows_total += rows
            self._step_rows[next((i for i, b in enumerate(STEP_ROW_BUCKETS) if rows <= b), -1)] += 1
        return self._track(outs)

    def _failed(self, why: str | None) -> list:
        """Count a failed step; after MAX_FAILURES_IN_A_ROW the engine goes out of service, and the
        requests it still holds (waiting ones) end."""
        self._failures += 1
        self._failures_in_a_row += 1
        if self._failures_in_a_row < MAX_FAILURES_IN_A_ROW or self._broken is not None:
            return []
        self._broken = f"{self._failures_in_a_row} engine steps failed in a row; the last: {why}"
        logger.error("the engine is out of service: %s", self._broken)
        return self._abort_all("error", f"the engine is out of service: {self._broken}")

    def _track(self, outs: list) -> list:
        for out in outs:
            if out.finished:
                self._live.pop(out.request_id, None)
        return outs

    def _abort_all(self, reason: str, error: str) -> list:
        """End every request; if the engine cannot even do that, it goes out of service."""
        try:
            outs = self.engine.abort_all(reason, error)
        except Exception as e:
            logger.exception("abort_all failed: the engine is out of service")
            self._broken = f"{type(e).__name__}: {e}"
            outs = [_error_final(rid, n, self._broken) for rid, n in self._live.items()]
        self._live.clear()
        return outs

    def _finish(self, batch: list) -> None:
        if self._broken is None and self.engine.has_unfinished_requests():
            batch += self._abort_all("abort", "the server is shutting down")
        if batch:
            self._post(batch)

    def _post(self, batch: list) -> None:
        eng, stats, pool = self.engine, self.engine.stats, self.engine.scheduler
        ahead = getattr(eng, "ahead", None)  # None on the torch runner
        snap = EngineSnapshot(
            running=eng.num_running, waiting=eng.num_waiting,
            kv_blocks_used=pool.num_blocks - pool.num_free_blocks, kv_blocks_total=pool.num_blocks,
            steps=self._steps, step_failures=self._failures,
            refills=stats.total_refills, preemptions=stats.total_preemptions,
            prefill_tokens=stats.total_prefill_tokens,
            prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
            run_ahead_steps=getattr(ahead, "total_launches", 0), run_ahead_runs=getattr(ahead, "runs", 0),
            run_ahead_riders=getattr(ahead, "total_riders", 0),
            run_ahead_exit_steps=getattr(ahead, "exit_launches", 0),
            run_ahead_rider_steps=getattr(ahead, "rider_launches", 0),
            run_ahead_shared_prefix_steps=getattr(getattr(ahead, "lanes", None), "cascade_launches", 0),
            rows_per_loop=list(stats.total_rows_per_loop), exit_depth=list(stats.exit_depth_histogram),
            step_rows=list(self._step_rows), rows_total=self._rows_total, wakeups=self._wakeups,
            broken=self._broken,
        )  # fmt: skip
        self.post(batch, snap)


def _error_final(rid: str, prompt_tokens: int, error: str):
    from ..engine.outputs import StepOutput

    return StepOutput(rid, [], "", True, "error", prompt_tokens, 0, [], error)
