"""Pinned host buffers mirrored by device buffers: how a GPU step's inputs reach the device."""

from __future__ import annotations

import math

import numpy as np
import torch


class StagingBuffers:
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
