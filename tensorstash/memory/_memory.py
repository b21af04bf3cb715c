"""Real memory over a step: what the process holds, not what a stash counts.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Real memory ]
1. On the CPU the real peak of a step is the most the process's resident set
   grew over it. A profile takes it without touching the counters a user
   reads (``VmHWM`` in /proc/self/status, and ``getrusage``'s ``ru_maxrss``,
   which the HF Trainer, Lightning's device monitor and users' own scripts
   read): a native thread (``_sampler.c``, no interpreter lock) reads
   /proc/self/statm every half millisecond, and where the step set a new
   high-water mark for the process, ``VmHWM`` read at its end is the exact
   peak, without resetting it. A peak shorter than the period, under the
   process's old high-water mark, can be missed.
2. The bench alone, a program of tensorstash's own, may reset the high-water
   mark (writing "5" to /proc/self/clear_refs) for an exact peak per region:
   ``PeakRss(reset=True)``. Where the native sampler is not built, a Python
   thread samples instead, at the same period, and takes the interpreter
   between the step's calls.
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
   recomputation of a checkpointed block, tensorstash's own pools and threads.
5. On CUDA the real peak is ``torch.cuda.max_memory_allocated`` over the step,
   after ``reset_peak_memory_stats``, less ``memory_allocated`` at its start:
   what the step added to the tensors already there (weights, gradients).
   The device keeps no other record of a peak, so this reset is the one
   tensorstash makes on a user's counters: only in the steps a profile
   measures (a few at the start, then two every ``remeasure_every``), and
   the plan table says so. The caching allocator counts on the host as
   kernels are queued, so a profile measuring a training step does not wait
   for the device (``sync=False``); the bench does, to close each region
   where the device finished it.
6. On the CPU nothing is reset but by the bench's own meters
   (``PeakRss(reset=True)``, rule 2).
7. On the CPU a meter also counts the bytes the region faulted in (minor page
   faults, ``getrusage``, process-wide, times the page size): memory handed
   back to the OS costs its first touch again when the heap reuses it, so this
   is where a step that returns memory pays for it: a trimmed disk spill
   faults in well beyond what no stash or an untrimmed spill does, and at the
   first touch's rate that is most of what the spill adds to the step.
"""

from __future__ import annotations

import gc
import importlib
import os
import threading
import time
from types import ModuleType
from typing import Any

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import psutil
import torch

from tensorstash.memory._trim import PAGE_SIZE, release_free_heap, resident_bytes


def _load_sampler() -> ModuleType | None:
    """The native peak sampler, or None where it is not built (no compiler, or not
    Linux): a Python thread samples then (rule 2)."""
    try:
        return importlib.import_module("tensorstash.memory._sampler")
    except ImportError:
        return None


_sampler = _load_sampler()


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
        interval_s: the sampling period.
        reset: reset the process's high-water mark for an exact peak (the bench's
            own regions only: rule 2); by default the user's counters stay as they were.

    Attributes:
        delta_bytes: the growth, set on exit.
        peak_bytes: the most the process held over the region, set on exit.
        start_bytes: the resident set when the region began.
        faulted_bytes: the bytes the process faulted in over the region (rule 7),
            set on exit; None where the platform does not count them.
        sampled: whether a sampling thread measured it (rules 1 and 2).

    Example:
        >>> with PeakRss() as meter:
        ...     run_step()
        >>> meter.delta_bytes
    """

    def __init__(self, interval_s: float = 0.0005, *, reset: bool = False) -> None:
        self.delta_bytes = 0
        self.peak_bytes = 0
        self.start_bytes = 0
        self.faulted_bytes: int | None = None
        self.sampled = False
        self._faults: int | None = None
        self._interval_s = interval_s
        self._reset = reset
        self._high: int | None = None
        self._most = 0
        self._native: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin the region (what ``with`` does)."""
        self.__enter__()

    def stop(self) -> int:
        """End the region (what ``with`` does); the growth in bytes."""
        self.__exit__(None, None, None)
        return self.delta_bytes

    def now(self) -> int:
        """The most the process held since the region began, this moment included."""
        if self._native is not None:
            return int(self._native.peak())
        self._most = max(self._most, current_rss())
        return self._most

    def __enter__(self) -> PeakRss:
        reset = self._reset and _reset_high_water_rss()
        self._high = None if reset else _high_water_rss()
        self.start_bytes = current_rss()
        self._faults = minor_faults()
        if reset:
            return self
        self.sampled = True
        self._most = self.start_bytes
        if _sampler is not None:
            try:
                self._native = _sampler.Sampler(self._interval_s)
                self._native.start()
                return self
            except (OSError, ValueError):
                self._native = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._native is not None:
            peak = int(self._native.stop())
            self._native = None
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            peak = max(self._most, current_rss())
        else:
            peak = max(_high_water_rss() or 0, current_rss())
        high = _high_water_rss() if self._high is not None else None
        if high is not None and self._high is not None and high > self._high:
            peak = max(peak, high)  # a new high for the process: the kernel's exact figure
        self.peak_bytes = peak
        self.delta_bytes = max(0, peak - self.start_bytes)
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
        self.start_bytes = 0
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
        self._start = self.start_bytes = torch.cuda.memory_allocated(self._device)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._sync:
            torch.cuda.synchronize(self._device)
        self.delta_bytes = max(0, torch.cuda.max_memory_allocated(self._device) - self._start)


def meter(device: torch.device, *, sync: bool = True, reset: bool = False) -> PeakRss | CudaPeak:
    """The real-memory meter of ``device``: :class:`CudaPeak` on CUDA, else :class:`PeakRss`
    (``reset``: the bench's own exact regions, rule 2)."""
    return CudaPeak(device, sync=sync) if device.type == "cuda" else PeakRss(reset=reset)


def real_memory_now(device: torch.device) -> int:
    """What the process holds now: CUDA allocated bytes, or the resident set."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return current_rss()


CAPACITY_TTL_S = 10.0
"""How long :func:`host_capacity` keeps what it read: a session under a limit asks every
step, and reading the cgroup's files took about 0.3 ms (a limit set anew is seen within
this)."""

_capacity: tuple[float, int] | None = None


def host_capacity() -> int:
    """The most RAM this process may hold: its cgroup's memory limit where one is set
    (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), else physical RAM; read
    again after ``CAPACITY_TTL_S``."""
    global _capacity
    now = time.monotonic()
    if _capacity is not None and now - _capacity[0] < CAPACITY_TTL_S:
        return _capacity[1]
    total = host_ram()[1]
    for limit in _cgroup_limits():
        if 0 < limit < total:
            total = limit
    _capacity = (now, total)
    return total


def _cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroup, as the files read (none where unset)."""
    try:
        with open("/proc/self/cgroup") as lines:
            groups = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return []
    candidates = []
    for fields in groups:
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        path = path.lstrip("/")
        if controllers == "":  # v2
            base, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        candidates += [os.path.join(base, path, name), os.path.join(base, name)]
    limits = []
    for candidate in candidates:
        try:
            with open(candidate) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return limits


def device_capacity(device: torch.device) -> int:
    """What a memory limit's share is of: a CUDA device's total memory, or for the CPU
    the most RAM the process may hold (:func:`host_capacity`)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return host_capacity()
