"""The engine: requests in, one loop step at a time, text deltas out.

Only one thread (the engine owner) may call it. Each `step()` is
schedule -> execute -> apply (engine/plan.py holds the contracts):
  the Scheduler emits a StepPlan, a runner (ReferenceRunner, or the GpuRunner of
  engine/gpu/) runs one loop and returns a StepResult, the Scheduler turns that into
  TokenEvents, and the engine checks stop conditions and turns tokens into text with
  the IncrementalDetokenizer. When run-ahead drives the batch (engine/gpu/), it
  hands each launch's StepResult to the same apply step.

Every request leaves through `_finish`, whatever ends it, and `requests` holds exactly the
requests that have not left. A step that raises ends the requests holding KV (`_fail_batch`);
a failure that belongs to one request (its sampling state, detokenization or output) ends that
request alone. Either way the others go on and the engine keeps serving.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..model.checkpoints import default_model_dir
from ..model.config import OuroConfig
from ..model.exit_rule import log_one_minus
from ..model.ouro import OuroForCausalLM
from ..model.quantization import check_quantization, has_fp8_weights, weight_bytes
from ..model.tokenizer import OuroTokenizer
from ..model.weights import load_config, load_generation_eos, load_weights
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .faults import FaultInjector, parse_faults
from .logits_processors import LogitsProcessors
from .outputs import StepOutput, StepStats
from .plan import StepPlan, StepResult, TokenEvents, TokenLogprobs
from .reference_runner import ReferenceRunner
from .sampling import SamplingParams
from .scheduler import FREE, WAITING, Scheduler
from .structured import GrammarCache, Grammars, encoded_vocab, grammar_compiler

logger = logging.getLogger("ouro_fast")

# Per-step decode batches are small: tokenizers' thread pool costs more than it saves.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Request:
    """One request as the engine tracks it; the finished one rides on its last StepOutput."""

    request_id: str
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs of each output token, when asked for
    prompt_logprobs: list = field(default_factory=list)  # per prompt token from the second on, when asked for
    text: str = ""
    arrival: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when the first step that ran its prompt began
    first_token_time: float | None = None
    finished_time: float | None = None
    exit_window: tuple[int, int, float] = (0, 0, 0.0)  # 0-based loops it may exit at, log(1 - q)


class Engine:
    """Requests in, one loop step at a time, outputs out. Only one thread (the engine owner) may call it."""

    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = cfg = config or EngineConfig(**overrides)
        t0 = time.monotonic()
        self.model_dir = Path(cfg.model) if cfg.model else default_model_dir()
        self.device = cfg.resolved_device()
        self.dtype = cfg.resolved_dtype(self.device)
        self.runner_kind = cfg.resolved_runner(self.device)
        self.kv_dtype = cfg.resolved_kv_dtype(self.dtype)
        old_gpu = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9)
        if self.kv_dtype != self.dtype and old_gpu:
            raise ValueError("kv_cache_dtype fp8 needs a GPU of compute capability 8.9+ (Ada, Hopper)")
        if self.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        self.model_config: OuroConfig = load_config(self.model_dir)
        self.num_loops = self.model_config.total_ut_steps
        self.tokenizer = OuroTokenizer.from_dir(self.model_dir)
        # What ends a reply, as vLLM reads it: the tokenizer's eos, generation_config.json's eos ids, and
        # config.json's where the checkpoint has no generation_config.json.
        generation_eos = load_generation_eos(self.model_dir) or self.model_config.eos_token_ids
        self.eos_ids = frozenset((self.tokenizer.eos_token_id, *generation_eos))
        self.model = self._load_model()
        self.vocab_limit = min(self.tokenizer.vocab_size, self.model_config.vocab_size)
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)  # fmt: skip
        self.scheduler = self._build_scheduler()
        self.scheduler.sampling.processors = LogitsProcessors(
            self.scheduler.capacity, self.config.max_num_seqs, self.vocab_limit, self.device
        )
        self.runner = self._build_runner()
        self.detok = IncrementalDetokenizer(self.tokenizer.raw)
        self.faults = self._build_faults()
        self.requests: dict[str, Request] = {}
        self.by_rid: dict[int, Request] = {}
        # Live shared-prompt prefixes (scheduler rids): the requests that take their prompt logprobs.
        self.prefixes: dict[int, list[Request]] = {}
        self.pending: list[
            StepOutput
        ] = []  # outputs not handed out yet: the next step() or abort_all() returns them
        self.ahead = self._build_run_ahead()
        # Requests never scheduled yet, oldest first (admission is in arrival order): queue_timeout's watch.
        self.unstarted: dict[str, float] = {}
        self.stats = StepStats(num_loops=self.num_loops)
        self.grammar_cache = self._prepare_grammars()
        self.load_seconds = time.monotonic() - t0
        logger.info(
            "engine ready in %.2fs: %s (%s, %s%s), weights %.2f GiB, %d KV blocks of %d tokens (%s), "
            "max_model_len %d",
            self.load_seconds, self.model_dir, self.device, self.dtype,
            f", {self.quantization} weights" if self.quantization else "", self.weight_bytes / 2**30,
            self.scheduler.num_blocks, cfg.block_size, str(self.kv_dtype).removeprefix("torch."),
            self.max_model_len,
        )  # fmt: skip

    # ---- construction ----------------------------------------------------------

    def _load_model(self) -> OuroForCausalLM:
        scheme = self.config.quantization
        check_quantization(scheme)
        cuda = self.device.type == "cuda"
        old_gpu = cuda and torch.cuda.get_device_capability(self.device) < (8, 9)
        if scheme == "fp8" and old_gpu:
            raise ValueError("quantization fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper)")
        with torch.device("meta"):
            model = OuroForCausalLM(self.model_config)
        load_weights(model, self.model_dir, self.model_config, self.dtype, self.device)
        if self.runner_kind == "triton":
            model.fuse()  # one qkv and one gate_up matmul per layer
        model.quantize(scheme)
        # A checkpoint stored in FP8 is served in FP8 without the option.
        self.quantization = "fp8" if has_fp8_weights(model) else None
        if self.quantization and old_gpu:
            raise ValueError(
                f"{self.model_dir} holds FP8 weights: they need a GPU of compute capability 8.9+"
            )
        if cuda:
            torch.cuda.empty_cache()  # the replaced weights' memory goes to the KV cache
        self.weight_bytes = weight_bytes(model)
        return model.eval()

    def _run_ahead_wanted(self) -> bool:
        cfg = self.config
        return cfg.run_ahead and cfg.refill and not cfg.keep_logits and self.runner_kind == "triton"

    def _build_scheduler(self) -> Scheduler:
        cfg, mc = self.config, self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        block_bytes = 2 * mc.num_hidden_layers * cfg.block_size * mc.num_key_value_heads * mc.head_dim * elem
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            budget = cfg.kv_cache_bytes
            if budget is None:
                budget = (
                    256 << 20
                    if self.device.type == "cpu"
                    else int(torch.cuda.mem_get_info(self.device)[0] * 0.85)
                )
            num_blocks = budget // block_bytes
        if num_blocks < self.num_loops:
            raise ValueError(f"the KV budget holds {num_blocks} blocks: fewer than one token at every loop")
        self.block_bytes = block_bytes
        self.max_blocks_per_seq = math.ceil(self.max_model_len / cfg.block_size)
        # Tokens one request can ever hold: the model limit, and what the pool fits at every loop.
        self.max_request_tokens = min(self.max_model_len, num_blocks // self.num_loops * cfg.block_size)
        return Scheduler(
            num_blocks, cfg.block_size, self.num_loops, cfg.max_num_seqs, cfg.max_waiting,
            cfg.max_num_batched_tokens, self.max_blocks_per_seq, cfg.refill, cfg.enable_prefix_caching,
        )  # fmt: skip

    def _build_runner(self):
        cfg, num_blocks = self.config, self.scheduler.num_blocks
        if self.runner_kind == "torch":
            return ReferenceRunner(self.model, num_blocks, cfg.block_size, self.vocab_limit, self.device,
                                   cfg.seed, cfg.keep_logits, self.kv_dtype)  # fmt: skip
        from .gpu import GpuRunner  # imports triton: only when asked for

        runner = GpuRunner(
            self.model, num_blocks, cfg.block_size, self.vocab_limit, self.device, cfg.max_num_seqs,
            cfg.max_num_batched_tokens, self.max_blocks_per_seq, self.max_model_len, cfg.seed,
            cfg.keep_logits, cfg.cuda_graphs, cfg.cascade_attention, self.kv_dtype,
        )  # fmt: skip
        runner.capture(lanes=self._run_ahead_wanted(), compile_threads=cfg.compile_threads)
        return runner

    def _build_faults(self) -> FaultInjector:
        faults = FaultInjector(parse_faults(self.config.test_faults))
        if faults.stages:
            logger.warning("TEST-ONLY fault injection is on (test_faults=%r): never in production",
                           self.config.test_faults)  # fmt: skip
            self.detok.fault_hook = lambda rid: faults.fire("detokenize", (self.by_rid[rid],))
            processors = self.scheduler.sampling.processors
            processors.fault_hook = lambda rid: faults.fire("sample", (self.by_rid[rid],))
        return faults

    def _build_run_ahead(self):
        if not self._run_ahead_wanted():
            return None
        from .gpu import RunAhead

        full, depth = self.config.run_ahead_full_depth, self.config.run_ahead_depth
        return RunAhead(self.scheduler, self.runner, self.by_rid, full, depth)

    # ---- requests ------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Raises ValueError (a client error) or OverflowError (queue full)."""
        self._queue(request_id, prompt_ids, params or SamplingParams())

    def add_requests(
        self, request_ids: list[str], prompt_ids: list[int], params: list[SamplingParams]
    ) -> None:
        """Queue requests of one prompt (a request's n choices) that share its KV: the prompt's whole
        blocks before its last token are computed once, each request computes the rest and samples on
        its own. All or none: ValueError (a client error) or OverflowError (queue full) queues nothing."""
        if len(params) != len(request_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("add_requests takes distinct request ids, one SamplingParams each")
        for p in params:
            p.validate(self.num_loops)
            self._check_prompt(prompt_ids, p)
        shared = self._shared_len(prompt_ids) if len(request_ids) > 1 else 0
        prefix, added = -1, []
        try:
            if shared:
                prefix = self._add_prefix(prompt_ids, shared, params)
            for request_id, p in zip(request_ids, params):
                added.append(self._queue(request_id, prompt_ids, p, prefix))
        except Exception:
            if prefix >= 0:
                self.scheduler.finish(prefix)  # its requests would compute alone: they end below
                self._forget_prefix(prefix)
            for req in added:
                self._finish(req, "abort")
            raise
        if prefix >= 0:
            self.prefixes[prefix] += [r for r in added if r.params.prompt_logprobs is not None]

    def _shared_len(self, prompt_ids: list[int]) -> int:
        """Tokens of a prompt that requests may share: whole blocks, short of its last token."""
        return (len(prompt_ids) - 1) // self.config.block_size * self.config.block_size

    def _add_prefix(self, prompt_ids: list[int], shared: int, params: list[SamplingParams]) -> int:
        """The scheduler's prefix request of a shared prompt; it computes the prompt logprobs its
        first `shared` positions give, for every request that asks for them."""
        wanted = [p.prompt_logprobs for p in params if p.prompt_logprobs is not None]
        # Prompt logprobs come from computing the positions: a prefix that reports them reuses no cache.
        prefix = self.scheduler.add_prefix(np.asarray(prompt_ids[:shared], dtype=np.int32), not wanted)
        self._forget_prefix(prefix)
        s = self.scheduler.sampling
        s.prompt_logprobs[prefix] = max(wanted, default=-1)
        s.prompt_done[prefix] = 0
        if wanted:
            s.prompts[prefix] = np.asarray(prompt_ids, np.int32)
        self.prefixes[prefix] = []
        if self.ahead is not None and self.ahead.active:
            self.ahead.arrive(prefix)  # held until the device's run hands the batch back
        return prefix

    def _forget_ended_prefixes(self) -> None:
        for rid in [p for p in self.prefixes if self.scheduler.core.status(p) == FREE]:
            self._forget_prefix(rid)

    def _forget_prefix(self, rid: int) -> None:
        """A prefix rid is gone (or taken again): drop what the engine kept for it."""
        if self.prefixes.pop(rid, None) is not None:
            self.scheduler.sampling.prompts.pop(rid, None)
            self.scheduler.sampling.prompt_logprobs[rid] = -1

    def _queue(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefix: int = -1
    ) -> Request:
        """Register and queue one request (on a shared prompt's prefix rid, if not -1); returns it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.num_loops)
        self._check_prompt(prompt_ids, params)
        lo, hi, q = params.exit_policy(self.num_loops, self.model_config.early_exit_threshold)
        if params.prompt_logprobs is not None:
            lo = hi = (
                self.num_loops
            )  # prompt logprobs come from the prompt's last loop: no token may end it sooner
        if q >= 1.0:
            lo = hi  # never exits early: no exit check (and no device sync) before the last loop
        cap = len(prompt_ids) + params.max_tokens
        eos = frozenset() if params.ignore_eos else self.eos_ids
        req = Request(request_id, -1, list(prompt_ids), params, eos | frozenset(params.stop_token_ids))
        req.exit_window = (lo - 1, hi - 1, log_one_minus(q))
        rid = self.scheduler.add(
            np.asarray(prompt_ids, dtype=np.int32), cap, lo, hi, req.exit_window[2], prefix,
            params.prompt_logprobs is None,  # prompt logprobs come from computing every position
        )  # fmt: skip
        req.rid = rid
        self._forget_prefix(rid)
        try:
            s = self.scheduler.sampling
            s.temperature[rid], s.top_p[rid] = params.temperature, params.top_p
            s.top_k[rid] = max(params.top_k, 0)
            s.seed[rid] = -1 if params.seed is None else params.seed
            s.num_outputs[rid] = 0
            s.logprobs[rid] = -1 if params.logprobs is None else params.logprobs
            s.min_p[rid] = params.min_p
            s.prompt_logprobs[rid] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
            s.prompt_done[rid] = 0 if prefix < 0 else self._shared_len(prompt_ids)  # the prefix reports those
            if params.prompt_logprobs is not None:
                s.prompts[rid] = np.asarray(req.prompt_ids, np.int32)
            s.processors.add(rid, params, req.prompt_ids, req.output_ids, req.eos_ids)
            if params.structured is not None:
                self._grammars().add(rid, params.structured)  # ValueError: an invalid schema or regex
            self.detok.add(rid, req.prompt_ids, params.skip_special_tokens, params.stop,
                           params.include_stop_str_in_output)  # fmt: skip
        except Exception:
            self._forget_rid(rid)  # leave no half-registered request behind
            raise
        self.requests[request_id] = req
        self.by_rid[rid] = req
        if self.config.queue_timeout is not None:
            self.unstarted[request_id] = req.arrival
        if prefix < 0 and self.ahead is not None and self.ahead.active:
            self.ahead.arrive(rid)  # the device runs ahead of the scheduler: it picks the launch
        return req

    def _prepare_grammars(self) -> GrammarCache:
        """Structured output's compiled grammars, their compiler being built on a thread of its own
        (xgrammar's import and the vocabulary's preprocessing take a second or more), so that the first
        request with a grammar does not stall every step in flight. Where xgrammar is not installed, the
        first use tries the build and raises its ImportError. Started last: it touches no GPU, and no CUDA
        graph is being captured by then."""
        stops = self.eos_ids | frozenset(self.tokenizer.end_of_turn_ids())
        args = (encoded_vocab(self.tokenizer), self.model_config.vocab_size, stops)
        if importlib.util.find_spec("xgrammar") is None:
            return GrammarCache(None, lambda: grammar_compiler(*args))
        done: Future = Future()

        def build() -> None:
            try:
                done.set_result(grammar_compiler(*args))
            except BaseException as e:  # handed to the first request that needs it
                done.set_exception(e)

        threading.Thread(target=build, name="ouro-grammar-prep", daemon=True).start()
        return GrammarCache(done)

    def _grammars(self) -> Grammars:
        """Structured output's state, on the first request that asks for it: the compiler built since the
        engine started (waited for if still building); a grammar may end at every eos and at the chat
        template's end of turn."""
        s = self.scheduler.sampling
        if s.grammars is None:
            s.grammars = Grammars(self.grammar_cache, self.model_config.vocab_size, self.scheduler.capacity,
                                  self.device)  # fmt: skip
        return s.grammars

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_limit for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_limit})")
        if any(t >= self.vocab_limit for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must be below {self.vocab_limit}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_request_tokens:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the {self.max_request_tokens} tokens one request may hold "
                f"(max_model_len {self.max_model_len}, KV pool {self.scheduler.num_blocks} blocks)"
            )

    def abort_request(self, request_id: str) -> None:
        """Drop a request now (between steps): its KV and row are freed, the next step() returns its final."""
        req = self.requests.get(request_id)
        if req is not None:
            self.pending.append(self._finish(req, "abort"))

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[StepOutput]:
        """End every request (engine failure or shutdown); returns their final outputs."""
        outs = [self._finish(req, reason, error) for req in list(self.requests.values())]
        outs, self.pending = self.pending + outs, []
        if self.ahead is not None:
            self.ahead.reset()  # its launches in flight belong to requests that no longer exist
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pending) or (self.ahead is not None and self.ahead.active)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the step --------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one loop for every scheduled row; return the outputs of requests with news.

        A step that raises ends the requests it touched with finish_reason "error" (`_fail_batch`)
        and returns normally; `stats.failed_steps` counts such steps. Every output is queued in
        `pending` as soon as it exists, and handed out only when the step returns: should even the
        failure handling raise, nothing is lost, and abort_all() returns them with the others."""
        try:
            self._expire_unstarted()
            self._advance()
        except Exception as e:
            self._fail_batch(e)
        outputs, self.pending = self.pending, []
        return outputs

    def _fail_batch(self, e: Exception) -> None:
        """End the requests a failed step touched: those holding KV (the step's rows, and any whose
        K/V copies rode on it), or, while run-ahead drives the device, every request."""
        why = f"the engine step failed: {type(e).__name__}: {e}"
        logger.error("%s: ending the requests holding KV", why, exc_info=e)
        self.stats.failed_steps += 1
        self.stats.last_failure = why
        self.scheduler.sampling.processors.take_failed()  # requests of the failed batch: ended below
        ahead = self.ahead is not None and self.ahead.active
        hit = [r for r in self.requests.values() if ahead or self.scheduler.holds_kv(r.rid)]
        for req in hit:
            self.pending.append(self._finish(req, "error", why))
        if ahead:
            self.ahead.reset()

    def _fire(self, stage: str, rids: np.ndarray) -> None:
        """Test-only: the fault injector's turn at a batch stage, over the step's requests."""
        if stage in self.faults.stages:
            self.faults.fire(stage, [self.by_rid[r] for r in rids.tolist() if r in self.by_rid])

    def _expire_unstarted(self) -> None:
        """End the requests that waited queue_timeout seconds without being scheduled ("abort", with why)."""
        if not self.unstarted or (self.ahead is not None and self.ahead.active):
            return  # run-ahead seats its arrivals itself: they are never left waiting for long
        timeout, now, status = self.config.queue_timeout, time.monotonic(), self.scheduler.core.status
        while self.unstarted:
            request_id, arrival = next(iter(self.unstarted.items()))
            req = self.requests.get(request_id)
            if req is not None and status(req.rid) == WAITING:
                if now - arrival < timeout:
                    return  # the rest arrived later
                error = f"the request waited {timeout:g} s in the queue without being scheduled"
                self.pending.append(self._finish(req, "abort", error))
            del self.unstarted[request_id]  # expired, finished, or started (started ones never wait again)

    def _advance(self) -> None:
        ahead = self.ahead
        t0 = time.perf_counter()
        if ahead is not None and ahead.active:
            plan = ahead.step(self._apply)
            if plan is None:
                return  # the device still drives the batch, or nothing is left to run
        else:
            if ahead is not None:
                ahead.hold_for_start()
            plan = self.scheduler.schedule()
            if plan is None and ahead is not None and ahead.release_holds():
                plan = self.scheduler.schedule()
            if plan is None:
                return
            self._fire("schedule", plan.rid)
            if ahead is not None and ahead.eligible(plan) and ahead.start(plan):
                ahead.step(self._apply)
                return
        t1 = time.perf_counter()
        self._fire("execute", plan.rid)
        result = self.runner.execute(plan)
        self._apply(plan, result, t1 - t0, time.perf_counter() - t1)

    def _apply(self, plan: StepPlan, result: StepResult, host_s: float, model_s: float) -> None:
        """The scheduler takes a step's result; new tokens become outputs (stop conditions, text)."""
        t0 = time.perf_counter()
        self._mark_scheduled(plan, time.monotonic() - host_s - model_s)
        failed = self.scheduler.sampling.processors.take_failed()  # rid -> why its sampling state failed
        for rid, entries in (result.prompt_logprobs or {}).items():
            sharers = self.prefixes.get(rid)
            for req in (self.by_rid[rid],) if sharers is None else sharers:
                req.prompt_logprobs.extend(_top(lp, req.params.prompt_logprobs) for _, lp in entries)
        self._fire("update", plan.rid)
        events = self.scheduler.update(result)
        self._forget_ended_prefixes()  # computed: their requests hold their blocks
        t1 = time.perf_counter()
        self._outputs(events, plan, result, failed)
        if self.scheduler.sampling.grammars is not None:
            self.scheduler.sampling.grammars.start_fill()  # the next tokens' bitmasks, while the host goes on
        self.stats.record(plan, events, self.scheduler, host_s + t1 - t0, model_s, time.perf_counter() - t1)

    def _mark_scheduled(self, plan: StepPlan, began: float) -> None:
        # A request is scheduled by the first step that runs its prompt (vLLM's queue/prefill split).
        for rid in plan.rid[plan.decode == 0].tolist():
            req = self.by_rid.get(rid)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = began

    def _outputs(self, events: TokenEvents, plan: StepPlan, result: StepResult, failed: dict[int, str]):
        """Queue each request's news of the step. A request whose own part fails (its sampling state,
        tokens, text or output; `failed`: rid -> why) ends alone with an error; the others go on."""
        news: dict[int, list[tuple[int, int, int]]] = {}
        for rid, tok, loop, fin in zip(
            events.rid.tolist(), events.token.tolist(), events.loop.tolist(), events.finished.tolist()
        ):
            news.setdefault(rid, []).append((tok, loop, fin))
        new: dict[int, list[int]] = {}
        finished: dict[int, str] = {}
        now = time.monotonic()
        for rid, toks in news.items():
            if rid not in failed:
                try:
                    self._take_tokens(self.by_rid[rid], toks, plan, result, now, new, finished)
                except Exception as e:
                    failed[rid] = _why("taking its tokens", e)
        new = {rid: ids for rid, ids in new.items() if rid not in failed}
        broken: dict[int, Exception] = {}
        deltas = self.detok.step(new, broken) if new else {}
        failed.update((rid, _why("detokenizing", e)) for rid, e in broken.items())
        for rid in (set(new) | set(finished)) - set(failed):
            req = self.by_rid[rid]
            delta, stop_hit = deltas.get(rid, ("", False))
            if stop_hit:
                finished[rid] = "stop"
            n_new = len(new.get(rid, ())) + (1 if finished.get(rid) == "stop" and not stop_hit else 0)
            new_ids = req.output_ids[-n_new:] if n_new else []
            if rid in finished:
                self.pending.append(self._finish(req, finished[rid], delta=delta, new_ids=new_ids))
                continue
            try:
                out = self._output(req, delta, new_ids, None)
            except Exception as e:
                failed[rid] = _why("building its output", e)
                continue
            req.text += delta
            self.pending.append(out)
        for rid, why in failed.items():
            if rid in self.by_rid:
                logger.error("request %s failed alone: %s", self.by_rid[rid].request_id, why)
                self.pending.append(self._finish(self.by_rid[rid], "error", why))

    def _take_tokens(self, req: Request, toks, plan, result, now: float, new: dict, finished: dict) -> None:
        """Record a request's sampled tokens (ids, exit loops, logits, logprobs) and its stop conditions."""
        rid = req.rid
        for tok, loop, fin in toks:
            req.output_ids.append(tok)
            req.exit_loops.append(loop)
            if req.first_token_time is None:
                req.first_token_time = now
            self.scheduler.sampling.num_outputs[rid] += 1
            if result.logits is not None:
                req.logits.append(result.logits[int(np.flatnonzero(plan.rid == rid)[0])])
            if req.params.logprobs is not None:
                req.logprobs.append(result.logprobs[rid])
            if tok in req.eos_ids:
                finished[rid] = "stop"  # the stop token's text is never emitted
            else:
                new.setdefault(rid, []).append(tok)
                if fin:
                    finished[rid] = "length"
            if req.params.structured is not None:
                self._follow_grammar(rid, tok, new, finished)

    def _follow_grammar(self, rid: int, tok: int, new: dict, finished: dict) -> None:
        """Advance rid's grammar by its token: a token that ends the grammar is a stop token (its text never
        emitted). ValueError for one the grammar rejects (never sampled under its mask)."""
        grammars = self.scheduler.sampling.grammars
        if not grammars.accept(rid, tok):
            raise ValueError(f"token {tok} does not match the request's structured output")
        if grammars.complete(rid) and finished.get(rid) != "stop":
            new[rid].pop()
            finished[rid] = "stop"

    def _finish(
        self, req: Request, reason: str, error: str | None = None, delta: str = "", new_ids=()
    ) -> StepOutput:
        """The one way out for a request, whatever ends it: frees its KV and its sampling and detokenizer
        state, forgets it, and returns its final output. Once it has freed the KV it cannot raise: a
        failing flush or output makes the final an error."""
        req.finished_time = time.monotonic()
        self._forget_rid(req.rid, detok=False)  # its text is flushed next
        if self.prefixes:
            self._forget_ended_prefixes()  # a prefix ends with the last request on it
        try:
            delta += self.detok.finish(req.rid)
            if reason == "length" and self.detok.stopped(req.rid):
                reason = "stop"  # the final flush revealed a stop string
        except Exception as e:
            reason, error = "error", error or _why("detokenizing", e)
        self.detok.remove(req.rid)
        req.text += delta
        try:
            out = self._output(req, delta, list(new_ids), reason, error)
        except Exception as e:
            out = _error_final(req, error or _why("building its output", e))
        del self.requests[req.request_id]
        del self.by_rid[req.rid]
        self.faults.forget(req.request_id)
        return out

    def _forget_rid(self, rid: int, detok: bool = True) -> None:
        """Free what a rid holds outside the engine's maps: its KV, its sampling state and its detokenizer."""
        self.scheduler.finish(rid)  # no-op when the scheduler already freed it (length cap)
        self.scheduler.sampling.processors.remove(rid)
        if self.scheduler.sampling.grammars is not None:
            self.scheduler.sampling.grammars.remove(rid)
        self.scheduler.sampling.prompts.pop(rid, None)
        if detok:
            self.detok.remove(rid)

    def _output(self, req: Request, delta: str, new_ids: list[int], reason: str | None, error=None):
        self.faults.fire("output", (req,))
        n = len(new_ids)
        return StepOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=self.scheduler.cached_tokens(req.rid),
            exit_loops=req.exit_loops[len(req.exit_loops) - n :] if n else [],
            logprobs=req.logprobs[len(req.logprobs) - n :] if n and req.logprobs else None,
            error=error,
            request=req if reason is not None else None,
        )


def _why(what: str, e: Exception) -> str:
    return f"{what} failed: {type(e).__name__}: {e}"


def _error_final(req: Request, error: str) -> StepOutput:
    """A final that building cannot fail: no text, no logprobs."""
    n_prompt, n_out = len(req.prompt_ids), len(req.output_ids)
    return StepOutput(req.request_id, [], "", True, "error", n_prompt, n_out, [], error)


def _top(lp: TokenLogprobs, k: int) -> TokenLogprobs:
    """A prompt token's log-probabilities with only the k likeliest others (a shared prefix computes the most
    any of its requests asks for)."""
    if len(lp.top_ids) <= k:
        return lp
    return TokenLogprobs(lp.logprob, lp.rank, lp.top_ids[:k], lp.top_logprobs[:k])
