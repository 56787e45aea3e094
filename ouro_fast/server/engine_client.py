"""EngineClient: the event loop's side of the engine owner.

It is the ring's single producer: admission (the in-flight bound, the ring's
capacity), SUBMIT and ABORT records, and the routing of each step's outputs to
per-request bounded queues all happen on the event loop thread. Nothing here
waits on model work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ..core.ring import RequestRing
from ..engine.outputs import StepOutput
from .config import ServerConfig
from .metrics import ServerMetrics
from .owner import (
    ABORT,
    ABORT_ALL,
    SUBMIT,
    EngineOwner,
    EngineSnapshot,
    ReadyInfo,
    Rejected,
    parse_owner_faults,
)
from .protocol import ApiError, ModelInfo

logger = logging.getLogger("ouro_fast.server")

# Inputs larger than this (characters, bytes or token ids) are parsed, rendered, tokenized and decoded
# off the event loop.
_INLINE_SIZE = 16_384
_REJECTION_REASONS = {400: "invalid", 429: "overload", 500: "error", 503: "unavailable"}
_ABORT_RETRY_S = 0.002
# How often the watchdog looks at the owner thread: a death is served 503s within this.
WATCH_INTERVAL_S = 0.2
# A failed server keeps answering 503 this long, so health checks see it, before it stops.
FAIL_LINGER_S = 1.0
_FAIL_DRAIN_S = 3.0  # and waits at most this long, from the failure, for handlers to send their errors


class Outputs:
    """A request's outputs from the owner to its handler: a bounded FIFO with one waiting reader.

    Lighter than asyncio.Queue on the path every streamed token takes: a deque, and a future only while
    the reader waits on an empty one."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def empty(self) -> bool:
        return not self.items

    def put_nowait(self, item) -> None:
        """Append item; asyncio.QueueFull when maxsize items are unread."""
        if len(self.items) >= self.maxsize:
            raise asyncio.QueueFull
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take_all(self) -> list:
        """Every item now queued, in order (at least one: waits for it)."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items = list(self.items)
        self.items.clear()
        return items


class RequestHandle:
    """One admitted request, as its HTTP handler sees it."""

    def __init__(self, key: int, buffer: int, transport, prompt_tokens: int = 0):
        self.key = key
        self.request_id = str(key)
        self.prompt_tokens = prompt_tokens
        self.queue = Outputs(buffer)
        self.transport = transport
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.finished = False  # its final output (or rejection) has arrived
        self.abort_sent = False
        self.released = False  # the handler is gone; the handle waits for its final
        self.dropped = False  # aborted for falling behind

    async def next(self) -> list:
        """Every output queued now, in order (at least one: waits for it)."""
        return await self.queue.take_all()


class EngineClient:
    """Starts the owner thread and mediates every exchange with it."""

    def __init__(self, config: ServerConfig, loop: asyncio.AbstractEventLoop, on_failure=None):
        self.config = config
        self.loop = loop
        self.on_failure = on_failure
        self.ring = RequestRing(config.ring_capacity)
        self.payloads: dict[int, tuple] = {}
        self.handles: dict[str, RequestHandle] = {}
        self.metrics = ServerMetrics(config.metrics_model_name)
        self.info: ModelInfo | None = None
        self.tokenizer = None
        self.grammars = None  # the engine's GrammarCache, once ready
        self.state = "loading"  # loading -> ready -> draining -> stopping; or failed
        self.error: str | None = None
        self.launch_epoch: float | None = None
        self.stop_requested = False  # a stop signal arrived (or the server is stopping itself)
        self._hurried = asyncio.Event()  # a second signal: skip what is left of the drain and the grace
        self._next_key = 1
        self._backlog: deque[tuple[int, int]] = deque()  # ABORT records that found the ring full
        self._retry: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        # One thread for large inputs: JSON parsing holds the GIL, and two parses at once would hold it
        # back to back while the loop waits.
        self.heavy = ThreadPoolExecutor(1, thread_name_prefix="ouro-heavy-input")
        self.owner = EngineOwner(
            config.engine_options(),
            self.ring,
            self.payloads,
            post=self._post_threadsafe,
            on_ready=self._ready_threadsafe,
            chat_template=config.chat_template,
            owner_faults=parse_owner_faults(config.test_owner_faults),
        )

    def start(self, launch_epoch: float) -> None:
        self.launch_epoch = launch_epoch
        self.owner.start()
        self._watchdog = self.loop.call_later(WATCH_INTERVAL_S, self._watch)

    # ---- the watchdog ---------------------------------------------------------------

    def _watch(self) -> None:
        """Every WATCH_INTERVAL_S: fail the server once the owner died or stalled with requests in flight."""
        if self.state == "failed":
            return
        reason = self.owner.failure(self.config.stall_limit if self.handles else math.inf)
        if reason is None:
            self._watchdog = self.loop.call_later(WATCH_INTERVAL_S, self._watch)
            return
        stop = self.state != "stopping"
        self.state, self.error = "failed", reason
        self.metrics.engine = dataclasses.replace(self.metrics.engine, broken=reason)
        logger.error("%s: failing %d requests in flight and stopping the server", reason, len(self.handles))
        failed = [h for h in self.handles.values() if not h.finished]
        self._route([StepOutput(h.request_id, [], "", True, "error", h.prompt_tokens, 0, [], reason)
                     for h in failed])  # fmt: skip
        if stop and self.on_failure is not None:
            asyncio.ensure_future(self._stop_when_answered())

    async def _stop_when_answered(self) -> None:
        start = self.loop.time()
        await asyncio.sleep(FAIL_LINGER_S)
        while any(not h.released for h in self.handles.values()) and self.loop.time() < start + _FAIL_DRAIN_S:
            await asyncio.sleep(0.02)
        self.on_failure()

    # ---- readiness ----------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Ready for new traffic: what /health reports to a load balancer."""
        return self.state == "ready" and self.metrics.engine.broken is None

    @property
    def serving(self) -> bool:
        """Admitting requests: while ready, and while draining after SIGTERM."""
        return self.state in ("ready", "draining") and self.metrics.engine.broken is None

    def status(self) -> str:
        if self.state in ("ready", "draining") and self.metrics.engine.broken is not None:
            return "out of service: " + self.metrics.engine.broken
        return self.state if self.error is None else f"{self.state}: {self.error}"

    def require_ready(self) -> ModelInfo:
        """The model info, or a 503 while loading, after a failure and once draining has ended."""
        if not self.serving:
            raise ApiError(503, f"the server is not ready ({self.status()})", code="not_ready", retry_after=1)
        return self.info

    def _ready_threadsafe(self, info: ReadyInfo | None, error: str | None) -> None:
        # The loop may already be closed when a shutdown overtook a slow model load.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._ready, info, error)

    def _ready(self, info: ReadyInfo | None, error: str | None) -> None:
        if info is None:
            self.state, self.error = "failed", error
            logger.error("the engine failed to start: %s", error)
            if self.on_failure is not None:
                self.on_failure()
            return
        self.info = ModelInfo(
            names=self.config.model_names,
            root=info.model_dir,
            max_model_len=info.max_model_len,
            max_request_tokens=info.max_request_tokens,
            vocab_limit=info.vocab_limit,
            num_loops=info.num_loops,
            end_of_turn_ids=info.tokenizer.end_of_turn_ids(),
            max_prompt_chars=info.max_request_tokens * info.tokenizer.max_token_chars(),
        )
        self.tokenizer, self.grammars = info.tokenizer, info.grammars
        if self.state == "loading":
            self.state = "ready"
        self.metrics.ready = True
        logger.info(
            "model prepared in %.2fs (engine build %.2fs, first inference %.2fs); "
            "process start to ready %.2fs; serving %s from %s, %d KV blocks, max_model_len %d",
            info.load_seconds + info.warmup_seconds, info.load_seconds, info.warmup_seconds,
            time.time() - self.launch_epoch, ", ".join(self.config.model_names), info.model_dir,
            info.num_kv_blocks, info.max_model_len,
        )  # fmt: skip

    # ---- requests -----------------------------------------------------------------

    def token_text(self, token: int) -> str:
        """One token's text, special tokens spelled out (the `token` of an OpenAI logprob)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    async def off_loop(self, size: int, work):
        """work(), inline when `size` is small, else on the large-input thread (the loop serves meanwhile)."""
        if size <= _INLINE_SIZE:
            return work()
        return await self.loop.run_in_executor(self.heavy, work)

    async def encode(self, text: str) -> list[int]:
        """Token ids of a request's text; ApiError 400 for text that is not valid Unicode."""
        try:
            return await self.off_loop(len(text), lambda: self.tokenizer.encode(text))
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens spelled out (/detokenize)."""
        return await self.off_loop(len(ids), lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    async def compile_grammar(self, want) -> None:
        """Compile a request's grammar (a StructuredOutput) into the engine's cache on the large-input thread,
        so that the engine-owner thread finds it compiled; ApiError 400 for an invalid one."""
        if self.grammars.cached(want):  # a lookup: no thread hop for a grammar seen before
            return
        try:
            await self.loop.run_in_executor(self.heavy, self.grammars.compile, want)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except ImportError as e:
            raise ApiError(400, f"structured output needs xgrammar, which is not installed ({e})") from None

    def require_room(self, count: int) -> None:
        """429 unless `count` more requests fit the in-flight bound: a request's choices enter together."""
        if len(self.handles) + count > self.config.max_in_flight:
            self.metrics.rejected("overload")
            raise ApiError(429, f"the server is full ({len(self.handles)} requests in flight); retry later",
                           code="server_overloaded", retry_after=1)  # fmt: skip

    def submit(self, prompt_ids: list[int], params, transport) -> RequestHandle:
        """Admit a request (429 when full, 503 when not serving); its outputs arrive on the handle."""
        self.require_ready()
        if len(self.handles) >= self.config.max_in_flight:
            self.metrics.rejected("overload")
            raise ApiError(429, f"the server is full ({len(self.handles)} requests in flight); retry later",
                           code="server_overloaded", retry_after=1)  # fmt: skip
        key, self._next_key = self._next_key, self._next_key + 1
        # The payload is in place before the push: the ring's release/acquire publishes it.
        self.payloads[key] = (prompt_ids, params)
        if not self.ring.push(SUBMIT, key):
            del self.payloads[key]
            self.metrics.rejected("overload")
            raise ApiError(
                429, "the request ring is full; retry later", code="server_overloaded", retry_after=1
            )
        handle = RequestHandle(key, self.config.stream_buffer, transport, len(prompt_ids))
        self.handles[handle.request_id] = handle
        self.metrics.in_flight = len(self.handles)
        self.owner.wake()
        return handle

    def submit_choices(self, prompt_ids: list[int], params: list, transport) -> list[RequestHandle]:
        """Admit requests of one prompt (a request's choices) as one record, under consecutive keys: the
        engine queues them together and computes the prompt once for all (429 when full, 503 when not
        serving)."""
        self.require_ready()
        self.require_room(len(params))
        key, self._next_key = self._next_key, self._next_key + len(params)
        self.payloads[key] = (prompt_ids, list(params))  # a list: the owner's sign of a shared prompt
        if not self.ring.push(SUBMIT, key):
            del self.payloads[key]
            self.metrics.rejected("overload")
            raise ApiError(
                429, "the request ring is full; retry later", code="server_overloaded", retry_after=1
            )
        handles = [RequestHandle(key + j, self.config.stream_buffer, transport) for j in range(len(params))]
        self.handles.update((h.request_id, h) for h in handles)
        self.metrics.in_flight = len(self.handles)
        self.owner.wake()
        return handles

    def abort(self, handle: RequestHandle, reason: str) -> None:
        """Tell the engine to drop a request whose client is gone (idempotent; no-op once finished)."""
        if handle.finished or handle.abort_sent:
            return
        handle.abort_sent = True
        self.metrics.aborted(reason)
        self._push(ABORT, handle.key)

    def release(self, handle: RequestHandle) -> None:
        """The handler is done with handle; it stays counted until the engine has let it go."""
        handle.released = True
        if handle.finished:
            self._forget(handle)

    def _forget(self, handle: RequestHandle) -> None:
        self.handles.pop(handle.request_id, None)
        self.metrics.in_flight = len(self.handles)

    def _push(self, op: int, key: int) -> None:
        """Push a control record; a full ring keeps it in a backlog retried shortly, in order."""
        if self._backlog or not self.ring.push(op, key):
            self._backlog.append((op, key))
            self._schedule_retry()
        self.owner.wake()

    def _schedule_retry(self) -> None:
        if self._retry is None:
            self._retry = self.loop.call_later(_ABORT_RETRY_S, self._flush_backlog)

    def _flush_backlog(self) -> None:
        self._retry = None
        while self._backlog and self.ring.push(*self._backlog[0]):
            self._backlog.popleft()
        if self._backlog:
            self._schedule_retry()
        self.owner.wake()

    # ---- outputs ------------------------------------------------------------------

    def _post_threadsafe(self, batch: list, snapshot: EngineSnapshot) -> None:
        # A closed loop (late in shutdown) has nobody left to read these.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._dispatch, batch, snapshot)

    def _dispatch(self, batch: list, snapshot: EngineSnapshot) -> None:
        """Take in one owner iteration's outputs (runs on the loop); none once the watchdog failed it."""
        if self.state == "failed":
            return
        self.metrics.engine = snapshot
        self._route(batch)

    def _route(self, batch: list) -> None:
        """Route outputs to their requests' queues."""
        now = time.monotonic()
        tokens = 0
        for out in batch:
            handle = self.handles.get(out.request_id)
            if handle is None:
                continue
            if isinstance(out, Rejected):
                handle.finished = True
                self.metrics.rejected(_REJECTION_REASONS.get(out.status, "error"))
            else:
                tokens += self._account(handle, out, now)
            try:
                handle.queue.put_nowait(out)
            except asyncio.QueueFull:
                self._drop(handle)
            if handle.finished and handle.released:
                self._forget(handle)
        self.metrics.output_batch(tokens)

    def _account(self, handle: RequestHandle, out, now: float) -> int:
        """Time one output against its request; returns the tokens it carried."""
        n = len(out.new_token_ids)
        if n and handle.first_token_at is None:
            handle.first_token_at = now
            self.metrics.first_token(now - handle.arrival)
        if out.finished:
            handle.finished = True
            decode = None if handle.first_token_at is None else now - handle.first_token_at
            done = self.metrics.request_done
            done(out.finish_reason, out.prompt_tokens, out.completion_tokens, now - handle.arrival, decode)
            req = out.request
            if req is not None:
                times = (req.arrival, req.scheduled_time, req.first_token_time, req.finished_time)
                self.metrics.request_phases(*times)
        return n

    def _drop(self, handle: RequestHandle) -> None:
        """A client that stopped reading: abort its request and cut its connection at once."""
        if handle.dropped:
            return
        handle.dropped = True
        logger.warning(
            "request %s: the client fell %d steps behind; aborting it", handle.key, handle.queue.maxsize
        )
        self.abort(handle, "slow_client")
        if handle.transport is not None:
            # abort(), not close(): close() would wait for the client to read what is buffered.
            handle.transport.abort()

    # ---- shutdown -----------------------------------------------------------------

    async def drain(self, delay: float) -> None:
        """/health turns 503 while requests are still admitted for `delay` seconds (a ready server only)."""
        if self.state != "ready" or delay <= 0:
            return
        self.state = "draining"
        logger.info("shutdown: /health answers 503; still admitting requests for %.1fs", delay)
        await self._wait_unless_hurried(delay)

    def hurry(self) -> None:
        """End the drain and the grace period now (a second SIGINT/SIGTERM)."""
        if not self._hurried.is_set():
            logger.info("shutdown: a second stop signal: aborting requests in flight now")
            self._hurried.set()

    async def _wait_unless_hurried(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._hurried.wait(), seconds)

    async def shutdown(self, grace: float, join_timeout: float = 30.0) -> None:
        """Stop admitting; let requests finish for `grace` seconds; abort the rest; join the owner."""
        if self.state in ("loading", "ready", "draining"):
            self.state = "stopping"
        deadline = self.loop.time() + grace
        while self.handles and self.loop.time() < deadline and not self._hurried.is_set():
            await asyncio.sleep(0.02)
        if self.handles:
            logger.info("shutdown: aborting %d requests still in flight", len(self.handles))
            self.metrics.aborted("shutdown", len(self.handles))
            self._push(ABORT_ALL, 0)
            deadline = self.loop.time() + 5.0
            while any(not h.released for h in self.handles.values()) and self.loop.time() < deadline:
                await asyncio.sleep(0.02)
        self.owner.stop()
        if self.state == "failed":
            join_timeout = min(join_timeout, 1.0)  # a dead or stalled owner will not end in time
        self.heavy.shutdown(wait=False, cancel_futures=True)
        deadline = self.loop.time() + join_timeout
        while not self.owner.join(0) and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.owner.join(0):
            logger.info("shutdown: the engine owner thread has ended")
        else:
            logger.error("shutdown: the engine owner thread did not end within %.0fs", join_timeout)
