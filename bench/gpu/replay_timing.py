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
