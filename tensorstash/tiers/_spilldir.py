"""The private spill directory: checks, creation, cleanup.

Rules 1, 2 and 8 of NOTE [ Spill files ] in disk.py.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import multiprocessing.util
import os
import shutil
import stat
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

PREFIX = "tensorstash-"
_API = "tensorstash.DiskSpill"
_FIX = "pass a writable directory you own, or directory=None for the system temporary one"
_RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
# What open() says where a file system makes no O_TMPFILE files.
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})


# -- checks ---------------------------------------------------------------------------


def check_parent(parent: Path, api: str) -> None:
    """Refuse a parent directory that is missing, unwritable or unsafe (rule 1).

    Raises:
        ValueError: with what is wrong and what to pass instead.
    """
    try:
        info = os.stat(parent)
    except OSError as error:
        raise ValueError(
            f"{api}: directory '{parent}' cannot be used ({error.strerror}); {_FIX}"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{api}: '{parent}' is not a directory; {_FIX}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{api}: directory '{parent}' is not writable; {_FIX}")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"{api}: directory '{parent}' is writable by every user and has no sticky bit, so "
            f"another user could replace the spill directory; {_FIX} (or `chmod +t` it)"
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
        raise ValueError(f"{api}: directory is an empty path; {_FIX}")
    check_parent(Path(directory), api)


def cannot_hold(parent: Path, error: OSError) -> ValueError:
    """The error for a parent in which no directory can be made (``/proc``, say)."""
    return ValueError(
        f"{_API}: cannot make a spill directory in '{parent}' ({error.strerror}); "
        f"the file system there does not take new directories. {_FIX.capitalize()}"
    )


_probed: set[tuple[int, Path]] = set()


def probe(parent: Path) -> None:
    """Make and remove a directory in ``parent``, once per process (rule 1).

    ``os.access`` says yes to root everywhere, also in ``/proc``; only making a
    directory tells. The name carries the pid, so a probe left by a killed
    process is removed like any stale directory.

    Raises:
        ValueError: no directory can be made there.
    """
    key = (os.getpid(), parent)
    if key in _probed:
        return
    try:
        made = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-probe-", dir=parent)
        os.rmdir(made)
    except OSError as error:
        raise cannot_hold(parent, error) from None
    _probed.add(key)


# -- RAM-backed file systems ---------------------------------------------------------------


def _mounts() -> Iterable[str]:
    try:
        with open("/proc/self/mountinfo") as lines:
            return lines.readlines()
    except OSError:
        return ()


def filesystem(path: Path, mounts: Callable[[], Iterable[str]] = _mounts) -> str | None:
    """The type of the file system holding ``path`` ("ext4", "tmpfs", ...), or None if unknown.

    Reads Linux's mount table (``/proc/self/mountinfo``): the mount point that
    is the longest prefix of the path's real location wins.
    """
    real = os.path.realpath(path)
    best, kind = -1, None
    for line in mounts():
        fields = line.split()
        if "-" not in fields:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fields[fields.index("-") + 1]
    return kind


_warned_ram: set[str] = set()
_kinds: dict[str, str | None] = {}  # the file system of each directory asked, from the mounts


def warn_if_ram_backed(
    parent: Path, mounts: Callable[[], Iterable[str]] = _mounts, stacklevel: int = 2
) -> str | None:
    """Warn once per directory if ``parent`` is on tmpfs or ramfs (rule 1); its type if so.

    The process's mount table is read once per directory: ``stash("disk")`` makes
    a DiskSpill every step, and each read parses the whole table.
    """
    key = os.path.realpath(parent)
    if mounts is not _mounts:
        kind = filesystem(parent, mounts)
    elif key in _kinds:
        kind = _kinds[key]
    else:
        kind = _kinds[key] = filesystem(parent, mounts)
    if kind not in _RAM_FILESYSTEMS:
        return None
    if key not in _warned_ram:
        _warned_ram.add(key)
        warnings.warn(
            f"{_API}: '{parent}' is on {kind}, which keeps files in RAM: spilling there frees "
            "no memory. Pass DiskSpill(directory=...) a directory on a disk (for example "
            "/var/tmp, or a scratch directory in your home or on a local SSD).",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
    return kind


# -- the directory ----------------------------------------------------------------------


def _stale(entry: os.DirEntry[str], uid: int) -> bool:
    """A spill directory of ours whose process is provably gone (rule 8)."""
    parts = entry.name[len(PREFIX) :].split("-", 1)
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
        if entry.name.startswith(PREFIX) and _stale(entry, uid):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


_swept: set[tuple[int, Path]] = set()


def _sweep_once(parent: Path) -> None:
    """:func:`remove_stale`, the first time this process makes a directory in ``parent``
    (rule 8): a parent may hold thousands of entries, and ``stash("disk")`` makes a
    directory each step."""
    key = (os.getpid(), parent)
    if key not in _swept:
        _swept.add(key)
        remove_stale(parent)


class SpillDirectory:
    """This process's private spill directory inside one parent (rules 1, 2 and 8).

    It lives while something holds it: a policy (:func:`hold`), a spill file
    made in it. When the last holder lets go, or at exit, the directory is
    removed and its descriptor closed.

    Raises:
        ValueError: the parent is unusable, or no directory can be made in it.
    """

    def __init__(self, parent: Path) -> None:
        check_parent(parent, _API)
        _sweep_once(parent)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        except OSError as error:
            raise cannot_hold(parent, error) from None
        self.parent = parent
        os.chmod(self.path, 0o700)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.pid = os.getpid()  # a forked child inherits this object but must not remove it
        self._count = 0
        self._lock = threading.Lock()
        # Rule 8: run when the last holder lets go, by ``close``, or at exit.
        self._remove = weakref.finalize(self, _remove, self.path, self.fd, self.pid)

    def new_name(self) -> str:
        with self._lock:
            self._count += 1
            return f"{self._count:08d}.bin"

    def create(self, name: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, 0o600, dir_fd=self.fd)

    def anonymous(self) -> int:
        """A descriptor, open for reading and writing, of a new file with no name here.

        The kernel frees the file when its last descriptor closes, also when the
        process dies (rule 6). ``O_TMPFILE`` makes it nameless from the start;
        where the file system has none, a file is made as in rule 2 and its
        name removed at once.
        """
        tmpfile = getattr(os, "O_TMPFILE", 0)
        if tmpfile:
            try:
                return os.open(".", tmpfile | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
            except OSError as error:
                if error.errno not in _NO_TMPFILE:
                    raise
        name = self.new_name()
        fd = self.create(name)
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        """Remove the directory and everything in it now (at exit), whoever holds it.

        Only the process that made it removes it; any process closes its descriptor.
        """
        with self._lock:
            self._remove()
            self.fd = -1


def _remove(path: Path, fd: int, pid: int) -> None:
    """A spill directory's end (rule 8): removed by the process that made it, if the
    path still names it (one deleted from outside may have been replaced), and its
    descriptor closed. Holds no reference to the directory object: it runs as that
    object is freed, on whichever thread let go of it last."""
    try:
        if os.getpid() == pid and _names(path, fd):
            try:
                os.rmdir(path)  # spill files have no names (rule 2): it is empty
            except OSError:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` is the directory open as ``fd`` (not a symlink, not a replacement)."""
    try:
        named, opened = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


# Each directory by the parent it was asked for, and by its real path; an entry goes
# when its directory does.
_directories: weakref.WeakValueDictionary[Path, SpillDirectory] = weakref.WeakValueDictionary()
_directories_lock = threading.Lock()


class _Slot:
    """What policies hold in one parent: its current directory (rule 8). A directory
    deleted from outside is replaced here, so its holders let go of the old one."""

    __slots__ = ("__weakref__", "directory")

    def __init__(self, directory: SpillDirectory) -> None:
        self.directory = directory


# The slot of each real parent path while a policy holds it.
_slots: weakref.WeakValueDictionary[Path, _Slot] = weakref.WeakValueDictionary()


def spill_directory(parent: Path) -> SpillDirectory:
    """The process's private directory inside ``parent``: the one alive, else a new one.

    The caller holds it for as long as it uses it (rule 8).
    """
    with _directories_lock:
        return _current(parent)


def _current(parent: Path) -> SpillDirectory:
    """:func:`spill_directory`, under its lock."""
    found = _directories.get(parent)
    if found is None or found.pid != os.getpid() or not found.path.is_dir():
        key = parent.resolve()
        found = _directories.get(key)
        if found is None or found.pid != os.getpid() or not found.path.is_dir():
            found = _directories[key] = SpillDirectory(key)
            slot = _slots.get(key)
            if slot is not None:
                slot.directory = found  # its holders let go of the one replaced
        _directories[parent] = found
    return found


# The slots held for owners (a DiskSpill that spilled), by ``id(owner)`` and real
# parent path; an owner's entry goes when it is freed. By identity: equal policies
# are not one holder.
_held: dict[int, dict[Path, _Slot]] = {}


def hold(owner: object, parent: Path) -> SpillDirectory:
    """The private directory inside ``parent`` (:func:`spill_directory`), and the one
    that replaces it there, kept while ``owner`` lives (rule 8)."""
    with _directories_lock:
        directory = _current(parent)
        slot = _slots.get(directory.parent)
        if slot is None:
            slot = _slots[directory.parent] = _Slot(directory)
    key = id(owner)
    fresh: dict[Path, _Slot] = {}
    held = _held.setdefault(key, fresh)  # one step under the GIL: no lock a finalizer needs
    if held is fresh:
        weakref.finalize(owner, _held.pop, key, None).atexit = False
    held[directory.parent] = slot
    return directory


@atexit.register
def remove_directories() -> None:
    """Remove every spill directory this process made and still holds (at exit, rule 8)."""
    with _directories_lock:
        for directory in set(_directories.values()):
            directory.close()
        _directories.clear()


def _forget_inherited() -> None:
    """In a forked child: the directories belong to the parent; start with none. The
    child's copies of their descriptors close as the inherited objects are freed."""
    global _directories_lock
    _directories.clear()
    _slots.clear()
    _held.clear()
    _directories_lock = threading.Lock()  # another thread may have held it at the fork


def _remove_at_multiprocessing_exit(_: object = None) -> None:
    """Children of multiprocessing (DDP ranks, DataLoader workers) end with
    os._exit, which skips atexit; multiprocessing runs its finalizers first.
    A forked child starts with none, hence the registration after fork too."""
    multiprocessing.util.Finalize(None, remove_directories, exitpriority=0)


os.register_at_fork(after_in_child=_forget_inherited)
_remove_at_multiprocessing_exit()
multiprocessing.util.register_after_fork(remove_directories, _remove_at_multiprocessing_exit)
