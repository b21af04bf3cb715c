"""Select and Auto: a policy chosen per tensor from its size and the memory left.

``Select`` and its memory probes are in _select.py; ``Auto``'s choice for each tensor
in _auto_choice.py, its planning of each step in _auto_step.py, the plan it asks for
in _auto_plan.py. Their names stay importable from here.

# NOTE [ Selection ]
1. A selector has ``choose(tensor, ctx, site) -> (policy, reason)``; the
   session calls it for each eligible tensor (``site``: its call site when the
   session has a profile, else None) and keeps the chosen policy beside the
   packed value, so unpack dispatches on what pack chose (no registry, no ids).
   The reason is a structured value (``_reasons.Reason``), rendered only in the
   decision log.
2. ``memory`` is a :class:`Memory` snapshot: device free/total bytes (CUDA:
   ``torch.cuda.mem_get_info``; a CPU tensor's device is the host), host
   available bytes (/proc/meminfo, or psutil), and the bytes this session holds per tier.
3. Probes are arguments with defaults and their readings are cached for
   ``refresh_s`` seconds of the injected clock, so a decision costs a few
   microseconds, not a system call.

# NOTE [ Quiet steps ]
1. A plan that moves nothing (every site kept, some modules perhaps
   recomputed) needs no saved-tensor hook: the modules it recomputes run
   under their own checkpoint, and everything else stays where autograd
   leaves it. Hooks and module tracking are not free: every saved tensor
   goes through Python, which on a model bound by launching kernels is a
   large share of its step.
2. So from the model's call (a forward pre-hook on the model the profile
   knows), such a step hands itself back to plain autograd (rule 10 of NOTE
   [ Session ]), when: the profile measures nothing in it (NOTE [ Profile ]
   rule 6), the model's inputs are those of the last step that recorded its
   sites (rule 8 there: another batch shape runs with hooks, and the plan
   follows its bytes), and the plan fits its budget. It still recomputes
   what the plan says, and on the CPU still returns freed memory (its
   ``Watch`` runs until the backward through the model's output ends).
3. The plan knows what hooks cost (NOTE [ Plan ] rule 7): where the cheapest
   plan moves sites (so needs the hooks), the planner also makes the plan
   that only recomputes, and takes it if it fits and its predicted step,
   without the hooks' cost, is no slower.
4. After a quiet step the next session opens quiet (rule 11 of NOTE
   [ Session ]): nothing follows its modules, so it plans in the model's
   pre-hook instead of at the first module call, stays quiet where rule 2
   allows, and else wakes the session, which pushes its hooks from the
   model's call on. A quiet step's session then costs little beyond that
   planning: on CUDA it makes no step object, timer events or page-fault
   reading. What is left is mostly Python run from caches the step's
   kernels emptied, which runs several times slower than the same calls in
   a tight loop.

The figures behind these rules (what hooks cost a step, what opening quiet
saves) are in docs/figures/auto.md, with the commands that measured them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tensorstash.core import _names
from tensorstash.core._reasons import Reason
from tensorstash.core._sizes import Share, parse_size
from tensorstash.core.policy import Context, Defer, Policy
from tensorstash.planning import _opening
from tensorstash.planning._auto_choice import POSTED_KEEPS, RECENT_SHARE, Choice
from tensorstash.planning._auto_plan import CPU_CONTENTION
from tensorstash.planning._auto_step import POOL_LEAST, TRIM_LEAST, _AutoState
from tensorstash.planning._limit import MemoryLimitError
from tensorstash.planning._select import (
    Memory,
    Probe,
    Rule,
    Select,
    check_probes,
    device_memory,
    host_memory,
    parse_bytes,
    shared_probes,
)
from tensorstash.session.quiet import HOOKED, Control, Planning
from tensorstash.tiers.disk import check_directory

__all__ = [
    "CPU_CONTENTION",
    "DEFAULT_LIMIT",
    "LIMIT_LEAST",
    "POOL_LEAST",
    "POSTED_KEEPS",
    "RECENT_SHARE",
    "TRIM_LEAST",
    "Auto",
    "Choice",
    "Memory",
    "MemoryLimitError",
    "Probe",
    "Rule",
    "Select",
    "check_probes",
    "device_memory",
    "host_memory",
    "parse_bytes",
]


DEFAULT_LIMIT = Share(0.9)
"""The limit ``Auto`` holds where given neither ``limit`` nor ``device_budget``: a share of
the device's capacity that leaves its allocator room (NOTE [ Memory limit ] in _limit.py)."""
LIMIT_LEAST = 1 << 20
"""A limit under this many bytes cannot be meant (NOTE [ Sizes ] rule 4)."""


@dataclass(frozen=True)
class Auto:
    """The default selector: a memory budget at the least step time.

    With a :class:`~tensorstash.Profile` given to the session, from the second
    step on ``Auto`` follows a plan (NOTE [ Plan ] in plan.py): the modules it
    recomputes for the step (run under non-reentrant checkpointing from the
    model's first call in the session, restored when it exits) and where each
    call site's tensors go, chosen from what the last steps measured, the
    cheapest saving per byte first. ``session.plan`` shows it, with its
    predicted step time and real peak. A run that fits keeps everything.

    Rules, in order, for each eligible tensor (the methods named after them of
    ``Chooser``, in _auto_choice.py):

    1. ``planned``: the plan's tier for this call site; a site the plan keeps
       stays while the held bytes fit the budget, and goes out past it (rule 5).
    2. ``host_low``: a CPU tensor whose device is host RAM, which this tensor
       would bring under ``host_reserve``: spill it to disk ("host memory
       low"), even under the budget.
    3. ``learning``: in the first step of a profile, a CPU tensor stays, so the
       step times the model with nothing moved (moving bytes on the cores the
       step runs on would blur every time the plan is made from); rule 2 still
       spills if host RAM runs low. The budget holds from the second step.
    4. ``under_budget``: while the tensors this session holds on their device
       stay within three quarters of ``device_budget``: keep it ("under device
       budget").
    5. ``outwards``: past that, move it out, deferred through the recent window:
       it waits, kept, until the tensors saved after it reach the last quarter
       of the budget (NOTE [ Recent window ] in stash.py), so the tensors
       backward needs first stay and held bytes stay within the budget plus
       one tensor. Where it goes:

       - host RAM available, less this tensor, under ``host_reserve``:
         spilled to disk as it is ("host memory low");
       - a CPU tensor, whose device is host RAM: spilled as it is (lz4 before
         the disk cost more than it saved where the page cache takes the
         writes; ``Chain(Lz4(), DiskSpill())`` is there for a slow disk);
       - host RAM under twice ``host_reserve``: compressed in host RAM
         ("host memory tight"; lz4 decides per tensor from a sample whether
         compression pays);
       - otherwise copied to host RAM as it is ("device budget reached"): the
         link to the host moves bytes an order of magnitude faster than lz4
         compresses them.

    The held bytes are those on the device: for a CPU tensor, every byte the
    session holds in host RAM (kept, compressed, or waiting to be written);
    for a CUDA tensor, the kept bytes and those whose copy to the host is
    still running. Those copies may hold the budget less what the step's plan
    holds when forward ends (none without a plan), plus the tensor being
    saved: past that, saving waits for the oldest copy (``CpuOffload``'s
    ``max_inflight_bytes``). With a fixed cap instead (``CpuOffload``'s
    default), the copies could hold the whole cap on top of a plan that keeps
    close to the budget (docs/figures/auto.md). On the CPU the bytes waiting
    for the disk writer are held the same way (``DiskSpill``'s
    ``max_pending_bytes``: what the plan leaves of the budget, or the recent
    window without a plan).

    Args:
        device_budget: eligible saved bytes held on the device per session: an
            int, a size such as "2GiB", or a fraction of the device's total
            memory. Default: half of the device memory free when the model is
            first called (or the first tensor saved).
        host_reserve: host RAM to leave free before spilling to disk (int, size
            string or fraction of host RAM). Default "2GiB".
        directory: where DiskSpill makes its private directory.
        recompute: whether the plan may recompute modules (False: offload only).
        never_recompute: modules the plan must not recompute: paths (a module
            and those inside it) or class names.
        always_recompute: modules the plan recomputes whatever the budget.
        trim_every: in a planned step on the CPU that moves or recomputes
            anything, the free memory the process may keep above what it
            uses, so the bytes the plan frees leave the process: the session
            pool's cap (NOTE [ Session pool ] in _pool.py), or, where there is
            no pool, the growth of the resident set after which a thread hands
            the allocator's free memory back to the OS (NOTE [ Returning
            memory ] in _trim.py, rule 6). "auto": a quarter of the step's
            activation bytes for the pool (at least 8 MiB), in every planned
            step that saves bytes; three quarters for trimming (at least 16
            MiB), only where the plan holds at most two thirds of them
            (``Plan.returns_memory``). None: neither.
        device_probe, host_probe, clock: injected probes (see :class:`Select`).

    Example:
        >>> profile, auto = tensorstash.Profile(), tensorstash.Auto(device_budget="4GiB")
        >>> for batch in loader:
        ...     with tensorstash.stash(auto, profile=profile) as session:
        ...         loss = model(batch)
        ...     loss.backward()
        >>> print(session.plan.table())
    """

    limit: int | float | str | None = None
    device_budget: int | float | str | None = None
    host_reserve: int | float | str = "2GiB"
    directory: str | None = None
    recompute: bool = True
    never_recompute: tuple[str, ...] = ()
    always_recompute: tuple[str, ...] = ()
    trim_every: int | str | None = "auto"
    device_probe: Probe = device_memory
    host_probe: Probe = host_memory
    clock: Callable[[], float] = time.monotonic

    # Parsed once, and the probes' readings shared by this Auto's sessions (each
    # reading kept refresh_s): a session opens at every step.
    _parsed: tuple[Any, Any, Any] = field(
        init=False, repr=False, compare=False, default=(None, 0, None)
    )
    _probes: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        api = "tensorstash.Auto"
        budget = limit = None
        if self.device_budget is not None:
            budget = parse_size(self.device_budget, api, "device_budget")
        if self.limit is not None:
            limit = parse_size(self.limit, api, "limit", least=LIMIT_LEAST)
            if limit == 0:
                raise ValueError(
                    f"{api}: limit must be more than 0 bytes: it is the most real memory a "
                    "step may hold; pass a size such as '12GiB' or a share such as '90%'"
                )
        elif budget is None:
            limit = DEFAULT_LIMIT  # NOTE [ Memory limit ] rule 1: the machine's, by default
        reserve = parse_size(self.host_reserve, api, "host_reserve")
        object.__setattr__(self, "_parsed", (budget, reserve, limit))
        object.__setattr__(
            self, "_probes", shared_probes(self.device_probe, self.host_probe, self.clock)
        )
        check_directory(self.directory, api)
        check_probes(self, api)
        if self.trim_every not in (None, "auto"):
            every = parse_size(self.trim_every, api, "trim_every", share=False)
            if every <= 0:
                raise ValueError(
                    f"{api}: trim_every must be a positive size such as '64MiB', 'auto' or None; "
                    f"got {self.trim_every!r}"
                )
        if not isinstance(self.recompute, bool):
            raise TypeError(f"{api}: recompute must be True or False; got {self.recompute!r}")
        for name in ("never_recompute", "always_recompute"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif not (isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)):
                raise TypeError(
                    f"{api}: {name} must be module paths or class names, such as "
                    f"('lm_head', 'LayerNorm'); got {value!r}"
                )
            else:
                object.__setattr__(self, name, tuple(value))

    def state(self, ctx: Context) -> _AutoState:
        """This session's state: its probes, its budget (fixed when first needed), its plan."""
        state: _AutoState | None = ctx.resources.get(id(self))  # the hot path: no lock
        if state is None:
            state = ctx.resource(id(self), lambda: _AutoState(self, ctx))
        return state

    def budget_bytes(self, ctx: Context, device: torch.device) -> int:
        """This session's device budget in bytes on ``device`` (resolved once per session)."""
        return self.state(ctx).choice.budget_on(device)

    def begin(
        self, ctx: Context, control: Control, *, alone: bool = False, min_bytes: int = 0
    ) -> Planning:
        """A session opens: its step's planning, which says how the step opens
        (NOTE [ Quiet-step machine ] in session/quiet.py; _opening.py) and plans at the
        model's first call (``_AutoState.entered`` in _auto_step.py).

        Args:
            ctx: the session's context.
            control: what the planning may ask of the session in the step.
            alone: whether the step may open otherwise than hooked.
            min_bytes: the session's ``min_bytes``.
        """
        if alone:
            whole = _opening.compiled_planning(self, ctx, min_bytes)
            if whole is not None:
                return whole
        profile = ctx.profile
        quiet = alone and profile is not None and profile.may_open_quiet()
        opening = _opening.detecting(self, ctx, min_bytes, quiet) if alone else HOOKED
        state = self.state(ctx)
        state.begin(control, opening)
        return state

    def choose(
        self, tensor: Tensor, ctx: Context, site: Any = None
    ) -> tuple[Policy | Defer, Reason]:
        """Where ``tensor`` goes, by the rules above, and why."""
        return self.state(ctx).choose(tensor, ctx, site)

    def pack(self, value: Tensor, ctx: Context) -> Any:
        return Select.pack(self, value, ctx)  # type: ignore[arg-type]

    def unpack(self, packed: Any, ctx: Context) -> Tensor:
        return Select.unpack(self, packed, ctx)  # type: ignore[arg-type]


@functools.cache
def _auto() -> Auto:
    """The ``Auto`` that "auto" names: one per process. An Auto holds no state of its
    own (a session's is in its context), and ``stash("auto")`` runs at every step:
    making one there would cost a quiet step tens of microseconds."""
    return Auto()


_names.register("auto", _auto)
