"""How fast bytes move here and now: the probes behind the plan's cost model (NOTE [ Plan ] rule 3).

A plan weighs recomputing a module (its measured forward time) against moving
bytes; both must be measured under the same load, so the speeds of moving
bytes are probed on this thread when a plan is made, a few milliseconds each,
and reused for ``REUSE_S`` seconds.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
import zlib
from collections.abc import Callable

import lz4.block
import torch

from tensorstash._layout import memory

PROBE_BYTES = 4 << 20
REUSE_S = 30.0
_cache: dict[object, tuple[float, float]] = {}


def _reused(key: object, probe: Callable[[], float]) -> float:
    now = time.monotonic()
    found = _cache.get(key)
    if found is not None and now - found[0] < REUSE_S:
        return found[1]
    rate = probe()
    _cache[key] = (now, rate)
    return rate


def disk_rate(directory: str | None) -> float:
    """Bytes per second of writing, reading back and checksumming a file in ``directory``."""
    parent = directory if directory is not None else tempfile.gettempdir()
    return _reused(("disk", parent), lambda: _probe_disk(parent))


def _probe_disk(parent: str) -> float:
    data = os.urandom(PROBE_BYTES)
    buffer = bytearray(PROBE_BYTES)
    try:
        fd, path = tempfile.mkstemp(prefix="tensorstash-probe-", dir=parent)
    except OSError:
        return 0.0
    start = time.perf_counter()
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        crc = zlib.crc32(data)
        os.lseek(fd, 0, os.SEEK_SET)
        got = os.readv(fd, [buffer])
        if got != PROBE_BYTES or zlib.crc32(buffer) != crc:
            return 0.0
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return PROBE_BYTES / max(time.perf_counter() - start, 1e-6)


def compress_rate() -> float:
    """Bytes per second of lz4 compressing and decompressing float activations."""
    return _reused("lz4", _probe_lz4)


def _probe_lz4() -> float:
    generator = torch.Generator().manual_seed(0)
    activations = torch.randn(PROBE_BYTES // 4, generator=generator).relu()
    sample = bytes(memory(activations.view(torch.uint8)))  # the view needs the tensor alive
    start = time.perf_counter()
    packed = lz4.block.compress(sample, store_size=False)
    lz4.block.decompress(packed, uncompressed_size=len(sample))
    return PROBE_BYTES / max(time.perf_counter() - start, 1e-6)


def refault_rate() -> float:
    """Bytes per second of handing pages back to the OS and faulting them in again.

    What a page a step faults in costs it (NOTE [ Plan ] rule 8): a fresh
    mapping is written once (its pages faulted in), written again (resident),
    then handed back with ``MADV_DONTNEED`` and written again; the rate is the
    bytes over the third write's and the hand-back's time less the second
    write's. Zero where there is no ``madvise``.
    """
    return _reused("refault", _probe_refault)


def _probe_refault() -> float:
    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    if dontneed is None:
        return 0.0
    mapping = mmap.mmap(-1, 2 * PROBE_BYTES)
    try:
        pages = torch.frombuffer(mapping, dtype=torch.uint8)
        pages.fill_(1)
        start = time.perf_counter()
        pages.fill_(2)
        resident = time.perf_counter() - start
        start = time.perf_counter()
        mapping.madvise(dontneed)
        pages.fill_(3)
        again = time.perf_counter() - start
        del pages
    finally:
        mapping.close()
    return 2 * PROBE_BYTES / max(again - resident, 1e-6)


def link_rate(device: torch.device) -> float:
    """Bytes per second of copying to pinned host memory and back on a CUDA device."""
    return _reused(("link", str(device)), lambda: _probe_link(device))


def _probe_link(device: torch.device) -> float:
    source = torch.empty(PROBE_BYTES * 4, dtype=torch.uint8, device=device)
    host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host.copy_(source, non_blocking=True)
    source.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return 2 * source.numel() / max(start.elapsed_time(end) / 1000.0, 1e-9)
