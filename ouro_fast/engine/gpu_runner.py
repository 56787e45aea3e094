"""The fast runner: Triton kernels, static device buffers, and CUDA graphs.

Same contract as ModelRunner.execute (and tested against it). Every step's inputs
are packed on the host into pinned buffers and copied to the device in two
transfers; the tensors the kernels read are fixed views into one device buffer.
A step runs padded to a power-of-two shape (rows, tokens, longest row), padding
rows and tokens doing nothing, so a few CUDA graphs cover every step (step_shape):
decode steps by row count; steps that carry a prompt chunk by token count alone
(at least PREFILL_MIN_ROWS rows, longest row = the token bucket; token buckets are powers
of two and, above 64, 9/16, 5/8 and 3/4 of each). All are captured
at start-up (up to MAX_GRAPHS; a shape beyond runs eagerly at the same padding), so
no request waits for a capture. The hidden states and exit statistics carried
between steps live in static buffers indexed by token.
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np
import torch

from ..kernels import propagate_kv
from ..kernels.exit_gate import gate_log_survival
from ..kernels.precompile import precompile
from ..model.exit_rule import exit_mask
from ..model.fast_loop import run_loop_fused
from ..model.ouro import OuroForCausalLM
from ..model.triton_attention import TritonBatch, TritonPagedAttention
from .lanes import DecodeLanes
from .runner import RowSampling, StepResult, allocate_kv_cache, sample_exited

logger = logging.getLogger("ouro_fast")

MAX_GRAPHS = 48  # captured (rows, tokens, max_q_len) shapes; steps beyond run eagerly at the same padding
# Rows of a step that carries a prompt chunk: padding rows cost an empty attention program and a
# gate row each, and one row bucket keeps the prefill graphs to one per token bucket.
PREFILL_MIN_ROWS = 64
# Token buckets above 64 tokens, in sixteenths of the next power of two, from OURO_FAST_TOKEN_BUCKETS
# (A/B runs; "12:16" gives the midpoints and powers alone). The last must be 16: the power itself.
BUCKET_SIXTEENTHS = tuple(
    sorted(int(v) for v in os.environ.get("OURO_FAST_TOKEN_BUCKETS", "9:10:12:16").split(":"))
)
if not (BUCKET_SIXTEENTHS[-1] == 16 and BUCKET_SIXTEENTHS[0] > 8):
    raise ValueError(f"OURO_FAST_TOKEN_BUCKETS: sixteenths in 9..16 ending with 16, got {BUCKET_SIXTEENTHS}")


def step_shape(rows: int, tokens: int, max_len: int, max_rows: int, max_tokens: int) -> tuple[int, int, int]:
    """The padded (rows, tokens, max_q_len) a step runs at: powers of two (capped by the buffers).
    Decode steps (max_len 1) keep their row bucket; steps with a prompt chunk are padded to at
    least PREFILL_MIN_ROWS rows and to a longest row of the whole token bucket."""
    if max_len <= 1:
        r_b = min(_pow2(rows), max_rows)
        return r_b, min(max(_pow2(tokens), r_b), max_tokens), 1
    r_b = min(max(_pow2(rows), PREFILL_MIN_ROWS), max_rows, max_tokens)
    n_b = min(max(_token_bucket(tokens), r_b), max_tokens)
    return r_b, n_b, n_b


def _token_bucket(n: int) -> int:
    """Tokens a step with a prompt chunk is padded to: powers of two up to 64, then the smallest of
    9/16, 5/8, 3/4 and 1 times the next power of two that holds n, so padding adds at most a third.
    A 128-token prompt with eight decode lanes (concurrency 8) runs at 144 tokens, not 192 or 256: a
    rider loop takes 1.725 ms there against 1.817 at 192 (H200; docs/benchmarks.md, nineteenth session)."""
    p = _pow2(n)
    if p <= 64:
        return p
    return next(p * f // 16 for f in BUCKET_SIXTEENTHS if n <= p * f // 16)


def _token_buckets(max_tokens: int) -> set[int]:
    """Every value _token_bucket takes up to max_tokens, and max_tokens itself."""
    pows = [1 << i for i in range(max_tokens.bit_length() + 1)]
    subs = {p * f // 16 for p in pows if p > 64 for f in BUCKET_SIXTEENTHS}
    return {b for b in set(pows) | subs if b < max_tokens} | {max_tokens}


def decode_shapes(max_rows: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """Every shape step_shape gives a decode step (one token a row), fewest rows first."""
    rows = _buckets(min(max_rows, max_tokens))
    return sorted({step_shape(r, r, 1, max_rows, max_tokens) for r in rows})


def prefill_shapes(max_rows: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """Every shape step_shape gives a step with a prompt chunk, fewest tokens first."""
    rows = _buckets(max_rows)
    toks = {t for t in _token_buckets(max_tokens) if t > 1}
    shapes = {step_shape(r, t, 2, max_rows, max_tokens) for r in rows for t in toks if r <= t}
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def _buckets(cap: int) -> set[int]:
    # A representative of every bucket up to cap: the powers of two below it, and cap itself.
    return {1 << i for i in range(cap.bit_length()) if 1 << i < cap} | {cap}


class _Staging:
    """Pinned host arrays mirrored by device views; filled per step, copied in one transfer each.

    Two host buffers alternate, each guarded by an event, so a step can be filled
    while the previous step's copy may still be in flight (steps that need no exit
    flags are launched without waiting for the device).
    """

    def __init__(self, layout: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        sizes = {k: math.prod(s) for k, s in layout.items()}
        total = sum(sizes.values())
        pin = device.type == "cuda"
        self.hosts = [torch.zeros(total, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.device = torch.zeros(total, dtype=dtype, device=device)
        self.views, self.dev, self.offset, off = [{}, {}], {}, {}, 0
        for k, shape in layout.items():
            for host, views in zip(self.hosts, self.views):
                views[k] = host.numpy()[off : off + sizes[k]].reshape(shape)
            self.dev[k] = self.device[off : off + sizes[k]].view(shape)
            self.offset[k] = off
            off += sizes[k]
        self.cur = 0

    def begin(self) -> dict[str, np.ndarray]:
        """Switch to the other host buffer once its last copy is done; returns its arrays."""
        self.cur ^= 1
        if self.events[self.cur] is not None:
            self.events[self.cur].synchronize()
        return self.views[self.cur]

    def upload(self, size: int | None = None) -> None:
        """Copy the first `size` elements (all by default) to the device."""
        size = self.device.numel() if size is None else size
        self.device[:size].copy_(self.hosts[self.cur][:size], non_blocking=True)
        if self.events[self.cur] is not None:
            self.events[self.cur].record()


class GpuModelRunner:
    def __init__(
        self,
        model: OuroForCausalLM,
        num_blocks: int,
        block_size: int,
        vocab_limit: int,
        device: torch.device,
        max_rows: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        seed: int = 0,
        keep_logits: bool = False,
        use_graphs: bool = True,
    ):
        from .sampling import Sampler

        cfg = model.config
        self.model, self.cfg, self.device = model, cfg, device
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        self.kv_cache = allocate_kv_cache(cfg, num_blocks * block_size, dtype, device)
        self.attn = TritonPagedAttention(self.kv_cache, block_size, cfg.rope_theta, max_model_len)
        self.sampler = Sampler(vocab_limit, device, seed, fused=True)
        self.keep_logits = keep_logits
        self.use_graphs = use_graphs and device.type == "cuda"
        r, n, mb = max_rows, max_tokens, max_blocks_per_seq
        self.max_rows, self.max_tokens = r, n
        tok, row = (n,), (r,)
        i64 = {"ids": tok, "pos": tok, "slot": tok, "hsrc": tok, "last": row, "prev_last": row, "store": row}
        self.i64 = _Staging(i64, torch.int64, device)
        self.i32 = _Staging(
            {"q_start": row, "len": row, "tok_off": row, "loop": row, "lo": row, "hi": row, "log1mq": row,
             "bt": (r, mb)}, torch.int32, device,
        )  # fmt: skip
        self.h_prev = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.ls_prev = torch.zeros(n + 1, dtype=torch.float32, device=device)
        self.exits = torch.zeros(r, dtype=torch.bool, device=device)
        self.x_last = torch.zeros(r, cfg.hidden_size, dtype=dtype, device=device)
        self.prop: _Staging | None = None  # propagation pairs (src half, dst half), sized on first use
        self.prop_half = 0
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.lanes = DecodeLanes(self, max_rows, cfg.total_ut_steps, max_blocks_per_seq, seed)

    # ---- inputs ----------------------------------------------------------------

    def _fill(self, sched, tables: np.ndarray, rows: int, tokens: int) -> None:
        """Write the step's inputs into the pinned buffers, padding up to `rows`/`tokens`."""
        r, n = sched.num_rows, sched.num_step_tokens
        a, b = self.i64.begin(), self.i32.begin()
        a["ids"][:n], a["pos"][:n] = sched.token_ids[:n], sched.positions[:n]
        a["slot"][:n], a["hsrc"][:n] = sched.slot_mapping[:n], sched.hidden_src[:n]
        a["ids"][n:tokens], a["pos"][n:tokens], a["slot"][n:tokens], a["hsrc"][n:tokens] = 0, 0, -1, -1
        last = sched.row_tok_off[:r] + sched.row_len[:r] - 1
        a["last"][:r] = last
        a["prev_last"][:r] = sched.hidden_src[last]
        a["store"][:r] = last
        # Padding rows park their exit statistics in a spare slot past the real tokens.
        a["last"][r:rows], a["prev_last"][r:rows], a["store"][r:rows] = 0, -1, self.max_tokens
        b["bt"][:r] = tables[sched.row_kv_slot[:r], sched.row_loop[:r]]
        b["q_start"][:r], b["len"][:r], b["tok_off"][:r] = (
            sched.row_start[:r],
            sched.row_len[:r],
            sched.row_tok_off[:r],
        )
        b["loop"][:r], b["lo"][:r], b["hi"][:r] = (
            sched.row_loop[:r],
            sched.row_exit_lo[:r],
            sched.row_exit_hi[:r],
        )
        b["log1mq"][:r] = sched.row_log1mq[:r].view(np.int32)  # float32 bits travel in the int32 buffer
        b["bt"][r:rows], b["q_start"][r:rows], b["len"][r:rows], b["tok_off"][r:rows] = -1, 0, 0, 0
        b["loop"][r:rows], b["lo"][r:rows], b["hi"][r:rows] = 0, 127, 127
        self.i64.upload()
        # The block tables come last: copy only the rows in use (a full table is ~1 MB).
        self.i32.upload(self.i32.offset["bt"] + rows * b["bt"].shape[1])

    def fill_rider_step(self, lanes: int, riders: list, tables: np.ndarray) -> tuple[int, int, int]:
        """Stage a step of decode lanes and riders' prompts (engine/riders.py); returns its padded shape.
        Rows and tokens [0, lanes) are the lanes', written on the device (kernels/lanes.pack_lane_step);
        rider i is row lanes + i over its prompt's tokens at rd.off, at loop rd.loop, carrying its
        hidden states from the tokens at rd.prev_off of the last step. Padding as in _fill."""
        n = lanes + sum(len(rd.ids) for rd in riders)
        longest = max(len(rd.ids) for rd in riders)
        rows, tokens, q_len = step_shape(lanes + len(riders), n, longest, self.max_rows, self.max_tokens)
        a, b = self.i64.begin(), self.i32.begin()
        t, w = slice(lanes, tokens), slice(lanes, rows)
        a["ids"][t], a["pos"][t], a["slot"][t], a["hsrc"][t] = 0, 0, -1, -1
        a["last"][w], a["prev_last"][w], a["store"][w] = 0, -1, self.max_tokens
        b["bt"][w], b["q_start"][w], b["len"][w], b["tok_off"][w] = -1, 0, 0, 0
        b["loop"][w], b["lo"][w], b["hi"][w] = 0, 127, 127
        bs = self.block_size
        for i, rd in enumerate(riders):
            row, o, k = lanes + i, rd.off, len(rd.ids)
            p = np.arange(k)
            table = tables[rd.kv, rd.loop]
            a["ids"][o : o + k], a["pos"][o : o + k] = rd.ids, p
            a["slot"][o : o + k] = table[p // bs].astype(np.int64) * bs + p % bs
            a["hsrc"][o : o + k] = p + rd.prev_off if rd.loop > 0 else -1
            a["last"][row] = a["store"][row] = o + k - 1
            a["prev_last"][row] = rd.prev_off + k - 1 if rd.loop > 0 else -1
            b["bt"][row] = table
            b["q_start"][row], b["len"][row], b["tok_off"][row], b["loop"][row] = 0, k, o, rd.loop
        self.i64.upload()
        self.i32.upload(self.i32.offset["bt"] + rows * b["bt"].shape[1])
        return rows, tokens, q_len

    # ---- the step on the device -------------------------------------------------

    def run_shape(self, shape: tuple[int, int, int]) -> None:
        """One loop over the staged step at a padded shape: its captured graph, else eagerly."""
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self._forward(*shape)

    def _forward(self, rows: int, tokens: int, max_q_len: int) -> None:
        """One loop for the first `rows` rows / `tokens` tokens of the static buffers (graph-capturable)."""
        a, b = self.i64.dev, self.i32.dev
        hsrc = a["hsrc"][:tokens]
        h = torch.where(
            (hsrc >= 0)[:, None], self.h_prev[hsrc.clamp(min=0)], self.model.embed(a["ids"][:tokens])
        )  # fmt: skip
        self.attn.batch = TritonBatch(
            a["slot"][:tokens], a["pos"][:tokens], b["bt"][:rows], b["q_start"][:rows], b["len"][:rows],
            b["tok_off"][:rows], max_q_len,
        )  # fmt: skip
        x = run_loop_fused(self.model, h, self.attn)
        last, prev = a["last"][:rows], a["prev_last"][:rows]
        xl = x[last]
        gate = self.model.model.early_exit_gate
        log_surv = gate_log_survival(x, last, prev, self.ls_prev, gate.weight, gate.bias)
        log1mq = b["log1mq"][:rows].view(torch.float32)
        self.exits[:rows] = exit_mask(
            b["loop"][:rows], log_surv, log1mq, b["lo"][:rows] + 1, b["hi"][:rows] + 1
        )
        self.x_last[:rows] = xl
        self.h_prev[:tokens] = x
        self.ls_prev[a["store"][:rows]] = log_surv

    def _capture(self, shape: tuple[int, int, int]) -> None:
        # Warm up (Triton compiles on first launch) outside the capture, on a side stream. Only at
        # start-up: the warm-up runs the step for real, over whatever the buffers hold.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(*shape)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        # One memory pool for all graphs: they never run at the same time.
        with torch.cuda.graph(g, pool=self.pool):
            self._forward(*shape)
        self.graphs[shape] = g

    def capture(self, lanes: bool = True) -> None:
        """Capture the step graphs up front (start-up): decode shapes, then the shapes of steps with
        a prompt chunk, up to MAX_GRAPHS; with `lanes`, the run-ahead lane graphs too. Steps of a
        shape not captured run eagerly: no request ever waits for a capture (30-80 ms each)."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        caps = (self.max_rows, self.max_tokens)
        shapes = decode_shapes(*caps) + prefill_shapes(*caps)
        with torch.inference_mode():
            # Every launch below once, compiling only: the variants compile side by side, not one by one.
            precompile(lambda: self._launch_all(shapes, lanes))
            self._compile_prefill_attention(shapes[MAX_GRAPHS:])
            for shape in shapes[:MAX_GRAPHS]:
                self._capture(shape)
            self._compile_host_kernels()
        logger.info("captured %d step graphs in %.1f s: %s", len(self.graphs), time.perf_counter() - t0,
                    sorted(self.graphs))  # fmt: skip
        if lanes:
            self.lanes.capture()

    def _launch_all(self, shapes: list[tuple[int, int, int]], lanes: bool) -> None:
        """Launch once each kernel variant that capture() launches (precompile's walk). Every layer launches
        the same variants, so the walk runs one: each launch costs the walk Python time even when its variant
        is in the disk cache (with 24 layers the walk made a warm start-up ~2-5 s slower, s32 call04)."""
        layers = self.model.model.layers
        self.model.model.layers = layers[:1]
        try:
            self._compile_prefill_attention(shapes[MAX_GRAPHS:])
            for shape in shapes[:MAX_GRAPHS]:
                self._forward(*shape)
            self._compile_host_kernels()
            if lanes:
                self.lanes.launch_all()
        finally:
            self.model.model.layers = layers

    def _compile_prefill_attention(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile the prefill attention variants the given (uncaptured, eager) step shapes use now:
        compiling one on first use (~0.5-0.8 s on the H200) stalled every request in that step.
        Captured shapes compile theirs in the capture's warm-up."""
        from ..kernels import paged_attention

        cfg, kc, vc = self.cfg, self.kv_cache[0, 0], self.kv_cache[1, 0]
        for rows, tokens, q_len in shapes:
            if q_len < 2:
                continue
            zeros = torch.zeros(rows, dtype=torch.int32, device=self.device)
            # The real block-table rows (their stride is part of the compiled variant: Triton
            # specializes integer arguments equal to 1 or divisible by 16).
            bt = self.i32.dev["bt"][:rows]
            q = torch.zeros(tokens, cfg.num_attention_heads, cfg.head_dim, dtype=kc.dtype, device=self.device)
            # Rows of length 0: nothing is read or written, but the launch compiles the variant.
            paged_attention(q, kc, vc, bt, zeros, zeros, zeros, self.block_size, q_len, 1.0)

    def propagate(self, sched) -> None:
        """Last-exited propagation; the pairs travel through pinned staging (a pageable copy would
        wait for the whole stream, stalling the host behind steps it launched without waiting)."""
        k = sched.num_prop
        self._propagate_pairs(sched.prop_src[:k], sched.prop_dst[:k], len(sched.prop_src))

    def _propagate_pairs(self, src: np.ndarray, dst: np.ndarray, capacity: int) -> None:
        k = len(src)
        if self.prop is None or k > self.prop_half:
            # An even half: the dst half starts 16-byte aligned whatever k is, so the kernel has one
            # compiled variant (Triton specializes pointer alignment), warmed at start-up.
            n = max(k, capacity, 2)
            self.prop_half = n + n % 2
            self.prop = _Staging({"pairs": (2 * self.prop_half,)}, torch.int64, self.device)
        h = self.prop_half
        pairs = self.prop.begin()["pairs"]
        pairs[:k], pairs[h : h + k] = src, dst
        self.prop.upload(h + k)
        dev = self.prop.dev["pairs"]
        propagate_kv(self.kv_cache, dev[:k], dev[h : h + k])

    def _compile_host_kernels(self) -> None:
        """Compile now the kernels the host path launches outside graphs: the propagation (first
        used at the first early exit) and the sampler on float32 logits (~0.1 and ~0.4 s on the
        H200, measured as stalls of the first such step before this)."""
        from ..kernels.sample import sample_gumbel
        from .sampling import GREEDY_EPS

        none = np.full(1, -1, np.int64)  # a pair with negative slots copies nothing
        self._propagate_pairs(none, none, 1)
        vocab = self.sampler.vocab_limit
        rows = self.model.logits(self.x_last[:1]).float()  # the host path's logits layout
        one = torch.ones(1, dtype=torch.float32, device=self.device)
        seed = torch.zeros(1, dtype=torch.int64, device=self.device)
        sample_gumbel(rows, one, seed, GREEDY_EPS, min(vocab, rows.shape[1]))

    @torch.inference_mode()
    def execute(self, sched, tables: np.ndarray, sampling: RowSampling) -> StepResult:
        r, n = sched.num_rows, sched.num_step_tokens
        if sched.num_prop:
            self.propagate(sched)
        shape = step_shape(r, n, int(sched.row_len[:r].max()), self.max_rows, self.max_tokens)
        self._fill(sched, tables, shape[0], shape[1])
        self.run_shape(shape)
        loops = sched.row_loop[:r]
        if not (sched.row_exit_lo[:r] <= loops).any():
            # No row may exit at this loop: nothing to read back, so do not wait for the device.
            return StepResult(np.zeros(r, np.uint8), np.zeros(r, np.int32))
        if (sched.row_exit_hi[:r] <= loops).all():
            # Every row reached its last loop (full depth): the exits are known without a device read.
            exited = np.ones(r, np.uint8)
        else:
            exited = self.exits[:r].to(torch.uint8).cpu().numpy()
        return sample_exited(self, sched, self.x_last[:r], exited, sampling)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
