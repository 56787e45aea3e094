"""Decode lanes: the device drives a decode-only batch by itself, one loop per launch.

A lane is one request's live token. Per launch the device runs one loop for
every lane at that lane's own depth, evaluates the gate, decides exits, samples
the exiting lanes, copies an exited token's K/V into the planes it skipped, and
advances its own state: an exited lane moves to loop 0 of its new token, the
others to their next loop. The host never has to answer before the next launch,
so launches can run ahead of the exit read-back (runahead.py replays the
recorded results into the scheduler one launch behind).

Per launch the device writes one record per lane, [loop, exited, sampled id,
active], into a ring in pinned host memory (its last kernel stores them there). A lane stops on the
device when it samples one of its stop ids or reaches its length cap (the same
rules as the engine), or when the host kills it (stop strings, aborts).

Lanes sample greedily or at their temperature, with each request's top_k, top_p and min_p (the host
sampler's masks, in the same order); launches with no lane that filters run graphs that sort nothing.
When a lane's request asks for log-probabilities, the launches compute them on the device for every
lane that samples (the sampled token's, its rank and the MAX_LOGPROBS likeliest, from the logits before
temperature, as the host path's token_logprobs) and copy them into a second ring in pinned host memory.
Launches without such a lane run graphs that compute none.

A lane whose request must match a grammar (structured output) samples under its next-token bitmask, which
the host fills from the request's matcher and uploads before the launch that can sample that token
(runahead.py decides when that is possible). The mask applies before the filters, as on the host; lanes
without a grammar hold an all-ones row, and launches with no grammar lane run graphs that mask nothing.

A free lane can also carry a newcomer's prompt (a rider, riders.py): while
the prompt runs its loops the launch is the runner's step graph over the lanes'
tokens and the prompt's, and after the prompt's last loop the lane decodes the
first token. The rider's record has the prompt row's loop, exit and first token.

Lanes whose requests share a prompt prefix (prefix-cache hits) form classes (prefix_groups.py, from the
host with the launch's inputs); launches with a class run graphs whose decode attention reads each class's
prefix once per loop plane for all its lanes (kernels/cascade_attention.py), the others graphs without.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from ...kernels import propagate_kv
from ...kernels.cascade_attention import SharedPrefixes
from ...kernels.sample import mask_tokens_, sample_gumbel
from ...kernels.skinny_gemm import SKINNY_MAX_M, skinny_linear
from ...model.triton_attention import TritonBatch
from ...model.triton_loop import run_loop_fused
from ..sampling import GREEDY_EPS, MAX_LOGPROBS, mask_min_p, mask_top_k_top_p
from .lane_kernels import (
    lane_epilogue,
    lane_exits,
    lane_prologue,
    pack_lane_step,
    publish_records,
    rider_epilogue,
)
from .prefix_groups import MAX_CLASSES
from .shapes import pow2
from .staging import StagingBuffers

MAX_STOP_IDS = 8  # stop token ids a lane checks on the device; requests with more stay host-driven
RING = 4  # launches whose records can be in flight to the host


def filters(params) -> bool:
    """The request samples with top_k, top_p or min_p (a greedy one takes the argmax whatever they say)."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0)


class DecodeLanes:
    """Device state and launches of the lanes of one GpuRunner (same model, cache and graph pool)."""

    def __init__(self, runner, num_slots: int, num_loops: int, max_blocks: int, seed: int = 0,
                 cascade: bool = True):  # fmt: skip
        # A weak reference (the runner owns the lanes): no cycle keeping the KV pool alive.
        self.runner, self.model, self.attn = weakref.proxy(runner), runner.model, runner.attn
        self.device, self.block_size, self.num_loops = runner.device, runner.block_size, num_loops
        self.max_lanes = r = runner.max_rows
        dev, hidden = runner.device, runner.cfg.hidden_size
        dtype = runner.h_prev.dtype
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.tok, self.pos, self.kvrow, self.cap = (torch.zeros(r, **i64) for _ in range(4))
        self.stop_ids = torch.full((r, MAX_STOP_IDS), -1, **i64)
        self.loop, self.lo, self.hi, self.active = (torch.zeros(r, **i32) for _ in range(4))
        # A rider's prompt loop (-1: the lane carries no prompt) and whether its first token is out.
        self.ploop, self.pdone = torch.full((r,), -1, **i32), torch.zeros(r, **i32)
        self.log1mq, self.temp, self.ls = (torch.zeros(r, dtype=torch.float32, device=dev) for _ in range(3))
        self.top_k = torch.zeros(r, **i32)  # 0: off
        self.top_p, self.min_p = torch.ones(r, dtype=torch.float32, device=dev), torch.zeros(r, device=dev)
        self.h = torch.zeros(r, hidden, dtype=dtype, device=dev)
        self.tok_off = torch.arange(r, **i32)
        self.lane_idx = torch.arange(r, **i64)
        self.launches = torch.zeros(1, **i64)
        self.seed = seed & ((1 << 62) - 1)
        self.tables = torch.full((num_slots, num_loops, max_blocks), -1, **i32)
        self.record = torch.zeros(r, 4, **i64)
        # Zeroed once: a launch that skips the lm_head leaves the last logits (finite) for the sampler.
        # Rows for every lane and as many riders.
        vocab = runner.model.lm_head_weight().shape[0]
        self.logits_buf = torch.zeros(min(2 * r, SKINNY_MAX_M), vocab, dtype=dtype, device=dev)
        # Per lane, the next token's grammar bitmask (bit t of word w: token 32 * w + t allowed), and the rows
        # the host uploads before a launch.
        self.words = -(-vocab // 32)
        self.gmask = torch.full((r, self.words), -1, **i32)
        self.mask_in = StagingBuffers({"lanes": (r,), "gm": (r, self.words)}, torch.int32, dev)
        self.prop_src, self.prop_dst = (torch.full(((num_loops - 1) * r,), -1, **i64) for _ in range(2))
        # Per launch from the host: the kill mask, the riders' lanes, each lane's prefix class, each device
        # group's prefix length (class * loops + loop), and block-table rows that changed.
        layout = {"kill": (r,), "riders": (r,), "cls": (r,), "glen": (MAX_CLASSES * num_loops,), "rows": (r,),
                  "tab": (r, num_loops * max_blocks)}  # fmt: skip
        self.inputs = StagingBuffers(layout, torch.int32, dev)
        # What the last upload left on the device (none yet): the kill mask and the classes.
        self._kill_on_device = np.full(r, -1, np.int32)
        self._classes_on_device = (np.full(r, -2, np.int32), np.zeros(MAX_CLASSES, np.int32))
        # Whether graphs with the shared-prefix attention exist (and launches may take them), and whether the
        # next launches do.
        self.cascade_ok = cascade and r >= 2
        self.cascade = False
        self.cascade_launches = 0  # launches that read shared prefixes once (tests, benchmarks)
        self.init = StagingBuffers(
            {"i64": (5 + MAX_STOP_IDS, r), "i32": (5, r), "f32": (4, r)}, torch.int64, dev
        )  # f32 and i32 parts travel as int64 words; i64's last row: the lane indices (seat)
        pin = dev.type == "cuda"
        self.host_records = torch.zeros(RING, r, 4, dtype=torch.int64, pin_memory=pin)
        self.emitted = torch.zeros(1, **i64)  # launches since start() on the device: the ring slot
        self.events = [torch.cuda.Event() if pin else None for _ in range(RING)]
        # Log-probabilities of the lanes' samples: [the sampled token's, its rank, the top ones'] and the top
        # ids, per lane on the device and per ring slot on the host.
        f32 = dict(dtype=torch.float32, device=dev)
        self.lp_vals, self.lp_ids = (
            torch.zeros(r, 2 + MAX_LOGPROBS, **f32),
            torch.zeros(r, MAX_LOGPROBS, **i64),
        )
        self.host_lp_vals = torch.zeros(RING, r, 2 + MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin)
        self.host_lp_ids = torch.zeros(RING, r, MAX_LOGPROBS, dtype=torch.int64, pin_memory=pin)
        self.logprobs = False  # the next launches compute log-probabilities (some lane wants them)
        self.filtering = False  # the next launches apply top_k / top_p / min_p (some lane samples so)
        self.masking = False  # the next launches apply grammar bitmasks (some lane has a grammar)
        self.lp_of = [False] * RING  # per ring slot: whether its launch computed them
        # By (lanes, log-probabilities, filtering, masking, shared prefixes); the plain variant, with and
        # without shared prefixes, at start-up (capture), the others once a run needs them (prepare).
        self.graphs: dict[tuple[int, bool, bool, bool, bool], torch.cuda.CUDAGraph] = {}
        variants = {(lp, f, m) for lp in (False, True) for f in (False, True) for m in (False, True)}
        self.prepared = set() if runner.use_graphs else variants
        self.rows = 0
        self.count = 0  # launches since start()

    # ---- host -> device ----------------------------------------------------------------

    def start(self, lanes: dict, hsrc: torch.Tensor | None, table_rows, tables) -> None:
        """Load lane state: `lanes` maps field -> numpy array [rows]; hsrc [rows] int64 on the device
        (index of the lane's carried hidden state in the runner's buffers, -1 for none)."""
        n = len(lanes["tok"])
        self.rows = min(pow2(n), self.max_lanes)
        d = self._stage(lanes, n, active=1)
        for j, t in enumerate((self.tok, self.pos, self.kvrow, self.cap)):
            t.copy_(d["i64"][j])
        self.stop_ids.copy_(d["i64"][4 : 4 + MAX_STOP_IDS].T)
        for j, t in enumerate((self.loop, self.lo, self.hi, self.active)):
            t.copy_(d["i32"][j])
        self.log1mq.copy_(d["f32"][0].to(torch.int32).view(torch.float32))
        self.temp.copy_(d["f32"][1].to(torch.int32).view(torch.float32))
        self.top_p.copy_(d["f32"][2].to(torch.int32).view(torch.float32))
        self.min_p.copy_(d["f32"][3].to(torch.int32).view(torch.float32))
        self.top_k.copy_(d["i32"][4])
        self.ls.zero_()
        self.ploop.fill_(-1)
        self.pdone.zero_()
        if hsrc is not None:
            # Carried rows take their hidden state and log-survival from the last host-driven step.
            has = hsrc >= 0
            src = hsrc.clamp(min=0)
            self.h[:n] = torch.where(has[:, None], self.runner.h_prev[src], self.h[:n])
            self.ls[:n] = torch.where(has, self.runner.ls_prev[src], torch.zeros_like(self.ls[:n]))
        self.count = 0
        self.emitted.zero_()
        self.launch_inputs(None, table_rows, tables)

    def seat(self, idx, lanes: dict) -> None:
        """Give lanes `idx` (numpy) to riders: their requests' fields (`lanes` as in start(), with
        pos = the prompt's length), idle as lanes until the prompt's last loop."""
        k = len(idx)
        d = self._stage(lanes, k, active=0, idx=idx)
        ix = d["i64"][4 + MAX_STOP_IDS, :k]
        for j, t in enumerate((self.tok, self.pos, self.kvrow, self.cap)):
            t.index_copy_(0, ix, d["i64"][j, :k])
        self.stop_ids.index_copy_(0, ix, d["i64"][4 : 4 + MAX_STOP_IDS, :k].T.contiguous())
        for j, t in enumerate((self.loop, self.lo, self.hi, self.active)):
            t.index_copy_(0, ix, d["i32"][j, :k].to(torch.int32))
        self.log1mq.index_copy_(0, ix, d["f32"][0, :k].to(torch.int32).view(torch.float32))
        self.temp.index_copy_(0, ix, d["f32"][1, :k].to(torch.int32).view(torch.float32))
        self.top_p.index_copy_(0, ix, d["f32"][2, :k].to(torch.int32).view(torch.float32))
        self.min_p.index_copy_(0, ix, d["f32"][3, :k].to(torch.int32).view(torch.float32))
        self.top_k.index_copy_(0, ix, d["i32"][4, :k].to(torch.int32))
        self.ls.index_fill_(0, ix, 0.0)
        self.ploop.index_fill_(0, ix, 0)
        self.pdone.index_fill_(0, ix, 0)

    def _stage(self, lanes: dict, n: int, active: int, idx=None) -> dict:
        """Upload lane fields for columns [0, n) (zeros beyond); returns the device views."""
        a = self.init.begin()
        i64 = a["i64"]
        i64[:, :] = 0
        for j, k in enumerate(("tok", "pos", "kvrow", "cap")):
            i64[j, :n] = lanes[k]
        i64[4 : 4 + MAX_STOP_IDS] = -1
        i64[4 : 4 + MAX_STOP_IDS, :n] = lanes["stop_ids"].T
        if idx is not None:
            i64[4 + MAX_STOP_IDS, :n] = idx
        i32, f32 = a["i32"], a["f32"]
        i32[:, :] = 0
        for j, k in enumerate(("loop", "lo", "hi")):
            i32[j, :n] = lanes[k]
        i32[3, :n] = active
        i32[4, :n] = lanes["top_k"]
        f32[:, :] = 0
        f32[2] = np.float32(1.0).view("int32")  # top_p off beyond n
        for j, k in enumerate(("log1mq", "temp", "top_p", "min_p")):
            f32[j, :n] = np.asarray(lanes[k], np.float32).view("int32")
        self.init.upload()
        return self.init.dev

    def launch_inputs(self, kill, table_rows, tables, riders=(), classes=None) -> None:
        """Stage the kill mask (lanes the host ended), the riders' lanes (in their step-row order),
        the lanes' prefix classes (prefix_groups.prefix_classes' pair; None: no class) and the
        block-table rows that changed; the next launches use shared prefixes where a class has one. A
        launch with no riders, no changed rows and the kill mask and classes already on the device
        copies nothing: a copy between two lane graphs delays the second by ~8 us on the H200."""
        mask = np.zeros(self.max_lanes, np.int32)
        if kill is not None:
            mask[: len(kill)] = kill
        cls = np.full(self.max_lanes, -1, np.int32)
        lens = np.zeros(MAX_CLASSES, np.int32)
        if classes is not None and self.cascade_ok:
            cls[: len(classes[0])], lens[:] = classes
        self.cascade = bool(lens.any())
        k = len(table_rows)
        same_classes = all(np.array_equal(x, y) for x, y in zip((cls, lens), self._classes_on_device))
        if not k and not len(riders) and np.array_equal(mask, self._kill_on_device) and same_classes:
            return
        self._kill_on_device, self._classes_on_device = mask, (cls, lens)
        a = self.inputs.begin()
        a["kill"][:] = mask
        a["riders"][: len(riders)] = riders
        a["cls"][:] = cls
        a["glen"][:] = np.repeat(lens, self.num_loops)
        a["rows"][:k] = table_rows
        if k:
            a["tab"][:k] = tables[table_rows].reshape(k, -1)
        self.inputs.upload(self.inputs.offset["tab"] + k * a["tab"].shape[1])
        if k:
            d = self.inputs.dev
            idx = d["rows"][:k].long()
            self.tables[idx] = d["tab"][:k].view(k, self.num_loops, -1)

    def masks(self, idx: np.ndarray, rows: np.ndarray) -> None:
        """Set the grammar bitmasks of lanes `idx` (numpy) to `rows` [len(idx), >= words] int32 (all ones:
        no grammar) for the next launches."""
        k = len(idx)
        if not k:
            return
        a = self.mask_in.begin()
        a["lanes"][:k] = idx
        a["gm"][:k] = rows[:, : self.words]
        self.mask_in.upload(self.mask_in.offset["gm"] + k * self.words)
        d = self.mask_in.dev
        self.gmask.index_copy_(0, d["lanes"][:k].long(), d["gm"][:k])

    # ---- the launch ----------------------------------------------------------------------

    def variant(self) -> tuple[bool, bool, bool, bool]:
        return self.logprobs, self.filtering, self.masking, self.cascade

    def launch(self) -> int:
        """Run one loop for every lane (a captured graph on CUDA); returns the launch's index."""
        rows = self.rows
        self.cascade_launches += self.cascade
        g = self.graphs.get((rows, *self.variant()))
        if g is not None:
            g.replay()
        else:
            self._step(rows, *self.variant())
        return self._emit_records(rows)

    def launch_with_riders(self, riders: list, tables) -> int:
        """Run one loop for every lane and the riders' prompts (`riders`: RiderRow, in step-row
        order, staged by launch_inputs too) as one runner step; returns the launch's index."""
        rows, k, r = self.rows, len(riders), self.runner
        shape = r.fill_rider_step(rows, riders, tables)
        rider_lanes, kill = self.inputs.dev["riders"][:k], self.inputs.dev["kill"]
        run, slot, seeds, temp = pack_lane_step(self, r, kill, rider_lanes, rows, self.block_size)
        self.cascade_launches += self.cascade
        r.run_shape(shape, self.cascade)
        exits = r.exits[: rows + k].to(torch.int32)
        logits = self._lm_head(r.x_last[: rows + k], exits)
        vocab = min(r.sampler.vocab_limit, logits.shape[1])
        chosen = logits
        lane = torch.cat([self.lane_idx[:rows], rider_lanes.long()])
        if self.masking:
            chosen = self._mask(chosen, lane)
        if self.filtering:
            chosen = self._filter(chosen, temp, lane)
        ids = sample_gumbel(chosen, temp, seeds, GREEDY_EPS, vocab, row_gate=exits)
        if self.logprobs:
            vals, top = self._logprobs(logits, ids)
            self.lp_vals[:rows], self.lp_ids[:rows] = vals[:rows], top[:rows]
            # A riding prompt's first token is its lane's sample (the lane itself idles until then).
            lane = rider_lanes.long()
            self.lp_vals[lane], self.lp_ids[lane] = vals[rows : rows + k], top[rows : rows + k]
        src, dst = self.prop_src[: (self.num_loops - 1) * rows], self.prop_dst[: (self.num_loops - 1) * rows]
        lane_epilogue(self, run, slot, r.ls_prev[:rows], exits, ids, r.h_prev[:rows], rows, self.block_size,
                      src, dst)  # fmt: skip
        rider_epilogue(self, r, rider_lanes, exits, ids, rows)
        propagate_kv(r.kv_cache, src, dst)
        publish_records(self, rows)  # the launch's last kernel stores its records in the host ring
        return self._emit_records(rows)

    def _emit_records(self, rows: int) -> int:
        # The launch's records reach the host ring without waiting; result() waits for them. Its
        # log-probabilities, when computed, are copied there behind the launch, before the event.
        i = self.count % RING
        self.lp_of[i] = self.logprobs
        if self.logprobs:
            self.host_lp_vals[i, :rows].copy_(self.lp_vals[:rows], non_blocking=True)
            self.host_lp_ids[i, :rows].copy_(self.lp_ids[:rows], non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        self.count += 1
        return self.count - 1

    def result(self, index: int):
        """The records of launch `index` [rows, 4] (loop, exited, id, active), as numpy, once ready."""
        i = index % RING
        if self.events[i] is not None:
            self.events[i].synchronize()
        return self.host_records[i, : self.rows].numpy()

    def logprobs_result(self, index: int):
        """Launch `index`'s log-probabilities per lane, ([lanes, 2 + MAX_LOGPROBS] float32: the sampled
        token's, its rank, the top ones'; [lanes, MAX_LOGPROBS] top ids), as numpy; None if it computed
        none. Read after result(index)."""
        i = index % RING
        if not self.lp_of[i]:
            return None
        return self.host_lp_vals[i, : self.rows].numpy(), self.host_lp_ids[i, : self.rows].numpy()

    def _logprobs(self, logits: torch.Tensor, ids: torch.Tensor):
        """Per row of logits [rows, >= vocab] with its sample ids [rows] (-1 where none): [the sampled
        token's log-probability, its rank, the top ones'] and the top ids (graph-capturable)."""
        vocab = min(self.runner.sampler.vocab_limit, logits.shape[1])
        lp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
        chosen = lp.gather(1, ids.clamp(min=0).long()[:, None])
        rank = (lp > chosen).sum(dim=-1, keepdim=True).float() + 1
        top, top_ids = lp.topk(MAX_LOGPROBS, dim=-1)
        return torch.cat([chosen, rank, top], dim=1), top_ids

    def _mask(self, logits: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
        """logits [rows, >= vocab] with the tokens each row's lane's grammar bitmask forbids at -inf (a copy).
        Graph-capturable."""
        out = logits.clone()
        mask_tokens_(out, self.gmask, lane, min(self.runner.sampler.vocab_limit, logits.shape[1]))
        return out

    def _filter(self, logits: torch.Tensor, temp: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
        """logits [rows, >= vocab] with what each row's lane's min_p, top_k and top_p drop at -inf, as the
        host sampler drops it (after temperature; greedy rows keep their argmax). Graph-capturable."""
        vocab = min(self.runner.sampler.vocab_limit, logits.shape[1])
        scaled = logits[:, :vocab].float() / temp.clamp(min=GREEDY_EPS)[:, None]
        scaled = mask_min_p(scaled, self.min_p[lane])
        scaled = mask_top_k_top_p(scaled, self.top_k[lane].long(), self.top_p[lane])
        out = logits.clone()
        out[:, :vocab] = logits[:, :vocab].masked_fill(scaled == -math.inf, -math.inf)
        return out

    def ready(self, lp: bool, filt: bool, gram: bool) -> bool:
        """The graphs of this variant are captured (or none are used)."""
        return not (lp or filt or gram) or (lp, filt, gram) in self.prepared

    def prepare(self, lp: bool, filt: bool, gram: bool) -> None:
        """Capture the graphs of a variant, with and without shared prefixes (once, on first need; only
        while no run is active: start() loads the lanes' state afterwards)."""
        if not self.ready(lp, filt, gram):
            self.active.zero_()  # so that warm-up and capture write no K/V
            for b in self._lane_counts():
                for casc in self._cascades():
                    self._graph(b, lp, filt, gram, casc)
            self.prepared.add((lp, filt, gram))

    def _cascades(self) -> tuple[bool, ...]:
        return (False, True) if self.cascade_ok else (False,)

    def _graph(self, rows: int, lp: bool = False, filt: bool = False, gram: bool = False,
               casc: bool = False) -> None:  # fmt: skip
        if (rows, lp, filt, gram, casc) not in self.graphs:
            r = self.runner
            state = self._save()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(rows, lp, filt, gram, casc)  # compiles the kernels outside the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._restore(state)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=r.pool):
                self._step(rows, lp, filt, gram, casc)
            self._restore(state)
            self.graphs[(rows, lp, filt, gram, casc)] = g

    def _save(self):
        # Warm-up and capture run the step for real: keep the lane state as it was.
        return [t.clone() for t in self._state()]

    def _restore(self, saved) -> None:
        for t, s in zip(self._state(), saved):
            t.copy_(s)

    def _state(self):
        lanes = (self.tok, self.pos, self.loop, self.active, self.h, self.ls, self.launches, self.ploop)
        return (*lanes, self.emitted)

    def _lane_counts(self) -> list[int]:
        # A graph for every power-of-two lane count, up to max_lanes.
        return sorted({min(1 << i, self.max_lanes) for i in range(self.max_lanes.bit_length() + 1)})

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the lane graphs for every power-of-two lane count (start-up); no lane active."""
        if self.runner.use_graphs:
            self.active.zero_()  # so that warm-up and capture write no K/V
            for b in self._lane_counts():
                for casc in self._cascades():
                    self._graph(b, casc=casc)
            self._compile_rider_kernels()

    @torch.inference_mode()
    def launch_all(self) -> None:
        """Launch each lane step capture() captures, and the riders' kernels, once (precompile's walk);
        the lane state is kept as it was."""
        state = self._save()
        self.active.zero_()
        for b in self._lane_counts():
            for casc in self._cascades():
                self._step(b, casc=casc)
        self._compile_rider_kernels()
        self._restore(state)

    def _compile_rider_kernels(self) -> None:
        """Compile the riders' two kernels now (on first use they would stall the first join by
        ~0.5 s). They run for real on idle lanes, whose state start() and seat() rewrite."""
        one = self.inputs.dev["riders"][:1]
        rows = self.rows or 1
        pack_lane_step(self, self.runner, self.inputs.dev["kill"], one, rows, self.block_size)
        exits = torch.zeros(rows + 1, dtype=torch.int32, device=self.device)
        ids = torch.zeros(rows + 1, dtype=torch.int64, device=self.device)
        rider_epilogue(self, self.runner, one, exits, ids, rows)
        self.ploop.fill_(-1)

    def _step(self, rows: int, lp: bool = False, filt: bool = False, gram: bool = False,
              casc: bool = False) -> None:  # fmt: skip
        """One loop for lanes [0, rows), with the samples' log-probabilities if lp, the lanes' top_k,
        top_p and min_p if filt, their grammar bitmasks if gram and their classes' shared prefixes read once
        if casc: graph-capturable (fixed shapes, no host reads)."""
        bs, d = self.block_size, self.inputs.dev
        embed = self.model.model.embed_tokens.weight
        h, tables, slot, q_start, run, seeds, group = lane_prologue(self, d["kill"][:rows], d["cls"][:rows],
                                                                    embed, rows, bs)  # fmt: skip
        prefixes = SharedPrefixes(group, d["glen"]) if casc else None
        self.attn.batch = TritonBatch(slot, self.pos[:rows], tables, q_start, run, self.tok_off[:rows], 1,
                                      prefixes)  # fmt: skip
        x = run_loop_fused(self.model, h, self.attn)
        # The host-driven step's log-survival kernel code, so exits match it bit for bit.
        log_surv, exits = lane_exits(self, run, x, self.model.model.early_exit_gate, rows)
        logits = self._lm_head(x, exits)
        # Exiting lanes sample (the others get id -1, never read): greedy or Gumbel-max, Philox keyed by
        # (engine seed, launch, lane), so a launch's draws never depend on the host.
        vocab = min(self.runner.sampler.vocab_limit, logits.shape[1])
        lane = self.lane_idx[:rows]
        chosen = self._mask(logits, lane) if gram else logits
        chosen = self._filter(chosen, self.temp[:rows], lane) if filt else chosen
        ids = sample_gumbel(chosen, self.temp[:rows], seeds, GREEDY_EPS, vocab, row_gate=exits)
        if lp:
            vals, top = self._logprobs(logits, ids)
            self.lp_vals[:rows].copy_(vals)
            self.lp_ids[:rows].copy_(top)
        src, dst = self.prop_src[: (self.num_loops - 1) * rows], self.prop_dst[: (self.num_loops - 1) * rows]
        lane_epilogue(self, run, slot, log_surv, exits, ids, x, rows, bs, src, dst)
        # Last-exited propagation: the exit plane's K/V into every deeper plane, in this launch.
        propagate_kv(self.runner.kv_cache, src, dst)
        publish_records(self, rows)  # the launch's last kernel stores its records in the host ring

    def _lm_head(self, x: torch.Tensor, exits: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab]. Up to SKINNY_MAX_M lanes a launch where no lane exits skips the
        weight stream (the stale logits then feed samples nobody reads); beyond, cuBLAS always."""
        rows = x.shape[0]
        if rows > SKINNY_MAX_M:
            return self.model.logits(x)
        weight = self.model.lm_head_weight()
        out = self.logits_buf[:rows]
        return skinny_linear(x, weight, out=out, row_gate=exits)
