"""The codec's threads: a stream's segments run as jobs ahead on a pool, and every codec op
runs with one intra-op thread.

Rule 4 of NOTE [ Codec ] (in _codec.py) is stated here.

4. Threads. Each segment is one job: its transform, then lz4 (or lz4, then
   the undo). Jobs run on the ``pool`` given, a few ahead of the one needed
   (``_AHEAD``): lz4 releases the GIL and so do torch ops, and a job issues a
   handful of ops, each on at most ``_PIECE`` elements (in _transforms.py;
   fewer, larger ops hold the GIL for less Python work). Every codec op runs
   with one intra-op thread, on a worker and on the caller alike
   (:func:`one_thread`): the ops are small, and an OpenMP team for each spins
   against the training step's threads, and on a loaded machine decoding on
   the caller with two threads was slower than with one. A job that no
   worker has started when it is needed is run by the caller, so ``pool``
   may be the executor the caller itself runs on, even a busy one.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from typing import Generic, TypeVar

import torch

__all__ = ["one_thread", "ordered"]

T = TypeVar("T")

# Blocks compressed or decompressed ahead of the one the caller waits for:
# enough to keep a few workers busy, few enough to bound the memory in flight.
_AHEAD = 8


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run this thread's torch ops without an intra-op thread team (rule 4).

    The setting is per thread and restored on exit.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Job(Generic[T]):
    """A call that runs once, on a pool worker or on the first caller to need it.

    Whoever waits for the result runs the call if no worker has started it, so
    a job never waits for a pool whose workers are all busy (rule 4).
    Unlike ``Future.cancel`` and a fallback, claiming cannot race a worker.
    """

    __slots__ = ("_call", "_claimed", "_done", "_error", "_value")

    def __init__(self, call: Callable[[], T]) -> None:
        self._call: Callable[[], T] | None = call
        self._claimed = threading.Lock()
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the call, unless someone already has."""
        if not self._claimed.acquire(blocking=False):
            return
        call, self._call = self._call, None
        try:
            if call is not None:
                self._value = call()
        except BaseException as error:  # handed to the caller by result()
            self._error = error
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the call has finished."""
        return self._done.is_set()

    def result(self) -> T:
        """The call's value; runs it here when no worker has started it."""
        self.run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def ordered(calls: Iterable[Callable[[], T]], pool: Executor | None) -> Iterator[T]:
    """Results of ``calls`` in order, running up to ``_AHEAD`` of them ahead on ``pool``.

    ``calls`` is consumed lazily, which bounds the blocks held in flight. While
    the oldest call is still running, this thread runs calls no worker has
    started rather than wait.
    """
    if pool is None:
        for call in calls:
            yield call()
        return
    pending: deque[_Job[T]] = deque()
    for call in calls:
        job = _Job(call)
        # A pool that was shut down refuses the job: result() then runs it here.
        with contextlib.suppress(RuntimeError):
            pool.submit(job.run)
        pending.append(job)
        if len(pending) > _AHEAD:
            yield _next(pending)
    while pending:
        yield _next(pending)


def _next(pending: deque[_Job[T]]) -> T:
    """The oldest job's result; runs pending jobs here until it is done."""
    for job in pending:
        if pending[0].done():
            break
        job.run()
    return pending.popleft().result()
