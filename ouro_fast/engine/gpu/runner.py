"""The GPU runner: executes a StepPlan on the Triton kernels, from static device buffers, in CUDA graphs.

Same contract as ReferenceRunner.execute, and tested against it. A step's inputs
are packed on the host into pinned buffers and copied to the device in two
transfers; the tensors the kernels read are fixed views into one device buffer.
A step runs padded to one of a few shapes (shapes.py), each captured as a CUDA
graph at start-up. The hidden states and exit statistics carried between steps
live in static buffers indexed by token. The runner also owns the decode lanes
(lanes.py) that run-ahead drives.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ...kernels import propagate_kv
from ...kernels.cascade_attention import SharedPrefixes
from ...kernels.exit_gate import gate_log_survival
from ...kernels.precompile import precompile
from ...model.attention import allocate_kv_cache
from ...model.exit_rule import exit_mask
from ...model.ouro import OuroForCausalLM
from ...model.triton_attention import TritonBatch, TritonPagedAttention
from ...model.triton_loop import run_loop_fused
from ..plan import StepPlan, StepResult
from ..sampling import GREEDY_EPS, Sampler, prompt_logprobs, sample_exited
from .lanes import DecodeLanes
from .shapes import MAX_GRAPHS, decode_shapes, prefill_shapes, step_shape
from .staging import StagingBuffers

logger = logging.getLogger("ouro_fast")


class GpuRunner:
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
        cascade: bool = True,
        kv_dtype: torch.dtype | None = None,
    ):
        cfg = model.config
        self.model, self.cfg, self.device = model, cfg, device
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        self.kv_cache = allocate_kv_cache(cfg, num_blocks * block_size, kv_dtype or dtype, device)
        self.attn = TritonPagedAttention(self.kv_cache, block_size, cfg.rope_theta, max_model_len, dtype)
        self.sampler = Sampler(vocab_limit, device, seed, fused=True)
        self.keep_logits = keep_logits
        self.use_graphs = use_graphs and device.type == "cuda"
        r, n, mb = max_rows, max_tokens, max_blocks_per_seq
        self.max_rows, self.max_tokens = r, n
        tok, row = (n,), (r,)
        i64 = {"ids": tok, "pos": tok, "slot": tok, "hsrc": tok, "last": row, "prev_last": row, "store": row}
        self.i64 = StagingBuffers(i64, torch.int64, device)
        self.i32 = StagingBuffers(
            {"q_start": row, "len": row, "tok_off": row, "loop": row, "lo": row, "hi": row, "log1mq": row,
             "grp": row, "bt": (r, mb)}, torch.int32, device,
        )  # fmt: skip
        self.h_prev = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.ls_prev = torch.zeros(n + 1, dtype=torch.float32, device=device)
        self.exits = torch.zeros(r, dtype=torch.bool, device=device)
        self.x_last = torch.zeros(r, cfg.hidden_size, dtype=dtype, device=device)
        self.prop: StagingBuffers | None = None  # propagation pairs (src half, dst half), sized on first use
        self.prop_half = 0
        # Pairs one step can owe: every token and row of the last step, into each deeper plane.
        self.prop_capacity = (n + r) * max(cfg.total_ut_steps - 1, 1)
        self.graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}  # (shape, casc)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.lanes = DecodeLanes(self, max_rows, cfg.total_ut_steps, max_blocks_per_seq, seed, cascade)
        self.cascade = self.lanes.cascade_ok  # steps with prompt rows group the lanes' rows too

    # ---- inputs ----------------------------------------------------------------

    def _fill(self, plan: StepPlan, rows: int, tokens: int) -> None:
        """Write the step's inputs into the pinned buffers, padding up to `rows`/`tokens`."""
        r, n = plan.num_rows, plan.num_tokens
        a, b = self.i64.begin(), self.i32.begin()
        a["ids"][:n], a["pos"][:n] = plan.token_ids, plan.positions
        a["slot"][:n], a["hsrc"][:n] = plan.slot_mapping, plan.hidden_src
        a["ids"][n:tokens], a["pos"][n:tokens], a["slot"][n:tokens], a["hsrc"][n:tokens] = 0, 0, -1, -1
        last = plan.tok_off + plan.length - 1
        a["last"][:r] = last
        a["prev_last"][:r] = plan.hidden_src[last]
        a["store"][:r] = last
        # Padding rows park their exit statistics in a spare slot past the real tokens.
        a["last"][r:rows], a["prev_last"][r:rows], a["store"][r:rows] = 0, -1, self.max_tokens
        b["bt"][:r] = plan.block_tables[plan.kv_slot, plan.loop]
        b["q_start"][:r], b["len"][:r], b["tok_off"][:r] = plan.start, plan.length, plan.tok_off
        b["loop"][:r], b["lo"][:r], b["hi"][:r] = plan.loop, plan.exit_lo, plan.exit_hi
        b["log1mq"][:r] = plan.log1mq.view(np.int32)  # float32 bits travel in the int32 buffer
        b["bt"][r:rows], b["q_start"][r:rows], b["len"][r:rows], b["tok_off"][r:rows] = -1, 0, 0, 0
        b["loop"][r:rows], b["lo"][r:rows], b["hi"][r:rows] = 0, 127, 127
        b["grp"][:rows] = -1  # host-driven steps: no shared-prefix groups
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
        b["grp"][w] = -1  # the lanes' groups come from pack_lane_step; riders' rows have none
        bs = self.block_size
        for i, rd in enumerate(riders):
            row, o, k = lanes + i, rd.off, len(rd.ids)
            p = rd.start + np.arange(k)
            table = tables[rd.kv, rd.loop]
            a["ids"][o : o + k], a["pos"][o : o + k] = rd.ids, p
            a["slot"][o : o + k] = table[p // bs].astype(np.int64) * bs + p % bs
            a["hsrc"][o : o + k] = np.arange(k) + rd.prev_off if rd.loop > 0 else -1
            a["last"][row] = a["store"][row] = o + k - 1
            a["prev_last"][row] = rd.prev_off + k - 1 if rd.loop > 0 else -1
            b["bt"][row] = table
            b["q_start"][row], b["len"][row], b["tok_off"][row], b["loop"][row] = rd.start, k, o, rd.loop
        self.i64.upload()
        self.i32.upload(self.i32.offset["bt"] + rows * b["bt"].shape[1])
        return rows, tokens, q_len

    # ---- the step on the device -------------------------------------------------

    def run_shape(self, shape: tuple[int, int, int], casc: bool = False) -> None:
        """One loop over the staged step at a padded shape: its captured graph, else eagerly. casc: a step
        with prompt rows whose lanes have shared-prefix groups (riders beside lanes of a class)."""
        casc = casc and self.cascade and shape[2] > 1
        graph = self.graphs.get((*shape, casc))
        if graph is not None:
            graph.replay()
        else:
            self._forward(*shape, casc)

    def _forward(self, rows: int, tokens: int, max_q_len: int, casc: bool = False) -> None:
        """One loop for the first `rows` rows / `tokens` tokens of the static buffers (graph-capturable)."""
        a, b = self.i64.dev, self.i32.dev
        hsrc = a["hsrc"][:tokens]
        h = torch.where(
            (hsrc >= 0)[:, None], self.h_prev[hsrc.clamp(min=0)], self.model.embed(a["ids"][:tokens])
        )  # fmt: skip
        # Riders beside lanes with shared-prefix groups read those prefixes once, as lane launches do; the
        # other steps (host-driven ones, riders beside lanes of no class) skip the prefix launch.
        prefixes = SharedPrefixes(b["grp"][:rows], self.lanes.inputs.dev["glen"]) if casc else None
        self.attn.batch = TritonBatch(
            a["slot"][:tokens], a["pos"][:tokens], b["bt"][:rows], b["q_start"][:rows], b["len"][:rows],
            b["tok_off"][:rows], max_q_len, prefixes,
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

    def _variants(self, shape: tuple[int, int, int]) -> tuple[bool, ...]:
        # Steps with prompt rows come with and without the shared-prefix launch.
        return (False, True) if self.cascade and shape[2] > 1 else (False,)

    def _capture(self, shape: tuple[int, int, int], casc: bool) -> None:
        # Warm up (Triton compiles on first launch) outside the capture, on a side stream. Only at
        # start-up: the warm-up runs the step for real, over whatever the buffers hold.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(*shape, casc)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        # One memory pool for all graphs: they never run at the same time.
        with torch.cuda.graph(g, pool=self.pool):
            self._forward(*shape, casc)
        self.graphs[(*shape, casc)] = g

    def capture(self, lanes: bool = True, compile_threads: int | None = None) -> None:
        """Capture the step graphs up front (start-up): decode shapes, then the shapes of steps with
        a prompt chunk, up to MAX_GRAPHS; with `lanes`, the run-ahead lane graphs too. Steps of a
        shape not captured run eagerly: no request ever waits for a capture (30-80 ms each).
        compile_threads: the parallel kernel compiles before the capture (None: the CPUs, at most 16)."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        caps = (self.max_rows, self.max_tokens)
        shapes = decode_shapes(*caps) + prefill_shapes(*caps)
        with torch.inference_mode():
            # Every launch below once, compiling only: the variants compile side by side, not one by one.
            precompile(lambda: self._launch_all(shapes, lanes), compile_threads)
            self._compile_prefill_attention(shapes[MAX_GRAPHS:])
            for shape in shapes[:MAX_GRAPHS]:
                for casc in self._variants(shape):
                    self._capture(shape, casc)
            self._compile_host_kernels()
        logger.info("captured %d step graphs in %.1f s: %s", len(self.graphs), time.perf_counter() - t0,
                    sorted(self.graphs))  # fmt: skip
        if lanes:
            self.lanes.capture()

    def _launch_all(self, shapes: list[tuple[int, int, int]], lanes: bool) -> None:
        """Launch once each kernel variant that capture() launches (precompile's walk). Every layer launches
        the same variants, so the walk runs one: each launch costs the walk Python time even when its variant
        is in the disk cache (with 24 layers the walk made a warm start-up ~2-5 s slower)."""
        layers = self.model.model.layers
        self.model.model.layers = layers[:1]
        try:
            self._compile_prefill_attention(shapes[MAX_GRAPHS:])
            for shape in shapes[:MAX_GRAPHS]:
                for casc in self._variants(shape):
                    self._forward(*shape, casc)
            self._compile_host_kernels()
            if lanes:
                self.lanes.launch_all()
        finally:
            self.model.model.layers = layers

    def _compile_prefill_attention(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile the prefill attention variants the given (uncaptured, eager) step shapes use now:
        compiling one on first use (~0.5-0.8 s on the H200) stalled every request in that step.
        Captured shapes compile theirs in the capture's warm-up."""
        from ...kernels import paged_attention

        cfg, kc, vc = self.cfg, self.kv_cache[0, 0], self.kv_cache[1, 0]
        for rows, tokens, q_len in shapes:
            if q_len < 2:
                continue
            zeros = torch.zeros(rows, dtype=torch.int32, device=self.device)
            # The real block-table rows (their stride is part of the compiled variant: Triton
            # specializes integer arguments equal to 1 or divisible by 16).
            bt = self.i32.dev["bt"][:rows]
            q = torch.zeros(tokens, cfg.num_attention_heads, cfg.head_dim, dtype=self.attn.dtype,
                            device=self.device)  # fmt: skip
            # Rows of length 0: nothing is read or written, but the launch compiles the variant (with and
            # without the shared-prefix launch, as _forward runs them).
            for casc in self._variants((rows, tokens, q_len)):
                grp = self.i32.dev["grp"][:rows]
                prefixes = SharedPrefixes(grp, self.lanes.inputs.dev["glen"]) if casc else None
                paged_attention(
                    q, kc, vc, bt, zeros, zeros, zeros, self.block_size, q_len, 1.0, prefixes=prefixes
                )

    def propagate(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Last-exited propagation: copy slot src[i] to dst[i] in every layer, K and V. The pairs travel
        through pinned staging (a pageable copy would wait for the whole stream, stalling the host
        behind steps it launched without waiting)."""
        self._propagate_pairs(src, dst, self.prop_capacity)

    def _propagate_pairs(self, src: np.ndarray, dst: np.ndarray, capacity: int) -> None:
        k = len(src)
        if self.prop is None or k > self.prop_half:
            # An even half: the dst half starts 16-byte aligned whatever k is, so the kernel has one
            # compiled variant (Triton specializes pointer alignment), warmed at start-up.
            n = max(k, capacity, 2)
            self.prop_half = n + n % 2
            self.prop = StagingBuffers({"pairs": (2 * self.prop_half,)}, torch.int64, self.device)
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
        from ...kernels.sample import sample_gumbel

        none = np.full(1, -1, np.int64)  # a pair with negative slots copies nothing
        self._propagate_pairs(none, none, 1)
        vocab = self.sampler.vocab_limit
        rows = self.model.logits(self.x_last[:1]).float()  # the host path's logits layout
        one = torch.ones(1, dtype=torch.float32, device=self.device)
        seed = torch.zeros(1, dtype=torch.int64, device=self.device)
        sample_gumbel(rows, one, seed, GREEDY_EPS, min(vocab, rows.shape[1]))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        r = plan.num_rows
        if plan.num_prop:
            self.propagate(plan.prop_src, plan.prop_dst)
        shape = step_shape(r, plan.num_tokens, int(plan.length.max()), self.max_rows, self.max_tokens)
        self._fill(plan, shape[0], shape[1])
        self.run_shape(shape)
        if plan.sampling.grammars is not None:
            plan.sampling.grammars.start_fill()  # the grammar masks, while the device runs the loop
        vocab, loops = self.sampler.vocab_limit, self.cfg.total_ut_steps
        if not plan.may_exit():
            # No row may exit at this loop: nothing to read back, so do not wait for the device.
            result = StepResult(np.zeros(r, np.uint8), np.zeros(r, np.int32))
        else:
            if plan.all_exit():
                # Every row reached its last loop (full depth): the exits are known without a device read.
                exited = np.ones(r, np.uint8)
            else:
                exited = self.exits[:r].to(torch.uint8).cpu().numpy()
            result = sample_exited(self.model, self.sampler, plan, self.x_last[:r], exited, self.keep_logits)
        if plan.sampling.prompts:
            result.prompt_logprobs = prompt_logprobs(self.model, plan, self.h_prev, loops, vocab)
        return result
