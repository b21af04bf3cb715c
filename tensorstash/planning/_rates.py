"""How fast bytes move here and now: the speeds the plan's cost model weighs (NOTE [ Plan ] rule 3).

A plan weighs recomputing a module (its measured forward time) against moving
bytes; both must be measured under the same load, so the speeds of moving
bytes are probed on this thread when a plan is made, each on ``PROBE_BYTES``
(short beside a step), and reused for ``REUSE_S`` seconds. What a
checkpointed region costs beyond its recompute is probed once per device
(:func:`region_cost`). :class:`Rates` carries them to the plan, with the
defaults below for what was not probed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lz4.block
import torch
import xxhash

from tensorstash.core._layout import memory
from tensorstash.tiers import _spillfile

LINK_BYTES_PER_S = 20e9
"""Device to host and back (PCIe), until probed (:func:`link_rate`)."""
DISK_BYTES_PER_S = 0.45e9
"""Spill write, read back and checksums, per second, until probed (:func:`disk_rate`)."""
LZ4_BYTES_PER_S = 0.6e9
"""lz4 compression and decompression of activations, per second of CPU, until probed."""
LZ4_RATIO = 1.5
"""What lz4 keeps of float activations, as original over stored bytes."""
REFAULT_BYTES_PER_S = 5e9
"""Handing memory back to the OS and faulting it in again, per second (NOTE [ Plan ]
rule 8), where the probe cannot run (:func:`refault_rate`)."""


@dataclass(frozen=True)
class Rates:
    """Speeds the cost model uses (bytes per second; NOTE [ Plan ] rule 3)."""

    link: float = LINK_BYTES_PER_S
    disk: float = DISK_BYTES_PER_S
    compress: float = LZ4_BYTES_PER_S
    ratio: float = LZ4_RATIO
    refault: float = REFAULT_BYTES_PER_S
    region_s: float = 0.0
    """What a recomputed region costs beyond its recompute, per region (:func:`region_cost`)."""
    saved_s: float = 0.0
    """The same per tensor the region saves."""


PROBE_BYTES = 4 << 20
REUSE_S = 30.0
_cache: dict[object, tuple[float, float]] = {}
_regions: dict[str, tuple[float, float]] = {}


def _reused(key: object, probe: Callable[[], float]) -> float:
    now = time.monotonic()
    found = _cache.get(key)
    if found is not None and now - found[0] < REUSE_S:
        return found[1]
    rate = probe()
    _cache[key] = (now, rate)
    return rate


def disk_rate(directory: str | None) -> float:
    """Bytes per second of spilling a value to ``directory`` and reading it back, as
    ``DiskSpill`` does."""
    parent = directory if directory is not None else tempfile.gettempdir()
    return _reused(("disk", parent), lambda: _probe_disk(parent))


def _probe_disk(parent: str) -> float:
    """What ``DiskSpill`` does to a value, timed (NOTE [ Spill files ] rule 4 in disk.py):
    written in hashed pieces into a file with no name, mapped back, read in and hashed,
    unmapped, and the file closed (which frees its pages). Zero where ``parent`` takes
    no file."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 256, (PROBE_BYTES,), dtype=torch.uint8, generator=generator)
    view = memory(values)
    start = time.perf_counter()
    fd = _nameless(parent)
    if fd is None:
        return 0.0
    try:
        digest = _spillfile.write_views(fd, [view], 0)
        with mmap.mmap(fd, PROBE_BYTES, mmap.MAP_SHARED) as region:
            populate = _spillfile._POPULATE_READ
            if populate is not None:
                with contextlib.suppress(OSError):
                    region.madvise(populate)
            with memoryview(region) as back:
                if xxhash.xxh3_64_intdigest(back) != digest:
                    return 0.0
    except OSError:
        return 0.0
    finally:
        os.close(fd)
    return PROBE_BYTES / max(time.perf_counter() - start, 1e-6)


def _nameless(parent: str) -> int | None:
    """A file in ``parent`` with no name, as spill files are (rule 2 there), or None."""
    with contextlib.suppress(OSError, AttributeError):
        return os.open(parent, os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        fd, path = tempfile.mkstemp(prefix="tensorstash-probe-", dir=parent)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.unlink(path)
    return fd


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


SHORT_REGION, LONG_REGION = 4, 36
"""The probe's regions: how many tensors each saves (:func:`region_cost`)."""
REGION_RUNS, REGION_ROUNDS = 8, 5


def region_cost(device: torch.device) -> tuple[float, float]:
    """Seconds a checkpointed region costs a step beyond its recompute: per region, and
    per tensor it saves (NOTE [ Plan ] rule 3).

    Non-reentrant checkpointing runs Python for each tensor the region saves,
    once in forward (a holder in place of the tensor) and once in backward
    (the unpack that looks up what the recompute made again), and some for
    the region itself (RNG state, its hook pair). On a step bound by
    launching kernels that time is the step's, and it can exceed the
    recompute itself (docs/figures/planning.md). The probe runs chains
    of ``sin`` (each saves its input) on a small tensor of ``device``, with
    and without checkpointing, and takes what checkpointing added beyond one
    more forward, for a short and a long chain. Probed once per device: it is
    the interpreter's cost, not the load's.
    """
    key = str(device)
    found = _regions.get(key)
    if found is None:
        found = _regions[key] = _probe_regions(device)
    return found


def _same(tensor: Any) -> Any:
    return tensor


def _probe_regions(device: torch.device) -> tuple[float, float]:
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(8, device=device, requires_grad=True)

    def chain(t: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            t = t.sin()
        return t.sum()

    def timed(run: Callable[[], Any]) -> float:
        start = time.perf_counter()
        for _ in range(REGION_RUNS):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / REGION_RUNS

    def extra(n: int) -> float:
        forward = timed(lambda: chain(x, n))
        plain = timed(lambda: chain(x, n).backward())
        region = timed(lambda: checkpoint(chain, x, n, use_reentrant=False).backward())
        return region - plain - forward

    # Outside any session's hooks: the probe's tensors are no step's. With grad on: a plan
    # can be made while a compiled graph's forward saves its tensors, where grad is off,
    # and where hooks may be turned off (no pair may be pushed there, and none is needed).
    hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)():
        hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
    with torch.inference_mode(False), torch.enable_grad(), hooks:
        extra(SHORT_REGION)  # the first run of checkpointing imports what it needs
        short = statistics.median(extra(SHORT_REGION) for _ in range(REGION_ROUNDS))
        long = statistics.median(extra(LONG_REGION) for _ in range(REGION_ROUNDS))
    per_tensor = max(long - short, 0.0) / (LONG_REGION - SHORT_REGION)
    return max(short - SHORT_REGION * per_tensor, 0.0), per_tensor
