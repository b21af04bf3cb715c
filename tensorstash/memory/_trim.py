"""Handing memory a spill freed back to the operating system.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Returning memory ]
1. A spill frees a saved tensor's bytes once they are written, but on glibc
   the process keeps them: once a large block is freed, glibc raises its mmap
   threshold, so later activations come from the heap, and freed heap memory
   stays mapped. Later allocations do not prefer the pages still resident, so
   a step walks over the whole free heap, and a disk spill of every
   activation, left at that, lowers the resident set's growth only a little.
2. So the stash returns it, when it must: after each value written and each
   value read back (on the writer and the workers, or on the training thread
   where it does the I/O itself; rule 3 of NOTE [ Spill files ] in disk.py),
   it reads the process's resident set, and once that has grown by
   ``trim_every`` bytes since the last call (or since the session began; for
   a disk spill after one that wrote at least ``trim_every`` bytes, since
   that one's last call where the resident set was lower then: rule 11) it
   calls glibc's ``malloc_trim(0)``, which gives the free pages of every
   arena back to the kernel (another allocator's own call: rule 12). A step
   that reuses memory already resident grows nothing and never calls it; a
   step that walks over free memory (glibc places a new block on free pages
   whether resident or not) is held to about ``trim_every`` above what it
   uses. Read buffers are not from the heap (NOTE [ Read buffers ] in
   _buffers.py), or every call would hand back the blocks the next reads
   land on.
3. The cost: each call frees the pages it hands back, and pages returned are
   faulted in again when the heap reuses them: the price of memory that
   really left. A smaller ``trim_every`` holds a lower peak for a slower
   step; ``trim_every=None`` keeps the heap and its pages. The resident set
   is read (``/proc/self/statm``) through a descriptor kept open, cheap
   enough to read after every value.
4. The other way, ``MALLOC_MMAP_THRESHOLD_`` (or ``mallopt``), makes every large
   allocation a fresh mapping returned at free: it changes the whole process
   for good (glibc stops adjusting the threshold) and makes every large
   temporary fault, so the library does not set it; docs/cpu-memory.md shows
   it as an allocator setting users may choose.
5. Elsewhere (musl, macOS, Windows, an allocator rule 12 does not know)
   nothing is called, and what the allocator keeps is its own business.
6. A planned step of ``Auto`` on the CPU frees memory with no writer to call
   the trimmer: a recomputed region drops its tensors in forward and makes
   them again in backward, where gradients and temporaries then walk over the
   free heap. There a ``Watch`` thread reads the resident set every 10 ms
   (each read takes the interpreter from the training thread: reading more
   often slowed the step), from the model's first call until the step's saved
   tensors are all freed (after backward, or when the graph is dropped), and
   trims on the same rule, ``Auto(trim_every=)``: by default three quarters
   of the step's activation bytes, and only where the plan holds at most two
   thirds of them (``plan.RETURNS_BELOW``): a plan that keeps most of its
   bytes frees too little for the pages faulted in again to pay. (The
   session pool faults nothing in twice, and serves every plan that saves
   bytes: rule 15.) As for a disk spill, a smaller ``trim_every`` holds a
   lower peak for a slower step.
7. Handing memory back and faulting it in again is the price, so it is
   counted: ``StashStats.returned_bytes``, the bytes the resident set fell by
   over the session's calls, ``StashStats.returned_seconds``, the time the
   calls took, and ``StashStats.returns``, the calls (for a disk spill, of
   its writer and read-aheads; for ``Auto``, of its ``Watch``). What the step
   then faults in again is ``PeakRss.faulted_bytes``.
8. Two ways to hand back less were measured and left: releasing the pages of
   each spilled tensor as soon as it was written and no one else held its
   storage (``MADV_DONTNEED`` on its own block, no heap walk) lowered the
   peak less, since the rest of the heap still grew, and with trimming on top
   it lay on the same memory and time curve; and ``Auto`` trimming once, when
   forward ends, made the same trade as a ``trim_every``, within the
   machine's noise.
9. The price is what a call hands back, not how often it is called: memory
   handed back is faulted in again at a cost per byte, so only handing back
   less makes a step cheaper. ``Auto`` calling once a step still faulted in
   again what that call handed back, and the step paid for it; trimming only
   once the resident set passed the plan's predicted real peak (a ceiling in
   place of the growth rule) also called once a step and cost the same.
   Likewise, trimming after a read-ahead's or a write's result was handed
   over, rather than before, left a disk spill's step as it was.
10. How far the walk of rule 1 goes: a step holds little more in malloc's
   blocks than at its start (``mallinfo2``, sampled beside the resident set)
   while its resident set grows several times that. The real peak is what a
   step walks, not what it holds, and these settings neither stop the walk
   nor make trimming cheaper: ``M_MMAP_THRESHOLD`` (a block is mapped only
   when no free one fits); PyTorch's huge pages for its large blocks
   (``THP_MEM_ALLOC_ENABLE=1``, read once per process: less growth, no faster
   step); glibc's own trimming of the heap's top at free
   (``M_TRIM_THRESHOLD``: nearly the same growth, more faults); transparent
   huge pages for the heap (``madvise(MADV_HUGEPAGE)`` before each call, or
   glibc's ``glibc.malloc.hugetlb=1`` tunable: fewer faults for every variant
   alike, the same step times against each other).
11. A training loop hands nothing back between steps: a step begins with
   the free memory the last one's backward left resident. Counted from the
   session's start, each step of a disk spill walked ``trim_every`` above
   that, and the heap crept up until no step grew, far above what one step
   from a trimmed heap holds. So a disk spill's growth counts from where the
   last one handed memory back (:class:`Floor`), if the resident set was
   lower there. Only after a session that wrote at least ``trim_every``: a
   loop that spills a little each step otherwise hands back its own
   temporaries every step, and its spill runs far below raw file speed.
   ``Auto``'s watch counts from the step's start: in such a loop its first
   step, which keeps everything, sets the heap's size, and no later step
   grows by ``trim_every``, so the loop holds about what no stash holds.
   Counted from the floor, the watch held less but cost more than
   checkpointing every block: it was left as it is. A loop's plain step also
   faults nothing, so against it every variant costs more than against no
   stash from a trimmed heap (rule 3 of NOTE [ Real memory ]).
12. Rules 1-11 are glibc's malloc. jemalloc (and tcmalloc) place a new block
   on memory freed recently, so a step does not walk its free memory and the
   process holds about what it uses: over a training loop every variant, no
   stash included, held less under jemalloc than under glibc, and a disk
   spill's growth seldom reached ``trim_every``. So memory goes back through
   the allocator that serves ``malloc`` (:func:`find_allocator`, at import):
   glibc's ``malloc_trim(0)``, jemalloc's purge of every arena (``mallctl``
   "arena.4096.purge"), tcmalloc's ``MallocExtension_ReleaseFreeMemory``.
   One counts as serving ``malloc`` only where its own count of the bytes
   allocated sees a ``malloc`` made through the process's symbols (another
   library may carry a private copy). An allocator has to be there before
   the process starts (``LD_PRELOAD``): the library loads none; docs/cpu-memory.md
   shows how, and the bench names the allocator in its title.
13. Three more ways for ``Auto`` to hand back less were measured and left:
   growth counted from the resident set each call left rather than the
   lowest since, and a call only while the resident set stands at the step's
   highest so far, each held the same peak for a slower step than the watch
   as it is; a ``trim_every`` a little above its default offers no point
   between: the peak jumps up, for about the same step; and recomputing more
   than the plan chose does not pay for its calls. Under jemalloc (rule 12) the watch
   seldom calls: ``Auto`` holds the same with it or without it.
14. Three more ways for a disk spill were measured and left: a low
   ``mallopt(M_MMAP_THRESHOLD, ...)`` while the session and its backward ran,
   put back after (beside steps that grew the heap, new blocks still land on
   the free heap, rule 10; a process that only spills never grows its heap
   and holds far less, but every large block then faults, and the step paid
   for it); a thread in C that read the resident set every millisecond
   without the interpreter, in place of the calls after each value (what a
   call leaves resident, the step's live memory, plus ``trim_every`` sets
   the peak, not how late the call comes); and counting a step's growth from
   the floor of rule 11 even where the step starts lower (fewer calls, the
   same step time, a higher peak: rule 9).
15. Where the session pool is built (NOTE [ Session pool ] in _pool.py), a
   disk spill that wrote ``trim_every`` bytes and every planned step of
   ``Auto`` that saves bytes (whatever share of them it keeps) hold it in
   place of trimming: freed blocks serve later requests with their pages
   resident and are unmapped past the high-water mark plus the cap, so no
   step walks a free heap and nothing is faulted in twice, and a plan holds
   far less, for a faster step, than with no pool. Rules 1-14 are what
   happens without it (or before a disk spill wrote that much: it trims
   until then, and hands the heap's free memory back once when it takes the
   pool).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorstash.memory._pool import Lease

Release = Callable[[], object]


@dataclass(frozen=True)
class Allocator:
    """The allocator serving the process's ``malloc``, and how its free memory goes back
    to the OS (rule 12).

    Attributes:
        name: "glibc", "jemalloc", "tcmalloc", or "other" (nothing is called).
        release: hands the allocator's free memory back to the OS; None where there
            is no way (rule 5).
    """

    name: str
    release: Release | None


def find_allocator(libc: Any = None) -> Allocator:
    """Which allocator serves ``malloc`` here (rule 12).

    Args:
        libc: the process's symbols (default ``ctypes.CDLL(None)``): jemalloc's
            ``mallctl`` or tcmalloc's ``MallocExtension_*`` count only where that
            allocator's own counter sees a ``malloc`` made through ``libc`` (a
            jemalloc built without its statistics cannot show it, and counts as
            not serving). A jemalloc whose purge of every arena fails (before 5.0)
            has no release.
    """
    if libc is None:
        try:
            libc = ctypes.CDLL(None)
        except OSError:
            return Allocator("other", None)
    if _serves(libc, _jemalloc_allocated(libc)):
        mallctl = libc.mallctl
        purge = f"arena.{_MALLCTL_ARENAS_ALL}.purge".encode()
        if mallctl(purge, None, None, None, 0) != 0:  # before jemalloc 5: no such name
            return Allocator("jemalloc", None)
        return Allocator("jemalloc", lambda: mallctl(purge, None, None, None, 0))
    if _serves(libc, _tcmalloc_allocated(libc)):
        return Allocator("tcmalloc", libc.MallocExtension_ReleaseFreeMemory)
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return Allocator("other", None)
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return Allocator("glibc", lambda: trim(0))


_MALLCTL_ARENAS_ALL = 4096
"""jemalloc's index for "every arena" in a ``mallctl`` name."""


def _serves(libc: Any, allocated: Callable[[], int] | None) -> bool:
    """Whether an allocator whose bytes allocated ``allocated()`` reads serves ``libc.malloc``."""
    if allocated is None:
        return False
    malloc, free = libc.malloc, libc.free
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    before = allocated()
    block = malloc(1 << 20)
    after = allocated()
    free(block)
    return block is not None and after - before >= 1 << 20


def _jemalloc_allocated(libc: Any) -> Callable[[], int] | None:
    """The bytes this thread allocated, by jemalloc's count, if jemalloc is loaded."""
    mallctl = getattr(libc, "mallctl", None)
    if mallctl is None:
        return None
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_size_t]  # fmt: skip
    mallctl.restype = ctypes.c_int

    def allocated() -> int:
        value, size = ctypes.c_uint64(0), ctypes.c_size_t(8)
        if mallctl(b"thread.allocated", ctypes.byref(value), ctypes.byref(size), None, 0):
            return 0
        return value.value

    return allocated


def _tcmalloc_allocated(libc: Any) -> Callable[[], int] | None:
    """The bytes allocated, by tcmalloc's count, if tcmalloc is loaded."""
    get = getattr(libc, "MallocExtension_GetNumericProperty", None)
    if get is None or getattr(libc, "MallocExtension_ReleaseFreeMemory", None) is None:
        return None
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    get.restype = ctypes.c_int
    libc.MallocExtension_ReleaseFreeMemory.argtypes = []
    libc.MallocExtension_ReleaseFreeMemory.restype = None

    def allocated() -> int:
        value = ctypes.c_size_t(0)
        if not get(b"generic.current_allocated_bytes", ctypes.byref(value)):
            return 0
        return value.value

    return allocated


ALLOCATOR = find_allocator()
"""The process's allocator, found at import (rule 12)."""


def release_free_heap() -> None:
    """Hand the allocator's free memory back to the OS now (rule 12); nothing where it has
    no way to."""
    if ALLOCATOR.release is not None:
        ALLOCATOR.release()


def resident_bytes() -> int:
    """The process's resident set in bytes (Linux ``/proc/self/statm``).

    Read through one descriptor the process keeps open: a ``pread`` is several
    times cheaper than opening, reading and closing the file, and a disk spill
    reads it twice per value (rule 2). A forked child opens its own (``self``
    was the parent when the descriptor was opened).
    """
    fd = _statm if _statm >= 0 else _open_statm()
    return int(os.pread(fd, 256, 0).split()[1]) * PAGE_SIZE


_statm = -1
_statm_lock = threading.Lock()


def _open_statm() -> int:
    global _statm
    with _statm_lock:
        if _statm < 0:
            _statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        return _statm


def _forget_statm() -> None:
    global _statm, _statm_lock
    _statm_lock = threading.Lock()  # another thread may have held it at the fork
    if _statm >= 0:
        os.close(_statm)  # the parent's
        _statm = -1


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""The size of a memory page in bytes."""


def whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of pages."""
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


class Floor:
    """What the process's disk spills left at their last hand-back (rule 2): the resident
    set after it, and the bytes the latest session wrote so far."""

    def __init__(self) -> None:
        self.resident: int | None = None
        self.written = 0
        self._lock = threading.Lock()

    def begin(self, resident: int, every: int) -> int:
        """A session begins with ``resident`` bytes resident: where its growth counts from.

        From the floor, where it is lower and the last session wrote at least ``every``
        bytes; from ``resident`` otherwise. The session's writes count from 0.
        """
        with self._lock:
            floor, written = self.resident, self.written
            self.written = 0
        if floor is None or written < every:
            return resident
        return min(resident, floor)

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self.written += nbytes

    def handed_back(self, resident: int) -> None:
        with self._lock:
            self.resident = resident

    def _forget(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self.resident, self.written = None, 0


FLOOR = Floor()
"""The floor of the process's disk spills (rule 2)."""


class Trimmer:
    """Returns free heap memory to the OS once the resident set grew by ``every`` bytes (rule 2).

    Args:
        every: growth of the resident set between two calls; None never calls.
        release: what returns the memory (default the allocator's own, rule 12:
            glibc's ``malloc_trim(0)``; None where there is none).
        resident: reads the resident set in bytes.
        counted: told, after each call, how many bytes the resident set fell
            by and how many seconds the call took (rule 7): ``StashStats.returned``.
        floor: shared by the trimmers of the sessions of one kind (a disk
            spill's): where growth counts from (rule 2).

    Example:
        >>> trimmer = Trimmer(16 << 20)
        >>> trimmer.moved(nbytes)  # on the writer thread, after nbytes were written
    """

    def __init__(
        self,
        every: int | None,
        release: Release | None = ALLOCATOR.release,
        resident: Callable[[], int] = resident_bytes,
        counted: Callable[[int, float], object] | None = None,
        floor: Floor | None = None,
    ) -> None:
        self.every = None if release is None else every
        self.release = release
        self.resident = resident
        self.counted = counted
        self.floor = floor
        self.calls = 0
        self._base = 0
        if self.every is not None:
            now = resident()
            self._base = now if floor is None else floor.begin(now, self.every)
        self._lock = threading.Lock()

    def moved(self, written: int = 0) -> None:
        """A value was spilled (``written`` bytes) or read back: return memory if the
        resident set grew enough.

        Rule 2 says who calls it.
        """
        if self.every is None:
            return
        if written and self.floor is not None:
            self.floor.wrote(written)
        with self._lock:
            before = self.resident()
            if before - self._base >= self.every:
                self._call(before)

    def _call(self, before: int) -> None:
        self.calls += 1
        start = time.perf_counter()
        if self.release is not None:
            self.release()
        took = time.perf_counter() - start
        self._base = self.resident()
        if self.floor is not None:
            self.floor.handed_back(self._base)
        if self.counted is not None:
            self.counted(max(before - self._base, 0), took)

    def hand_back(self) -> None:
        """Hand the allocator's free memory back now, whatever the growth."""
        if self.every is None:
            return
        with self._lock:
            self._call(self.resident())

    def freed(self) -> None:
        """Memory may have been freed: growth counts from the resident set now, if lower."""
        if self.every is None:
            return
        with self._lock:
            self._base = min(self._base, self.resident())


class Watch:
    """A thread that trims while a step runs (rule 6), until ``holding()`` turns False.

    Args:
        every: growth of the resident set between two calls.
        holding: whether the step still holds saved tensors; read by the
            thread once the session exited (:meth:`exited`).
        release, resident, counted: as for :class:`Trimmer`.
        interval_s: how often the resident set is read.
        lease: the session pool's lease for the step (NOTE [ Session pool ] in
            _pool.py): then the thread trims nothing and closes the lease when
            ``holding()`` turns False.
    """

    def __init__(
        self,
        every: int,
        holding: Callable[[], bool],
        release: Release | None = ALLOCATOR.release,
        resident: Callable[[], int] = resident_bytes,
        interval_s: float = 0.01,
        counted: Callable[[int, float], object] | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.trimmer = Trimmer(None if lease is not None else every, release, resident, counted)
        self.holding = holding
        self.interval_s = interval_s
        self.lease = lease
        self._exited = False
        self._thread = threading.Thread(target=self._run, name="tensorstash-trim", daemon=True)

    def start(self) -> None:
        if self.trimmer.every is not None or self.lease is not None:
            self._thread.start()

    def exited(self) -> None:
        """The session exited: stop once its saved tensors are freed."""
        self._exited = True

    def _run(self) -> None:
        trimmer, lease = self.trimmer, self.lease
        while True:
            time.sleep(self.interval_s)
            if self._exited and not self.holding():
                if lease is not None:
                    lease.close()
                return
            if lease is None:
                trimmer.freed()
                trimmer.moved()


def _forget_in_child() -> None:
    """A forked child reads its own resident set and has handed nothing back yet."""
    _forget_statm()
    FLOOR._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
