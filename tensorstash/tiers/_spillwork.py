"""What a session's spills share, and the outcome of the work on each value.

Rules 3, 5, 6 and 7 of NOTE [ Spill files ] in disk.py: the writes in flight,
the spill file and the bytes on disk of a session (:class:`Shared`), how the
memory its spills free leaves the process (:class:`Returning`), and what a
write resolves to, whether the writer thread did it (a future) or the training
thread (:class:`Done`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tensorstash.core.policy import Context, Pending, without_frames
from tensorstash.memory import _pool
from tensorstash.memory._trim import Floor, Trimmer
from tensorstash.tiers._spillfile import Files, Usage

_T = TypeVar("_T", covariant=True)


class Outcome(Protocol[_T]):
    """What a write (or read) resolves to: a future's ``done`` and ``result``."""

    def done(self) -> bool: ...

    def result(self) -> _T: ...


@dataclass(frozen=True, slots=True)
class Written:
    """What the writer did with a value.

    Attributes:
        sizes: the bytes of each buffer, in file order.
        digest: xxh3-64 of the file's bytes.
        shell: the value without its bytes (``from_buffers`` rebuilds it).
        kept: the value itself when its bytes stayed in memory (rule 5), else None.
    """

    sizes: tuple[int, ...]
    digest: int
    shell: Any
    kept: Any = None

    @property
    def size(self) -> int:
        return sum(self.sizes)


class Shared:
    """What a session's spills share, made at its first: the writes in flight (rule 3),
    the spill file (rule 6), the bytes on disk (rule 5), how freed memory leaves the
    process (rule 7), and whether the process has a core beyond torch's threads
    (rule 3). Closed when the session has ended and its graph is freed.

    Args:
        trim_every: DiskSpill's ``trim_every`` (rule 7).
        ctx: the session's context.
        spare_cores: whether the process has a core beyond torch's threads.
        floor: where a disk spill's growth counts from (rule 11 of NOTE
            [ Returning memory ] in _trim.py).
    """

    __slots__ = ("files", "pending", "returning", "spare_cores", "usage")

    def __init__(
        self, trim_every: int | None, ctx: Context, *, spare_cores: bool, floor: Floor
    ) -> None:
        self.pending = Pending()
        self.files = Files()
        self.usage = Usage()
        self.returning = Returning(trim_every, ctx, floor)
        self.spare_cores = spare_cores

    def close(self) -> None:
        self.returning.close()
        self.files.close()


class Returning:
    """Rule 7: how a session's freed memory leaves the process. The trimmer, until the
    session wrote ``every`` bytes; then, where there is one, the session pool (a
    session that frees less than that needs nothing more, and a pool would map its
    blocks anew where the heap has them resident). ``moved`` is called after each
    value written or read back."""

    __slots__ = ("_lock", "every", "lease", "trimmer", "written")

    def __init__(self, every: int | None, ctx: Context, floor: Floor) -> None:
        self.every = every if _pool.compiled is not None else None
        self.lease: _pool.Lease | None = None
        self.written = 0
        self._lock = threading.Lock()
        self.trimmer = Trimmer(every, counted=ctx.stats.returned, floor=floor)

    def moved(self, written: int = 0) -> None:
        if self.lease is not None:
            return
        self.trimmer.moved(written)
        every = self.every
        if every is None or not written:
            return
        with self._lock:
            self.written += written
            if self.written < every or self.lease is not None:
                return
            self.lease = _pool.lease(every)
            if self.lease is None:  # another allocator holds the CPU: trim on
                self.every = None
                return
        self.trimmer.hand_back()  # what the heap holds free goes, once: the pool serves on

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Done:
    """The outcome of work done on this thread, read as a finished future's is."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: Written | None, error: Exception | None) -> None:
        self._value = value
        self._error = error

    def done(self) -> bool:
        return True

    def result(self) -> Written | None:
        if self._error is not None:
            raise self._error
        return self._value


def run_now(work: Callable[[], Written | None]) -> Done:
    """Run ``work`` on this thread: its result, or its error kept for unpack, as the
    writer's errors are.

    The outcome is a plain value rather than a ``Future`` made and resolved
    here, and the spill directory is looked up once a session rather than for
    every value: each of those was a measurable share of an inline pack's cost.
    """
    try:
        return Done(without_frames(work), None)
    except Exception as error:
        return Done(None, error)
