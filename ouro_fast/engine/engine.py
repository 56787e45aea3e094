"""The engine: requests in, one loop step at a time, text deltas out.

Only one thread (the engine owner) may call it. Each `step()` is
schedule -> execute -> update -> detokenize:
  LoopScheduler (compiled) picks the rows, ModelRunner runs one loop and decides
  exits, the scheduler applies them, the engine checks stop conditions and the
  IncrementalDetokenizer turns new tokens into text.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..model.checkpoints import default_model_dir
from ..model.config import OuroConfig
from ..model.exit_rule import log_one_minus
from ..model.ouro import OuroForCausalLM
from ..model.tokenizer import OuroTokenizer
from ..model.weights import load_config, load_weights
from .core import BlockTable, LoopScheduler
from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput, StepStats
from .runner import ModelRunner, RowSampling
from .sampling import SamplingParams

logger = logging.getLogger("ouro_fast")

# Per-step decode batches are small: tokenizers' thread pool costs more than it saves.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class EngineConfig:
    """How to build an Engine. `model` None serves the embedded tiny default (random weights)."""

    model: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    max_num_seqs: int = 64  # rows per step = requests holding KV
    max_num_batched_tokens: int = 512  # tokens per step (prefill chunks included)
    max_waiting: int = 1024  # requests queued beyond the running ones
    max_model_len: int | None = None  # default: the config's max_position_embeddings
    block_size: int = 16
    kv_cache_bytes: int | None = None  # default: 256 MiB on CPU, 85% of free memory on CUDA
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes
    refill: bool = True  # False: a batch drains to its slowest row before new rows join
    seed: int = 0
    keep_logits: bool = False  # keep each output token's logits (tests)
    runner: str = "auto"  # "torch" (reference), "triton" (kernels + CUDA graphs); auto: triton on CUDA
    cuda_graphs: bool = True  # capture decode steps (triton runner on CUDA)
    cpu_threads: int | None = 1  # torch threads on CPU (None: torch's default); leaves a core to HTTP
    run_ahead: bool = True  # triton runner: decode-only batches launch ahead of their exit read-back
    # Also at full depth, where it hides the host's per-step work instead of an exit read-back.
    run_ahead_full_depth: bool = True
    run_ahead_depth: int = 1  # launches queued ahead of the one whose records the host reads (1..3)
    # Triton runner on CUDA, bf16: one-token decode loops as one persistent launch (kernels/dataflow.py;
    # +1 copy of the layer weights). None: off while the tensor-core matmuls are on (kernels/tc_gemm.py:
    # their loop measured as fast at one token, 1.166 against 1.187 ms on the H200), else on where
    # supported; True: on, with a warning where unsupported; False: off.
    dataflow: bool | None = None


@dataclass
class Request:
    request_id: str
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    text: str = ""
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    exit_window: tuple[int, int, float] = (0, 0, 0.0)  # 0-based loops it may exit at, log(1 - q)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = cfg = config or EngineConfig(**overrides)
        t0 = time.monotonic()
        self.model_dir = Path(cfg.model) if cfg.model else default_model_dir()
        self.device = _pick_device(cfg.device)
        self.dtype = _pick_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        self.model_config: OuroConfig = load_config(self.model_dir)
        self.num_loops = self.model_config.total_ut_steps
        self.tokenizer = OuroTokenizer.from_dir(self.model_dir)
        self.model = self._load_model()
        self.vocab_limit = min(self.tokenizer.vocab_size, self.model_config.vocab_size)
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)  # fmt: skip
        self._build_kv_and_scheduler()
        self.detok = IncrementalDetokenizer(self.tokenizer.raw)
        self.requests: dict[str, Request] = {}
        self.by_rid: dict[int, Request] = {}
        self.pending: list[RequestOutput] = []  # finals of aborts, returned by the next step()
        self.ahead = self._build_run_ahead()
        self.stats = StepStats(num_loops=self.num_loops)
        self.load_seconds = time.monotonic() - t0
        logger.info(
            "engine ready in %.2fs: %s (%s, %s), %d KV blocks of %d tokens, max_model_len %d",
            self.load_seconds, self.model_dir, self.device, self.dtype, self.bt.num_blocks,
            cfg.block_size, self.max_model_len,
        )  # fmt: skip

    def _load_model(self) -> OuroForCausalLM:
        with torch.device("meta"):
            model = OuroForCausalLM(self.model_config)
        load_weights(model, self.model_dir, self.model_config, self.dtype, self.device)
        if self._runner_kind() == "triton":
            model.fuse()  # one qkv and one gate_up matmul per layer
            if self.config.dataflow is not False:
                self._attach_dataflow(model)
        return model.eval()

    def _attach_dataflow(self, model: OuroForCausalLM) -> None:
        # Before the KV pool is sized from free memory: the loop holds its own copy of the layer weights.
        from ..kernels import tc_gemm  # noqa: PLC0415 (triton only)
        from ..kernels.dataflow import DataflowLoop, supported  # noqa: PLC0415

        why = supported(self.model_config)
        if self.device.type != "cuda" or self.dtype != torch.bfloat16:
            why = "needs CUDA and bfloat16"
        elif torch.cuda.get_device_capability(self.device) < (9, 0):
            why = "measured only on Hopper (compute capability 9.0+)"  # TMA loads; not tuned elsewhere
        elif self.config.dataflow is None and tc_gemm.ENABLED:
            why = "the tensor-core matmuls are on (OURO_FAST_DATAFLOW=1 attaches it)"
        if why:  # asked for explicitly: a warning; by default: a note
            log = logger.warning if self.config.dataflow else logger.info
            log("dataflow decode loop off: %s", why)
            return
        model.dataflow = DataflowLoop(model)
        logger.info("dataflow decode loop on for one-token steps (%d streamers)", model.dataflow.streamers)

    def _runner_kind(self) -> str:
        kind = self.config.runner
        if kind == "auto":
            kind = "triton" if self.device.type == "cuda" else "torch"
        if kind not in ("torch", "triton"):
            raise ValueError(f"runner must be auto, torch or triton; got {kind!r}")
        return kind

    def _run_ahead_wanted(self) -> bool:
        cfg = self.config
        return cfg.run_ahead and cfg.refill and not cfg.keep_logits and self._runner_kind() == "triton"

    def _build_run_ahead(self):
        if not self._run_ahead_wanted():
            return None
        from .runahead import RunAhead

        return RunAhead(self)

    def _build_kv_and_scheduler(self) -> None:
        cfg, mc = self.config, self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
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
        max_blocks_per_seq = math.ceil(self.max_model_len / cfg.block_size)
        self.bt = BlockTable(num_blocks, cfg.block_size, self.num_loops, cfg.max_num_seqs, max_blocks_per_seq)
        self.scheduler = LoopScheduler(
            self.bt,
            cfg.max_num_seqs + cfg.max_waiting,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.refill,
        )
        n = self.scheduler_capacity = cfg.max_num_seqs + cfg.max_waiting
        self.sampling = RowSampling(
            temperature=np.ones(n, np.float32), top_p=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
            seed=np.full(n, -1, np.int64), num_outputs=np.zeros(n, np.int32),
        )  # fmt: skip
        if self._runner_kind() == "triton":
            from .gpu_runner import GpuModelRunner  # imports triton: only when asked for

            self.runner = GpuModelRunner(
                self.model, num_blocks, cfg.block_size, self.vocab_limit, self.device, cfg.max_num_seqs,
                cfg.max_num_batched_tokens, max_blocks_per_seq, self.max_model_len, cfg.seed, cfg.keep_logits,
                cfg.cuda_graphs,
            )  # fmt: skip
            self.runner.capture(lanes=self._run_ahead_wanted())
        else:
            self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, self.vocab_limit, self.device,
                                      cfg.seed, cfg.keep_logits)  # fmt: skip
        # Tokens one request can ever hold: the model limit, and what the pool fits at every loop.
        pool_tokens = num_blocks // self.num_loops * cfg.block_size
        self.max_request_tokens = min(self.max_model_len, pool_tokens)

    # ---- requests ------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Raises ValueError (a client error) or OverflowError (queue full)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.num_loops)
        self._check_prompt(prompt_ids, params)
        lo, hi, q = params.exit_policy(self.num_loops, self.model_config.early_exit_threshold)
        if q >= 1.0:
            lo = hi  # never exits early: no exit check (and no device sync) before the last loop
        cap = len(prompt_ids) + params.max_tokens
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        req = Request(request_id, -1, list(prompt_ids), params, eos | frozenset(params.stop_token_ids))
        req.exit_window = (lo - 1, hi - 1, log_one_minus(q))
        rid = self.scheduler.add(np.asarray(prompt_ids, dtype=np.int32), cap, lo, hi, req.exit_window[2])
        req.rid = rid
        try:
            s = self.sampling
            s.temperature[rid], s.top_p[rid] = params.temperature, params.top_p
            s.top_k[rid] = max(params.top_k, 0)
            s.seed[rid] = -1 if params.seed is None else params.seed
            s.num_outputs[rid] = 0
            self.detok.add(rid, req.prompt_ids, params.skip_special_tokens, params.stop)
        except Exception:
            self.scheduler.finish(rid)  # leave no half-registered request behind
            raise
        self.requests[request_id] = req
        self.by_rid[rid] = req
        if self.ahead is not None and self.ahead.active:
            self.ahead.arrive(rid)  # the device runs ahead of the scheduler: it picks the launch

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_limit for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_limit})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_request_tokens:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the {self.max_request_tokens} tokens one request may hold "
                f"(max_model_len {self.max_model_len}, KV pool {self.bt.num_blocks} blocks)"
            )

    def abort_request(self, request_id: str) -> None:
        """Drop a request now (between steps): its KV and row are freed, the next step() returns its final."""
        req = self.requests.get(request_id)
        if req is not None:
            self.pending.append(self._finish(req, "abort"))

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
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

    def step(self) -> list[RequestOutput]:
        """Run one loop for every scheduled row; return the outputs of requests with news."""
        outputs, self.pending = self.pending, []
        ahead = self.ahead
        t0 = time.perf_counter()
        if ahead is not None and ahead.active:
            outputs += ahead.step()
            if not ahead.handed_back:
                return outputs
            ahead.handed_back = False
            rows = self.scheduler.num_rows  # the run ended with this step, scheduled for the host path
        else:
            rows = self.scheduler.schedule()
            if rows and ahead is not None and ahead.eligible() and ahead.start():
                return outputs + ahead.step()
        if rows == 0:
            return outputs
        t1 = time.perf_counter()
        result = self.runner.execute(self.scheduler, self.bt.tables, self.sampling)
        t2 = time.perf_counter()
        events = self.scheduler.update(result.exited, result.sampled)
        t3 = time.perf_counter()
        outputs += self._apply_events(events, result)
        t4 = time.perf_counter()
        self.stats.record(self.scheduler, self.bt, events, t1 - t0 + t3 - t2, t2 - t1, t4 - t3)
        return outputs

    def _apply_events(self, events: int, result) -> list[RequestOutput]:
        s = self.scheduler
        new: dict[int, list[int]] = {}
        finished: dict[int, str] = {}
        now = time.monotonic()
        for e in range(events):
            rid, tok, loop = int(s.ev_rid[e]), int(s.ev_token[e]), int(s.ev_loop[e])
            req = self.by_rid[rid]
            req.output_ids.append(tok)
            req.exit_loops.append(loop)
            if req.first_token_time is None:
                req.first_token_time = now
            self.sampling.num_outputs[rid] += 1
            if result.logits is not None:
                req.logits.append(result.logits[self._row_of(rid)])
            if tok in req.eos_ids:
                finished[rid] = "stop"  # the stop token's text is never emitted
            else:
                new.setdefault(rid, []).append(tok)
                if s.ev_finished[e]:
                    finished[rid] = "length"
        deltas = self.detok.step(new) if new else {}
        outs = []
        for rid in set(new) | set(finished):
            req = self.by_rid[rid]
            delta, stop_hit = deltas.get(rid, ("", False))
            if stop_hit:
                finished[rid] = "stop"
            n_new = len(new.get(rid, ())) + (1 if finished.get(rid) == "stop" and not stop_hit else 0)
            if rid in finished:
                outs.append(
                    self._finish(
                        req, finished[rid], delta=delta, new_ids=req.output_ids[-n_new:] if n_new else []
                    )
                )
            else:
                req.text += delta
                outs.append(self._output(req, delta, req.output_ids[-n_new:], None))
        return outs

    def _row_of(self, rid: int) -> int:
        s = self.scheduler
        return int(np.flatnonzero(s.row_rid[: s.num_rows] == rid)[0])

    def _finish(
        self, req: Request, reason: str, error: str | None = None, delta: str = "", new_ids=()
    ) -> RequestOutput:
        self.scheduler.finish(req.rid)  # no-op when the scheduler already freed it (length cap)
        delta += self.detok.finish(req.rid)
        if reason == "length" and self.detok.stopped(req.rid):
            reason = "stop"  # the final flush revealed a stop string
        self.detok.remove(req.rid)
        req.text += delta
        del self.requests[req.request_id]
        del self.by_rid[req.rid]
        return self._output(req, delta, list(new_ids), reason, error)

    @staticmethod
    def _output(req: Request, delta: str, new_ids: list[int], reason: str | None, error: str | None = None):
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            exit_loops=req.exit_loops[len(req.exit_loops) - len(new_ids) :] if new_ids else [],
            error=error,
            request=req if reason is not None else None,
        )
