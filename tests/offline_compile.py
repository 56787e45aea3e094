"""A mock sm_90 driver: triton compiles for Hopper (ptxas included) on a machine without a GPU.

Triton compiles for a target with no device present if the active driver reports one: `MockDriver` says
"cuda, sm_90", and a kernel's `warmup(...)` (or a launch inside the start-up's compile walk) compiles without
running. tests/test_precompile.py uses it in subprocesses.
"""

from __future__ import annotations

import torch


class MockDriver:
    """The active driver for compiling only: one CUDA device of compute capability 9.0, stream 0."""

    backend = "cuda"

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def install() -> None:
    """Make MockDriver triton's active driver (for this process)."""
    from triton.runtime import driver

    driver.set_active(MockDriver())
