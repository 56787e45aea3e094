"""Programmatic dependent launch (PDL): let the next decode kernel launch while this one runs.

A decode step is ~200 small kernels; on Hopper each would otherwise pay its launch
and ramp-up after the previous one drains. A kernel launched with PDL may start
while its predecessor still runs; it must call `pdl_enter` before touching any
memory a predecessor writes. pdl_enter first lets the kernel after it launch, then
blocks until the predecessor finished and flushed its writes. Reads of memory no
kernel in the step writes (weights) may come before pdl_enter.

Releasing the successor before the wait lets a matmul behind a small kernel (a norm,
the attention) stream its weights while the kernel before that still runs. It cannot
deadlock: each kernel still waits for its predecessor, which waited for its own, and a
dependent launches only once every CTA of its predecessor has started.

Enabled on CUDA devices of compute capability >= 9, compiled (not under the interpreter).
A kernel launched without PDL after one with PDL, or the reverse, is ordered as usual,
so PDL and plain launches mix safely.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import interpreting


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """With USE_PDL, allow the next kernel to launch, then wait for the previous kernel's writes."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on `device` launch with PDL (Hopper or newer, compiled)."""
    if device.type != "cuda" or interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict:
    """Launch options for a kernel that calls pdl_enter: USE_PDL, plus launch_pdl where PDL is enabled."""
    if not pdl_enabled(device):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}
