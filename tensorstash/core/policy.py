"""The Policy protocol, the values policies pack to, Keep and Chain.

# NOTE [ Stages ]
A policy is configuration; what one pack produced is a :class:`Packed` value
that owns its resources. Policies compose as stages of a :class:`Chain`:

1. A stage's ``pack`` receives a tensor (first stage) or what the previous
   stage packed; its ``unpack`` returns the same kind of value it was given,
   so ``unpack`` of the whole chain runs the stages in reverse and ends with a
   tensor.
2. Stages rank by where they put bytes: device -> host (CpuOffload, rank 0),
   host -> compressed host (Lz4, rank 1), anything -> disk (DiskSpill, rank 2).
   A chain's ranks must strictly increase; :class:`Chain` checks this when it
   is built.
3. The bytes in host memory between stages are a :class:`HostBytes`: a
   layout (see NOTE [ Geometry ] in _layout.py) and a uint8 payload.
4. A packed value reports where its bytes rest (``tier``) and how many
   (``stored_bytes``); work that finishes later (compression, a disk write)
   reports through :meth:`Context.update`, so stats stay true. Bytes still
   waiting for that work are where they are now: in host RAM.

# NOTE [ Tiers ]
Stages meet through two protocols, never through each other's fields:

1. A codec (:class:`tensorstash.tiers._codec.Codec`) turns a tensor's host bytes
   into an ``Encoded`` value of plain byte buffers and back; the compression
   stage (compress.py) runs any codec on the session's workers.
2. A value a later stage can store as raw bytes is :class:`Spillable`:
   ``spill_buffers(ctx)`` waits for its bytes and returns a shell (the value
   without its bytes) and its buffers in order; ``shell.from_buffers(pieces)``
   rebuilds the value from copies of those buffers. DiskSpill writes any
   Spillable value this way (HostBytes and Compressed are).
3. Adding a codec: one module with a class that has the Codec methods and a
   frozen policy dataclass (stage rank 1) whose pack and unpack call
   ``compress.pack_with`` and ``compress.unpack_with``; name it in _names.py
   to give it a name. Adding a storage tier (a remote store, say): one module
   with a policy of stage rank 2 that stores ``spill_buffers`` and rebuilds
   with ``from_buffers``; its packed value owns what it stored (a finalizer
   removes it, rule 7 of NOTE [ Session ]) and reports its tier through
   :meth:`Context.update`. Nothing in the other stages changes.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from tensorstash.core._layout import Layout, describe, memory, rebuild
from tensorstash.core._reasons import Reason
from tensorstash.core.stats import Decision, StashStats, Tier

T = TypeVar("T")


def bug(message: str) -> AssertionError:
    """The error for a broken internal invariant."""
    return AssertionError(f"tensorstash: {message}; this is a bug in tensorstash, please report it")


class ReadBackError(RuntimeError):
    """A policy could not give a saved tensor back as it was saved (a spill file lost,
    cut short or corrupted). The session raises it again naming the module that saved
    the tensor; a policy raises it with what went wrong and how to fix it."""


# -- packed values ---------------------------------------------------------------


@dataclass(eq=False, slots=True, weakref_slot=True)
class Packed:
    """What a policy's ``pack`` returns; owns the resources that hold the bytes.

    Attributes:
        tier: where the bytes rest now: "kept", "host" or "disk".
        nbytes: the tensor's original size in bytes.
        stored_bytes: bytes held in ``tier`` for it (after compression).
        accounted: whether the session counts it in the stats (see
            :meth:`Context.account`).
        row: its row of the session's decision log, kept current, when recording.
        outcomes: what background work did before the row was attached.
    """

    tier: Tier
    nbytes: int
    stored_bytes: int
    accounted: bool = field(default=False, init=False)
    row: Decision | None = field(default=None, init=False)
    outcomes: tuple[Reason, ...] = field(default=(), init=False)


@dataclass(eq=False, slots=True, weakref_slot=True)
class Held(Packed):
    """A tensor left where it was (detached, so the graph is not kept alive)."""

    tensor: Tensor | None = None

    def value(self) -> Tensor:
        """The tensor held."""
        if self.tensor is None:
            raise bug("Held without a tensor")
        return self.tensor


@dataclass(eq=False, slots=True, weakref_slot=True)
class HostBytes(Packed):
    """A tensor's bytes in host memory (rule 3 of NOTE [ Stages ]).

    Attributes:
        layout: how to rebuild the tensor; ``layout.device`` is where it came from.
        payload: 1-D uint8 CPU tensor of ``layout.nbytes`` bytes.
    """

    layout: Layout | None = None
    payload: Tensor | None = None

    def ready(self) -> Tensor:
        """The payload, once any copy that fills it has completed."""
        if self.payload is None:
            raise bug("HostBytes without a payload")
        return self.payload

    def spill_buffers(self, ctx: Context) -> tuple[HostBytes, list[memoryview]]:
        """The payload as one buffer, and a shell without it (rule 2 of NOTE [ Tiers ]).

        The buffer is valid while this value is alive.
        """
        payload = self.ready()
        shell = HostBytes(self.tier, self.nbytes, self.stored_bytes, self.layout, None)
        return shell, [memory(payload)]

    def from_buffers(self, pieces: list[Tensor]) -> HostBytes:
        """This shell with its payload back: ``pieces`` holds one 1-D uint8 CPU tensor."""
        if len(pieces) != 1:
            raise bug(f"HostBytes rebuilt from {len(pieces)} buffers")
        return HostBytes("host", self.nbytes, self.stored_bytes, self.layout, pieces[0])


@runtime_checkable
class Spillable(Protocol):
    """A packed value a later stage can store as raw bytes (rule 2 of NOTE [ Tiers ]).

    ``spill_buffers`` waits for the value's bytes (a compression, a copy from
    the device) and returns a shell, the value without its bytes, and the
    bytes as buffers, in order, valid while the value is alive.
    ``shell.from_buffers(pieces)`` returns a value equal to the one spilled,
    given 1-D uint8 CPU tensors holding those buffers' bytes (it may keep
    views of them).
    """

    def spill_buffers(self, ctx: Context) -> tuple[Any, list[memoryview]]: ...

    def from_buffers(self, pieces: list[Tensor]) -> Any: ...


Returns = Literal["tensor", "held", "host"]


def to_host(value: Tensor | Packed, *, wait: bool = True) -> tuple[HostBytes, Returns]:
    """The host bytes of a stage's input, and which kind :func:`from_host` must rebuild.

    A CPU tensor's payload is a view of its storage: the caller must finish
    reading it before the tensor may change, and keep the tensor alive meanwhile
    (the returned value does). A device tensor is copied to the host here,
    synchronously; use CpuOffload first for an asynchronous copy, whose
    completion is waited for here unless ``wait`` is False (the kind is then
    "host", and the caller calls ``ready()`` where it may block).
    """
    if isinstance(value, HostBytes):
        if wait:
            value.ready()
        return value, "host"
    kind: Returns = "tensor"
    if isinstance(value, Held):
        value, kind = value.value(), "held"
    if not isinstance(value, Tensor):
        raise bug(f"stage input of type {type(value).__name__}")
    layout, payload = describe(value)
    if payload.device.type != "cpu":
        payload = payload.cpu()
    return HostBytes("host", layout.nbytes, layout.nbytes, layout, payload), kind


def from_host(layout: Layout, payload: Tensor, kind: Returns) -> Tensor | Packed:
    """Rebuild the kind of value :func:`to_host` was given from its bytes."""
    if kind == "host":
        return HostBytes("host", layout.nbytes, layout.nbytes, layout, payload)
    tensor = rebuild(layout, payload)
    if layout.device.type != "cpu":
        tensor = tensor.to(layout.device)
    if kind == "held":
        return Held("kept", layout.nbytes, layout.nbytes, tensor)
    return tensor


def _one_torch_thread() -> None:
    """Run torch ops on a worker thread without an intra-op thread team of their own.

    The forward pass already uses every core; a worker's torch ops (shuffles,
    bitmaps) would otherwise start OpenMP teams that spin against it. The
    setting is per thread: the caller's thread count is unchanged.
    """
    torch.set_num_threads(1)


# -- the context a session hands to policies -------------------------------------


class Context:
    """Per-session resources handed to policies: stats, worker threads, warnings.

    Threads start when first needed and stop once the session is closed and no
    packed value is alive, so a freed graph leaves no thread behind.

    Args:
        stats: the session's counters.
        workers: threads for compression and reads.
    """

    def __init__(self, stats: StashStats, *, workers: int = 2) -> None:
        self.stats = stats
        self._workers = workers
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._live = 0
        self._open = 0
        self._warnings: list[str] = []
        self._warned: set[str] = set()
        self.resources: dict[Any, Any] = {}
        # The session's profile (NOTE [ Profile ] in profile.py), or None.
        self.profile: Any = None

    # Executors -------------------------------------------------------------------

    def pool(self) -> Executor:
        """Threads for compression and reads (lz4 and file I/O release the GIL)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._workers, "tensorstash-worker", initializer=_one_torch_thread
                )
            return self._pool

    def writer(self) -> Executor:
        """One thread that writes spill files in the order they were packed."""
        with self._lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(
                    1, "tensorstash-writer", initializer=_one_torch_thread
                )
            return self._writer

    def resource(self, key: Any, make: Any) -> Any:
        """The session's resource under ``key``, made by ``make()`` the first time.

        Resources (side streams, buffer pools, spill directories) live until the
        session is closed and its last packed value freed; then ``close()`` is
        called on each.
        """
        found = self.resources.get(key)  # the hot path: a dict read needs no lock
        if found is not None:
            return found
        with self._lock:
            found = self.resources.get(key)
            if found is None:
                found = self.resources[key] = make()
            return found

    # Lifetime --------------------------------------------------------------------

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            self._open -= 1
            self._maybe_stop()

    @property
    def idle(self) -> bool:
        """Whether the session is closed and no packed value it accounted is alive."""
        with self._lock:
            return not self._live and not self._open

    def account(self, packed: Packed) -> None:
        """Start counting a packed value in the stats; it holds the context until freed."""
        with self._lock:
            packed.accounted = True
            self._live += 1
            self.stats.add(packed.tier, packed.nbytes, packed.stored_bytes)

    def attach_row(self, packed: Packed, row: Decision) -> None:
        """Keep ``row`` of the decision log current with ``packed`` (see :meth:`update`)."""
        with self._lock:
            packed.row = row
            row.tier, row.stored_bytes = packed.tier, packed.stored_bytes
            row.outcomes.extend(packed.outcomes)

    def update(
        self, packed: Packed, tier: Tier, stored: int, outcome: Reason | None = None
    ) -> None:
        """A packed value's bytes moved to ``tier`` and now take ``stored`` bytes.

        ``outcome`` (when given) is what the background work did, added to the
        decision log's row for it.
        """
        with self._lock:
            old = (packed.tier, packed.nbytes, packed.stored_bytes)
            packed.tier, packed.stored_bytes = tier, stored
            if packed.accounted:
                self.stats.move(old, (tier, packed.nbytes, stored))
            row = packed.row
            if row is not None:
                row.tier, row.stored_bytes = tier, stored
                if outcome is not None:
                    row.outcomes.append(outcome)
            elif outcome is not None:  # the session attaches the row after pack returns
                packed.outcomes += (outcome,)

    def replace(self, old: Packed, new: Packed) -> None:
        """``new`` holds what ``old`` held (a deferred tensor was packed): move its count.

        The decision log row of ``old`` follows ``new``; it no longer waits.
        """
        with self._lock:
            if old.accounted:
                old.accounted = False
                new.accounted = True
                self.stats.move(
                    (old.tier, old.nbytes, old.stored_bytes),
                    (new.tier, new.nbytes, new.stored_bytes),
                )
            row = old.row
            if row is not None:
                new.row, old.row = row, None
                row.tier, row.stored_bytes, row.waiting = new.tier, new.stored_bytes, False
                row.outcomes.extend(new.outcomes)

    def release(self, packed: Packed) -> None:
        """A packed value was freed: forget its live bytes."""
        with self._lock:
            if packed.accounted:
                packed.accounted = False
                self._live -= 1
                self.stats.release(packed.tier, packed.stored_bytes)
            self._maybe_stop()

    def _maybe_stop(self) -> None:
        if self._live or self._open:
            return
        for executor in (self._pool, self._writer):
            if executor is not None:
                executor.shutdown(wait=False)
        self._pool = self._writer = None
        for resource in self.resources.values():
            close = getattr(resource, "close", None)
            if close is not None:
                close()
        self.resources.clear()

    # Warnings from background threads ---------------------------------------------

    def warn(self, message: str, *, once: str | None = None) -> None:
        """Queue a warning raised on a background thread, shown on the caller's thread.

        With ``once``, only the first warning of that kind in this session is shown
        (a full disk warns once, not once per tensor; the stats count every one).
        """
        with self._lock:
            if once is not None:
                if once in self._warned:
                    return
                self._warned.add(once)
            self._warnings.append(message)

    def flush_warnings(self) -> None:
        if not self._warnings:  # the hot path: read without the lock, appended under it
            return
        with self._lock:
            pending, self._warnings = self._warnings, []
        for message in pending:
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def without_frames(job: Callable[..., T], *args: Any) -> T:
    """``job(*args)`` for a worker thread; an error it raises keeps no frame of the job.

    A worker's error waits in its future until unpack re-raises it, and the
    session's context keeps the futures: frames in its traceback would keep the
    job's arguments (packed values, their bytes, and so the graph) alive as
    long as the session.
    """
    try:
        return job(*args)
    except BaseException as error:
        del job, args
        chain: list[BaseException | None] = [error]
        while chain:
            found = chain.pop()
            if found is not None:
                found.__traceback__ = None
                chain += [found.__cause__, found.__context__]
        raise


class Pending:
    """Background work in flight (compressions, disk writes), for back-pressure.

    A stage adds each job with the bytes it holds; ``wait_under`` blocks pack
    until the jobs still running hold at most ``limit`` bytes. A job leaves as
    soon as it is done, so the session keeps no finished future (nor the error
    one may hold) beyond the packed value that owns it.
    """

    def __init__(self) -> None:
        self.running: dict[int, tuple[Future[Any], int]] = {}
        self.bytes = 0
        self.lock = threading.Lock()

    def add(self, future: Future[Any], nbytes: int) -> None:
        with self.lock:
            self.running[id(future)] = (future, nbytes)
            self.bytes += nbytes
        future.add_done_callback(self._done)

    def _done(self, future: Future[Any]) -> None:
        with self.lock:
            found = self.running.pop(id(future), None)
            if found is not None:
                self.bytes -= found[1]

    def wait_under(self, limit: int, ctx: Context) -> None:
        while True:
            with self.lock:
                if self.bytes <= limit or not self.running:
                    return
                oldest = next(iter(self.running.values()))[0]
            start = time.perf_counter()
            exception = oldest.exception()  # waits; errors surface at unpack
            del exception
            ctx.stats.timed("wait", time.perf_counter() - start)
            self._done(oldest)  # the callback may not have run yet


# -- the protocol and the simplest policies --------------------------------------


@runtime_checkable
class Policy(Protocol):
    """Where a saved tensor goes: ``pack`` it, later ``unpack`` it (maybe many times).

    ``unpack`` must not free what ``pack`` made: autograd may unpack again
    (``retain_graph=True``); the packed value frees its resources when it is
    garbage-collected. ``prefetch``, when a policy has it, starts bringing a
    value back before backward needs it.
    """

    def pack(self, value: Any, ctx: Context) -> Any: ...

    def unpack(self, packed: Any, ctx: Context) -> Any: ...


@dataclass(frozen=True)
class Keep:
    """Leave every tensor where it is (what plain autograd does), counted in the stats.

    Example:
        >>> with tensorstash.stash(tensorstash.Keep()) as session:
        ...     loss = model(x).sum()
    """

    def pack(self, value: Tensor, ctx: Context) -> Held:
        nbytes = value.numel() * value.element_size()
        return Held("kept", nbytes, nbytes, value.detach())

    def unpack(self, packed: Held, ctx: Context) -> Tensor:
        return packed.value()


@dataclass(frozen=True)
class Defer:
    """A selector's choice: keep the tensor for now, pack it with ``policy`` later.

    The session keeps a window of the tensors most recently deferred; once
    those saved after a tensor hold more than ``window`` bytes, it is packed
    with ``policy`` (the newest one always stays). The tensors saved last
    before backward are the first backward needs: moving them out would only
    make backward wait for them (NOTE [ Recent window ] in stash.py).
    """

    policy: Policy
    window: int


@dataclass(frozen=True, init=False)
class Chain:
    """Stages applied left to right in pack and right to left in unpack.

    Nested chains are flattened. Stages must go from the device outwards (see
    NOTE [ Stages ]): ``Chain(CpuOffload(), Lz4(), DiskSpill())`` moves a CUDA
    tensor to host RAM, compresses it and writes it to disk.

    Args:
        *stages: policies with a stage rank: CpuOffload, Lz4, DiskSpill, or chains
            of them.

    Raises:
        TypeError: a stage is not a policy that can be a stage.
        ValueError: no stage, or stages out of order.

    Example:
        >>> policy = tensorstash.Chain(tensorstash.Lz4(), tensorstash.DiskSpill())
    """

    stages: tuple[Any, ...]

    def __init__(self, *stages: Any) -> None:
        flat: list[Any] = []
        for stage in stages:
            flat.extend(stage.stages if isinstance(stage, Chain) else (stage,))
        if not flat:
            raise ValueError(
                "tensorstash.Chain: no stages given; pass policies such as "
                "Chain(Lz4(), DiskSpill())"
            )
        for stage in flat:
            if isinstance(stage, str) or not isinstance(getattr(stage, "stage_rank", None), int):
                raise TypeError(
                    f"tensorstash.Chain: {stage!r} cannot be a stage; stages are CpuOffload(), "
                    "Lz4() and DiskSpill() (Keep and Select are whole policies: pass them to "
                    "stash() directly)"
                )
        ranks = [stage.stage_rank for stage in flat]
        if any(a >= b for a, b in itertools.pairwise(ranks)):
            names = ", ".join(type(stage).__name__ for stage in flat)
            raise ValueError(
                f"tensorstash.Chain: stages ({names}) are out of order; each stage must move "
                "bytes further from the device: CpuOffload, then Lz4, then DiskSpill, each "
                "at most once"
            )
        object.__setattr__(self, "stages", tuple(flat))

    stage_rank: ClassVar[None] = None

    def pack(self, value: Tensor, ctx: Context) -> Any:
        for stage in self.stages:
            value = stage.pack(value, ctx)
        return value

    def unpack(self, packed: Any, ctx: Context) -> Any:
        for stage in reversed(self.stages):
            packed = stage.unpack(packed, ctx)
        return packed

    def prefetch(self, packed: Any, ctx: Context) -> None:
        prefetch = getattr(self.stages[-1], "prefetch", None)
        if prefetch is not None:
            prefetch(packed, ctx)


def finalize(owner: object, func: Any, *args: Any) -> weakref.finalize:
    """Run ``func(*args)`` when ``owner`` is garbage-collected (and at exit)."""
    return weakref.finalize(owner, func, *args)


def nbytes_of(tensor: Tensor) -> int:
    """Bytes of a tensor's elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def device_of(value: Tensor | Packed) -> torch.device:
    if isinstance(value, Tensor):
        return value.device
    if isinstance(value, Held) and value.tensor is not None:
        return value.tensor.device
    return torch.device("cpu")
