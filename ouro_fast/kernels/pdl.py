"""Programmatic dependent launch (PDL): let the next decode kernel launch while this one runs.

A decode step is ~200 small kernels; on Hopper each would otherwise pay its launch
and ramp-up after the previous one drains. A kernel launched with PDL may start
while its predecessor still runs; it must call `pdl_enter` before touching any
memory a predecessor writes (it blocks until the predecessor finished and flushed),
and pdl_enter lets the kernel after it launch in turn: after the wait, or before it
with EARLY (the default with the tensor-core matmuls, below). Reads of memory no
kernel in the step writes (weights) may come before pdl_enter.

Enabled on CUDA devices of compute capability >= 9 (not under the interpreter);
OURO_FAST_PDL=0 turns it off. OURO_FAST_PDL_PLAIN (comma-separated kernel names: skinny,
norm, rope_kv, decode_attention, lanes, sample, propagate) launches those kernels without
the attribute, for A/B runs: they still wait and release their successor, but start only once their
predecessor is done (a large grid launched early may crowd onto the SMs freed first).
A kernel launched without PDL after one with PDL, or the reverse, is ordered as
usual, so PDL and plain launches mix safely.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .launch import interpreting


# Early release: a kernel lets the next one launch BEFORE its own wait, so that a matmul behind a small
# kernel (a norm, the attention) starts streaming its weights while the kernel before that still runs.
# Safe: each kernel still waits for its predecessor, which waited for its own, and a dependent launches
# only once every CTA of its predecessor has started, so no kernel waits for one that cannot start.
# On with the tensor-core matmuls (tc_gemm, whose weight ring fills before its wait); with the Triton
# skinny matmuls it was slower (docs/benchmarks.md, sixteenth session). OURO_FAST_PDL_EARLY=0/1 overrides.
def early_release(environ) -> bool:
    """OURO_FAST_PDL_EARLY if set, else on unless the tensor-core matmuls are off (OURO_FAST_TC_GEMM=0)."""
    return environ.get("OURO_FAST_PDL_EARLY", environ.get("OURO_FAST_TC_GEMM", "1")) not in ("0", "")


EARLY = early_release(os.environ)
_EARLY = tl.constexpr(EARLY)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, and allow the next kernel to launch (before the wait, EARLY)."""
    if USE_PDL:
        if _EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not _EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on `device` launch with PDL (Hopper or newer, compiled, not switched off)."""
    if device.type != "cuda" or interpreting() or os.environ.get("OURO_FAST_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device, kernel: str = "") -> dict:
    """Launch options for a kernel that calls pdl_enter: USE_PDL, plus launch_pdl when enabled
    (unless `kernel` is named in OURO_FAST_PDL_PLAIN)."""
    if not pdl_enabled(device):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": kernel not in _PLAIN}


def plain_kernels(spec: str) -> frozenset[str]:
    """The kernel names of an OURO_FAST_PDL_PLAIN value ("skinny,norm"); empty names are ignored."""
    return frozenset(name.strip() for name in spec.split(",") if name.strip())


_PLAIN = plain_kernels(os.environ.get("OURO_FAST_PDL_PLAIN", ""))
