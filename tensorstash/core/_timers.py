"""Timers that mark moments and give the seconds between two marks: a clock's on the CPU,
events on the current stream on CUDA (NOTE [ Profile ] rule 7, NOTE [ Recompute ] rule 7)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CpuTimer:
    """Marks times with a clock (the profile's)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def mark(self) -> Any:
        return self.clock()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    @staticmethod
    def done(end: Any) -> bool:
        return True


class CudaTimer:
    """Marks times with events on the device's current stream: read once they complete."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0

    @staticmethod
    def done(end: Any) -> bool:
        return bool(end.query())
