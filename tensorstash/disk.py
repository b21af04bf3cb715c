"""DiskSpill: saved tensors written to a private directory, read back with a checksum.

# NOTE [ Spill files ]
1. Each process spills into its own directory ``tensorstash-<pid>-<random>``,
   mode 0700, made inside the directory the user names (default: the system
   temporary directory). A parent that anyone may write to without the sticky
   bit is refused: another user could swap our directory out.
2. Files are created 0600 with O_EXCL|O_NOFOLLOW relative to an open handle of
   the private directory, so no planted name or symlink is ever written
   through.
3. A single background writer writes files in pack order while forward goes on;
   the packed value holds the bytes until they are written. A full disk
   (ENOSPC, EDQUOT) keeps the bytes in memory instead, with one warning and a
   count in ``stats.fallbacks``.
4. Reads are raw bytes checked against a CRC-32 taken while writing; a missing,
   truncated or corrupted file raises :class:`SpillError` naming the tensor.
   Nothing is ever unpickled.
5. A file is deleted when its packed value is freed (never at unpack). The
   private directory is removed at exit (atexit, or multiprocessing's exit for
   its children); directories left by dead processes of the same user are
   removed when a new one is made. A forked child makes its own directory and
   never removes its parent's files or directory.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import multiprocessing.util
import os
import shutil
import stat
import tempfile
import threading
import time
import weakref
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import psutil
import torch
from torch import Tensor

from tensorstash._layout import Layout, memory
from tensorstash._reasons import Reason, Why, reason
from tensorstash.policy import (
    Context,
    Held,
    HostBytes,
    Packed,
    Pending,
    Returns,
    bug,
    finalize,
    from_host,
    to_host,
    without_frames,
)
from tensorstash.stats import Tier

_PREFIX = "tensorstash-"
_FULL = (errno.ENOSPC, errno.EDQUOT)


class SpillError(RuntimeError):
    """A spill file could not be read back as it was written."""


# -- the private directory ----------------------------------------------------------


def check_parent(parent: Path, api: str) -> None:
    """Refuse a parent directory that is missing, unwritable or unsafe (rule 1).

    Raises:
        ValueError: with what is wrong and what to pass instead.
    """
    fix = "pass a writable directory you own, or directory=None for the system temporary one"
    try:
        info = os.stat(parent)
    except OSError as error:
        raise ValueError(
            f"{api}: directory '{parent}' cannot be used ({error.strerror}); {fix}"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{api}: '{parent}' is not a directory; {fix}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{api}: directory '{parent}' is not writable; {fix}")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"{api}: directory '{parent}' is writable by every user and has no sticky bit, so "
            f"another user could replace the spill directory; {fix} (or `chmod +t` it)"
        )


def check_directory(directory: object, api: str) -> None:
    """A ``directory=`` argument: None, or a path to a usable parent (see :func:`check_parent`).

    Raises:
        TypeError: not a path.
        ValueError: an empty path, or one :func:`check_parent` refuses.
    """
    if directory is None:
        return
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"{api}: directory must be a path (str or os.PathLike) or None; "
            f"got {type(directory).__name__} {directory!r}"
        )
    if os.fspath(directory) == "":
        raise ValueError(
            f"{api}: directory is an empty path; pass a writable directory you own, "
            "or directory=None for the system temporary one"
        )
    check_parent(Path(directory), api)


def _stale(entry: os.DirEntry[str], uid: int) -> bool:
    """A spill directory of ours whose process is provably gone (rule 5)."""
    parts = entry.name[len(_PREFIX) :].split("-", 1)
    if len(parts) != 2 or not parts[0].isdigit():
        return False
    pid = int(parts[0])
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or pid == os.getpid():
        return False
    return not psutil.pid_exists(pid)


def remove_stale(parent: Path) -> list[str]:
    """Remove spill directories left in ``parent`` by dead processes of this user."""
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(_PREFIX) and _stale(entry, uid):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


class SpillDirectory:
    """This process's private spill directory inside one parent (rules 1, 2 and 5)."""

    def __init__(self, parent: Path) -> None:
        check_parent(parent, "tensorstash.DiskSpill")
        remove_stale(parent)
        self.path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent))
        os.chmod(self.path, 0o700)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.pid = os.getpid()  # a forked child inherits this object but must not touch it
        self._count = 0
        self._lock = threading.Lock()

    def new_name(self) -> str:
        with self._lock:
            self._count += 1
            return f"{self._count:08d}.bin"

    def create(self, name: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, 0o600, dir_fd=self.fd)

    def open(self, name: str) -> int:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)

    def remove(self, name: str) -> None:
        if self.pid != os.getpid():
            return  # the parent's file, freed in a forked child: the parent removes it
        with self._lock:
            if self.fd < 0:
                return  # closed: the directory and its files are already gone
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)

    def __del__(self) -> None:
        # A directory replaced after it was deleted from outside (spill_directory)
        # is freed with the last spilled value that used it: close its descriptor.
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            self.fd = -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Remove the directory and everything in it (in the process that made it)."""
        if self.pid != os.getpid():
            return
        with self._lock:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


_directories: dict[Path, SpillDirectory] = {}
_directories_lock = threading.Lock()


def spill_directory(parent: Path) -> SpillDirectory:
    """The process-wide private directory inside ``parent``, made on first use."""
    key = parent.resolve()
    with _directories_lock:
        found = _directories.get(key)
        if found is None or found.pid != os.getpid() or not found.path.is_dir():
            found = _directories[key] = SpillDirectory(key)
        return found


@atexit.register
def _remove_directories() -> None:
    with _directories_lock:
        for directory in _directories.values():
            directory.close()
        _directories.clear()


def _forget_inherited() -> None:
    """In a forked child: the directories belong to the parent; start with none."""
    global _directories_lock
    _directories.clear()
    _directories_lock = threading.Lock()  # another thread may have held it at the fork


def _remove_at_multiprocessing_exit(_: object = None) -> None:
    """Children of multiprocessing (DDP ranks, DataLoader workers) end with
    os._exit, which skips atexit; multiprocessing runs its finalizers first.
    A forked child starts with none, hence the registration after fork too."""
    multiprocessing.util.Finalize(None, _remove_directories, exitpriority=0)


os.register_at_fork(after_in_child=_forget_inherited)
_remove_at_multiprocessing_exit()
multiprocessing.util.register_after_fork(_remove_directories, _remove_at_multiprocessing_exit)


# -- what gets written ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Hole:
    """Where a buffer of a flattened value goes (an index into the written buffers)."""

    index: int
    nbytes: int
    tensor: bool = False


_BYTES = (bytes, bytearray, memoryview)


def _flatten(value: Any, buffers: list[memoryview]) -> Any:
    """Replace the byte buffers inside a value (nested tuples, lists, dataclasses) by holes."""
    if isinstance(value, _BYTES):
        view = memoryview(value).cast("B")
        buffers.append(view)
        return _Hole(len(buffers) - 1, view.nbytes)
    if isinstance(value, Tensor):
        buffers.append(memory(value.contiguous().view(torch.uint8).reshape(-1)))
        return _Hole(len(buffers) - 1, buffers[-1].nbytes, tensor=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_flatten(item, buffers) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _flatten(getattr(value, f.name), buffers)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


def _fill(skeleton: Any, data: Tensor, offsets: list[int]) -> Any:
    """The inverse of :func:`_flatten`: holes become slices of the bytes read back."""
    if isinstance(skeleton, _Hole):
        start = offsets[skeleton.index]
        piece = data[start : start + skeleton.nbytes]
        return piece if skeleton.tensor else memory(piece)
    if isinstance(skeleton, (tuple, list)):
        return type(skeleton)(_fill(item, data, offsets) for item in skeleton)
    if dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        changes = {
            f.name: _fill(getattr(skeleton, f.name), data, offsets)
            for f in dataclasses.fields(skeleton)
            if f.init
        }
        return dataclasses.replace(skeleton, **changes)
    return skeleton


# -- the packed value ---------------------------------------------------------------------


@dataclass(eq=False, slots=True, weakref_slot=True)
class Spilled(Packed):
    """A value written to a spill file (or kept in memory if the disk was full).

    Attributes:
        inner: what the previous stage packed (a Compressed value) with its byte
            buffers replaced by holes; None when the file holds a tensor's bytes.
        layout: the tensor's layout, when the file holds its bytes.
        kind: what unpack returns (see ``policy.from_host``).
        directory, name: where the file is.
        written: resolves to the file's (size, crc32) once the writer is done,
            or to None if the bytes stayed in memory (full disk).
        source: the bytes to write (or kept, on a full disk).
        prefetched: the file's bytes read ahead of unpack (a cache, not a resource).
    """

    inner: Any = None
    layout: Layout | None = None
    kind: Returns = "tensor"
    directory: SpillDirectory | None = None
    name: str = ""
    written: Future[tuple[int, int] | None] | None = None
    source: Any = None
    prefetched: Future[Tensor] | None = None

    def describe(self) -> str:
        inner = self.inner[0] if isinstance(self.inner, tuple) else self.inner
        layout = self.layout or getattr(inner, "layout", None)
        what = f"{layout.dtype} tensor of shape {list(layout.shape)}" if layout else "a tensor"
        path = self.directory.path / self.name if self.directory else self.name
        return f"{what} (spill file '{path}')"


@dataclass(frozen=True)
class DiskSpill:
    """Write saved tensors to files in a private directory; read them back in backward.

    See NOTE [ Spill files ] for how files are protected and cleaned up. Put
    ``Lz4()`` before it to write compressed bytes.

    Args:
        directory: where to make the private spill directory (default: the
            system temporary directory).
        max_pending_bytes: bytes allowed to wait for the writer before pack waits.

    Raises:
        ValueError: the directory is missing, unwritable, or world-writable
            without the sticky bit.
        TypeError: an argument of the wrong type.

    Example:
        >>> with tensorstash.stash(tensorstash.DiskSpill("/scratch")) as session:
        ...     loss = model(x).sum()
    """

    directory: str | os.PathLike[str] | None = None
    max_pending_bytes: int = 512 << 20

    stage_rank: ClassVar[int] = 2

    def __post_init__(self) -> None:
        check_directory(self.directory, "tensorstash.DiskSpill")
        value = self.max_pending_bytes
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"tensorstash.DiskSpill: max_pending_bytes must be an int >= 0; got {value!r}"
            )
        if value < 0:
            raise ValueError(
                f"tensorstash.DiskSpill: max_pending_bytes must be an int >= 0; got {value}"
            )

    def _parent(self) -> Path:
        return Path(self.directory) if self.directory is not None else Path(tempfile.gettempdir())

    def pack(self, value: Tensor | Packed, ctx: Context) -> Spilled:
        directory = spill_directory(self._parent())
        if isinstance(value, HostBytes) or not isinstance(value, Packed) or isinstance(value, Held):
            # Host bytes still being copied from the device are waited for by
            # the writer, not here (rule 3).
            host, kind = to_host(value, wait=False)
            layout = host.layout
            source: Any = host if kind == "host" else host.ready()
            inner = None
            nbytes = host.nbytes
        else:
            layout, kind, inner, source, nbytes = None, "tensor", value, value, value.nbytes
        pending: Pending = ctx.resource("disk-pending", Pending)
        pending.wait_under(self.max_pending_bytes, ctx)
        stored = layout.nbytes if layout is not None else value.stored_bytes  # type: ignore[union-attr]
        packed = Spilled(
            "disk", nbytes, stored, inner=inner, layout=layout, kind=kind,
            directory=directory, name=directory.new_name(), source=source,
        )  # fmt: skip
        ref = weakref.ref(packed)
        packed.written = ctx.writer().submit(_write, ref, ctx, directory, packed.name, source)
        pending.add(packed.written, stored)
        finalize(packed, directory.remove, packed.name)
        return packed

    def unpack(self, packed: Packed, ctx: Context) -> Tensor | Packed:
        if not isinstance(packed, Spilled):
            raise bug(f"DiskSpill cannot unpack {type(packed).__name__}")
        if packed.written is None:
            raise bug("Spilled without a writer future")
        start = time.perf_counter()
        written = packed.written.result()
        if written is None:  # the disk was full: the bytes stayed in memory
            ctx.stats.timed("wait", time.perf_counter() - start)
            return _rebuild(packed, packed.source)
        prefetched, packed.prefetched = packed.prefetched, None
        data = prefetched.result() if prefetched is not None else _read(packed, written)
        ctx.stats.timed("wait", time.perf_counter() - start)
        return _rebuild(packed, data)

    def prefetch(self, packed: Packed, ctx: Context) -> None:
        if isinstance(packed, Spilled) and packed.prefetched is None and packed.written:
            written_future = packed.written

            def read() -> Tensor | Any:
                written = written_future.result()
                return packed.source if written is None else _read(packed, written)

            packed.prefetched = ctx.pool().submit(without_frames, read)


def _write(
    ref: weakref.ref[Spilled], ctx: Context, directory: SpillDirectory, name: str, source: Any
) -> tuple[int, int] | None:
    """The writer's job (rule 3), whose error keeps no frame that holds the tensor.

    The future keeps the error until unpack re-raises it, and the session's
    context keeps the future: an error whose traceback reached the packed value
    or its bytes would keep them, and the graph, alive as long as the session.
    """
    return without_frames(_write_now, ref, ctx, directory, name, source)


def _write_now(
    ref: weakref.ref[Spilled], ctx: Context, directory: SpillDirectory, name: str, source: Any
) -> tuple[int, int] | None:
    """Write and checksum, or keep the bytes on a full disk."""
    packed = ref()
    if packed is None:
        return None  # freed before it was written: nothing to keep
    inner = packed.inner
    if inner is not None:
        encoded = inner.encoded(ctx)
        buffers: list[memoryview] = []
        packed.inner = dataclasses.replace(inner, future=None, source=None, restored=None)
        skeleton = _flatten(encoded, buffers)
    else:
        if isinstance(source, HostBytes):
            source = packed.source = source.ready()
        buffers = [memory(source)]
        skeleton = None
    try:
        size, crc = _write_file(directory, name, buffers)
    except OSError as error:
        if error.errno not in _FULL:
            raise SpillError(
                f"tensorstash.DiskSpill: cannot write {packed.describe()}: {error}"
            ) from error
        directory.remove(name)
        ctx.stats.fallback("disk full")
        ctx.warn(
            f"tensorstash.DiskSpill: the disk holding '{directory.path}' is full "
            f"({error.strerror}); keeping the tensor in memory instead. Free space or pass "
            "DiskSpill(directory=...) on a larger disk. (Shown once per session; "
            "stats.fallbacks['disk full'] counts every tensor.)",
            once="disk full",
        )
        if inner is not None:
            packed.source = encoded
            packed.inner = inner
        tier: Tier = "host" if inner is not None else "kept"
        ctx.update(packed, tier, sum(b.nbytes for b in buffers), Reason(Why.DISK_FULL))
        return None
    packed.source = None
    outcome = Reason(Why.SPILLED)
    if skeleton is not None:
        packed.inner = (packed.inner, skeleton)
        if size < packed.nbytes:
            outcome = reason(Why.SPILLED_COMPRESSIBLE, f"{packed.nbytes / max(size, 1):.1f}x")
    ctx.update(packed, "disk", size, outcome)
    return size, crc


def _write_file(directory: SpillDirectory, name: str, buffers: list[memoryview]) -> tuple[int, int]:
    fd = directory.create(name)
    try:
        crc, size = 0, 0
        for buffer in buffers:
            view = buffer
            while view.nbytes:
                written = os.write(fd, view)
                view = view[written:]
            crc = zlib.crc32(buffer, crc)
            size += buffer.nbytes
        return size, crc
    finally:
        os.close(fd)


def _read(packed: Spilled, written: tuple[int, int]) -> Tensor:
    """Read a spill file back whole, checking its size and checksum (rule 4)."""
    size, crc = written
    directory = packed.directory
    if directory is None:
        raise bug("Spilled without a directory")
    fix = (
        "The spill directory must not be changed while a graph that uses it is alive; "
        "rerun the step."
    )
    try:
        fd = directory.open(packed.name)
    except OSError as error:
        raise SpillError(
            f"tensorstash.DiskSpill: cannot read back {packed.describe()}: {error.strerror}. {fix}"
        ) from None
    try:
        data = torch.empty(size, dtype=torch.uint8)
        view = memory(data)
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        extra = os.read(fd, 1)
    finally:
        os.close(fd)
    if got != size or extra:
        raise SpillError(
            f"tensorstash.DiskSpill: {packed.describe()} was truncated or grew: expected "
            f"{size} bytes. {fix}"
        )
    if zlib.crc32(view) != crc:
        raise SpillError(
            f"tensorstash.DiskSpill: {packed.describe()} is corrupted (checksum mismatch). {fix}"
        )
    return data


def _rebuild(packed: Spilled, data: Any) -> Tensor | Packed:
    """The value the previous stage packed (or the tensor), from the bytes read back."""
    if packed.layout is not None:
        if not isinstance(data, Tensor):
            raise bug("a tensor's spill bytes are not a tensor")
        return from_host(packed.layout, data, packed.kind)
    if isinstance(packed.inner, tuple):
        compressed, skeleton = packed.inner
        encoded = _fill(skeleton, data, _offsets(skeleton))
        return _with_encoded(compressed, encoded, data)
    if packed.inner is not None:  # full disk: `data` is the encoded value itself
        return _with_encoded(packed.inner, data, None)
    raise bug("Spilled holds neither a layout nor an inner value")


def _offsets(skeleton: Any) -> list[int]:
    sizes: dict[int, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, _Hole):
            sizes[node.index] = node.nbytes
        elif isinstance(node, (tuple, list)):
            for item in node:
                walk(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))

    walk(skeleton)
    offsets, total = [], 0
    for index in range(len(sizes)):
        offsets.append(total)
        total += sizes[index]
    return offsets


def _with_encoded(compressed: Any, encoded: Any, keep_alive: Tensor | None) -> Packed:
    """A copy of a Compressed value whose bytes are ``encoded`` (already done)."""
    future: Future[Any] = Future()
    future.set_result(encoded)
    # `keep_alive` owns the memory the encoded slices point into.
    result: Packed = dataclasses.replace(compressed, future=future, source=keep_alive)
    return result
