"""A session used as a decorator: each call of the function opens a session of its own.

# NOTE [ Decorator ]
1. A decorated function may run on any thread and call itself, as any Python
   decorator allows. A session's open is one region on one thread (its hooks,
   its quiet-step state, its selector's planning, its profile's step), so each
   call opens a fresh session with the decorator's settings (policy,
   ``min_bytes``, ``workers``, ``record``, ``profile``, ``verify``), as
   ``torch.no_grad`` makes a fresh context for each call.
2. A call made while a call of the same decorator is the innermost session of
   its thread, with that session's hooks on top (a function that calls
   itself), opens nothing: its tensors go to the session already in place, and
   the step stays one step. Under other hooks pushed in between (``pause()``,
   another stash, a checkpointed region) the call opens its own session, which
   wins in its region as sessions nest.
3. The decorator's ``stats`` count every call. A call's counters are added to
   them once the call returned and its graph is freed (nothing can change them
   after that); until then a read returns a copy that adds them. Calls count as
   steps run one after the other (``StashStats.merge``): a peak is the largest
   one call held.
4. A profile measures one step at a time: with a profile, a call that opens
   a session while another call's session is open (on another thread, or
   around it under other hooks) raises, and says what to do instead (a
   profile, and a decorated function, per thread).
5. One session used in a ``with`` block is one region at a time: entering it
   while it is open (inside itself, or on another thread) raises, saying to
   open a fresh ``stash`` or to decorate the function. Entering it inside a
   region that recomputes (rule 8 of NOTE [ Session ]) takes no state, and is
   allowed as before.
"""

from __future__ import annotations

import threading
from typing import Any

from tensorstash.core.stats import StashStats


class Calls:
    """The sessions a decorated function's calls opened, until their graphs are freed.

    Args:
        stats: the decorator's counters, where the calls done are added (rule 3).
    """

    def __init__(self, stats: StashStats) -> None:
        self.lock = threading.Lock()  # also the calls' claim on opening (rule 4)
        self._stats = stats
        self._running: list[Any] = []  # calls between their start and their return
        self._returned: list[Any] = []  # calls returned, their graphs perhaps alive
        self.plan: Any = None  # the plan of the call that returned last

    def started(self, session: Any) -> None:
        """A call's session was made, and is about to open."""
        with self.lock:
            self._settle()
            self._running.append(session)

    def returned(self, session: Any) -> None:
        """A call returned (or raised): its session is closed."""
        with self.lock:
            self._running.remove(session)
            self._returned.append(session)
            self.plan = session.plan

    def open_elsewhere(self, session: Any) -> bool:
        """Whether another call's session is open (call it holding :attr:`lock`)."""
        return any(other is not session and other.is_open for other in self._running)

    def stats(self) -> StashStats:
        """The decorator's counters with every call's (rule 3)."""
        with self.lock:
            self._settle()
            alive = [*self._returned, *self._running]
        if not alive:
            return self._stats
        return StashStats.combined([self._stats, *(call.stats for call in alive)])

    def _settle(self) -> None:
        """Add the calls that returned and whose graphs are freed to the counters."""
        alive = []
        for call in self._returned:
            if call._finished:
                call._stats.fold()  # nothing of it is left to run: safe on any thread
                self._stats.merge(call._stats)
            else:
                alive.append(call)
        self._returned = alive
