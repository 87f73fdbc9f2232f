"""Wall-clock timing that reads finished work: on CUDA, kernels run asynchronously, so the clock
synchronises the device before every reading. The decoders, the benchmark and the pass-cost
measurement all time through here."""

from __future__ import annotations

import time

import torch


def now(device: torch.device | None = None) -> float:
    """`time.perf_counter()` after the device's queued work has finished."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Clock:
    """Seconds since it was made, read after the device's queued work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.now()

    def now(self) -> float:
        return now(self.device)

    def elapsed(self) -> float:
        return self.now() - self.start
