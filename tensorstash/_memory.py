"""What the process or the device really holds: the peak over a span of time.

# NOTE [ Real memory ]
1. On a CUDA device the real figure is ``torch.cuda.max_memory_allocated``: the
   meter resets the device's peak statistics when it starts and reports the
   peak less what was allocated then.
2. On the CPU it is the resident set. Linux keeps the process's high-water mark
   (``VmHWM`` in /proc/self/status) and resets it to the current resident size
   when "5" is written to /proc/self/clear_refs: the meter resets it when it
   starts and reads it when it stops, exact and cheap (no sampling thread).
   Where that file cannot be written, it samples the resident size on a thread.
3. Both are process- or device-wide: a meter resets the peak that other tools
   read. Freed memory often stays in the process (glibc keeps it for reuse), so
   the growth over a step depends on what the heap held before; the bench
   trims the heap (``malloc_trim``) before each measured step.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import psutil
import torch

_PAGE = 1024  # VmHWM and VmRSS are in kB
_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kb(field: str) -> int | None:
    try:
        with open(_STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_high_water_mark() -> bool:
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``), if there is one."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMeter:
    """The peak memory growth over a span (rules 1 and 2 of NOTE [ Real memory ]).

    Args:
        device: a CUDA device measures allocated device memory; anything else
            measures the process's resident memory.

    Example:
        >>> meter = PeakMeter(torch.device("cpu"))
        >>> meter.start()
        >>> loss = model(x).sum(); loss.backward()
        >>> meter.stop()  # bytes the peak rose over where it started
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None
        self._base = 0
        self._sampled = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Begin the span: reset the peak, remember where memory stands."""
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        self._base = _rss()
        if not _reset_high_water_mark():
            self._sampled = self._base
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, name="tensorstash-meter")
            self._sampler.start()

    def stop(self) -> int:
        """End the span: the bytes the peak rose over the start (0 if it never rose)."""
        if self.device is not None:
            return max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            peak = self._sampled
        else:
            high = _status_kb("VmHWM:")
            peak = high * _PAGE if high is not None else _rss()
        return max(0, peak - self._base)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, _rss())
            time.sleep(0.0005)


def _rss() -> int:
    resident = _status_kb("VmRSS:")
    return resident * _PAGE if resident is not None else int(psutil.Process().memory_info().rss)
