"""GPU time of a captured CUDA graph by CUDA events: shared by the GPU benchmark scripts.

The scripts run as files (`python3 -P bench/gpu/NAME.py`, so that the installed
ouro_fast is imported, not the source tree); each puts this folder on sys.path first.
"""

from __future__ import annotations

import torch


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn run once eagerly (compiles, allocates), then captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, warmup: int = 10) -> float:
    """Mean GPU milliseconds per replay over `replays` back-to-back replays, after `warmup` untimed."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def host_replay_us(graph: torch.cuda.CUDAGraph, n: int = 20) -> dict[str, float]:
    """Median host microseconds of one graph.replay() call: with the GPU idle (synchronized first), and
    queued right behind a replay of the same graph (the GPU busy, as run-ahead queues launches)."""
    import statistics
    import time

    idle, busy = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        idle.append(time.perf_counter() - t)
        t = time.perf_counter()
        graph.replay()
        busy.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return {"idle": round(1e6 * statistics.median(idle), 1), "busy": round(1e6 * statistics.median(busy), 1)}


def kernel_us(graph: torch.cuda.CUDAGraph, replays: int, top: int = 12) -> dict[str, float]:
    """GPU microseconds a replay spends in each kernel (by name, the largest `top`, the rest as "other"),
    from the torch profiler over `replays` replays."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            times[e.key[:60]] = times.get(e.key[:60], 0.0) + us / replays
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    table = {k: round(v, 1) for k, v in ranked[:top]}
    if len(ranked) > top:
        table["other"] = round(sum(v for _, v in ranked[top:]), 1)
    return table
