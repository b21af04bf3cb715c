"""CpuOffload: device tensors to (pinned) host RAM, copied asynchronously on side streams.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Streams ]
On CUDA every cross-stream use is ordered by an event or a ``wait_stream``:

1. Pack: the copy stream waits for the current stream (the tensor's producer)
   through ``produced``, an event recorded there, copies the tensor into a
   pinned buffer, and records ``copied``. The source tensor is kept alive by
   the packed value until ``copied`` has completed (polled at later packs, or
   waited for at unpack), so the caching allocator cannot hand its memory to
   another tensor while the copy still reads it.
2. Unpack (or prefetch), once the source is gone (rule 5): the copy-back
   stream waits for ``copied``, allocates the device tensor, copies, and
   records ``restored``; the consumer stream waits for ``restored`` and the
   device tensor is marked as used by it (``record_stream``), since it was
   allocated on the copy-back stream.
3. A pinned buffer goes back to the pool when its packed value is freed, with
   an event recorded after the last copy that read it; the pool hands it out
   again only once that event has completed, and only once nothing else uses
   its memory: a later stage of a Chain (Lz4 keeping incompressible bytes raw,
   DiskSpill writing in the background) may hold views of it past the packed
   value's life.
4. At most ``max_inflight_bytes`` of device tensors wait for their copy to the
   host: beyond it, pack waits for the oldest copies. Without that bound a
   forward pass that saves faster than the link moves would keep every source
   alive, and offloading would save no device memory at all.
5. A packed value that still holds its source (its copy running, or done and
   not yet reaped) comes back as that source: no second device tensor, no
   copy back, and no wait for the copy out. The consumer waits for
   ``produced``, the event recorded on the producer's stream at pack (the
   copy stream waits for it too), and the source is marked as used by the
   consumer. Backward needs the tensors saved last first, often before their
   copy out ends: brought back as a second device tensor beside its source,
   such a tensor (the loss head's log-softmax output, the last saved and the
   first backward brings back) raised the step's device peak by its size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from tensorstash.core._layout import Layout, describe, rebuild, unfilled
from tensorstash.core._sizes import size_fields
from tensorstash.core.policy import Context, Held, HostBytes, Packed, bug, finalize, nbytes_of

ON_HOST = "already in host memory (CpuOffload)"
"""Why ``CpuOffload`` copies nothing of a tensor that is not on a CUDA device."""


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PinnedPool:
    """Host buffers reused by exact size (no power-of-two rounding).

    Args:
        allocate: makes a 1-D uint8 buffer of n bytes (pinned on CUDA).
        max_cached_bytes: free buffers beyond this are dropped, not cached.
    """

    def __init__(self, allocate: Callable[[int], Tensor], max_cached_bytes: int) -> None:
        self._allocate = allocate
        self._max_cached = max_cached_bytes
        self._free: dict[int, deque[tuple[Tensor, _Event | None]]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self._alone = _storage_users(torch.empty(1, dtype=torch.uint8))

    @property
    def cached_bytes(self) -> int:
        return self._cached

    def take(self, nbytes: int) -> Tensor:
        """A buffer of ``nbytes`` bytes no pending copy still reads."""
        with self._lock:
            free = self._free.get(nbytes) or deque()
            for index, (buffer, last_use) in enumerate(free):
                unused = _storage_users(buffer) == self._alone
                if unused and (last_use is None or last_use.query()):
                    del free[index]
                    self._cached -= nbytes
                    return buffer
        return self._allocate(nbytes)

    def give(self, buffer: Tensor, last_use: _Event | None) -> None:
        """Return a buffer; it is reused once ``last_use`` (if any) has completed."""
        nbytes = buffer.numel()
        with self._lock:
            if self._cached + nbytes > self._max_cached:
                return
            self._free.setdefault(nbytes, deque()).append((buffer, last_use))
            self._cached += nbytes

    def close(self) -> None:
        with self._lock:
            for free in self._free.values():
                for _, last_use in free:
                    if last_use is not None:
                        last_use.synchronize()
            self._free.clear()
            self._cached = 0


def _storage_users(buffer: Tensor) -> int | None:
    """How many tensors share ``buffer``'s memory (views included); None where torch cannot say.

    None never equals the count of a lone buffer, so a pool that cannot tell
    never reuses a buffer (rule 3 of NOTE [ Streams ]).
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(buffer.untyped_storage()._cdata))


@dataclass(eq=False, slots=True, weakref_slot=True)
class OnHost(HostBytes):
    """A CUDA tensor's bytes in a pinned host buffer, filled by an asynchronous copy.

    Attributes:
        source: the device tensor, kept alive until ``copied`` completes.
        produced: event recorded on the producer's stream at pack (rule 5 of NOTE [ Streams ]).
        copied: event recorded after the device-to-host copy.
        restored: the device tensor brought back early by prefetch, and its event.
        uses: events of copies that read the pinned buffer (rule 3 of NOTE [ Streams ]).
    """

    source: Tensor | None = None
    produced: Any = None
    copied: Any = None
    restored: tuple[Tensor, Any] | None = None
    uses: list[Any] | None = None

    def ready(self) -> Tensor:
        """A view of the pinned buffer, once the copy into it has completed.

        A view, not the buffer: the pool counts the tensors that share the
        buffer, and reuses it only when none is left (rule 3 of NOTE [ Streams ]).
        """
        if self.copied is not None:
            self.copied.synchronize()
            self.source = None
        return super(OnHost, self).ready().detach()

    def ready_unsynced(self) -> Tensor:
        """A view of the pinned buffer, for a copy that is itself ordered after ``copied``."""
        return super(OnHost, self).ready().detach()


class Inflight:
    """Device-to-host copies still running, oldest first, and the bytes they pin
    on the device (rules 1 and 4 of NOTE [ Streams ])."""

    def __init__(self) -> None:
        self._copies: deque[tuple[OnHost, int]] = deque()
        self.nbytes = 0

    def add(self, packed: OnHost, nbytes: int) -> None:
        self._copies.append((packed, nbytes))
        self.nbytes += nbytes

    def reap(self, max_bytes: int | None = None) -> None:
        """Drop the sources of completed copies; then, while more than
        ``max_bytes`` are in flight, wait for the oldest."""
        while self._copies:
            packed, nbytes = self._copies[0]
            if not packed.copied.query():
                if max_bytes is None or self.nbytes <= max_bytes:
                    return
                packed.copied.synchronize()
            self._copies.popleft()
            self.nbytes -= nbytes
            packed.source = None

    def close(self) -> None:
        for packed, _ in self._copies:
            packed.copied.synchronize()
            packed.source = None
        self._copies.clear()
        self.nbytes = 0


class _Cuda:
    """Per-session, per-device CUDA state: side streams, pinned pool, copies in flight."""

    def __init__(self, device: torch.device, max_cached_bytes: int) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.pool = PinnedPool(lambda n: unfilled(n, torch.uint8, pinned=True), max_cached_bytes)
        self.inflight = Inflight()

    def close(self) -> None:
        self.inflight.close()
        self.pool.close()


def _give_back(pool: PinnedPool, buffer: Tensor, uses: list[Any]) -> None:
    pool.give(buffer, uses[-1] if uses else None)


@dataclass(frozen=True)
class CpuOffload:
    """Move saved device tensors to host RAM; bring them back in backward.

    On CUDA the copies run on side streams, ordered by events (see NOTE
    [ Streams ]), into pinned buffers that the session reuses while it lives and
    frees with its last graph (PyTorch's pinned-memory cache then keeps them for
    the next step). A tensor already in host memory is left as it is (nothing to
    copy), counted in ``stats.nothing_to_do[ON_HOST]`` ("already in host memory
    (CpuOffload)").

    Args:
        pin_memory: copy into page-locked host memory (needed for asynchronous
            copies; a plain copy is synchronous).
        max_cached_bytes: pinned bytes kept for reuse once their tensors are freed.
        max_inflight_bytes: device bytes whose copy to the host may still be
            running; beyond it, saving a tensor waits for the oldest copies, so
            that the device memory is really given back (rule 4 of NOTE [ Streams ]).

    Example:
        >>> with tensorstash.stash(tensorstash.CpuOffload()) as session:
        ...     loss = model(x.cuda()).sum()
    """

    pin_memory: bool = True
    max_cached_bytes: int = 8 << 30
    max_inflight_bytes: int = 1 << 30

    stage_rank: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(
                f"tensorstash.CpuOffload: pin_memory must be True or False; got {self.pin_memory!r}"
            )
        size_fields(self, "tensorstash.CpuOffload", "max_cached_bytes", "max_inflight_bytes")

    def pack(self, value: Tensor | Packed, ctx: Context) -> Packed:
        tensor = value.tensor if isinstance(value, Held) else value
        if not isinstance(tensor, Tensor):
            raise bug(f"CpuOffload given {type(value).__name__}")
        nbytes = nbytes_of(tensor)
        if tensor.device.type != "cuda":
            ctx.stats.count_nothing_to_do(ON_HOST)
            return Held("kept", nbytes, nbytes, tensor.detach())
        if not self.pin_memory:
            layout, payload = describe(tensor)
            host = payload.to("cpu")
            return HostBytes("host", nbytes, layout.nbytes, layout, host)
        return self._pack_cuda(tensor, ctx)

    def _pack_cuda(self, tensor: Tensor, ctx: Context) -> OnHost:
        cuda = self._cuda(tensor.device, ctx)
        start = time.perf_counter()
        cuda.inflight.reap(self.max_inflight_bytes)
        ctx.stats.timed("wait", time.perf_counter() - start)
        layout, payload = describe(tensor)
        buffer = cuda.pool.take(layout.nbytes)
        produced, copied = torch.cuda.Event(), torch.cuda.Event()
        produced.record(torch.cuda.current_stream(tensor.device))
        cuda.d2h.wait_event(produced)
        with torch.cuda.stream(cuda.d2h):
            buffer.copy_(payload, non_blocking=True)
            copied.record(cuda.d2h)
        # The source (and the payload view, which may be a compact copy) stay
        # alive until `copied` completes: rule 1 of NOTE [ Streams ].
        uses: list[Any] = []
        packed = OnHost(
            "host",
            nbytes_of(tensor),
            layout.nbytes,
            layout,
            buffer,
            source=payload,
            produced=produced,
            copied=copied,
            uses=uses,
        )
        cuda.inflight.add(packed, layout.nbytes)
        finalize(packed, _give_back, cuda.pool, buffer, uses)
        return packed

    def unpack(self, packed: Packed, ctx: Context) -> Tensor | Packed:
        if isinstance(packed, Held):
            return packed.value()
        if isinstance(packed, OnHost):
            consumer = torch.cuda.current_stream(_layout_of(packed).device)
            return self._restore(packed, ctx, consumer)
        if isinstance(packed, HostBytes) and packed.layout is not None:
            payload = packed.ready().to(packed.layout.device)
            return rebuild(packed.layout, payload)
        raise bug(f"CpuOffload cannot unpack {type(packed).__name__}")

    def prefetch(self, packed: Packed, ctx: Context) -> None:
        if isinstance(packed, OnHost) and packed.restored is None:
            packed.restored = self._bring_back(packed, ctx)

    def _bring_back(self, packed: OnHost, ctx: Context) -> tuple[Tensor, Any]:
        """The device bytes of ``packed`` and the event to wait for: its source while it
        still holds it (rule 5 of NOTE [ Streams ]), else a copy back from the host."""
        if packed.source is not None:
            return packed.source, packed.produced
        return self._copy_back(packed, ctx)

    def _copy_back(self, packed: OnHost, ctx: Context) -> tuple[Tensor, Any]:
        layout = _layout_of(packed)
        cuda = self._cuda(layout.device, ctx)
        restored = torch.cuda.Event()
        with torch.cuda.stream(cuda.h2d):
            cuda.h2d.wait_event(packed.copied)
            device_bytes = unfilled(layout.nbytes, torch.uint8, layout.device)
            device_bytes.copy_(packed.ready_unsynced(), non_blocking=True)
            restored.record(cuda.h2d)
        if packed.uses is not None:
            packed.uses.append(restored)
        return device_bytes, restored

    def _restore(self, packed: OnHost, ctx: Context, consumer: Any) -> Tensor:
        restored = packed.restored or self._bring_back(packed, ctx)
        self._cuda(_layout_of(packed).device, ctx).inflight.reap()
        packed.restored = None  # a cache of prefetch, not a resource: see Rule 5 of stash.py
        device_bytes, event = restored
        consumer.wait_event(event)
        device_bytes.record_stream(consumer)
        return rebuild(_layout_of(packed), device_bytes)

    def _cuda(self, device: torch.device, ctx: Context) -> _Cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
        state = ctx.resource(
            ("cuda", index), lambda: _Cuda(torch.device("cuda", index), self.max_cached_bytes)
        )
        return state


def _layout_of(packed: HostBytes) -> Layout:
    if packed.layout is None:
        raise bug("HostBytes without a layout")
    return packed.layout
