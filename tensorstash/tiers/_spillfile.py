"""A session's spill file: the extents its values own, and the reads and writes of their bytes.

Rules 4 and 6 of NOTE [ Spill files ] in disk.py. A session's values share one
file with no name (:class:`SpillFile`); each value owns a page-aligned extent of
it (:class:`Extent`), taken at most once while the value lives and given back
when it is freed or, if a write, a read or a mapping of it is at work on it
then, when that ends. Bytes go in pieces of :data:`PIECE`, each hashed while it
is still in the core's cache; a value of :data:`MAP_FROM` bytes or more is read
back by mapping its extent. Nothing here knows what a value is: DiskSpill
(disk.py) decides what is written, and what a short or corrupted read means.
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path

import torch
import xxhash
from torch import Tensor

from tensorstash.core._layout import memory
from tensorstash.memory._trim import PAGE_SIZE, whole_pages
from tensorstash.tiers._buffers import POOL
from tensorstash.tiers._spilldir import SpillDirectory, spill_directory

PIECE = 1 << 20
"""Bytes hashed and then written, or read and then hashed, at a time (rule 4)."""

IOV_MAX = 1024
"""Buffers one ``pwritev`` takes (Linux's ``IOV_MAX``)."""

MAP_FROM = 1 << 20
"""Values of this many bytes or more are read by mapping their extent (rule 4)."""

# Linux's MADV_POPULATE_READ (5.14), which Python's mmap module names from 3.12 on:
# the pages are read in now, and a page that cannot be read fails the call here
# rather than raising SIGBUS when backward touches it.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform == "linux" else None


class Usage:
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


class CapReached(Exception):
    """The session's files would hold more than ``max_disk_bytes``."""


# -- the file and its extents (rule 6) ----------------------------------------------------


class SpillFile:
    """A file with no name in the spill directory, holding many values' bytes (rule 6).

    Each value has its own extent, page-aligned, so no two values share a page.
    Extents are taken first-fit from the free ones, else at the end, and given
    back when their value is freed; the file is closed, and the kernel frees it,
    once the last one is given back.
    """

    __slots__ = ("_end", "_free", "_live", "_lock", "directory", "fd", "parent")

    def __init__(self, directory: SpillDirectory, parent: Path) -> None:
        self.directory = directory
        self.parent = parent  # the directory the user named, as the session names it
        self.fd = directory.anonymous()
        self._free: list[tuple[int, int]] = []  # (offset, length), by offset, none adjacent
        self._end = 0
        self._live = 0
        self._lock = threading.Lock()

    def take(self, length: int) -> int | None:
        """The offset of ``length`` bytes of the file for a value; None once it is closed."""
        with self._lock:
            if self.fd < 0:
                return None
            self._live += 1
            for index, (offset, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + length, free - length)
                    return offset
            offset, self._end = self._end, self._end + length
            return offset

    def give(self, offset: int, length: int) -> None:
        """Free an extent taken before; the last one closes the file."""
        with self._lock:
            self._live -= 1
            if self._live == 0:
                fd, self.fd = self.fd, -1
                self._free.clear()
                os.close(fd)
                return
            index = bisect.bisect(self._free, (offset, length))
            if index < len(self._free) and self._free[index][0] == offset + length:
                length += self._free.pop(index)[1]
            if index and sum(self._free[index - 1]) == offset:
                index -= 1
                offset, before = self._free.pop(index)
                length += before
            if offset + length == self._end:
                self._end = offset
            else:
                self._free.insert(index, (offset, length))


class Files:
    """The spill file a session's new extents go to, made again once closed (rule 6)."""

    def __init__(self) -> None:
        self._file: SpillFile | None = None
        self._lock = threading.Lock()

    def extent(self, parent: Path, length: int) -> tuple[SpillFile, int]:
        """A file in the private directory inside ``parent`` and the offset of ``length``
        bytes taken in it.

        The directory is looked up only for a new file (rule 1: made again if
        it was deleted); a forked child's is its own, so it never writes to
        the file it inherited (rule 8).
        """
        with self._lock:
            file = self._file
            while True:
                if file is None or file.parent != parent or file.directory.pid != os.getpid():
                    file = self._file = SpillFile(spill_directory(parent), parent)
                offset = file.take(length)
                if offset is not None:
                    return file, offset
                file = None

    def close(self) -> None:
        """Let go of the last file: the session's graph is freed (rule 8).

        No lock: a freed value may close the session inside :meth:`extent` on
        this thread, and a forked child's copy of the lock may be held forever.
        """
        self._file = None


_WAITING, _WRITTEN, _GONE = range(3)


class Extent:
    """Where one packed value's bytes are in a spill file: taken at most once,
    while the value lives, and given back when it is freed, or, if a write or a
    read is at work on it then, when that ends (rule 6)."""

    __slots__ = (
        "_busy",
        "_held",
        "_lock",
        "_state",
        "file",
        "files",
        "length",
        "offset",
        "parent",
        "pid",
        "usage",
    )

    def __init__(self, parent: Path, files: Files, usage: Usage) -> None:
        self.parent = parent
        self.pid = os.getpid()
        self.files = files
        self.usage = usage
        self.file: SpillFile | None = None
        self.offset = 0
        self.length = 0
        self._lock = threading.Lock()
        self._state = _WAITING
        self._held = 0
        self._busy = 0

    @property
    def released(self) -> bool:
        return self._state == _GONE

    def where(self) -> str:
        file = self.file
        if file is None:
            return f"a spill directory in '{self.parent}'"
        return f"spill file in '{file.directory.path}', at byte {self.offset}"

    def write(self, views: list[memoryview], size: int, cap: int | None) -> int | None:
        """Write ``views`` to an extent taken for them: their xxh3-64 digest.

        None when the value was freed first (nothing is taken).

        Raises:
            CapReached: the session's cap would be passed (nothing is taken).
            OSError: the bytes could not be written; the extent is given back.
        """
        with self._lock:
            if self._state != _WAITING:
                return None
            if not self.usage.take(size, cap):
                raise CapReached
            self._held = size
            length = max(PAGE_SIZE, whole_pages(size))
            try:
                self.file, self.offset = self.files.extent(self.parent, length)
            except OSError:
                self._drop()
                raise
            self.length = length
            self._state = _WRITTEN
            self._busy += 1
        try:
            return write_views(self.file.fd, views, self.offset)
        except OSError:
            self.release()
            raise
        finally:
            self.unpin()

    def pin(self) -> SpillFile | None:
        """The file, held for a read of the value's bytes; None if they are gone."""
        with self._lock:
            if self._state != _WRITTEN or self.file is None:
                return None
            self._busy += 1
            return self.file

    def unpin(self) -> None:
        with self._lock:
            self._busy -= 1
            self._give_if_done()

    def release(self) -> None:
        """The value is gone: give its extent back, now or once the work on it ends."""
        if self.pid != os.getpid():
            return  # a forked child's copy: the file belongs to the parent (rule 8)
        with self._lock:
            self._state = _GONE
            self._drop()
            self._give_if_done()

    def _give_if_done(self) -> None:
        if self._state == _GONE and not self._busy and self.file is not None:
            file, self.file = self.file, None
            file.give(self.offset, self.length)

    def _drop(self) -> None:
        if self._held:
            self.usage.give(self._held)
            self._held = 0


# -- the bytes (rule 4) -------------------------------------------------------------------


def write_views(fd: int, views: list[memoryview], offset: int) -> int:
    """Write the views in order from ``offset``: their xxh3-64 digest (rule 4).

    Each piece of up to :data:`PIECE` bytes is hashed and then written while it
    is still in the core's cache; small views go out together, in one ``pwritev``.
    """
    digest = xxhash.xxh3_64()
    batch: list[memoryview] = []
    size = 0
    for view in views:
        for start in range(0, view.nbytes, PIECE):
            piece = view[start : start + PIECE]
            digest.update(piece)
            batch.append(piece)
            size += piece.nbytes
            if size >= PIECE or len(batch) == IOV_MAX:
                offset = pwrite_all(fd, batch, offset)
                batch, size = [], 0
    if batch:
        pwrite_all(fd, batch, offset)
    return digest.intdigest()


def pwrite_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Write every byte of ``views`` from ``offset``: the offset after them."""
    first = 0
    while first < len(views):
        done = os.pwritev(fd, views[first:], offset)
        offset += done
        while done >= views[first].nbytes:
            done -= views[first].nbytes
            first += 1
            if first == len(views):
                return offset
        views[first] = views[first][done:]
    return offset


def read(extent: Extent, size: int) -> tuple[Tensor, int, int] | None:
    """A value's ``size`` bytes, read back (rule 4): a tensor of them, the bytes
    read (fewer at the file's end) and their xxh3-64 digest. None when the value
    was freed first (a read-ahead's race with backward).

    A value of :data:`MAP_FROM` bytes or more is the extent itself, mapped
    shared (:func:`_mapped`); any other, or one that cannot be mapped, is read
    into a buffer of the stash's own (NOTE [ Read buffers ] in _buffers.py).

    Raises:
        OSError: the file could not be read.
    """
    file = extent.pin()
    if file is None:
        return None
    mapped = None
    try:
        if size >= MAP_FROM:
            mapped = _mapped(file.fd, extent, size)
        if mapped is not None:
            return mapped
        data = POOL.take(size)  # rule 4: the tensor handed back
        digest = xxhash.xxh3_64()
        got = read_into(file.fd, memory(data), extent.offset, digest)
        return data, got, digest.intdigest()
    finally:
        if mapped is None:
            extent.unpin()  # a mapping holds the extent until its tensor dies


def _mapped(fd: int, extent: Extent, size: int) -> tuple[Tensor, int, int] | None:
    """The extent's first ``size`` bytes as a tensor over a shared mapping of the
    file, its pages read in and hashed; None where the file is short, cannot be
    mapped, or its pages cannot all be read in now (the caller reads instead,
    and reports what it finds).

    The mapping holds the extent (pinned by the caller) until the tensor dies:
    no other value's bytes can be written into the pages the tensor shows.
    """
    if _POPULATE_READ is None:
        return None  # no way to learn of an unreadable page before backward touches it
    try:
        if os.fstat(fd).st_size < extent.offset + size:
            return None  # a page past the file's end would raise SIGBUS when touched
        region = mmap.mmap(fd, size, mmap.MAP_SHARED, offset=extent.offset)
    except (OSError, ValueError):
        return None
    try:
        region.madvise(_POPULATE_READ)
    except OSError:
        region.close()
        return None  # an old kernel, or unreadable pages: the read reports any error
    view = memoryview(region)
    digest = xxhash.xxh3_64_intdigest(view)
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    # The tensor's storage holds `view`; when the storage dies, so does the view.
    weakref.finalize(view, _unmap, region, extent).atexit = False
    return tensor, size, digest


def _unmap(region: mmap.mmap, extent: Extent) -> None:
    """A mapped value's tensor died: unmap it, and let go of its extent."""
    try:
        region.close()
    except BufferError:
        pass  # another view still exports it: unmapped when that goes
    finally:
        extent.unpin()


def read_into(fd: int, view: memoryview, offset: int, digest: xxhash.xxh3_64) -> int:
    """Fill ``view`` from the file at ``offset``, hashing each piece while it is
    in the cache (rule 4): the bytes read (fewer at the file's end)."""
    got = 0
    while got < view.nbytes:
        piece = view[got : got + PIECE]
        count = os.preadv(fd, [piece], offset + got)
        if count == 0:
            break
        digest.update(piece[:count])
        got += count
    return got


def advise_will_need(extent: Extent) -> None:
    """Ask the kernel to bring a value's bytes into the page cache, if they left it (rule 3)."""
    file = extent.pin()
    if file is None:
        return
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(file.fd, extent.offset, extent.length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # advice only: the read at unpack reports any real error
    finally:
        extent.unpin()
