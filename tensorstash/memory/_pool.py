"""The session pool: freed activations that leave the process, or are used again at once.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Session pool ]
1. On glibc, memory a step frees stays in the process and the next blocks land
   on other free pages (NOTE [ Returning memory ] in _trim.py, rules 1 and 10):
   a step's resident set grows by what it walks, not by what it holds, and
   trimming the heap gets it down only by handing pages back that the step
   faults in again. So while a session that frees memory runs (a disk spill,
   or a planned step of ``Auto`` on the CPU), PyTorch's CPU allocator is the
   pool in ``_alloc.cpp``:
   - a block of at least 128 KiB (``LEAST``, glibc's own first mmap
     threshold) is a mapping of its own, rounded up to whole pages; smaller
     ones go to the allocator installed before;
   - freed, a block waits, its pages resident, and serves a later request:
     whole where it is at most an eighth larger, else split (the smallest
     block large enough; its tail waits on its own), or, where no block
     waiting is large enough, the largest one grown to the size asked for by
     ``mremap`` (its pages move, resident; only the rest are faulted in);
   - the blocks waiting hold at most ``cap`` bytes (the session's
     ``trim_every``) or, while the blocks in use hold less than the most
     they held since the pool began to serve, up to that difference: the
     pool's pages never exceed that high-water mark plus ``cap``. Past it
     the oldest blocks waiting are unmapped, and all of them once the last
     lease ends (rule 4); a block freed after that is unmapped at once, so its
     pages leave the process on the thread that freed it (a disk spill's
     writer, for a written activation).
   A step then holds what it uses plus at most ``cap``, and faults in only the
   pages its blocks did not have resident: no heap walk, no trimming. A pool
   that served a request only with a block of its size, and kept ``cap``
   bytes waiting however few were in use, mapped anew most blocks whose size
   no block waiting had (under bf16 autocast, casts and activations of many
   sizes), and faulted them in: splitting, growing and the high-water mark
   keep a planned step about as fast as checkpointing.
2. A disk spill takes the pool once it has written ``trim_every`` bytes, and
   until then trims as before (NOTE [ Returning memory ] in _trim.py); when it
   takes it, it hands the heap's free memory back once. A session that frees
   less than what it may keep has nothing to gain, and the pool would map its
   blocks anew where glibc's heap has them resident: with the pool from the
   first spill, a single large spill ran far below raw file speed, since
   every block of its backward was faulted in, and faulting a page in costs
   many times what writing over a resident one does.
3. A step that frees much gains most: with the pool, a disk spill and a
   planned ``Auto`` step each hold less at their real peak, and take less
   time, than trimming the heap (NOTE [ Returning memory ]) lets them.
   ``Auto``'s cap, "auto", is a quarter of the step's activation bytes (at
   least 8 MiB; ``auto.POOL_LEAST``): with a pool that served only blocks of
   a request's size, a cap of three quarters, its trimming threshold, kept
   blocks no later request fitted and held nearly what no stash holds; and
   unmapping the oldest blocks waiting whenever a request found none that
   fits held less but mapped and faulted in anew the blocks later requests
   would have taken, a slower step. Where a step is short (under bf16
   autocast) the pool's mappings and unmappings (``PoolCounts.mapping_s``)
   are a visible share of it: a plan's step is a little slower with the
   pool than without, for a lower real peak.
4. The pool serves while any session holds a :class:`Lease` (a disk
   spill's from rule 2's point until its graph is freed, ``Auto``'s over the
   step its ``Watch`` covers), with the largest cap asked for. It serves
   every thread meanwhile: blocks other threads make are freed through it
   too, whenever that happens. It becomes PyTorch's CPU allocator once, at
   the first lease, and stays it: a process that never runs a CPU session
   that frees memory (one that uses tensorstash on a GPU only) keeps
   PyTorch's own, and pays no indirection on its allocations. Installing
   may happen while other threads allocate (a disk spill's writer takes the
   first lease): torch's ``SetCPUAllocator`` publishes with a plain store,
   so a request on another thread meanwhile reaches either the allocator the
   pool replaces or the pool passing it on; the pool records that allocator
   before it is published and never changes it. The pool itself is made,
   inert, when the extension is imported, so that a thread started after
   ``import tensorstash`` sees it whole whenever it is published (for one
   started before, a fence orders its making before c10's store). What the replaced allocator
   gave before the pool came, ``raw_allocate``'d or not, goes back to it:
   a block the pool did not map is passed on. Leases switch serving on and
   off (an atomic); between them the pool hands every request to that
   allocator. It is never swapped back: oneDNN (an LSTM on the CPU, among
   others) takes scratch memory with ``raw_allocate`` and gives it back with
   ``raw_deallocate`` of whichever allocator is installed then, and only the
   pool knows which blocks are its own. It goes in only over c10's default
   CPU allocator: where another library installed its own first (at its
   import, or at any time before the first lease), the pool stays out.
5. It is a C++ extension built against the torch of the environment it is
   installed into (setup.py) and stamped with that torch's version
   (``_alloc.TORCH_VERSION``). The ``c10::Allocator`` interface changes
   between versions, so it is used only under that same torch: under
   another, it is not loaded past its stamp, one warning says so, and
   sessions trim the heap as NOTE [ Returning memory ] says. So they do where
   it is not built, fails to load, ``TENSORSTASH_POOL=0`` is set, or rule 4
   keeps it out; :func:`tensorstash.info` says which, and why. Under
   ``LD_PRELOAD``'d jemalloc or tcmalloc the pool serves as well; it is
   Linux only.
6. Across ``fork`` the pool's lock is held (``pthread_atfork``, registered
   at install), so the child gets its lists whole; the child serves nothing,
   unmaps its copies of the blocks waiting, and counts its high-water mark
   from what it holds. A block another thread was growing at the fork is in
   none of the child's books (rule 10): the child keeps its copy mapped and
   never hands it out. Leases belong to the parent: the child's ``_caps``
   start empty.
7. Blocks of the pool are not reported to PyTorch's memory profiler.
8. A library that installs its own CPU allocator after the pool displaces
   it: the pool sees it at its next lease or large request, and serves no
   more, for good (sessions trim). ``raw_allocate`` is not virtual, so the
   pool cannot tell which of its blocks were taken raw; those still in use
   when another allocator comes would be given back through that allocator.
   A library that installs its allocator when it is imported, as torch
   asks, is mostly there before any session needed the pool: the pool then
   stays out (rule 4), and no block of it can reach another allocator.
9. A block whose ``munmap`` fails stays mapped, out of every list but the
   pool's stuck ones (listed in the blocks' own first bytes, so that a
   failed ``munmap`` needs no memory), and is unmapped at a later try;
   ``PoolCounts`` counts the failures and the bytes still stuck.
10. The books (``sizes_`` in ``_alloc.cpp``) hold every block handed out or
   waiting. An address enters them only once its range is mapped, and
   leaves them before its range is unmapped or moved (``mremap``): the
   moment a range is gone, the kernel may hand its address to another
   thread's ``mmap``, whose block must not lose its record to a late erase
   (that block would be handed to ``free()`` when freed, and corrupt the
   heap). An address entered twice aborts the process with a message that
   names the bug, before the heap can be corrupted. The books never throw:
   where a container cannot grow (``bad_alloc``), a block that would wait
   leaves the pool, a block to unmap later is unmapped at once, and a
   request passes on to the allocator the pool replaced, so a ``DataPtr``'s
   deleter never throws and a list is never changed by half. A block whose
   ``mremap`` fails waits again. :func:`check_books` checks that what the
   books record adds up to what is in use and what waits; the tests call it
   after every case.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import NamedTuple

import torch  # loads libc10, which _alloc needs

from tensorstash.core.policy import bug

_STATES = {
    2: "another CPU allocator than c10's default was installed before a session needed the "
    "session pool: it stays out (rule 4)",
    3: "c10 kept a CPU allocator installed with a higher priority (rule 4)",
    4: "another library installed its own CPU allocator after the session pool: the pool "
    "serves no more (rule 8)",
}


def load(
    environ: Mapping[str, str] = os.environ,
    torch_version: str = torch.__version__,
    name: str = "tensorstash.memory._alloc",
) -> tuple[ModuleType | None, str]:
    """Load the session pool (rule 5), installing nothing (the first lease does, rule 4):
    the extension and "loaded", or None and why not. Warns once where the extension was
    built for another torch."""
    if environ.get("TENSORSTASH_POOL", "") == "0":
        return None, "turned off by TENSORSTASH_POOL=0"
    if not sys.platform.startswith("linux"):
        return None, f"Linux only (this is {sys.platform})"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        return None, (
            "not built: no C++ compiler, or no torch, where tensorstash was installed; install "
            "torch first, then `pip install --no-cache-dir --force-reinstall --no-deps tensorstash`"
        )
    except Exception as error:  # any failure to load means no pool (rule 5)
        return None, _warned(f"failed to load ({type(error).__name__}: {error})")
    built_for = getattr(module, "TORCH_VERSION", "an unknown version")
    if built_for != torch_version:
        return None, _warned(f"built for torch {built_for}, but torch {torch_version} runs")
    return module, "loaded"


def _warned(why: str) -> str:
    warnings.warn(
        f"tensorstash: the session pool is off: {why}; sessions trim the heap instead. "
        "Rebuild it against the torch installed: `pip install --no-cache-dir --force-reinstall "
        "--no-deps tensorstash` (or set TENSORSTASH_POOL=0 to silence this)",
        RuntimeWarning,
        stacklevel=3,
    )
    return why


compiled: ModuleType | None
compiled, _why = load()
_loaded_at = time.time()

installed_at: float | None = None
"""When the pool became PyTorch's CPU allocator (``time.time()``), at the first lease
(rule 4); None until then, and where it cannot."""

del torch

LEAST = 128 << 10
"""The smallest block the pool maps (rule 1)."""


class PoolCounts(NamedTuple):
    """What the pool did since the process began.

    Attributes:
        hits: requests served by a freed block waiting in the pool, whole or
            split (rule 1).
        grown: requests served by a freed block waiting, grown to their size.
        misses: requests that mapped a new block.
        unmapped: blocks unmapped (past the cap, freed after the last lease
            ended, or waiting when it did).
        unmapped_bytes: their bytes.
        cached_bytes: bytes of freed blocks waiting now.
        live_bytes: bytes of the pool's blocks in use now.
        mapping_s: seconds spent mapping, growing and unmapping blocks, on
            every thread.
        unmap_failures: ``munmap`` calls that failed (rule 9).
        stuck_bytes: bytes of blocks whose ``munmap`` failed, still mapped.
    """

    hits: int
    grown: int
    misses: int
    unmapped: int
    unmapped_bytes: int
    cached_bytes: int
    live_bytes: int
    mapping_s: float
    unmap_failures: int = 0
    stuck_bytes: int = 0


def counts() -> PoolCounts | None:
    """What the pool did (None where there is no pool)."""
    if compiled is None:
        return None
    hits, grown, misses, unmapped, unmapped_bytes, cached, live, mapping_ns, failures, stuck = (
        compiled.counts()
    )
    return PoolCounts(
        hits,
        grown,
        misses,
        unmapped,
        unmapped_bytes,
        cached,
        live,
        mapping_ns / 1e9,
        failures,
        stuck,
    )


def installed() -> bool:
    """Whether the pool serves PyTorch's CPU allocations now."""
    return compiled is not None and bool(compiled.serving())


def status() -> tuple[bool, str]:
    """Whether the pool can serve sessions, and "active" (installed), "ready" (not
    installed yet: no session needed it, rule 4) or why not (rule 5)."""
    if compiled is None:
        return False, _why
    state = compiled.state()
    if state == 0:
        return True, "ready"
    if state != 1:
        return False, _STATES.get(state, f"unknown state {state}")
    return True, "active"


def installed_after() -> float | None:
    """Seconds from loading the pool (``import tensorstash``) to installing it, or None
    where it is not installed (rule 4)."""
    return None if installed_at is None else installed_at - _loaded_at


class Books(NamedTuple):
    """The pool's books (rule 10), as :func:`check_books` found them.

    Attributes:
        recorded_bytes: the sizes of the blocks the pool records.
        live_bytes: of the blocks in use.
        cached_bytes: of the blocks waiting.
        stuck_bytes: of the blocks whose ``munmap`` failed (rule 9), recorded apart.
    """

    recorded_bytes: int
    live_bytes: int
    cached_bytes: int
    stuck_bytes: int


def check_books() -> Books | None:
    """Check the pool's books (rule 10): the blocks recorded add up to those in use
    plus those waiting, each block waiting is listed by age and by size, and no two
    blocks overlap. None where there is no pool.

    Raises:
        AssertionError: where they do not add up (a bug in tensorstash).
    """
    if compiled is None:
        return None
    recorded, live, cached, stuck, wrong = compiled._check()
    if wrong:
        raise bug(f"the session pool's books: {wrong}")
    return Books(recorded, live, cached, stuck)


_lock = threading.RLock()  # a lease freed by the collector may close under it
_caps: dict[int, int] = {}  # lease id -> the cap it asked for


def _install(pool: ModuleType) -> bool:
    """Under ``_lock``: make ``pool`` PyTorch's CPU allocator, once (rule 4); whether
    it is. Where it cannot be (another allocator is there), it is off for good."""
    global compiled, _why, installed_at
    if installed_at is not None:
        return True
    state = pool.install()
    if state != 1:
        compiled, _why = None, _STATES.get(state, f"unknown state {state}")
        return False
    installed_at = time.time()
    return True


class Lease:
    """A session's hold on the pool (rule 4); :meth:`close` ends it (twice is harmless)."""

    __slots__ = ("_id", "_pool")

    def __init__(self, lease_id: int, pool: ModuleType) -> None:
        self._id = lease_id
        self._pool = pool  # the extension it was taken from, whatever ``compiled`` says later

    def close(self) -> None:
        with _lock:
            if _caps.pop(self._id, None) is None:
                return
            if _caps:
                self._pool.set_cap(max(_caps.values()))
            else:
                self._pool.stop()

    def __del__(self) -> None:
        if _caps is not None:  # None while the interpreter shuts down
            self.close()


_next_id = iter(range(1, 1 << 62))


def lease(cap: int) -> Lease | None:
    """Serve CPU blocks from the pool until the lease is closed, keeping up to ``cap``
    bytes of freed blocks (rule 1); the first installs the pool (rule 4). None where
    there is no pool (rule 5), another allocator was there first (rule 4) or
    displaced it (rule 8)."""
    if compiled is None:
        return None
    pool = compiled
    with _lock:
        if not _install(pool):
            return None
        lease_id = next(_next_id)
        _caps[lease_id] = cap
        if not pool.serve(max(_caps.values()), LEAST):
            del _caps[lease_id]
            return None
        return Lease(lease_id, pool)


def _forget_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # another thread may have held it at the fork
    _caps.clear()  # the parent's leases (rule 6)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
