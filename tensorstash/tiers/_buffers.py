"""The buffers spill files are read into: the stash's own memory, reused, and returned.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Read buffers ]
1. A spill file's value that is not mapped (rule 4 of NOTE [ Spill files ]
   in disk.py: a value under 1 MiB, or one whose pages cannot be mapped) is
   read straight into a buffer of the stash's own, an anonymous mapping, and
   autograd gets that memory as the unpacked tensor's storage
   (``torch.frombuffer``): no copy beside the read.
2. When that tensor dies its buffer comes back (a finalizer on the
   memoryview its storage holds) and serves the next read of the same size.
   A step's reads land on memory already resident: no page faults, and no
   pieces of the allocator's heap, which places a new block on any free
   pages, resident or not: reads into heap blocks that had been handed back
   to the OS faulted them in again every step (NOTE [ Returning memory ] in
   _trim.py).
3. At most ``max_cached_bytes`` of idle buffers are kept, process-wide;
   beyond that a returned buffer is unmapped at once, and its memory leaves
   the process.
4. New buffers are mapped with MAP_POPULATE where there is one: the kernel
   fills the pages in one call, faster than faulting them in one at a time
   during the read.
5. A forked child starts with an empty pool.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import torch
from torch import Tensor

from tensorstash.memory._trim import whole_pages

_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0) | getattr(mmap, "MAP_POPULATE", 0)

MAX_CACHED_BYTES = 128 << 20
"""Idle read buffers kept for reuse (rule 3): a step's reads in flight at once
(the read-ahead depth and the tensors backward is using), with room to spare."""


class BufferPool:
    """Page-aligned buffers reused by size (rules 2 and 3).

    Args:
        max_cached_bytes: idle buffers beyond this are unmapped, not kept.
    """

    def __init__(self, max_cached_bytes: int = MAX_CACHED_BYTES) -> None:
        self.max_cached_bytes = max_cached_bytes
        self.cached_bytes = 0
        self.mapped = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Tensor:
        """A 1-D uint8 tensor of ``nbytes`` whose memory comes back here when it dies."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        length = whole_pages(nbytes)
        with self._lock:
            free = self._free.get(length)
            region = free.pop() if free else None
            if region is not None:
                self.cached_bytes -= length
        if region is None:
            region = mmap.mmap(-1, length, flags=_FLAGS)
            self.mapped += 1
        view = memoryview(region)[:nbytes]
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        # The tensor's storage holds `view`; when the storage dies, so does the view.
        weakref.finalize(view, self._give, region, length).atexit = False
        return tensor

    def _give(self, region: mmap.mmap, length: int) -> None:
        with self._lock:
            if self.cached_bytes + length <= self.max_cached_bytes:
                self._free.setdefault(length, []).append(region)
                self.cached_bytes += length
                return
        # Not kept: dropping the last reference unmaps it (rule 3).

    def clear(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0

    def _forget(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self.clear()


POOL = BufferPool()
"""The process's read buffers (rule 3)."""

os.register_at_fork(after_in_child=POOL._forget)
