"""DiskSpill: saved tensors written to a private directory, read back with a checksum.

# NOTE [ Spill files ]
1. Each process spills into its own directory ``tensorstash-<pid>-<random>``,
   mode 0700, made inside the directory the user names (default: the system
   temporary directory). A parent that anyone may write to without the sticky
   bit is refused: another user could swap our directory out. A parent that
   takes no new directory (``/proc``) is refused at construction, and at the
   first spill if it stops taking them later. A parent on tmpfs or ramfs warns
   once: files there stay in RAM.
2. Files are created 0600 with O_EXCL|O_NOFOLLOW relative to an open handle of
   the private directory, so no planted name or symlink is ever written
   through.
3. A single background writer writes files in pack order while forward goes
   on. Until a value is written its bytes are in host RAM and count there in
   the stats ("host"); pack waits while more than ``max_pending_bytes`` wait.
4. The data path. The writer takes the value's buffers through the Spillable
   protocol (rule 2 of NOTE [ Tiers ] in policy.py), whatever stage made
   them, and writes them with one ``writev`` per value: one copy, into the
   page cache. The checksum is xxh3-64, at memory speed and without the GIL.
   A read goes straight into the buffer handed back, the stash's own (NOTE
   [ Read buffers ] in _buffers.py), after an ``fstat`` that checks the
   size; the checksum is checked after. A missing,
   truncated, grown or corrupted file raises :class:`SpillError` naming the
   tensor. Nothing is ever unpickled.
5. A full disk (ENOSPC, EDQUOT), or a session past ``max_disk_bytes``, keeps
   the value in memory instead, with one warning per session and a count in
   ``stats.fallbacks`` ("disk full", "disk cap").
6. A file belongs to its packed value (:class:`_File`): it is created only
   while the value is alive, at most once, and removed when the value is
   freed, also while the writer or a read-ahead is at work on it (unlink works
   on an open file). Work in flight holds the file and the bytes, never the
   packed value, so a freed graph leaves no file once ``gc.collect()`` returns.
7. Bytes a spill frees must leave the process: once the resident set grew by
   ``trim_every`` bytes, the writer or a read-ahead hands the allocator's free
   memory back to the OS (NOTE [ Returning memory ] in _trim.py). Read buffers are the
   stash's own and go back to the pool, or the OS, when their tensor dies.
8. The private directory is removed at exit (atexit, or multiprocessing's exit
   for its children); directories left by dead processes of the same user are
   removed when a new one is made. A forked child makes its own directory and
   never removes its parent's files or directory.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import xxhash
from torch import Tensor

from tensorstash._buffers import POOL
from tensorstash._layout import Layout, memory
from tensorstash._reasons import Reason, Why, reason
from tensorstash._spilldir import (
    SpillDirectory,
    check_directory,
    filesystem,
    probe,
    remove_directories,
    remove_stale,
    spill_directory,
    warn_if_ram_backed,
)
from tensorstash._trim import Trimmer
from tensorstash.policy import (
    Context,
    Held,
    HostBytes,
    Packed,
    Pending,
    Spillable,
    bug,
    finalize,
    from_host,
    to_host,
    without_frames,
)
from tensorstash.stats import Tier

__all__ = [
    "DiskSpill",
    "SpillDirectory",
    "SpillError",
    "Spilled",
    "filesystem",
    "remove_directories",
    "remove_stale",
    "spill_directory",
]

_FULL = (errno.ENOSPC, errno.EDQUOT)
# Buffers one writev takes (Linux's IOV_MAX is 1024).
_IOV_MAX = 1024
_RERUN = (
    "The spill directory must not be changed while a graph that uses it is alive; rerun the step."
)


class SpillError(RuntimeError):
    """A spill file could not be written, or read back as it was written."""


# -- one value's file (rule 6) ------------------------------------------------------------


class _Usage:
    """Bytes a session's files hold on disk, against its cap (rule 5)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, cap: int | None) -> bool:
        with self._lock:
            if cap is not None and self.bytes + nbytes > cap:
                return False
            self.bytes += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes


class _CapReached(Exception):
    """The session's files would hold more than ``max_disk_bytes``."""


_WAITING, _CREATED, _GONE = range(3)


class _File:
    """The file of one packed value: made at most once, while the value lives (rule 6)."""

    __slots__ = ("_held", "_lock", "_state", "directory", "name", "usage")

    def __init__(self, directory: SpillDirectory, usage: _Usage) -> None:
        self.directory = directory
        self.name = directory.new_name()
        self.usage = usage
        self._lock = threading.Lock()
        self._state = _WAITING
        self._held = 0

    @property
    def path(self) -> Path:
        return self.directory.path / self.name

    @property
    def released(self) -> bool:
        return self._state == _GONE

    def write(self, views: list[memoryview], size: int, cap: int | None) -> int | None:
        """Create the file and write ``views`` to it: their xxh3-64 digest.

        None when the value was freed first (no file is made).

        Raises:
            _CapReached: the session's cap would be passed (nothing is made).
            OSError: the file could not be made or written; nothing is left.
        """
        with self._lock:
            if self._state != _WAITING:
                return None
            if not self.usage.take(size, cap):
                raise _CapReached
            self._held = size
            try:
                fd = self.directory.create(self.name)
            except OSError:
                self._drop()
                raise
            self._state = _CREATED
        try:
            return _write_views(fd, views)
        except OSError:
            self.release()
            raise
        finally:
            os.close(fd)

    def open(self) -> int:
        return self.directory.open(self.name)

    def release(self) -> None:
        """Remove the file, now or as soon as it is made: the value is gone."""
        if self.directory.pid != os.getpid():
            return  # a forked child's copy: the file and its lock belong to the parent (rule 7)
        with self._lock:
            created = self._state == _CREATED
            self._state = _GONE
            if created:
                self.directory.remove(self.name)
            self._drop()

    def _drop(self) -> None:
        if self._held:
            self.usage.give(self._held)
            self._held = 0


def _write_views(fd: int, views: list[memoryview]) -> int:
    """Write the views in order, one writev at a time (rule 4); their xxh3-64 digest."""
    digest = xxhash.xxh3_64()
    for view in views:
        digest.update(view)
    rest = [view for view in views if view.nbytes]
    while rest:
        done = os.writev(fd, rest[:_IOV_MAX])
        while done:
            first = rest[0]
            if done >= first.nbytes:
                done -= first.nbytes
                rest.pop(0)
            else:
                rest[0], done = first[done:], 0
    return digest.intdigest()


# -- the packed value ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Written:
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


Holds = Literal["tensor", "held", "packed"]
"""What a Spilled value's unpack returns: a tensor or Held value, rebuilt from the
bytes of its HostBytes (``from_host``), or the Spillable value it was given."""


@dataclass(eq=False, slots=True, weakref_slot=True)
class Spilled(Packed):
    """A value written to a spill file (or kept in memory, rule 5).

    Attributes:
        layout: the tensor's layout (for messages, and to rebuild a tensor).
        holds: what unpack returns.
        file: the file, owned by this value (rule 6).
        written: resolves to what the writer did (None: nothing, the value was freed).
        prefetched: the file's bytes read ahead of unpack (a cache, not a resource).
    """

    layout: Layout | None = None
    holds: Holds = "packed"
    file: _File | None = None
    written: Future[_Written | None] | None = None
    prefetched: Future[Tensor | None] | None = None

    def describe(self) -> str:
        return _describe(self.layout, self.file)


def _describe(layout: Layout | None, file: _File | None) -> str:
    what = f"{layout.dtype} tensor of shape {list(layout.shape)}" if layout else "a tensor"
    return f"{what} (spill file '{file.path}')" if file is not None else what


@dataclass(frozen=True)
class DiskSpill:
    """Write saved tensors to files in a private directory; read them back in backward.

    See NOTE [ Spill files ] for how files are protected and cleaned up. Put
    ``Lz4()`` before it to write compressed bytes.

    Args:
        directory: where to make the private spill directory (default: the
            system temporary directory). Point it at a disk: on tmpfs or ramfs
            (``/dev/shm``, and ``/tmp`` on many systems) files stay in RAM,
            and DiskSpill warns once.
        max_pending_bytes: bytes allowed to wait for the writer before pack waits.
        max_disk_bytes: the most bytes a session's files may hold on disk; past
            it, tensors stay in memory (``stats.fallbacks["disk cap"]``).
            None: no cap.
        trim_every: once the process's resident set grew by this many bytes,
            hand the memory the allocator keeps free back to the OS (glibc's
            ``malloc_trim``, from a background thread; NOTE [ Returning
            memory ] in _trim.py). None: never.

    Raises:
        ValueError: the directory is missing, unwritable, world-writable
            without the sticky bit, or takes no new directory.
        TypeError: an argument of the wrong type.

    Example:
        >>> with tensorstash.stash(tensorstash.DiskSpill("/scratch")) as session:
        ...     loss = model(x).sum()

    .. warning::
        Spilled bytes go through the page cache: the kernel writes them to the
        disk when it needs the memory, and drops them when the file is removed.
    """

    directory: str | os.PathLike[str] | None = None
    max_pending_bytes: int = 32 << 20
    max_disk_bytes: int | None = None
    trim_every: int | None = 16 << 20

    stage_rank: ClassVar[int] = 2

    def __post_init__(self) -> None:
        check_directory(self.directory, "tensorstash.DiskSpill")
        _check_size("max_pending_bytes", self.max_pending_bytes, optional=False)
        _check_size("max_disk_bytes", self.max_disk_bytes, optional=True)
        _check_size("trim_every", self.trim_every, optional=True)
        parent = self._parent()
        probe(parent)
        warn_if_ram_backed(parent, stacklevel=4)

    def _parent(self) -> Path:
        return Path(self.directory) if self.directory is not None else Path(tempfile.gettempdir())

    def pack(self, value: Tensor | Packed, ctx: Context) -> Spilled:
        directory = spill_directory(self._parent())
        item, holds, kept_tier = _spillable(value)
        pending: Pending = ctx.resource("disk-pending", Pending)
        pending.wait_under(self.max_pending_bytes, ctx)
        file = _File(directory, ctx.resource("disk-usage", _Usage))
        layout = getattr(item, "layout", None)
        packed = Spilled(
            "host", item.nbytes, item.stored_bytes, layout=layout, holds=holds, file=file
        )
        job = _Job(
            file, item, weakref.ref(packed), ctx, self.max_disk_bytes, kept_tier, self._trimmer(ctx)
        )
        packed.written = ctx.writer().submit(without_frames, job.run)
        pending.add(packed.written, item.stored_bytes)
        finalize(packed, file.release)
        return packed

    def _trimmer(self, ctx: Context) -> Trimmer:
        trimmer: Trimmer = ctx.resource(
            "disk-trim", lambda: Trimmer(self.trim_every, counted=ctx.stats.returned)
        )
        return trimmer

    def unpack(self, packed: Packed, ctx: Context) -> Tensor | Packed:
        if not isinstance(packed, Spilled) or packed.written is None or packed.file is None:
            raise bug(f"DiskSpill cannot unpack {type(packed).__name__}")
        start = time.perf_counter()
        written = packed.written.result()
        if written is None:
            raise bug("a freed value was unpacked")
        if written.kept is not None:
            value = written.kept
        else:
            prefetched, packed.prefetched = packed.prefetched, None
            data = prefetched.result() if prefetched is not None else None
            if data is None:
                data = _read(packed.file, written, packed.layout)
            value = written.shell.from_buffers(_pieces(data, written.sizes))
        ctx.stats.timed("wait", time.perf_counter() - start)
        return _returned(value, packed)

    def prefetch(self, packed: Packed, ctx: Context) -> None:
        if not isinstance(packed, Spilled) or packed.prefetched is not None:
            return
        written, file = packed.written, packed.file
        if written is not None and file is not None:
            packed.prefetched = ctx.pool().submit(
                without_frames, _read_ahead, file, written, packed.layout, self._trimmer(ctx)
            )


def _check_size(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    wanted = "None or an int >= 0" if optional else "an int >= 0"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tensorstash.DiskSpill: {name} must be {wanted}; got {value!r}")
    if value < 0:
        raise ValueError(f"tensorstash.DiskSpill: {name} must be {wanted}; got {value}")


def _spillable(value: Tensor | Packed) -> tuple[Any, Holds, Tier]:
    """What the writer writes, what unpack returns, and the tier if it stays in memory."""
    if isinstance(value, (Tensor, Held)):
        # A CPU tensor's payload is a view of its own storage: kept in memory,
        # it stays where it was.
        host, kind = to_host(value, wait=False)
        holds: Holds = "held" if kind == "held" else "tensor"
        on_cpu = host.layout is not None and host.layout.device.type == "cpu"
        return host, holds, "kept" if on_cpu else "host"
    if isinstance(value, Spillable) and isinstance(value, Packed):
        return value, "packed", "host"
    raise TypeError(
        f"tensorstash.DiskSpill: cannot spill a {type(value).__name__}: a stage before "
        "DiskSpill must pack to a value with spill_buffers and from_buffers "
        "(NOTE [ Tiers ] in tensorstash/policy.py)"
    )


def _returned(value: Any, packed: Spilled) -> Tensor | Packed:
    """The value DiskSpill's pack was given, from the value rebuilt from its bytes."""
    if packed.holds == "packed":
        result: Packed = value
        return result
    if not isinstance(value, HostBytes) or value.layout is None:
        raise bug("a tensor's spilled bytes did not come back as HostBytes")
    return from_host(value.layout, value.ready(), packed.holds)


# -- the writer (rules 3 to 6) ------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    """The writer's job for one value. It holds the file and the bytes, never the
    packed value (rule 6); its error keeps no frame (``without_frames``), since
    the future keeps the error until unpack re-raises it."""

    file: _File
    item: Any
    ref: weakref.ref[Spilled]
    ctx: Context
    cap: int | None
    kept_tier: Tier
    trimmer: Trimmer

    def run(self) -> _Written | None:
        item, self.item = self.item, None  # the bytes leave with this frame
        if self.file.released:
            return None  # freed before it was written: no file (rule 6)
        written = self._store(item)
        del item  # the bytes written are free once forward lets go of them too
        if written is not None and written.kept is None:
            self.trimmer.moved()  # rule 7
        return written

    def _store(self, item: Any) -> _Written | None:
        shell, views = item.spill_buffers(self.ctx)
        sizes = tuple(view.nbytes for view in views)
        try:
            digest = self.file.write(views, sum(sizes), self.cap)
        except _CapReached:
            return self._keep(item, Why.DISK_CAP, "disk cap", self._cap_message())
        except OSError as error:
            if error.errno not in _FULL:
                what = _describe(getattr(item, "layout", None), self.file)
                raise SpillError(f"tensorstash.DiskSpill: cannot write {what}: {error}") from error
            return self._keep(item, Why.DISK_FULL, "disk full", self._full_message(error))
        if digest is None:
            return None  # freed while the file was being made
        self._moved("disk", sum(sizes), _outcome(item, sum(sizes)))
        return _Written(sizes, digest, shell)

    def _keep(self, item: Any, why: Why, count: str, message: str) -> _Written:
        """Rule 5: the bytes stay in memory, counted where they rest."""
        self.ctx.stats.fallback(count)
        self.ctx.warn(message, once=count)
        self._moved(self.kept_tier, item.stored_bytes, Reason(why))
        return _Written((), 0, None, kept=item)

    def _moved(self, tier: Tier, stored: int, outcome: Reason) -> None:
        packed = self.ref()
        if packed is not None:
            self.ctx.update(packed, tier, stored, outcome)

    def _full_message(self, error: OSError) -> str:
        return (
            f"tensorstash.DiskSpill: the disk holding '{self.file.directory.path}' is full "
            f"({error.strerror}); keeping the tensor in memory instead. Free space or pass "
            "DiskSpill(directory=...) on a larger disk. (Shown once per session; "
            "stats.fallbacks['disk full'] counts every tensor.)"
        )

    def _cap_message(self) -> str:
        return (
            f"tensorstash.DiskSpill: this session's spill files reached max_disk_bytes="
            f"{self.cap}; keeping further tensors in memory. Raise max_disk_bytes (or pass "
            "None) to spill them. (Shown once per session; stats.fallbacks['disk cap'] "
            "counts every tensor.)"
        )


def _outcome(item: Any, size: int) -> Reason:
    nbytes = item.nbytes
    if isinstance(item, HostBytes) or size >= nbytes:
        return Reason(Why.SPILLED)
    return reason(Why.SPILLED_COMPRESSIBLE, f"{nbytes / max(size, 1):.1f}x")


# -- reading back (rule 4) ----------------------------------------------------------------


def _read_ahead(
    file: _File, written: Future[_Written | None], layout: Layout | None, trimmer: Trimmer
) -> Tensor | None:
    """A read-ahead's job: the file's bytes, or None when there is nothing to read."""
    done = written.result()
    if done is None or done.kept is not None or file.released:
        return None
    data = _read(file, done, layout)
    trimmer.moved()  # rule 7
    return data


def _read(file: _File, written: _Written, layout: Layout | None) -> Tensor:
    """Read a spill file whole into a buffer of the stash's own, checking size and checksum."""
    size = written.size
    try:
        fd = file.open()
    except OSError as error:
        raise SpillError(
            f"tensorstash.DiskSpill: cannot read back {_describe(layout, file)}: "
            f"{error.strerror}. {_RERUN}"
        ) from None
    try:
        data = POOL.take(size)  # rule 4: the tensor handed back (NOTE [ Read buffers ])
        got = _read_into(fd, memory(data), size)
    finally:
        os.close(fd)
    if got != size:
        raise SpillError(
            f"tensorstash.DiskSpill: {_describe(layout, file)} was truncated or grew: "
            f"expected {size} bytes. {_RERUN}"
        )
    if xxhash.xxh3_64_intdigest(memory(data)) != written.digest:
        raise SpillError(
            f"tensorstash.DiskSpill: {_describe(layout, file)} is corrupted (checksum "
            f"mismatch). {_RERUN}"
        )
    return data


def _read_into(fd: int, view: memoryview, size: int) -> int:
    """Read the file into ``view``: the bytes read, or -1 if the file is not ``size`` long."""
    if os.fstat(fd).st_size != size:
        return -1
    got = 0
    while got < size:
        count = os.preadv(fd, [view[got:]], got)
        if count == 0:
            break
        got += count
    return got


def _pieces(data: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
    """The buffers written, as slices of the bytes read back."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(data[start : start + size])
        start += size
    return pieces
