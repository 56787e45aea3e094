"""The engine on the GPU, no HTTP: 128 tokens in, 64 out, concurrency 1 and 8, full depth and threshold 0.5.

Generates the ouro-1.4b preset (random bf16 weights, in OURO_PROBE_CKPT, default /tmp/ck14) on first use,
warms up, then prints per case: tokens/s, ms per loop step, TTFT, and the split of a step into
scheduler / model / detokenization; the GPU time of one captured loop step (step graph and run-ahead
lane graph) at 1 and 8 rows against the weight-streaming floor; start-up time and GPU memory; and a
torch-profiler table of the top kernels. Usage (GPU machine, repo root, the package installed):

    python3 -P bench/gpu/engine_probe.py [RUNNER]        # RUNNER: auto (default), triton or torch

Settings (environment): PROBE_CASES ("conc:threshold/...", "none": graph times only), PROBE_RUN_AHEAD
(1, full: full-depth batches too, as the server runs them, or 0), PROBE_CLOSED
("conc:threshold:prompts[:K]/..." closed loops, every engine call timed by kind; K: a profiler trace
after the K-th completion, with the GPU time of each kernel over 60 engine calls), PROBE_IN / PROBE_OUT
(the closed loops' prompt and output tokens, 128 / 64), PROBE_MAX_SEQS (64), PROBE_MAX_TOKENS (2048),
PROBE_CASCADE=0 (the engine without shared-prefix decode attention), PROBE_KV_CACHE_DTYPE (auto, fp8),
PROBE_HOLD=0 (the engine without holding newcomers for a run's start), PROBE_TRACE=1 (a chrome trace of the
profiled steps), PROBE_LOG_COMPILES=1 (Triton compiles after
start-up), PROBE_TAG.
Writes engine_probe_<tag>.json (and any traces) to $OUT, by default bench/results/engine-probe-<UTC time>/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from ouro_fast.engine.engine import Engine, EngineConfig
from ouro_fast.engine.sampling import SamplingParams
from ouro_fast.model.checkpoints import make_checkpoint

sys.path.insert(0, str(Path(__file__).parent))  # replay_timing, next to this file
from replay_timing import replay_ms  # noqa: E402

CKPT = os.environ.get("OURO_PROBE_CKPT", "/tmp/ck14")
# PROBE_IN, PROBE_OUT: prompt and output tokens of the closed-loop runs.
CLOSED_IN, CLOSED_OUT = int(os.environ.get("PROBE_IN", "128")), int(os.environ.get("PROBE_OUT", "64"))
_OUT: list[str] = []


def out_dir() -> str:
    """$OUT, or a new bench/results/engine-probe-<UTC time>/ (git-ignored) made on first use."""
    if not _OUT:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        default = Path(__file__).resolve().parents[2] / "bench" / "results" / f"engine-probe-{stamp}"
        _OUT.append(os.environ.get("OUT") or str(default))
        os.makedirs(_OUT[0], exist_ok=True)
    return _OUT[0]


def run_case(eng: Engine, rng, conc: int, q: float) -> dict:
    def submit(tag: str, n_out: int) -> None:
        for i in range(conc):
            prompt = rng.integers(3, 1000, 128).tolist()
            eng.add_request(f"{tag}{conc}-{q}-{i}", prompt, SamplingParams(max_tokens=n_out, ignore_eos=True,
                                                                            exit_threshold=q))  # fmt: skip

    submit("warm", 8)
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    s = eng.stats
    before = (s.steps, s.model_seconds, s.scheduler_seconds, s.detok_seconds)
    t0 = time.perf_counter()
    submit("run", 64)
    ttft = None
    while eng.has_unfinished_requests():
        outs = eng.step()
        if ttft is None and any(o.new_token_ids for o in outs):
            ttft = time.perf_counter() - t0
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    steps = s.steps - before[0]
    per_step = lambda total, i: round(1000 * (total - before[i]) / steps, 4)  # noqa: E731
    return {
        "conc": conc, "threshold": q, "seconds": round(dt, 4), "tok_s": round(conc * 64 / dt, 1),
        "steps": steps, "ms_per_step": round(1000 * dt / steps, 4), "ttft_ms": round(1000 * ttft, 2),
        "model_ms_per_step": per_step(s.model_seconds, 1),
        "sched_ms_per_step": per_step(s.scheduler_seconds, 2),
        "detok_ms_per_step": per_step(s.detok_seconds, 3),
        "exit_depth_histogram": list(s.exit_depth_histogram),
    }  # fmt: skip


COMPILES: list[dict] = []  # Triton compiles after start-up (PROBE_LOG_COMPILES=1)
CURRENT = {"call": "start-up"}


def log_compiles() -> None:
    """Record every Triton compile from now on, with the engine call it happened in: a compile
    after start-up stalls the requests of that step (~0.1-0.8 s on the H200)."""
    from triton.runtime.jit import JITFunction

    inner = JITFunction._do_compile

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        kernel = inner(self, *args, **kwargs)
        COMPILES.append({"kernel": self.fn.__name__, "call": CURRENT["call"],
                         "ms": round(1000 * (time.perf_counter() - t), 1),
                         "constexprs": str(args[3] if len(args) > 3 else "")[:240]})  # fmt: skip
        return kernel

    JITFunction._do_compile = timed


def run_closed(eng: Engine, rng, conc: int, q: float, prompts: int, trace_after: int = -1) -> dict:
    """Closed loop, as `vllm bench serve --max-concurrency`: a finished request is replaced at once.

    Times every engine call by kind: a run-ahead replay ("lanes"), a step that starts run-ahead
    ("start"), a host-driven step with or without prompt tokens ("host_prefill", "host_decode"),
    and add_request (which replays the launches in flight first: "admit")."""
    kinds: dict[str, list[float]] = {}
    s, ahead = eng.stats, eng.ahead

    def add(kind: str, dt: float) -> None:
        kinds.setdefault(kind, []).append(dt)
        CURRENT["call"] = f"{conc}:{q} after {kind}"

    def submit(i: int) -> None:
        prompt = rng.integers(3, 1000, CLOSED_IN).tolist()
        t = time.perf_counter()
        params = SamplingParams(max_tokens=CLOSED_OUT, ignore_eos=True, exit_threshold=q)
        eng.add_request(f"closed{conc}-{q}-{i}", prompt, params)
        add("admit", time.perf_counter() - t)

    # trace_after=K: a torch-profiler chrome trace of 60 engine calls after the K-th completion.
    prof, traced, traced_t0, kernel_table = None, 0, 0.0, None
    launches_at, calls_at = (0, 0), {}  # launches, rider launches and engine calls when the trace started
    runs0 = ahead.runs if ahead is not None else 0
    riders0 = getattr(ahead, "total_riders", 0)  # builds before riders have none
    hist0 = list(s.exit_depth_histogram)
    t0 = time.perf_counter()
    sent = done = 0
    for _ in range(conc):
        submit(sent)
        sent += 1
    while eng.has_unfinished_requests():
        was = ahead is not None and ahead.active
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if was:
            add("lanes", dt)
        elif ahead is not None and ahead.active:
            add("start", dt)
        else:
            add("host_prefill" if s.tokens > s.rows else "host_decode", dt)
        if prof is not None:
            traced += 1
            if traced == 60:
                torch.cuda.synchronize()
                prof.stop()
                window_ms = 1000 * (time.perf_counter() - traced_t0)
                if os.environ.get("PROBE_TRACE"):
                    prof.export_chrome_trace(os.path.join(out_dir(), f"closed_{conc}_{q}.json"))
                kernel_table = kernel_summary(prof, window_ms)
                if ahead is not None:
                    kernel_table["launches"] = ahead.total_launches - launches_at[0]
                    kernel_table["rider_launches"] = ahead.rider_launches - launches_at[1]
                kernel_table["calls"] = {k: len(v) - calls_at.get(k, 0) for k, v in kinds.items()}
                prof, trace_after = None, -1
        for o in outs:
            if o.finished:
                done += 1
                if done == trace_after and prof is None:
                    # PROBE_TRACE_CPU=0: the GPU's timeline alone (no host-side profiling overhead).
                    acts = [ProfilerActivity.CUDA]
                    if os.environ.get("PROBE_TRACE_CPU", "1") != "0":
                        acts.append(ProfilerActivity.CPU)
                    prof = profile(activities=acts)
                    if ahead is not None:
                        launches_at = (ahead.total_launches, ahead.rider_launches)
                    calls_at = {k: len(v) for k, v in kinds.items()}
                    prof.start()
                    traced_t0 = time.perf_counter()
                if sent < prompts:
                    submit(sent)
                    sent += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    hist = [a - b for a, b in zip(s.exit_depth_histogram, hist0)]
    return {
        "closed_loop": True, "conc": conc, "threshold": q, "prompts": prompts, "seconds": round(dt, 4),
        "tok_s": round(prompts * CLOSED_OUT / dt, 1), "in_out": [CLOSED_IN, CLOSED_OUT],
        "mean_depth": round(sum((i + 1) * n for i, n in enumerate(hist)) / max(sum(hist), 1), 3),
        "run_ahead_runs": (ahead.runs if ahead is not None else 0) - runs0,
        "run_ahead_riders": getattr(ahead, "total_riders", 0) - riders0,
        "calls": {k: {"n": len(v), "total_ms": round(1000 * sum(v), 2),
                      "mean_ms": round(1000 * sum(v) / len(v), 4), "max_ms": round(1000 * max(v), 2)}
                  for k, v in kinds.items()},
        "exit_depth_histogram": hist, "max_num_seqs": eng.config.max_num_seqs,
        "max_num_batched_tokens": eng.config.max_num_batched_tokens, "kernels": kernel_table,
    }  # fmt: skip


# Kernel families by name (first match wins): the step's time split the way the floor model splits it.
KERNEL_KINDS = (
    ("decode_attention", ("_fused_decode_kernel", "_decode_split_kernel", "_decode_merge_kernel")),
    ("shared_prefix_attention", ("_prefix_kernel",)),
    ("prompt_attention", ("_paged_attention_kernel", "flash", "attention")),
    ("matmul", ("_tc_gemm_kernel", "_skinny_kernel", "_split_reduce_kernel", "_tiled_kernel",
                "_quantize_rows", "gemm", "nvjet", "cutlass", "xmma", "sm90_", "splitk")),
    ("norm", ("rms_norm",)),
    ("swiglu", ("_silu_and_mul",)),
    ("sampling_and_lanes", ("_sample_kernel", "_bitmask_kernel", "_gate_kernel", "_prologue_kernel",
                            "_exits_kernel", "_epilogue_kernel", "_publish_kernel", "_pack_kernel",
                            "_rider_epilogue_kernel", "_propagate_kernel", "_rope_write_kv_kernel")),
)  # fmt: skip


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def kernel_summary(prof, window_ms: float, top: int = 25) -> dict:
    """GPU time by kernel over a traced window of 60 engine calls: the share of the window each takes,
    and the sums by kernel family (KERNEL_KINDS)."""
    rows = []
    busy = 0.0
    kinds: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us <= 0:
            continue
        busy += us
        rows.append((us, e.count, e.key[:90]))
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + us
    rows.sort(reverse=True)
    return {"window_ms": round(window_ms, 2), "gpu_busy_ms": round(busy / 1000, 2),
            "by_kind_ms": {k: round(v / 1000, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"ms": round(us / 1000, 3), "n": n, "name": k} for us, n, k in rows[:top]]}  # fmt: skip


def main() -> None:
    runner = sys.argv[1] if len(sys.argv) > 1 else "auto"
    if not os.path.exists(os.path.join(CKPT, "model.safetensors")):
        make_checkpoint("ouro-1.4b", CKPT, seed=0, dtype="bfloat16", progress=False)
    t = time.perf_counter()
    # PROBE_RUN_AHEAD: 1 (default: early-exit batches), full (full-depth batches too) or 0 (off);
    # PROBE_RUN_AHEAD_DEPTH: launches queued ahead (1..3).
    ahead = os.environ.get("PROBE_RUN_AHEAD", "1")
    depth = int(os.environ.get("PROBE_RUN_AHEAD_DEPTH", "1"))
    # PROBE_MAX_TOKENS: the step's token budget (max_num_batched_tokens).
    max_tokens = int(os.environ.get("PROBE_MAX_TOKENS", "2048"))
    max_seqs = int(os.environ.get("PROBE_MAX_SEQS", "64"))
    eng = Engine(EngineConfig(model=CKPT, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                              runner=runner, run_ahead=ahead != "0", run_ahead_full_depth=ahead == "full",
                              run_ahead_depth=depth,
                              cascade_attention=os.environ.get("PROBE_CASCADE") != "0",
                              kv_cache_dtype=os.environ.get("PROBE_KV_CACHE_DTYPE", "auto")))  # fmt: skip
    print(f"engine ready in {time.perf_counter() - t:.2f}s, {eng.scheduler.num_blocks} KV blocks", flush=True)
    rng = np.random.default_rng(0)
    startup_s = time.perf_counter() - t
    if os.environ.get("PROBE_HOLD") == "0" and eng.ahead is not None:
        eng.ahead.hold_for_start = lambda: None  # the host path never holds arrivals for a start
    if os.environ.get("PROBE_LOG_COMPILES") == "1":
        log_compiles()
    # PROBE_CASES: "conc:threshold/..." (default all four), or "none" for the graph step times only.
    spec = os.environ.get("PROBE_CASES", "1:1.0/8:1.0/1:0.5/8:0.5")
    cases = [] if spec == "none" else [(int(c), float(q)) for c, q in (x.split(":") for x in spec.split("/"))]
    results = [run_case(eng, rng, conc, q) for conc, q in cases]
    # PROBE_CLOSED: "conc:threshold:prompts[:K]/..." closed-loop runs (default none); K: a profiler
    # trace (perturbs that run's timing) of 60 engine calls after the K-th completion.
    closed = os.environ.get("PROBE_CLOSED", "")
    for c, q, n, *k in (x.split(":") for x in closed.split("/") if x):
        results.append(run_closed(eng, rng, int(c), float(q), int(n), int(k[0]) if k else -1))
    if COMPILES:
        results.append({"compiles_after_start_up": COMPILES})
    for r in results:
        print(json.dumps(r), flush=True)
    graph_steps = graph_step_times(eng)
    print(json.dumps({"graph_loop_step": graph_steps}), flush=True)
    free, total = torch.cuda.mem_get_info()
    gib = 2**30
    memory = {"startup_s": round(startup_s, 2),
              "max_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
              "reserved_gib": round(torch.cuda.memory_reserved() / gib, 2),
              "device_used_gib": round((total - free) / gib, 2), "kv_blocks": eng.scheduler.num_blocks,
              "run_ahead": ahead,
              "run_ahead_depth": depth}  # fmt: skip
    print(json.dumps(memory), flush=True)
    table = profile_table(eng, rng) if os.environ.get("PROBE_PROFILE", "1") != "0" else ""
    tag = os.environ.get("PROBE_TAG", runner)
    with open(os.path.join(out_dir(), f"engine_probe_{tag}.json"), "w") as f:
        json.dump({"runner": runner, "results": results, "graph_loop_step": graph_steps, **memory,
                   "profile_top_kernels": table}, f, indent=1)  # fmt: skip


def profile_table(eng: Engine, rng) -> str:
    """The torch-profiler table of the top kernels over 8 decode steps of one request."""
    prompt = rng.integers(3, 1000, 128).tolist()
    eng.add_request("profile", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(8):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            eng.step()
        torch.cuda.synchronize()
    if os.environ.get("PROBE_TRACE"):
        prof.export_chrome_trace(os.path.join(out_dir(), "trace.json"))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    print(table)
    return table


def graph_step_times(eng: Engine, replays: int = 200) -> list[dict]:
    """GPU time of one captured decode loop step (all 24 layers) at 1 and 8 rows, by CUDA events.

    The host-driven step graph replays on staged inputs that write no K/V (one token per
    row at position 0, slot -1); the run-ahead lane graph (same loop plus the lanes' exit,
    sampling and propagation work) replays with every lane active on an idle slot. The
    floor streams every weight of the 24 layers once at the measured ~4.8 TB/s peak of
    this GPU.
    """
    runner, rows = eng.runner, []
    weight_bytes = 0
    for lay in eng.model.model.layers:
        for w in (lay.self_attn.qkv_weight, lay.self_attn.o_proj.weight, lay.mlp.gate_up_weight,
                  lay.mlp.down_proj.weight):  # fmt: skip
            weight_bytes += w.numel() * w.element_size()
    floor_ms = weight_bytes / 4.8e12 * 1e3
    a, b = runner.i64.dev, runner.i32.dev
    a["ids"].zero_(), a["pos"].zero_(), a["slot"].fill_(-1), a["hsrc"].fill_(-1)
    a["last"].copy_(torch.arange(len(a["last"]))), a["prev_last"].fill_(-1)
    a["store"].fill_(runner.max_tokens)
    b["q_start"].zero_(), b["len"].fill_(1), b["tok_off"].copy_(torch.arange(len(b["tok_off"])))
    b["loop"].zero_(), b["lo"].fill_(127), b["hi"].fill_(127), b["bt"].fill_(0)
    lanes = getattr(runner, "lanes", None)
    for n in (1, 8):
        timed = [("step", getattr(runner, "graphs", {}).get((n, n, 1, False)))]
        plain = (n, False, False, False, False)  # no log-probabilities, filters, masks or shared prefixes
        if lanes is not None and plain in lanes.graphs:
            lanes.kvrow[:n] = 0
            lanes.tables.zero_()  # every plane in block 0: nothing else runs now
            lanes.pos[:n], lanes.loop[:n], lanes.lo[:n], lanes.hi[:n] = 0, 0, 0, 3
            lanes.cap[:n] = 1 << 30
            # Full depth, nothing killed, no stop ids: the last run's leftovers (an early-exit threshold, a
            # kill mask staged for its last launch) would change what the timed launches do.
            lanes.log1mq[:n] = float("-inf")
            lanes.stop_ids[:n] = -1
            lanes.inputs.dev["kill"].zero_()
            lanes.active[:n] = 1
            timed.append(("lanes", lanes.graphs[plain]))
        for kind, g in timed:
            if g is None:
                continue
            ms = replay_ms(g, replays)
            rows.append({"rows": n, "graph": kind, "gpu_ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
                         "fraction_of_floor": round(floor_ms / ms, 3)})  # fmt: skip
        if lanes is not None:
            lanes.active.zero_()
    return rows


if __name__ == "__main__":
    main()
