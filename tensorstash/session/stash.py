"""``stash()``: the session that owns ``saved_tensors_hooks``, and ``pause()``.

# NOTE [ Session ]
Every tensor autograd saves inside ``with stash(policy):`` reaches
:meth:`Session.pack`; backward hands back what pack returned to
:meth:`Session.unpack`. Around any policy the session applies these rules, in
this order:

1. Eligibility. Tensors under ``min_bytes`` (checked first, after the type:
   the most common case, and the cheapest), parameters (and views or casts of them), other leaf
   tensors that require grad (the graph holds them anyway: moving them saves
   nothing), module buffers (see _modules.py: BatchNorm changes its saved
   running statistics in place without bumping their version), and tensors
   no policy can handle (sparse, nested, meta, quantized, conjugate or
   negative views, functorch wrappers, subclasses such as fake tensors) are
   kept untouched and counted in ``stats.skipped``. An untouched tensor is
   held as it is, without a copy, unless it is the output of the operation
   saving it: that one is held detached, or the graph would hold itself.
2. Version check. With hooks pushed autograd no longer notices a saved tensor
   changed in place, so the session records ``tensor._version`` at pack and
   compares at unpack, raising as plain autograd would.
3. Dedupe. The same storage, geometry and version saved again while its first
   pack is alive returns that pack (:class:`Dedupe`: by the storage object's
   identity, never by a bare pointer).
4. Choice. A selector (Select, Auto) chooses the policy per tensor, with the
   call site when the session has a profile; a plain policy is used as it is.
   What is kept costs a small record and a count (:class:`Kept`); what a
   policy packs is held with its policy (:class:`Saved`).
5. Recent window. A tensor whose choice is :class:`~tensorstash.core.policy.Defer`
   waits, kept, in the window until newer tensors push it out (NOTE
   [ Recent window ], :class:`RecentWindow`).
6. Order. Each value remembers (weakly) the packed value before it; backward
   unpacks roughly in reverse, so unpacking one starts the prefetch of the
   previous few.
7. Lifetime. The value autograd holds owns what was packed; when autograd
   frees the graph, its ``__del__`` releases its stats and the policy's
   resources. Nothing is freed in unpack: autograd may unpack again.
8. Nesting. Only the innermost hook pair is active, so an inner session wins in
   its region; :func:`pause` pops this thread's sessions' hooks for a region.
   A session opened inside a recomputed region (non-reentrant checkpoint,
   ``recompute``, in forward or while backward recomputes it) pushes nothing:
   the region's own hooks keep what it recomputes, and the session counts the
   pass in ``stats.inside_recompute``.
9. Distributed tensors. A DTensor (tensor parallelism) wraps this rank's
   local tensor and holds no data of its own. Rule 1 is asked of the DTensor
   (a parameter, a view or cast of one, a leaf; a placement it cannot be
   rebuilt with), counting its local tensor's bytes. Then pack runs rules 1 to
   7 on the local tensor, as an alias that carries the DTensor's version
   counter (so rules 2 and 3 see the version autograd checks), and
   :class:`Distributed` holds what that returned with the DTensor's spec;
   unpack rebuilds the DTensor around the unpacked local tensor, without an
   autograd op. Stats and the decision log count local bytes and shapes; a
   row names the DTensor's op. See NOTE [ DTensor ] in _dtensor.py.
10. Quiet steps. A selector may hand a step back to plain autograd once it
   knows it will keep every tensor (``Auto`` with a profile, when its plan
   moves nothing: NOTE [ Quiet steps ] in auto.py). At the model's first call
   the session pops its hooks and stops following modules, and the rest of
   the step runs with no hook at all: the rules above cost nothing, and
   autograd checks in-place changes itself. Only where this session's hooks
   are the only ones pushed (no other stash or hook pair around or inside
   it), and never with ``record`` or ``verify``, which need every tensor.
11. Opening quiet. Once a step went quiet, the next session expects to as
   well, and opens with nothing pushed and no module followed (``Auto``
   with a profile, where the profile measures nothing in the step: NOTE
   [ Profile ] rule 9): a quiet step then costs no hook, no module tracking
   and no step being measured, only the planning at the model's call. It
   waits for the next module call on its thread (one global pre-hook, taken
   out at that call). At the model's call the plan decides, as in rule 10:
   the step stays quiet, or the session wakes: it pushes its hooks, follows
   modules from that call on, and the profile's step begins there. It wakes
   as well at a first module call that is not the model's, when a session
   opens inside it, and at :func:`pause`, so its hooks go below the inner
   ones as if pushed at its open. What autograd saves before the first
   module call is kept as plain autograd keeps it. Where other hooks are
   pushed inside it at the model's call, it can neither stay quiet nor push
   its hooks above theirs: it stays as it is for that step, and the next
   session opens with its hooks, as one does after a session that opened
   quiet and called no module.
   Rules 10 and 11 are the states and transitions of NOTE [ Quiet-step
   machine ] in quiet.py; the session knows a selector only through the
   protocols there.
12. Compiled code. The hooks the session pushes, and what the C hooks call
   back into, run with dynamo off. Autograd calls a pack hook from the frame
   that saves the tensor; where that frame is eager code inside a compiled
   function (past a graph break, a recompute region in a compiled model),
   dynamo's frame callback is on, and would take the hook for user code,
   compile it with fake tensors, and fail there. Each hook's code is marked
   for dynamo to run as it is, with all it calls (core/_frames.py): nothing
   is paid for it outside compiled code, as dynamo's frame hook is not even
   installed there. Compiled graphs themselves call no hook but at their end
   (NOTE [ Compiled code ] in planning/compiler.py).
13. One region at a time. A session's open is one region on one thread:
   entering a session that is open (inside itself, or on another thread)
   raises. Used as a decorator, each call opens a fresh session, so a
   decorated function runs on any thread and calls itself (NOTE
   [ Decorator ] in _calls.py).

# NOTE [ Recent window ]
Backward starts with the tensors saved last (the output head, the loss):
moving them out only makes backward wait for them to come back. A selector
that cannot know which tensors come last (Auto in a first step, before its
Profile has seen a backward) returns :class:`~tensorstash.core.policy.Defer`: the
session keeps the tensor and puts it in a window; when the window holds more
than ``Defer.window`` bytes saved after its oldest entry, that entry is packed
with its deferred policy (its ``Saved`` switches to the new packed value, the
stats and the decision log move with it). So whatever was deferred last stays
kept when forward ends, and at most ``window`` bytes plus one tensor wait there.
A tensor changed in place while it waits is not packed (unpack raises, as
autograd would).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from tensorstash.core._fastpath import compiled
from tensorstash.core._frames import keep_out
from tensorstash.core._names import NAMES
from tensorstash.core._names import resolve as _resolve
from tensorstash.core._sizes import parse_size
from tensorstash.core.policy import Context, Keep, Policy
from tensorstash.core.stats import StashStats
from tensorstash.session import _modules
from tensorstash.session._calls import Calls
from tensorstash.session.packing import Packing
from tensorstash.session.quiet import HOOKED, Event, Machine, Pair, State
from tensorstash.session.rules import (
    PARAMETER_COPIES,
)

DEFAULT_MIN_BYTES = 64 * 1024
"""Tensors smaller than this are kept: moving them costs more time than the bytes are worth."""


@runtime_checkable
class Records(Protocol):
    """What a session asks of its profile (:class:`~tensorstash.Profile`)."""

    @property
    def root(self) -> Any: ...

    def begin(self, ctx: Any, min_bytes: int) -> Any: ...

    def site(self, module: str, tensor: Tensor) -> Any: ...

    def record_pack(self, site: Any, nbytes: int) -> Any: ...

    def clock(self) -> float: ...


_local = threading.local()
_Tensor = Tensor
_Parameter = torch.nn.Parameter
_perf_counter = time.perf_counter
_sequence_nr = torch._C._autograd._get_sequence_nr


def _active() -> list[Session]:
    """This thread's sessions whose hooks are pushed, innermost last."""
    active: list[Session] | None = getattr(_local, "active", None)
    if active is None:
        active = _local.active = []
    return active


def resolve(policy: Policy | str) -> Policy:
    """A policy object from a policy or its name ("keep", "cpu", "lz4", "disk", "auto").

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor an object with ``pack`` and ``unpack``.
    """
    return _resolve(policy, NAMES)


# -- the session ----------------------------------------------------------------------------


_C_CALLEES_KEPT_OUT: list[bool] = []
"""Whether the Python functions the C hooks call back into were marked (rule 12)."""


class Session:
    """A stash session; see :func:`stash` and NOTE [ Session ].

    A context manager, and a decorator whose every call opens a session of its
    own (NOTE [ Decorator ] in _calls.py).

    Attributes:
        policy: where eligible tensors go.
        min_bytes: tensors smaller than this are kept.
        stats: what the session did (:class:`~tensorstash.StashStats`).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        min_bytes: int,
        workers: int,
        record: bool,
        profile: Records | None,
        verify: bool = False,
    ) -> None:
        self.policy = policy
        self.verify = verify
        self.min_bytes = min_bytes
        self.workers = workers
        self.record = record
        self.profile = profile
        self._stats = StashStats()
        self._ctx = Context(self._stats, workers=workers)
        self._ctx.profile = profile
        self._packing = packing = Packing(
            policy,
            min_bytes=min_bytes,
            record=record,
            verify=verify,
            profile=profile,
            ctx=self._ctx,
        )
        self.pack = packing.pack  # the hooks (NOTE [ Session ]); no cycle: they hold no session
        self.unpack = packing.unpack
        self._owner = 0  # the thread whose hooks this session pushed last
        self._opener: int | None = None  # the thread it is open on (rule 13)
        self._claim = threading.Lock()  # taken to open; a call's is its decorator's
        # Per thread, per enter: whether it opened the session (rule 8: a region that
        # recomputes its tensors enters it without opening it).
        self._pushed: dict[int, list[bool]] = {}
        self._calls: Calls | None = None  # as a decorator: its calls (NOTE [ Decorator ])
        self._decorator: Session | None = None  # as a call's session: its decorator's
        self._planner: Any = None  # the selector's planning for the step (session/quiet.py)
        self._machine = Machine()  # NOTE [ Quiet-step machine ] in quiet.py
        self._cancel_next: Callable[[], None] = _nothing  # stop waiting for a module call
        self._pair: Pair | None = None  # a compiler's pair pushed in this session's place
        self._pair_plan: Any = None  # what the pair's step planned (NOTE [ Compiled code ])

    def __repr__(self) -> str:
        return f"tensorstash.stash({self.policy!r}, min_bytes={self.min_bytes})"

    @property
    def stats(self) -> StashStats:
        """What the session did.

        Read on the thread that runs the session, it is exact; read on another
        while the session is open, it lags by the tensors kept since it was
        last read on that thread. A session used as a decorator counts every
        call's session (rule 3 of NOTE [ Decorator ] in _calls.py).
        """
        if threading.get_ident() == self._owner:
            self._stats.fold()
        if self._calls is not None:
            return self._calls.stats()  # rule 3 of NOTE [ Decorator ]
        return self._stats

    # Decorator (NOTE [ Decorator ] in _calls.py) -------------------------------------

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` with each call inside a session of its own, made like this one."""
        with self._claim:
            if self._calls is None:
                self._calls = Calls(self._stats)
        calls = self._calls

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._called_inside():
                return func(*args, **kwargs)  # rule 2
            session = self._for_call(calls)
            calls.started(session)
            try:
                with session:
                    return func(*args, **kwargs)
            finally:
                calls.returned(session)

        return call

    def _for_call(self, calls: Calls) -> Session:
        """A fresh session for one call (rule 1 of NOTE [ Decorator ])."""
        session = Session(
            self.policy,
            min_bytes=self.min_bytes,
            workers=self.workers,
            record=self.record,
            profile=self.profile,
            verify=self.verify,
        )
        session._decorator, session._claim = self, calls.lock
        return session

    def _called_inside(self) -> bool:
        """Whether this thread's innermost session is one of this decorator's calls, its
        hooks on top (rule 2 of NOTE [ Decorator ])."""
        active = _active()
        return bool(active) and active[-1]._decorator is self and active[-1]._on_top()

    @property
    def is_open(self) -> bool:
        """Whether the session is open (on any thread)."""
        return self._opener is not None

    @property
    def _finished(self) -> bool:
        """Whether the session is closed and nothing it packed or kept is alive."""
        return self._opener is None and self._ctx.idle and self._stats.live_bytes == 0

    def _take(self) -> None:
        """Rule 13: mark the session open on this thread, or raise where it is open."""
        me = threading.get_ident()
        with self._claim:
            if self._opener is not None:
                raise RuntimeError(_open_already(self._opener == me))
            decorator = self._decorator
            if decorator is not None and self.profile is not None:
                calls = decorator._calls
                if calls is not None and calls.open_elsewhere(self):
                    raise RuntimeError(_PROFILE_IN_USE)  # rule 4 of NOTE [ Decorator ]
            self._opener = me

    # Context manager ---------------------------------------------------------------

    def __enter__(self) -> Session:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        me = threading.get_ident()
        if top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint":
            self._pushed.setdefault(me, []).append(False)  # rule 8: the region recomputes
            with self._stats._lock:
                self._stats.inside_recompute += 1
            return self
        self._take()
        self._pushed.setdefault(me, []).append(True)
        active = _active()
        depth = len(active)
        try:
            self._open(top, active)
        except BaseException:
            del active[depth:]
            self._forget_enter(me)
            self._opener = None
            raise
        return self

    def _open(self, top: Any, active: list[Session]) -> None:
        """Open the session on this thread (rules 8, 10 and 11)."""
        packing = self._packing
        self._owner = threading.get_ident()
        if active and active[0].opened_quiet:
            active[0].wake()  # rule 11: its hooks go below this session's
        alone = (
            not active
            and top is None
            and not self.record
            and not self.verify
            and torch.is_grad_enabled()
        )
        active.append(self)
        self._ctx.opened()
        begin = getattr(self.policy, "begin", None)
        planning = None
        if begin is not None:
            planning = begin(self._ctx, self, alone=alone, min_bytes=self.min_bytes)
        self._planner = planning
        opening = planning.opening if planning is not None else HOOKED
        # The step's own choose (Auto's state), bound once: rule 4 runs per tensor.
        packing.choose = getattr(planning, "choose", None) or getattr(self.policy, "choose", None)
        packing.step = self._pair_plan = None
        self._machine.move(Event.OPEN, opening.state)
        if opening.state is State.HOOKED:
            _modules.track()
            packing.step = self.profile.begin(self._ctx, self.min_bytes) if self.profile else None
            hooks = self._hooks()
        else:
            hooks = (_same, _same)  # eager code's tensors stay where they are
            if opening.state is State.OPENED_QUIET:
                self._cancel_next = _modules.next_call(self._next_call)
            elif opening.pair is None:
                self._count_quiet()
        if opening.pair is not None:
            opening.pair.hand(*hooks)
            self._pair = opening.pair
            torch._C._autograd._push_saved_tensors_default_hooks(
                opening.pair.pack, opening.pair.unpack
            )
        elif opening.state is State.HOOKED:
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)

    @property
    def opened_quiet(self) -> bool:
        """Whether this open pushed nothing yet and waits for the model's call (rule 11)."""
        return self._machine.state is State.OPENED_QUIET

    def _next_call(self, module: Any, args: Any) -> None:
        """The first module call of a session that opened quiet (rule 11): not the model's
        (whose own pre-hook decides), so the session pushes its hooks."""
        if self.profile is None or module is not self.profile.root:
            self.wake(module, args)

    def wake(self, module: Any = None, args: Any = ()) -> bool:
        """Rule 11: a session that opened quiet pushes its hooks and follows modules, as one
        that opened so; ``module``, being called, is followed from its call.

        False where it cannot: it did not open quiet, or it decided already, or
        others' hooks are pushed inside it (it then stays as it is for this step).
        """
        packing = self._packing
        if not self.opened_quiet or not self._innermost_alone():
            return False
        self._decided()
        self._machine.move(Event.WAKE, State.HOOKED)
        _modules.track()
        woke = getattr(self._planner, "woke", None)
        if woke is not None:
            woke()  # its planning hears of the first module called, if not planned yet
        packing.step = self.profile.begin(self._ctx, self.min_bytes) if self.profile else None
        torch._C._autograd._push_saved_tensors_default_hooks(*self._hooks())
        if module is not None:
            _modules.enter(module, args)
        return True

    def stay_quiet(self) -> bool:
        """Rule 11: the model was called, and the session that opened quiet stays so for
        the step; False where it cannot (see :meth:`wake`)."""
        if not self.opened_quiet or not self._innermost_alone():
            return False
        self._decided()
        self._machine.move(Event.STAY_QUIET, State.QUIET)
        self._count_quiet()
        return True

    def _count_quiet(self) -> None:
        with self._stats._lock:
            self._stats.quiet += 1

    def _innermost_alone(self) -> bool:
        active = _active()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is None and bool(active) and active[-1] is self

    def _decided(self) -> None:
        """The open that waited for the model's call decided: stop waiting (rule 11)."""
        self._cancel_next()
        self._cancel_next = _nothing

    def _hooks(self) -> tuple[Any, Any]:
        """The hook pair to push: in C when nothing needs the Python hooks (NOTE [ Fast path ]).

        Made at each push and not kept on the session: either pair holds the
        session, and a pair kept on it would be a cycle left for the collector.
        """
        packing = self._packing
        if compiled is None or self.record or self.verify or packing.step is not None:
            pack, unpack = packing.pack, packing.unpack_hook
            keep_out(pack, unpack)  # rule 12
            return pack, unpack
        hooks = compiled.Hooks(
            owner=self,
            pack=self.pack,
            unpack=self.unpack,
            hot=packing.hot,
            kept_tier=packing.kept_tier,
            dedupe=packing.dedupe,
            values=packing.dedupe.values,
            state=_modules._state,
            thread=_modules._thread(),
            policy=self.policy,
            choose=packing.choose,
            ctx=self._ctx,
            tensor_type=_Tensor,
            parameter_type=_Parameter,
            keep_type=Keep,
            copies=PARAMETER_COPIES,
            sequence_nr=_sequence_nr,
            pack_chosen=packing.pack_chosen,
            prefetch=packing.prefetch_from,
            order=packing.order,
            min_bytes=self.min_bytes,
        )
        # Rule 12: the C hooks are no frames; what they call back into is (the methods of
        # Packing and its dedupe once, the chooser, which varies, at each push).
        if not _C_CALLEES_KEPT_OUT:
            keep_out(
                self.pack,
                self.unpack,
                packing.pack_chosen,
                packing.prefetch_from,
                packing.dedupe.sweep,
            )
            _C_CALLEES_KEPT_OUT.append(True)
        keep_out(packing.choose)
        return hooks.pack, hooks.unpack

    def _pushed_by(self, hook: Any) -> bool:
        """Whether ``hook`` (a pushed pack hook) is this session's, Python's, C's, or the
        compiler pair it pushed."""
        if self._pair is not None and hook is self._pair.pack:
            return True
        hooks = getattr(hook, "__self__", None)
        return hook == self.pack or getattr(hooks, "owner", None) is self

    def _on_top(self) -> bool:
        """Whether the hooks on top of this thread's stack are this session's: its own or
        its pair where it pushed them, none where it is quiet (rule 10)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self._machine.hooked or self._pair is not None:
            return top is not None and self._pushed_by(top[0])
        return top is None

    def __exit__(self, *exc: object) -> None:
        packing = self._packing
        me = threading.get_ident()
        enters = self._pushed.get(me)
        if not enters:
            raise RuntimeError(
                "tensorstash.stash: the session was exited more often than entered on this thread"
            )
        if not enters[-1]:
            self._forget_enter(me)
            return
        active = _active()
        if not active or active[-1] is not self:
            raise RuntimeError(
                "tensorstash.stash: sessions were exited out of order; exit the innermost "
                "stash first (use them as nested `with` blocks)"
            )
        # Rule 10: a quiet session has nothing of its own pushed, and nothing else may be.
        if not self._on_top():
            raise RuntimeError(
                "tensorstash.stash: other saved-tensor hooks are still pushed inside this "
                "session; close them before the session ends"
            )
        if self._machine.hooked or self._pair is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.closed()
            self._pair_plan = getattr(pair, "plan", None)
        self._forget_enter(me)
        active.pop()
        self._stats.fold()
        if packing.step is not None:  # kept: backward's first unpack tells it (unpack_hook)
            packing.step.session_exited()
        if self._planner is not None:
            self._planner.end()
        if self.opened_quiet:  # rule 11: the model was never called, or could not decide
            self._decided()
        if not active:
            _modules.forget_stack()
        if self._machine.hooked:
            _modules.untrack()
        self._machine.move(Event.CLOSE, State.CLOSED)
        self._opener = None
        self._ctx.closed()
        self._ctx.flush_warnings()

    def _forget_enter(self, thread: int) -> None:
        enters = self._pushed[thread]
        enters.pop()
        if not enters:
            del self._pushed[thread]

    def go_quiet(self) -> bool:
        """Run the rest of this step as plain autograd (rule 10); False where it cannot.

        Called by the selector's planning at the model's first call.
        """
        if not self._machine.hooked or self._pair is not None:
            return False  # a pair's step is planned by the compiler (NOTE [ Compiled code ])
        if self.record or self.verify or self._pushed.get(threading.get_ident()) != [True]:
            return False
        active = _active()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not active or active[-1] is not self or top is None or not self._pushed_by(top[0]):
            return False
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*top)  # hooks below: not alone
            return False
        self._machine.move(Event.GO_QUIET, State.QUIET)
        _modules.untrack()
        self._packing.step = (
            None  # the profile times the step as quiet (rule 8 of NOTE [ Profile ])
        )
        self._count_quiet()
        return True

    @property
    def plan(self) -> Any:
        """The plan this session followed (``Auto`` with a profile, from step two), or None.

        See :class:`~tensorstash.planning.plan.Plan`: the modules recomputed, each site's
        tier, the predicted step time and real peak; ``plan.table()`` for people.
        """
        if self._pair_plan is not None:
            return self._pair_plan
        if self._calls is not None and self._planner is None:
            return self._calls.plan  # a decorator's: its last call's
        return getattr(self._planner, "plan", None)

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """The decision log (``record=True``): one row per saved tensor, in pack order.

        Each row has ``module`` (path of the module that saved it), ``op`` (the
        operation that produced it), ``shape``, ``dtype``, ``bytes``, ``tier``,
        ``stored_bytes`` and ``reason``; tier and stored bytes are updated as
        background compression and writes finish.
        """
        return self.stats.decisions


def _open_already(here: bool) -> str:
    """The error for a session entered while it is open (rule 13 of NOTE [ Session ])."""
    if here:
        where = "this session is open already on this thread (entered again inside itself)"
    else:
        where = (
            "this session is open on another thread (saved-tensor hooks are per thread: "
            "the threads would share one session's state)"
        )
    return (
        f"tensorstash.stash: {where}; a session is one region on one thread at a time. "
        "Open a new session for each region and thread (`with tensorstash.stash(...):`), "
        "or decorate the function with `@tensorstash.stash(...)`: each call of a decorated "
        "function opens a session of its own, on any thread, and a call inside a call uses "
        "the session already open"
    )


_PROFILE_IN_USE = (
    "tensorstash.stash: another call of this decorated function is open (on another "
    "thread, or around this call under other hooks), and the decorator's profile measures "
    "one step at a time; give each thread its own decorated function with its own "
    "tensorstash.Profile (a profile follows one model's steps), or leave the profile out"
)


def stash(
    policy: Policy | str = "auto",
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    workers: int = 2,
    record: bool = False,
    profile: Records | None = None,
    verify: bool = False,
) -> Session:
    """Move the tensors autograd saves for backward out of the way.

    Every tensor saved inside the session goes through ``policy`` (see NOTE
    [ Session ] in this module for what is kept untouched). Gradients equal
    plain autograd's bit for bit under every lossless policy.

    Args:
        policy: a policy object (``Keep()``, ``CpuOffload()``, ``Lz4()``,
            ``DiskSpill()``, a ``Chain`` of them, ``Select``/``Auto``) or its name:
            "keep", "cpu", "lz4", "disk", "auto".
        min_bytes: tensors smaller than this many bytes are kept as they are.
        workers: threads for compression and reads.
        record: keep a decision log, one row per saved tensor (module, shape,
            dtype, bytes, tier, stored bytes, reason): ``session.decisions``
            and ``stats.to_dict()["decisions"]``.
        profile: a :class:`~tensorstash.Profile` this session updates, given to
            the session of every step; ``Auto`` plans with it from step two.
        verify: take a checksum of every tensor a policy packs and check it
            when backward unpacks it, raising :class:`~tensorstash.VerifyError`
            on a mismatch instead of computing a wrong gradient (NOTE [ Verify ]
            in _verify.py; it costs a pass over the bytes at pack and at unpack).

    Returns:
        A :class:`Session`: a context manager and a decorator; ``session.stats``
        holds its counters.

    Raises:
        TypeError, ValueError: a bad policy or argument, with what to pass instead.

    Example:
        >>> import tensorstash as ts
        >>> with ts.stash(ts.Chain(ts.Lz4(), ts.DiskSpill())) as s:
        ...     loss = model(batch).sum()
        >>> loss.backward()
        >>> print(s.stats.table())

    .. warning::
        ``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` refuse to run
        while saved-tensor hooks are pushed: call them inside :func:`pause`.
    """
    min_bytes = int(parse_size(min_bytes, "tensorstash.stash", "min_bytes", share=False))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TypeError(f"tensorstash.stash: workers must be a positive int; got {workers!r}")
    if not isinstance(record, bool):
        raise TypeError(f"tensorstash.stash: record must be True or False; got {record!r}")
    if not isinstance(verify, bool):
        raise TypeError(f"tensorstash.stash: verify must be True or False; got {verify!r}")
    if profile is not None and not isinstance(profile, Records):
        raise TypeError(
            f"tensorstash.stash: profile must be a tensorstash.Profile; got {profile!r}"
        )
    return Session(
        resolve(policy),
        min_bytes=min_bytes,
        workers=workers,
        record=record,
        profile=profile,
        verify=verify,
    )


@contextlib.contextmanager
def pause() -> Iterator[None]:
    """Save tensors as plain autograd would inside this region, even within a stash.

    Pops this thread's tensorstash hooks for the region and pushes them back
    after, so ``torch.func.grad`` and friends (which refuse to run while hooks
    are pushed) work inside it, and an output head can stay in memory.

    Example:
        >>> with tensorstash.stash("lz4"):
        ...     h = body(x)
        ...     with tensorstash.pause():
        ...         g = torch.func.grad(loss_fn)(h.detach())
    """
    popped: list[tuple[Session, Any]] = []
    active = _active()
    if active and active[0].opened_quiet:
        active[0].wake()  # rule 11 of NOTE [ Session ]: what is paused are its hooks
    for session in reversed(active):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or not session._pushed_by(top[0]):
            break
        torch._C._autograd._pop_saved_tensors_default_hooks()
        popped.append((session, top))
    del active[len(active) - len(popped) :]
    try:
        yield
    finally:
        for session, hooks in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
            active.append(session)


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _nothing() -> None:
    return None
