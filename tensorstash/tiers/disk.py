"""DiskSpill: saved tensors written to a private directory, read back with a checksum.

The spill file, its extents and the raw reads and writes are in _spillfile.py;
what a session's spills share (writes in flight, memory returned) in
_spillwork.py. The measurements behind these rules are in
docs/figures/tiers-and-memory.md.

# NOTE [ Spill files ]
1. Each process spills into its own directory ``tensorstash-<pid>-<random>``,
   mode 0700, made inside the directory the user names (default: the system
   temporary directory). A parent that anyone may write to without the sticky
   bit is refused: another user could swap our directory out. A parent that
   takes no new directory (``/proc``) is refused at construction, and at the
   first spill if it stops taking them later. A parent on tmpfs or ramfs warns
   once: files there stay in RAM.
2. Spill files have no name: ``O_TMPFILE``, mode 0600, relative to an open
   handle of the private directory. Where the file system has no
   ``O_TMPFILE``, a file is created 0600 with O_EXCL|O_NOFOLLOW and its name
   removed at once, so no planted name or symlink is ever written through.
   Nothing can open, replace or remove a spill file from outside, and the
   kernel frees it when it is closed, also when the process is killed.
3. Who writes and reads. Where the process has a core beyond torch's own
   threads, a single background writer writes values in pack order while
   forward goes on, and workers read each value back ahead of its unpack.
   Until a value is written its bytes are in host RAM and count there in the
   stats ("host"); pack waits while more than ``max_pending_bytes`` wait.
   Where torch's threads take every core, background threads hide nothing:
   each hand-over of the GIL waits for a core, and torch's calls on the
   training thread wait with it. There the training thread writes a CPU tensor
   as it is packed and reads it as it is unpacked, and the prefetch only asks
   the kernel to read the extent ahead (``POSIX_FADV_WILLNEED``), which helps
   once the page cache has let the bytes go. On such a machine a step costs
   less this way than with the same I/O on threads, trimmed or not, and also
   with the reads and writes themselves left out. A device tensor's copy, and a value an
   earlier stage may still be making (Lz4's), always go to the writer, and
   ``background=True`` sends every value there (a slow disk, whose writes may
   then wait on the device).
4. The data path. The writer takes the value's buffers through the Spillable
   protocol (rule 2 of NOTE [ Tiers ] in policy.py), whatever stage made
   them, and writes them with ``pwritev``: one copy, into the page cache. The
   checksum is xxh3-64, at memory speed and without the GIL. Bytes go in
   pieces of 1 MiB, each hashed and then written while it is still in the
   core's cache (small buffers go together, one call for many). A value of
   1 MiB or more comes back as its extent itself, mapped shared: the tensor
   backward gets is the page cache's own pages, read in at once
   (``MADV_POPULATE_READ``) and hashed, with no copy; the mapping holds the
   extent until that tensor dies, so no later value is written into pages
   it shows. A smaller value, one whose pages cannot be read in now (an I/O
   error, which the read then reports), or any value on a kernel without
   ``MADV_POPULATE_READ`` (before Linux 5.14, where an unreadable page would
   raise SIGBUS in backward rather than an error at unpack) is read straight
   into the buffer handed back, the stash's own (NOTE [ Read buffers ] in
   _buffers.py), a piece at a time, each hashed right after it is read:
   hashing a whole value before writing it, and after reading it, reads
   every byte from memory twice. The length read and the checksum are
   checked before the value is handed back. Bytes that come back short or
   corrupted raise :class:`SpillError` naming the tensor. Nothing is ever
   unpickled. A mapped page the kernel drops under memory pressure while its
   tensor lives is read from the disk again when touched, as for any mapped
   file; the file has no name (rule 2), so nothing outside the process can
   shorten it under the mapping. Three other paths were measured and left,
   none faster: ``O_DIRECT`` (writes straight from the tensor's pages, reads
   into the page-aligned buffers) spares the copies, but a read then waits
   on the device rather than coming from the page cache, and steps got
   slower; a private writable mapping, which copies every page; and
   ``posix_fallocate`` ahead of the writes.
5. A full disk (ENOSPC, EDQUOT), or a session past ``max_disk_bytes``, keeps
   the value in memory instead, with one warning per session and a count in
   ``stats.fallbacks`` ("disk full", "disk cap").
6. A session's values share a spill file (``SpillFile`` in _spillfile.py);
   each value owns an extent of it (``Extent``), page-aligned, taken while the
   value is alive, at most once, and given back when the value is freed, or,
   if the writer or a read-ahead is at work on it then, when that work ends.
   Freed extents are reused; the file is closed, and the kernel frees it, when
   its last extent is given back. Work in flight holds the extent and the
   bytes, never the packed value, so a freed graph leaves no file open once
   ``gc.collect()`` returns and the work in flight ends. One file a session
   costs one ``open`` and one ``close`` a step, where a file per value
   (create, open to read, unlink) costs three calls a value. Writing over the
   pages of a file kept open from the last step, rather than filling a new
   one, would be cheaper still (the kernel copies into page-cache pages it
   has faster than it allocates new ones), but such a file would outlive the
   graph that wrote it: it is not kept.
7. Bytes a spill frees must leave the process. Once a session has written
   ``trim_every`` bytes, and until its graph is freed, it holds the session
   pool (NOTE [ Session pool ] in _pool.py, rule 2) with ``trim_every`` as its
   cap: a written activation's block waits there for the next activation of
   its size, or is unmapped on the writer's thread. Until then, and where
   there is no pool, once the resident set grew by ``trim_every`` bytes,
   whoever wrote or read the last value (rule 3) hands the allocator's free
   memory back to the OS (NOTE [ Returning memory ] in _trim.py; in a
   training loop growth counts from where the last spill step handed memory
   back, rule 11 there). Read buffers are the stash's own and go back to
   their pool, or the OS, when their tensor dies.
8. The private directory goes with its last user. Its users are the DiskSpill
   policies that spilled into it (each holds it until the policy is freed)
   and its spill files (each until its last extent is given back, rule 6);
   a session holds it only through them, and lets go of its file once its
   graph is freed. When the last user goes, on every path (a forward that
   raised, a full disk, a session past its cap, rule 5), the directory is
   removed and its descriptor closed: a disk or tmpfs spilled to can be
   unmounted once its policies and graphs are gone. What is still held at
   exit is removed then (atexit, or multiprocessing's exit for its
   children). A path is removed only while it still leads to the directory
   held open: one deleted from outside is replaced for its policies, and its
   name may lead elsewhere since. Directories left by dead processes of the
   same user are removed when this process first makes one in that parent. A policy made for each
   step (``stash("disk")``) makes and removes a directory each step (the file
   system's mkdir and rmdir); one policy kept across steps makes one. A
   forked child makes its own directory and file, closes its copies of its
   parent's descriptors as it frees them, and never removes its parent's
   directory, writes to its parent's file or gives back its extents.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from tensorstash.core._layout import Layout
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.core._sizes import size_fields
from tensorstash.core.policy import (
    Context,
    Held,
    HostBytes,
    Packed,
    ReadBackError,
    Spillable,
    bug,
    finalize,
    from_host,
    to_host,
    without_frames,
)
from tensorstash.core.stats import Tier
from tensorstash.memory._trim import FLOOR
from tensorstash.tiers import _spillfile
from tensorstash.tiers._spilldir import (
    SpillDirectory,
    check_directory,
    filesystem,
    hold,
    probe,
    remove_directories,
    remove_stale,
    spill_directory,
    warn_if_ram_backed,
)
from tensorstash.tiers._spillfile import CapReached, Extent
from tensorstash.tiers._spillwork import Outcome, Returning, Shared, Written, run_now, usable_cores

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
_RERUN = (
    "The spill directory must not be changed while a graph that uses it is alive; rerun the step."
)


class SpillError(ReadBackError):
    """A spill file could not be written, or read back as it was written."""


# -- the packed value ---------------------------------------------------------------------


Holds = Literal["tensor", "held", "packed"]
"""What a Spilled value's unpack returns: a tensor or Held value, rebuilt from the
bytes of its HostBytes (``from_host``), or the Spillable value it was given."""


@dataclass(eq=False, slots=True, weakref_slot=True)
class Spilled(Packed):
    """A value written to a spill file (or kept in memory, rule 5).

    Attributes:
        layout: the tensor's layout (for messages, and to rebuild a tensor).
        holds: what unpack returns.
        extent: where its bytes are in a spill file, owned by this value (rule 6).
        written: resolves to what the writer did (None: nothing, the value was freed).
        prefetched: the file's bytes read ahead of unpack (a cache, not a resource).
        inline: written at pack and read at unpack by the training thread (rule 3).
    """

    layout: Layout | None = None
    holds: Holds = "packed"
    extent: Extent | None = None
    written: Outcome[Written | None] | None = None
    prefetched: Future[Tensor | None] | None = None
    inline: bool = False

    def describe(self) -> str:
        return _describe(self.layout, self.extent)


def _describe(layout: Layout | None, extent: Extent | None) -> str:
    what = f"{layout.dtype} tensor of shape {list(layout.shape)}" if layout else "a tensor"
    return f"{what} ({extent.where()})" if extent is not None else what


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
        trim_every: the free memory the process may keep above what it uses
            while the session and its graph live: the session pool's cap
            (NOTE [ Session pool ] in _pool.py), or, where there is no pool,
            the growth of the resident set (since the session began, or since
            the last spill step handed memory back, where that is lower) after
            which the allocator's free memory goes back to the OS (glibc's
            ``malloc_trim``, or another allocator's own call; NOTE [ Returning
            memory ] in _trim.py). None: neither.
        background: write and read ahead on background threads. None
            (default): where the process has a core beyond torch's own
            threads, and always for a value not yet in CPU memory (a device
            tensor's copy, an earlier stage's packed value); otherwise the
            training thread writes each tensor as it is packed and reads it
            back as it is unpacked, while the kernel reads ahead (NOTE
            [ Spill files ], rule 3). Pass True for a slow disk on a machine
            whose cores torch keeps busy.

    Raises:
        ValueError: the directory is missing, unwritable, world-writable
            without the sticky bit, or takes no new directory.
        TypeError: an argument of the wrong type.

    Example:
        >>> with tensorstash.stash(tensorstash.DiskSpill("/scratch")) as session:
        ...     loss = model(x).sum()

    .. warning::
        Spilled bytes go through the page cache: the kernel writes them to the
        disk when it needs the memory, and drops them when the file is closed.
    """

    directory: str | os.PathLike[str] | None = None
    max_pending_bytes: int = 32 << 20
    max_disk_bytes: int | None = None
    trim_every: int | None = 32 << 20
    background: bool | None = None

    stage_rank: ClassVar[int] = 2

    def __post_init__(self) -> None:
        check_directory(self.directory, "tensorstash.DiskSpill")
        size_fields(
            self,
            "tensorstash.DiskSpill",
            "max_pending_bytes",
            "max_disk_bytes",
            "trim_every",
            optional=("max_disk_bytes", "trim_every"),
        )
        if self.background is not None and not isinstance(self.background, bool):
            raise TypeError(
                "tensorstash.DiskSpill: background must be True, False or None (decide by the "
                f"cores free); got {self.background!r}"
            )
        parent = self._parent()
        probe(parent)
        warn_if_ram_backed(parent, stacklevel=4)

    def _parent(self) -> Path:
        return Path(self.directory) if self.directory is not None else Path(tempfile.gettempdir())

    def _first_spill(self) -> Path:
        """A session's first spill: the parent, once its private directory is there
        (rule 1: one that stops taking new directories fails here), held by this
        policy until it is freed (rule 8)."""
        parent = self._parent()
        hold(self, parent)
        return parent

    def pack(self, value: Tensor | Packed, ctx: Context) -> Spilled:
        parent: Path = ctx.resource(("disk-parent", self.directory), self._first_spill)
        shared = self._shared(ctx)
        item, holds, kept_tier = _spillable(value)
        shared.pending.wait_under(self.max_pending_bytes, ctx)
        extent = Extent(parent, shared.files, shared.usage)
        layout = getattr(item, "layout", None)
        packed = Spilled(
            "host", item.nbytes, item.stored_bytes, layout=layout, holds=holds, extent=extent
        )
        job = _Job(
            extent, item, weakref.ref(packed), ctx, self.max_disk_bytes, kept_tier, shared.returning
        )
        finalize(packed, extent.release)
        if self._in_background(kept_tier, shared):
            packed.written = ctx.writer().submit(without_frames, job.run)
            shared.pending.add(packed.written, item.stored_bytes)
        else:
            packed.inline = True
            packed.written = run_now(job.run)
        return packed

    def _shared(self, ctx: Context) -> Shared:
        shared: Shared = ctx.resource("disk", lambda: self._share(ctx))
        return shared

    def _share(self, ctx: Context) -> Shared:
        """What the session's spills share (rules 3 and 7): the cores and the floor are
        this module's, so that tests can replace them."""
        spare_cores = usable_cores() > torch.get_num_threads()
        return Shared(self.trim_every, ctx, spare_cores=spare_cores, floor=FLOOR)

    def _in_background(self, kept_tier: Tier, shared: Shared) -> bool:
        """Whether a value goes to the writer thread rather than being written now (rule 3)."""
        if self.background is not None:
            return self.background
        if kept_tier != "kept":
            return True  # a copy from a device, or a value an earlier stage may still be making
        return shared.spare_cores

    def unpack(self, packed: Packed, ctx: Context) -> Tensor | Packed:
        if not isinstance(packed, Spilled) or packed.written is None or packed.extent is None:
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
                data = _read(packed.extent, written, packed.layout)
                if packed.inline:
                    self._shared(ctx).returning.moved()  # rule 7
            if data is None:
                raise bug("the bytes of a value being unpacked were given back")
            if packed.holds != "packed" and packed.layout is not None:
                # A tensor's one buffer: rebuilt from the bytes read, no shell between.
                ctx.stats.timed("wait", time.perf_counter() - start)
                return from_host(packed.layout, data, packed.holds)
            value = written.shell.from_buffers(_pieces(data, written.sizes))
        ctx.stats.timed("wait", time.perf_counter() - start)
        return _returned(value, packed)

    def prefetch(self, packed: Packed, ctx: Context) -> None:
        if not isinstance(packed, Spilled) or packed.prefetched is not None:
            return
        written, extent = packed.written, packed.extent
        if written is None or extent is None:
            return
        if packed.inline:
            _spillfile.advise_will_need(extent)
        else:
            returning = self._shared(ctx).returning
            packed.prefetched = ctx.pool().submit(
                without_frames, _read_ahead, extent, written, packed.layout, returning
            )


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
        "(NOTE [ Tiers ] in tensorstash/core/policy.py)"
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

    extent: Extent
    item: Any
    ref: weakref.ref[Spilled]
    ctx: Context
    cap: int | None
    kept_tier: Tier
    returning: Returning

    def run(self) -> Written | None:
        item, self.item = self.item, None  # the bytes leave with this frame
        if self.extent.released:
            return None  # freed before it was written: no file (rule 6)
        written = self._store(item)
        del item  # the bytes written are free once forward lets go of them too
        if written is not None and written.kept is None:
            self.returning.moved(sum(written.sizes))  # rule 7
        return written

    def _store(self, item: Any) -> Written | None:
        shell, views = item.spill_buffers(self.ctx)
        sizes = tuple(view.nbytes for view in views)
        try:
            digest = self.extent.write(views, sum(sizes), self.cap)
        except CapReached:
            return self._keep(item, Why.DISK_CAP, "disk cap", self._cap_message())
        except OSError as error:
            if error.errno not in _FULL:
                what = _describe(getattr(item, "layout", None), self.extent)
                raise SpillError(f"tensorstash.DiskSpill: cannot write {what}: {error}") from error
            return self._keep(item, Why.DISK_FULL, "disk full", self._full_message(error))
        if digest is None:
            return None  # freed while the file was being made
        self._moved("disk", sum(sizes), _outcome(item, sum(sizes)))
        return Written(sizes, digest, shell)

    def _keep(self, item: Any, why: Why, count: str, message: str) -> Written:
        """Rule 5: the bytes stay in memory, counted where they rest."""
        self.ctx.stats.fallback(count)
        self.ctx.warn(message, once=count)
        self._moved(self.kept_tier, item.stored_bytes, Reason(why))
        return Written((), 0, None, kept=item)

    def _moved(self, tier: Tier, stored: int, outcome: Reason) -> None:
        packed = self.ref()
        if packed is not None:
            self.ctx.update(packed, tier, stored, outcome)

    def _full_message(self, error: OSError) -> str:
        return (
            f"tensorstash.DiskSpill: the disk holding '{self.extent.parent}' is full "
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
    extent: Extent,
    written: Outcome[Written | None],
    layout: Layout | None,
    returning: Returning,
) -> Tensor | None:
    """A read-ahead's job: the value's bytes, or None when there is nothing to read."""
    done = written.result()
    if done is None or done.kept is not None or extent.released:
        return None
    data = _read(extent, done, layout)
    returning.moved()  # rule 7
    return data


def _read(extent: Extent, written: Written, layout: Layout | None) -> Tensor | None:
    """Read a value's bytes into a buffer of the stash's own, checking length and checksum.

    None when the value was freed first (a read-ahead's race with backward).
    """
    size = written.size
    try:
        read = _spillfile.read(extent, size)
    except OSError as error:
        raise SpillError(
            f"tensorstash.DiskSpill: cannot read back {_describe(layout, extent)}: "
            f"{error.strerror}. {_RERUN}"
        ) from None
    if read is None:
        return None
    data, got, digest = read
    if got != size:
        raise SpillError(
            f"tensorstash.DiskSpill: {_describe(layout, extent)} was truncated: read {got} "
            f"of {size} bytes. {_RERUN}"
        )
    if digest != written.digest:
        raise SpillError(
            f"tensorstash.DiskSpill: {_describe(layout, extent)} is corrupted (checksum "
            f"mismatch). {_RERUN}"
        )
    return data


def _pieces(data: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
    """The buffers written, as slices of the bytes read back."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(data[start : start + size])
        start += size
    return pieces
