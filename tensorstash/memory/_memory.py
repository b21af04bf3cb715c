"""Real memory over a step: what the process holds, not what a stash counts.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Real memory ]
1. On the CPU the real peak of a step is the most the process's resident set
   grew over it: Linux's high-water mark (``VmHWM`` in /proc/self/status)
   after resetting it to the current resident set (writing "5" to
   /proc/self/clear_refs), less the resident set at the step's start. Exact
   (the kernel keeps the maximum), and two small file operations per step.
2. Where clear_refs cannot be written (not Linux, or not allowed), a thread
   samples the resident set every millisecond instead; it may miss a peak
   shorter than that, and its wake-ups cost the step a little time.
3. Before a step, garbage is collected and the allocator's free memory is
   handed back to the operating system (glibc's ``malloc_trim(0)``, or another
   allocator's own call: rule 12 of NOTE [ Returning memory ] in _trim.py):
   glibc keeps freed memory, so a step would otherwise reuse the last step's
   pages and show no growth at all (see DESIGN.md, measured facts). Every
   variant starts from the same trimmed heap, and its step time includes the
   first touch of the fresh pages it uses, as in a process just started. On
   CUDA, where the real peak is the device's (rule 5), garbage is collected
   and the heap kept: a step there would fault in the interpreter's pages
   for nothing it measures, and a step bound by launching kernels pays that
   in full.
4. Everything the process holds counts: bytes a stash counts as "disk" that
   still wait for the writer, compressed buffers, allocator slack, the
   recomputation of a checkpointed block.
5. On CUDA the real peak is ``torch.cuda.max_memory_allocated`` over the step,
   after ``reset_peak_memory_stats``, less ``memory_allocated`` at its start:
   what the step added to the tensors already there (weights, gradients). The
   caching allocator counts on the host as kernels are queued, so a profile
   measuring a training step does not wait for the device (``sync=False``);
   the bench does, to close each region where the device finished it.
6. Both peaks are process- or device-wide: a meter resets the high-water mark
   other tools read too.
7. On the CPU a meter also counts the bytes the region faulted in (minor page
   faults, ``getrusage``, process-wide, times the page size): memory handed
   back to the OS costs its first touch again when the heap reuses it, so this
   is where a step that returns memory pays for it: a trimmed disk spill
   faults in well beyond what no stash or an untrimmed spill does, and at the
   first touch's rate that is most of what the spill adds to the step.
"""

from __future__ import annotations

import gc
import os
import threading

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import psutil
import torch

from tensorstash.memory._trim import PAGE_SIZE, release_free_heap, resident_bytes


def current_rss() -> int:
    """The process's resident set size in bytes (/proc/self/statm where it exists: cheap)."""
    try:
        return resident_bytes()
    except OSError:
        return int(psutil.Process().memory_info().rss)


def host_ram() -> tuple[int, int]:
    """Available and total bytes of host RAM.

    Linux's ``MemAvailable`` and ``MemTotal`` from /proc/meminfo, what
    ``psutil.virtual_memory()`` reports there, read through one descriptor
    the process keeps open (system-wide: a forked child may share it), several
    times faster than psutil, which opens the file and parses every line:
    Auto reads it every step. Elsewhere, or on a kernel without
    ``MemAvailable``, psutil.
    """
    global _meminfo
    try:
        if _meminfo < 0:
            _meminfo = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
        head = os.pread(_meminfo, 512, 0)
    except OSError:
        head = b""
    total = available = None
    for line in head.splitlines():
        if line.startswith(b"MemTotal:"):
            total = int(line.split()[1]) * 1024
        elif line.startswith(b"MemAvailable:"):
            available = int(line.split()[1]) * 1024
            break
    if total is None or available is None:
        info = psutil.virtual_memory()
        return int(info.available), int(info.total)
    return available, total


_meminfo = -1  # /proc/meminfo, opened by the first read (a race opens it twice: harmless)


def _high_water_rss() -> int | None:
    """Linux's VmHWM, the process's peak resident set, or None where unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_high_water_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _high_water_rss() is not None


def return_free_memory(device: torch.device | None = None) -> None:
    """Rule 3 of NOTE [ Real memory ]: collect garbage, and return the allocator's free
    memory unless the step runs on a CUDA ``device``."""
    gc.collect()
    if device is None or device.type != "cuda":
        release_free_heap()


def minor_faults() -> int | None:
    """The process's minor page faults so far, or None where ``getrusage`` is missing."""
    if resource is None:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def faulted_since(faults: int | None) -> int | None:
    """Bytes the process faulted in since :func:`minor_faults` read ``faults``, or None
    where faults are not counted."""
    if faults is None:
        return None
    now = minor_faults()
    return None if now is None else (now - faults) * PAGE_SIZE


class PeakRss:
    """How far the resident set grows over a region (rules 1 and 2 of NOTE [ Real memory ]).

    Args:
        interval_s: the sampling thread's period, where the high-water mark
            cannot be reset.
        resettable: whether to use the high-water mark; injected for tests.

    Attributes:
        delta_bytes: the growth, set on exit.
        faulted_bytes: the bytes the process faulted in over the region (rule 7),
            set on exit; None where the platform does not count them.
        sampled: whether a sampling thread measured it (rule 2).

    Example:
        >>> with PeakRss() as meter:
        ...     run_step()
        >>> meter.delta_bytes
    """

    def __init__(self, interval_s: float = 0.001, *, resettable: bool = True) -> None:
        self.delta_bytes = 0
        self.faulted_bytes: int | None = None
        self.sampled = False
        self._faults: int | None = None
        self._interval_s = interval_s
        self._resettable = resettable
        self._start = 0
        self._most = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin the region (what ``with`` does)."""
        self.__enter__()

    def stop(self) -> int:
        """End the region (what ``with`` does); the growth in bytes."""
        self.__exit__(None, None, None)
        return self.delta_bytes

    def __enter__(self) -> PeakRss:
        reset = self._resettable and _reset_high_water_rss()
        self._start = current_rss()
        self._faults = minor_faults()
        if not reset:
            self.sampled = True
            self._most = self._start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is None:
            peak = max(_high_water_rss() or 0, current_rss())
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._most, current_rss())
        self.delta_bytes = max(0, peak - self._start)
        self.faulted_bytes = faulted_since(self._faults)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._most = max(self._most, current_rss())


class CudaPeak:
    """How far CUDA allocated memory grows over a region (rule 5 of NOTE [ Real memory ]).

    Args:
        device: the CUDA device.
        sync: wait for the device at the region's ends (the bench); a profile
            does not (rule 5).
    """

    def __init__(self, device: torch.device, *, sync: bool = True) -> None:
        self.delta_bytes = 0
        self._device = device
        self._sync = sync
        self._start = 0

    def start(self) -> None:
        """Begin the region (what ``with`` does)."""
        self.__enter__()

    def stop(self) -> int:
        """End the region (what ``with`` does); the growth in bytes."""
        self.__exit__(None, None, None)
        return self.delta_bytes

    def __enter__(self) -> CudaPeak:
        if self._sync:
            torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._start = torch.cuda.memory_allocated(self._device)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._sync:
            torch.cuda.synchronize(self._device)
        self.delta_bytes = max(0, torch.cuda.max_memory_allocated(self._device) - self._start)


def meter(device: torch.device, *, sync: bool = True) -> PeakRss | CudaPeak:
    """The real-memory meter of ``device``: :class:`CudaPeak` on CUDA, else :class:`PeakRss`."""
    return CudaPeak(device, sync=sync) if device.type == "cuda" else PeakRss()


def real_memory_now(device: torch.device) -> int:
    """What the process holds now: CUDA allocated bytes, or the resident set."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return current_rss()
