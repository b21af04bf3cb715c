"""Select and Auto: a policy chosen per tensor from its size and the memory left.

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
   leaves it. Hooks and module tracking are not free: on an H200 the bench's
   ``medium`` model (a 20 ms step, bound by launching kernels) took 1.45x
   no stash's step under ``Auto`` keeping everything, every tensor through
   the Python hooks, against 1.00x with none.
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
   model's call on. On the bench's ``tiny`` model (one thread, 2-core host,
   ``python benchmarks/quiet_loop.py --model tiny --threads 1 --steps 1500
   --skip 20``) a quiet step's session added 615-690 us to no stash's step,
   against 820-870 us before (1.022-1.024x against 1.028-1.031x); on CUDA
   it also makes no step object, timer events or page-fault reading a step.
   What is left is mostly Python run from caches the step's kernels emptied:
   the same calls take about 4x what they take in a tight loop.
"""

from __future__ import annotations

import functools
import re
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tensorstash.core import _names, _reasons
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.core.policy import Chain, Context, Defer, Keep, Policy
from tensorstash.core.stats import StashStats, Tier, human_bytes
from tensorstash.memory import _pool
from tensorstash.memory._memory import host_ram
from tensorstash.memory._trim import Watch
from tensorstash.planning import _opening, _rates
from tensorstash.planning.plan import RETURNS_BELOW, Plan, Rates, make_plan
from tensorstash.planning.profile import signature
from tensorstash.session import _modules
from tensorstash.session.quiet import HOOKED, Control, Opening, Planning, State
from tensorstash.tiers._names import POLICIES, resolve
from tensorstash.tiers.compress import Lz4
from tensorstash.tiers.cpu import CpuOffload
from tensorstash.tiers.disk import DiskSpill, check_directory
from tensorstash.tiers.recompute import unwrap_for_plan, warm_up, wrap_for_plan

_HOST = torch.device("cpu")

Probe = Callable[[torch.device], tuple[int, int]]
"""``probe(device) -> (free_bytes, total_bytes)``."""


@dataclass(frozen=True, slots=True)
class Memory:
    """What a rule sees of memory when a tensor is saved (rule 2 of NOTE [ Selection ])."""

    device_free: int
    device_total: int
    host_available: int
    held: dict[Tier, int]


def device_memory(device: torch.device) -> tuple[int, int]:
    """Free and total bytes of a device; the host's for a CPU tensor.

    On CUDA, free counts the bytes PyTorch's caching allocator holds and no
    tensor uses: they serve this process's next tensors, and the driver sees
    them as taken. Without them the default budget (half the free memory)
    fell with whatever the process's earlier work left cached: on the bench's
    ``large`` model on an H200 it went below the step's 9.9 GiB of activation
    bytes in 6 of 8 rounds, and ``Auto`` copied up to 7.6 GiB a step at 1.18x
    no stash's step where nothing had to move. Both are read from one nested
    reading of the allocator's statistics: ``memory_reserved`` and
    ``memory_allocated`` each flatten and sort all of them (about 150), some
    120 us of Python each on a 2-core host, in a session opened every step.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        cached = _current(stats, "reserved_bytes") - _current(stats, "allocated_bytes")
        return int(free) + max(cached, 0), int(total)
    return host_memory(device)


def _current(stats: dict[str, Any], name: str) -> int:
    """The current value of one of the caching allocator's statistics, over all pools."""
    try:
        return int(stats[name]["all"]["current"])
    except (KeyError, TypeError):
        return 0  # not initialised yet (an empty reading), or another layout


def host_memory(device: torch.device | None = None) -> tuple[int, int]:
    """Available and total bytes of host RAM (:func:`~tensorstash.memory._memory.host_ram`)."""
    return host_ram()


def check_probes(owner: Any, api: str) -> None:
    """``device_probe``, ``host_probe`` and ``clock`` must be callables."""
    for name, call in (
        ("device_probe", "device_probe(device) -> (free_bytes, total_bytes)"),
        ("host_probe", "host_probe(device) -> (available_bytes, total_bytes)"),
        ("clock", "clock() -> seconds"),
    ):
        value = getattr(owner, name)
        if not callable(value):
            raise TypeError(f"{api}: {name} must be callable as {call}; got {value!r}")


Rule = Callable[[Tensor, Memory], Any]
"""``rule(tensor, memory) -> policy`` or ``(policy, reason)``; a policy object or name."""


@dataclass(frozen=True)
class Select:
    """Pack each eligible tensor with the policy ``rule(tensor, memory)`` returns.

    Args:
        rule: ``rule(tensor, memory) -> Policy`` (a policy object or name).
        device_probe: ``(device) -> (free, total)``; default: CUDA's or the host's.
        host_probe: ``(device) -> (available, total)`` of host RAM; default:
            /proc/meminfo (psutil where there is none).
        refresh_s: how long a probe's reading is reused.
        clock: seconds, monotonic; injected for tests.

    Example:
        >>> big = lambda t, m: tensorstash.Lz4() if t.numel() > 1 << 20 else tensorstash.Keep()
        >>> with tensorstash.stash(tensorstash.Select(big)):
        ...     loss = model(x).sum()
    """

    rule: Rule
    device_probe: Probe = device_memory
    host_probe: Probe = host_memory
    refresh_s: float = 0.05
    clock: Callable[[], float] = time.monotonic
    _cache: dict[Any, tuple[float, tuple[int, int]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not callable(self.rule):
            raise TypeError(
                f"tensorstash.Select: rule must be callable as rule(tensor, memory) -> policy; "
                f"got {self.rule!r}"
            )
        check_probes(self, "tensorstash.Select")
        refresh = self.refresh_s
        if isinstance(refresh, bool) or not isinstance(refresh, (int, float)):
            raise TypeError(f"tensorstash.Select: refresh_s must be seconds; got {refresh!r}")
        if not refresh >= 0:
            raise ValueError(
                f"tensorstash.Select: refresh_s must be >= 0 seconds (0 reads the probes for "
                f"every tensor); got {refresh}"
            )

    def memory(self, tensor: Tensor, ctx: Context) -> Memory:
        """The snapshot a rule sees for ``tensor`` (probes cached, rule 3)."""
        free, total = self._read("device", tensor.device, self.device_probe)
        available, _ = self._read("host", _HOST, self.host_probe)
        held = {name: tier.live_bytes for name, tier in ctx.stats.tiers.items()}
        held["kept"] += ctx.stats.hot.live
        return Memory(free, total, available, held)

    def _read(self, kind: str, device: torch.device, probe: Probe) -> tuple[int, int]:
        now = self.clock()
        key = (kind, device)
        found = self._cache.get(key)
        if found is None or now - found[0] > self.refresh_s:
            found = self._cache[key] = (now, probe(device))
        return found[1]

    def choose(
        self, tensor: Tensor, ctx: Context, site: Any = None
    ) -> tuple[Policy | Defer, Reason | None]:
        """The rule's policy for ``tensor``, and its reason when the rule gives one."""
        choice = self.rule(tensor, self.memory(tensor, ctx))
        policy, why = choice if isinstance(choice, tuple) else (choice, None)
        given = None if why is None else reason(Why.RULE, why)
        if isinstance(policy, Defer):
            return Defer(resolve(policy.policy, POLICIES, api="Select"), policy.window), given
        return resolve(policy, POLICIES, api="Select"), given

    def pack(self, value: Tensor, ctx: Context) -> Any:
        raise TypeError(
            "tensorstash.Select: a selector chooses a policy per tensor; pass it to "
            "tensorstash.stash(), not as a stage of a Chain"
        )

    def unpack(self, packed: Any, ctx: Context) -> Tensor:
        raise TypeError("tensorstash.Select: unpack is dispatched to the chosen policy")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bytes(value: int | float | str, api: str, name: str) -> int | float:
    """``"2GiB"`` -> 2147483648; ints pass through; floats in (0, 1] stay fractions."""
    if isinstance(value, bool):
        raise TypeError(
            f"{api}: {name} must be bytes, a size like '2GiB', or a fraction; got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{api}: {name} must be >= 0; got {value}")
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(
                f"{api}: {name} as a float is a fraction of memory in (0, 1]; got {value}"
            )
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"{api}: {name} must be bytes (int), a size such as '512MiB' or '2GB', or a "
            f"fraction such as 0.5; got {value!r}"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    scale = 1024 ** "bkmgt".index(unit[0]) if "i" in unit else _UNITS[unit[:1]]
    return int(number * scale)


def _resolve_budget(budget: int | float, total: int) -> int:
    return int(budget * total) if isinstance(budget, float) else budget


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

    Rules, in order, for each eligible tensor (the functions of ``_AutoState``
    named after them):

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
    ``max_inflight_bytes``). With the fixed default of 1 GiB, the bench's
    ``large`` on an H200 at a quarter of its activation bytes kept 2.4 GiB
    against a 2.5 GiB budget, and its copies could hold 1 GiB more (``cpu``
    there peaked 1.0 GiB higher than when every module waited for its copies).

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
    _parsed: tuple[Any, Any] = field(init=False, repr=False, compare=False, default=(None, 0))
    _probes: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        api = "tensorstash.Auto"
        budget = None
        if self.device_budget is not None:
            budget = parse_bytes(self.device_budget, api, "device_budget")
        reserve = parse_bytes(self.host_reserve, api, "host_reserve")
        object.__setattr__(self, "_parsed", (budget, reserve))
        object.__setattr__(
            self, "_probes", _shared_probes(self.device_probe, self.host_probe, self.clock)
        )
        check_directory(self.directory, api)
        check_probes(self, api)
        if self.trim_every not in (None, "auto"):
            every = parse_bytes(self.trim_every, api, "trim_every")
            if isinstance(every, float) or every <= 0:
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
        state = self.state(ctx)
        if state.budget < 0:
            state._resolve_limits(device)
        return state.budget

    def begin(
        self, ctx: Context, control: Control, *, alone: bool = False, min_bytes: int = 0
    ) -> Planning:
        """A session opens: its step's planning, which says how the step opens
        (NOTE [ Quiet-step machine ] in session/quiet.py; _opening.py) and plans at the
        model's first call (see ``_AutoState.entered``).

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


def _trims(device: str, every: int | str | None) -> bool | Literal["auto"]:
    """Whether a planned CPU step that saves bytes hands memory back: with the session
    pool, or a size given, always; trimming the heap by default, "auto": where the
    plan frees enough (NOTE [ Returning memory ] in _trim.py, rule 6)."""
    if device != "cpu" or every is None:
        return False
    return "auto" if every == "auto" and _pool.compiled is None else True


CPU_CONTENTION = 3.0
"""How much more a byte moved on a busy CPU costs the step than a probe of it took."""

TRIM_LEAST = 16 << 20
"""The least ``trim_every`` "auto" chooses (NOTE [ Returning memory ] in _trim.py, rule 6)."""

POOL_LEAST = 8 << 20
"""The least cap "auto" gives the session pool (NOTE [ Session pool ] in _pool.py, rule 3)."""

RECENT_SHARE = 4
"""Auto keeps the tensors saved last in the last 1/RECENT_SHARE of its budget (rule 5)."""

POSTED_KEEPS = 64
"""How many tensors the C pack keeps under Auto's posted limit before asking it again."""

Choice = tuple[Policy | Defer, Reason]
"""A policy (or a deferral) and why."""


class _AutoState:
    """Per-session state of an :class:`Auto`: probes, resolved limits, this step's plan."""

    def __init__(self, auto: Auto, ctx: Context) -> None:
        self.auto = auto
        self.profile = ctx.profile  # the context holds this state: no reference back to it
        tiers = ctx.stats.tiers
        self.kept, self.host = tiers["kept"], tiers["host"]
        self.hot = ctx.stats.hot  # kept bytes the session counts without a lock
        self.select: Select = auto._probes
        self.keep = Keep()
        self.budget = -1
        self.window = 0
        self.reserve = 0
        self.keep_below = -1  # the budget less the recent window (rule 4)
        self.keep_under_budget: Choice = (self.keep, _reasons.UNDER_BUDGET)
        profile = ctx.profile
        self.learning_now = profile is not None and profile.learning  # fixed for a step
        self.headroom = 0
        self.headroom_until = float("-inf")
        self.plan: Plan | None = None
        self.planned_for = False  # whether this step's plan was made
        self.recomputed: list[tuple[str, nn.Module]] = []
        self.cache_off: list[Any] = []  # model configs whose use_cache was turned off
        self.stats = ctx.stats
        self.watch: Watch | None = None  # returns freed memory in a planned CPU step
        self.control: Control | None = None  # the session's, during its step
        self.opening: Opening = HOOKED
        self.root_hook: Any = None  # the model's pre-hook that may make the step quiet
        self.unobserve: Callable[[], None] = _nothing  # stops observing modules (begin)

    # The tiers, made when first chosen: a step that keeps everything makes none
    # (a DiskSpill checks its directory when made).

    @functools.cached_property
    def offload(self) -> Policy:
        return CpuOffload(max_inflight_bytes=self.inflight_room())

    @functools.cached_property
    def compress(self) -> Policy:
        return Chain(CpuOffload(max_inflight_bytes=self.inflight_room()), Lz4())

    @functools.cached_property
    def spill(self) -> Policy:
        # Written as they are: lz4 first took the bench's small model from 1.38x to 2.28x
        # no stash's step on the CPU (a 2-core machine), and held more meanwhile.
        return Chain(CpuOffload(), DiskSpill(self.auto.directory))  # a CPU tensor: to disk

    def inflight_room(self) -> int:
        """The device bytes whose copy to the host may still run (the held bytes of
        ``Auto``'s docstring): the budget less what this step's plan holds when forward
        ends; none without a plan that fits, whose kept bytes reach the budget."""
        plan = self.plan
        if plan is None or not plan.fits:
            return 0
        return max(0, self.budget - plan.held_bytes)

    # The session's step ------------------------------------------------------------

    def begin(self, control: Control, opening: Opening) -> None:
        """Plan when the model is first called (a module observer until then).

        Called before the profile starts timing the step, so this observer
        hears of the model's call before the step's does (``entered``). A
        session that opened quiet follows no module: it plans in the model's
        pre-hook (NOTE [ Quiet steps ] rule 4).
        """
        self.control, self.opening = control, opening
        quiet = opening.state is State.OPENED_QUIET
        profile = self.profile
        if quiet:
            profile.began_quiet()
        self.learning_now = profile is not None and profile.learning
        self.hot.keep_left = 0  # nothing posted carries across steps
        if profile is not None and torch.is_grad_enabled():
            if not quiet:
                self.unobserve = _modules.observe(self)
            root = profile.root
            if root is not None:  # NOTE [ Quiet steps ] rule 2
                self.root_hook = root.register_forward_pre_hook(
                    self._model_called, with_kwargs=True
                )

    def woke(self) -> None:
        """The session that opened quiet pushed its hooks before the model's call: plan
        at the first module call, as in a session that opened with them."""
        if not self.planned_for:
            self.unobserve = _modules.observe(self)

    def entered(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The first module called: plan for this step and recompute what the plan says."""
        self.unobserve()
        if self.planned_for or not module.training:
            return
        self.planned_for = True
        profile = self.profile
        profile.saw_root(module)
        if self.auto.recompute:
            self._without_cache(module)
        if not profile.steps:
            return  # the first step measures
        if self.budget < 0:
            device = next((a.device for a in args if isinstance(a, Tensor)), None)
            if device is None:
                device = next((p.device for p in module.parameters()), _HOST)
            self.device = device
            self._resolve_limits(device)
        self.plan = self._plan(module)
        self.hot.keep_left = 0  # the plan decides from here
        if self.plan is not None:
            if self.plan.recompute and warm_up():
                # Checkpointing's one-time set-up imports torch._dynamo (a second,
                # 70 MiB): only a plan that recomputes pays it, and not in its step.
                profile.set_up_ran()
            self._recompute(self.plan.recompute)
            self._watch(self.plan)

    def left(self, module: nn.Module) -> None:
        return None

    def _model_called(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """NOTE [ Quiet steps ] rule 2: hand the step to plain autograd where its plan allows."""
        self._drop_root_hook()
        session = self.control
        if session is not None and session.opened_quiet:
            self._called_quiet(session, module, args, kwargs)
            return
        plan, profile = self.plan, self.profile
        if not profile.model_called(signature(args, kwargs)):
            return
        if plan is None or not plan.quiet:
            return
        if session is None or not session.go_quiet():
            return
        paths = tuple(path for path, _ in self.recomputed)
        self._quiet_from_here(profile.went_quiet(module, paths, timed=self.watch is not None))

    def _called_quiet(
        self, session: Any, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """NOTE [ Quiet steps ] rule 4: the model's call in a session that opened quiet."""
        self.entered(module, args)  # no module observer told it of the call
        plan, profile = self.plan, self.profile
        inputs = signature(args, kwargs)
        if (
            plan is not None
            and plan.quiet
            and profile.stays_quiet(module, inputs)
            and session.stay_quiet()
        ):
            paths = tuple(path for path, _ in self.recomputed)
            opened = (self.device, self.stats)
            timed = self.watch is not None
            self._quiet_from_here(profile.went_quiet(module, paths, timed=timed, opened=opened))
        elif session.wake(module, args):
            # What a step that began at the session's open took at the model's call.
            if self.planned_for:
                profile.recomputing(tuple(path for path, _ in self.recomputed), self._moves())
            profile.model_called(inputs)

    def _quiet_from_here(self, quiet: Any) -> None:
        """The step went quiet (``quiet``: its timing, or None where it is not timed)."""
        if self.watch is not None and quiet is not None:
            # The stats count nothing now: trim until the backward through the output ends,
            # and let the session pool go then, not at the watch's next look.
            self.watch.holding = lambda: not quiet.ended
            if self.watch.lease is not None:
                quiet.when_ended.append(self.watch.lease.close)

    def _drop_root_hook(self) -> None:
        if self.root_hook is not None:
            self.root_hook.remove()
            self.root_hook = None

    def end(self) -> None:
        """The session exits: give every module back, and the session's control."""
        self._drop_root_hook()
        self.unobserve()
        control, self.control = self.control, None
        if control is not None and control.opened_quiet:
            self.profile.did_not_stay_quiet()  # the model was never called, or could not decide
        if self.watch is not None:
            self.watch.exited()  # it stops when the step's saved tensors are freed
            self.watch = None
        for _, module in self.recomputed:
            unwrap_for_plan(module)
        self.recomputed = []
        for config in self.cache_off:
            config.use_cache = True
        self.cache_off = []
        self.planned_for = False

    def _plan(self, root: nn.Module) -> Plan | None:
        profile = self.profile
        auto = self.auto
        device = "cuda" if self.device_type == "cuda" else "cpu"
        trims = _trims(device, auto.trim_every)
        key = (device, auto.recompute, auto.never_recompute, auto.always_recompute, trims)
        plan = profile.plan_for(key, self.budget, lambda: make_plan(
            profile,
            self.budget,
            device=device,
            recompute=auto.recompute,
            never=lambda path: _named(profile.module(path), path, auto.never_recompute),
            always=_paths(profile, auto.always_recompute),
            rates=self._rates(root),
            trims=trims,  # as _watch does
        ))  # fmt: skip
        if plan is not None and not plan.fits and profile.warn_unreachable(self.budget):
            warnings.warn(
                f"tensorstash.Auto: device_budget {human_bytes(self.budget)} cannot be held: "
                f"with every module that is safe to recompute recomputed and every site "
                f"moved, a step holds {human_bytes(plan.reachable_bytes)}. Pass "
                f"device_budget >= {plan.reachable_bytes} (or allow more modules to be "
                "recomputed); until then Auto holds what it can. (Shown once per budget.)",
                RuntimeWarning,
                stacklevel=2,
            )
        return plan

    def _rates(self, root: nn.Module) -> Rates:
        """The speeds of moving bytes, probed now (see _rates.py)."""
        device = next((p.device for p in root.parameters()), torch.device(self.device_type))
        region_s, saved_s = self._region_cost(device)
        if self.device_type == "cuda":
            return Rates(link=_rates.link_rate(device), region_s=region_s, saved_s=saved_s)
        # On the CPU the writer and the compressor run on the cores the step runs
        # on, and take the interpreter from it between their calls: a probe alone
        # says too little. Until a step measured it (Plan rule 6), a byte costs
        # CPU_CONTENTION times what the probe took.
        disk, lz4 = _rates.disk_rate(self.auto.directory), _rates.compress_rate()
        refault = _rates.refault_rate() or Rates.refault  # what the step pays: NOTE [ Plan ] 8
        return Rates(
            disk=disk / CPU_CONTENTION,
            compress=lz4 / CPU_CONTENTION,
            refault=refault,
            region_s=region_s,
            saved_s=saved_s,
        )

    def _region_cost(self, device: torch.device) -> tuple[float, float]:
        """What a recomputed region costs beyond its recompute (``_rates.region_cost``),
        probed only where a plan may recompute: a run that fits runs no checkpointing.
        Nothing where the profile's clock is not ``time.perf_counter`` (a test's ticks):
        the probe's seconds would not be the clock's."""
        auto = self.auto
        activation = sum(record.nbytes for record in self.profile.last.values())
        if not auto.recompute or (activation <= self.budget and not auto.always_recompute):
            return 0.0, 0.0
        if self.profile.clock is not time.perf_counter:
            return 0.0, 0.0
        return _rates.region_cost(device)

    def _recompute(self, paths: tuple[str, ...]) -> None:
        profile = self.profile
        for path in paths:
            module = profile.module(path)
            if module is not None and wrap_for_plan(module, profile.clock):
                self.recomputed.append((path, module))
        profile.recomputing(tuple(path for path, _ in self.recomputed), self._moves())

    def _moves(self) -> frozenset[str]:
        """The stats' tiers the plan moves bytes to, as a step's record will name them."""
        tiers = self.plan.tiers.values() if self.plan is not None else ()
        return frozenset("disk" if tier == "disk" else "host" for tier in tiers if tier != "keep")

    def _watch(self, plan: Plan) -> None:
        """Lease the session pool, or else trim, while a CPU step whose plan frees memory
        runs (NOTE [ Session pool ] in _pool.py; NOTE [ Returning memory ], 6)."""
        every = self.auto.trim_every
        if every is None or self.device_type != "cpu" or not plan.returns_memory:
            return
        stats, activation, auto = self.stats, plan.activation_bytes, every == "auto"
        if auto:
            every = max(POOL_LEAST, activation // 4)  # the pool's cap
        every = int(parse_bytes(every, "tensorstash.Auto", "trim_every"))
        lease = _pool.lease(every) if _pool.compiled is not None else None
        if lease is None and auto:
            # No pool, or another allocator holds the CPU (NOTE [ Session pool ] rule 5):
            # trim, and only where the plan frees enough (a plan made for the pool may not).
            if plan.held_bytes > RETURNS_BELOW * activation:
                return
            every = max(TRIM_LEAST, activation * 3 // 4)
        self.watch = Watch(every, lambda: _holding(stats), counted=stats.returned, lease=lease)
        self.watch.start()

    def _without_cache(self, root: nn.Module) -> None:
        """Run a Hugging Face model's training forward without its key-value cache.

        A recomputed region keeps its inputs, and a cache passed from layer to
        layer would keep every layer's keys and values alive through it; Hugging
        Face's own gradient checkpointing turns the cache off for this reason.
        Turned off in every training step of a plan, the first included, so the
        steps it measures are the steps it runs. The configs are those of the
        model and of every module in it: a model of the user's own that wraps
        a Hugging Face one has none at its root (on the bench's HF GPT-2
        config, recomputing every block with the cache left on held 0.88-0.91
        of no stash's real peak, against 0.75 without it).
        """
        for config in _cache_configs(root):
            if config.use_cache is True:
                config.use_cache = False
                self.cache_off.append(config)

    # The rules -----------------------------------------------------------------

    def choose(self, tensor: Tensor, ctx: Any = None, site: Any = None) -> Choice:
        """The rules of :class:`Auto`, in order.

        The session calls this for every eligible tensor, so the common case is
        answered first: with no plan (rule 1 cannot apply), outside a profile's
        first step on the CPU (nor can rule 3), under the budget less the window
        and with host RAM far from its reserve (nor can rule 2), rule 4 keeps it.
        """
        if self.budget < 0:
            self._resolve_limits(tensor.device)
        nbytes = tensor.nbytes
        held = self.hot.live + self.kept.live_bytes + nbytes
        on_host = tensor.is_cpu
        if on_host:
            held += self.host.live_bytes  # host RAM is this tensor's device
        if (
            self.plan is None
            and held <= self.keep_below
            and not (on_host and (self.learning_now or nbytes > self._headroom()))
        ):
            # Posted for the C pack (rule 5 of NOTE [ Fast path ]): the kept bytes may
            # grow to the budget less the window and the other tiers' bytes; on the
            # CPU, by at most the headroom just read.
            hot = self.hot
            limit = self.keep_below - (held - nbytes - hot.live)
            if on_host:
                limit = min(limit, hot.live + self.headroom)
            hot.keep_limit, hot.keep_cpu, hot.keep_left = limit, on_host, POSTED_KEEPS
            return self.keep_under_budget
        return (
            self.planned(tensor, nbytes, held, site)
            or self.host_low(tensor, nbytes)
            or self.learning(tensor)
            or self.under_budget(held)
            or self.outwards(tensor, nbytes)
        )

    def planned(self, tensor: Tensor, nbytes: int, held: int, site: Any) -> Choice | None:
        """Rule 1: the plan's tier for this call site."""
        plan = self.plan
        if plan is None or site is None:
            return None
        tier = plan.tier(site)
        if tier == "keep":
            if site not in self.profile.last:
                return None  # a site the plan has not seen: the other rules
            if held <= self.budget:
                return self.keep, _PLANNED_KEEP
            policy, why = self._outwards(tensor, nbytes)
            return policy, _OVER_PLAN
        policy, why = self._outwards(tensor, nbytes)
        if why.why is Why.HOST_LOW:
            return policy, reason(Why.PLANNED_HOST_LOW, f"plan: {tier}")
        if tier == "host" and not tensor.is_cpu:
            return self.offload, _PLANNED[tier]
        if tier == "compressed":
            return self.compress, _PLANNED[tier]
        return self.spill, _PLANNED["disk"]

    def host_low(self, tensor: Tensor, nbytes: int) -> Choice | None:
        """Rule 2: a CPU tensor would bring host RAM under ``host_reserve``."""
        if tensor.is_cpu and self._host_available() - nbytes < self.reserve:
            return self.spill, _HOST_LOW
        return None

    def learning(self, tensor: Tensor) -> Choice | None:
        """Rule 3: a CPU tensor in a profile's first step stays (see the class docstring)."""
        profile = self.profile
        if profile is not None and tensor.is_cpu and profile.learning:
            return self.keep, _LEARNING
        return None

    def under_budget(self, held: int) -> Choice | None:
        """Rule 4: the held bytes stay within the budget less the recent window."""
        if held <= self.budget - self.window:
            return self.keep, _reasons.UNDER_BUDGET
        return None

    def outwards(self, tensor: Tensor, nbytes: int) -> Choice:
        """Rule 5: out of the device, through the recent window."""
        policy, why = self._outwards(tensor, nbytes)
        return (Defer(policy, self.window) if self.window else policy), why

    # Helpers -----------------------------------------------------------------

    def _outwards(self, tensor: Tensor, nbytes: int) -> tuple[Policy, Reason]:
        """Where a tensor goes past the budget (the list of rule 5)."""
        available = self._host_available() - nbytes
        if available < self.reserve:
            return self.spill, _HOST_LOW
        if tensor.is_cpu:
            return self.spill, _TO_DISK
        if available < 2 * self.reserve:
            return self.compress, _HOST_TIGHT
        return self.offload, _BUDGET_REACHED

    def _host_available(self) -> int:
        return self.select._read("host", _HOST, self.auto.host_probe)[0]

    def _headroom(self) -> int:
        """Host RAM available over the reserve, read again every ``refresh_s``."""
        now = self.auto.clock()
        if now > self.headroom_until:
            self.headroom = self._host_available() - self.reserve
            self.headroom_until = now + self.select.refresh_s
        return self.headroom

    def _resolve_limits(self, device: torch.device) -> None:
        self.device_type = device.type
        free, total = self.select._read("device", device, self.auto.device_probe)
        parsed, reserve = self.auto._parsed
        self.budget = free // 2 if parsed is None else _resolve_budget(parsed, total)
        self.window = self.budget // RECENT_SHARE
        self.keep_below = self.budget - self.window
        host_total = self.select._read("host", _HOST, self.auto.host_probe)[1]
        self.reserve = _resolve_budget(reserve, host_total)

    device_type = "cpu"
    device = _HOST  # the model's, once planned for


_SHARED: dict[tuple[Any, ...], Select] = {}


def _shared_probes(device: Probe, host: Probe, clock: Callable[[], float]) -> Select:
    """The probes an Auto reads through: one reading shared by every Auto with the defaults.

    ``stash("auto")`` makes an Auto each step; with its own probes each step
    would ask the device and the host again (``torch.cuda.mem_get_info`` and
    /proc/meminfo).
    """
    key = (device, host, clock)
    if key != (device_memory, host_memory, time.monotonic):
        return Select(_unused_rule, device, host, clock=clock)  # injected: not kept here
    found = _SHARED.get(key)
    if found is None:
        found = _SHARED[key] = Select(_unused_rule, device, host, clock=clock)
    return found


def _named(module: nn.Module | None, path: str, names: tuple[str, ...]) -> bool:
    """Whether ``path`` (or its class) is one of ``names``: a path covers the modules in it."""
    if any(path == name or path.startswith(name + ".") for name in names):
        return True
    return module is not None and type(module).__name__ in names


def _paths(profile: Any, names: tuple[str, ...]) -> list[str]:
    """The measured module paths ``names`` stand for (paths, or class names)."""
    found = []
    for path in profile.modules:
        if _named(profile.module(path), path, names):
            found.append(path)
    return found


_HOST_LOW = Reason(Why.HOST_LOW)
_LEARNING = Reason(Why.LEARNING)
_TO_DISK = Reason(Why.TO_DISK)
_HOST_TIGHT = Reason(Why.HOST_TIGHT)
_BUDGET_REACHED = Reason(Why.BUDGET_REACHED)
_PLANNED_KEEP = reason(Why.PLANNED, "plan: keep")
_OVER_PLAN = reason(Why.OVER_PLAN, "plan: keep")
_PLANNED = {tier: reason(Why.PLANNED, f"plan: {tier}") for tier in ("host", "compressed", "disk")}


_configs: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _cache_configs(root: nn.Module) -> tuple[Any, ...]:
    """The distinct configs with a ``use_cache`` of ``root`` and the modules in it.

    Found once per model: a module tree is walked when a model is first planned for.
    """
    found = _configs.get(root)
    if found is None:
        seen: dict[int, Any] = {}
        for module in root.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "use_cache"):
                seen.setdefault(id(config), config)
        found = _configs[root] = tuple(seen.values())
    return found


def _holding(stats: StashStats) -> bool:
    """Whether a session still holds saved tensors; read from another thread.

    The kept bytes are the tier's plus the hot path's (``StashStats.fold``
    moves them), less the kept tensors freed and not yet taken off. A read
    that races with a fold may be off for one poll: the answer only decides
    when a ``Watch`` stops.
    """
    hot = stats.hot
    live = hot.live + sum(tier.live_bytes for tier in stats.tiers.values())
    try:
        live -= hot.pending()
    except RuntimeError:  # the queue changed while copied: ask again next time
        return True
    return live > 0


def _unused_rule(tensor: Tensor, memory: Memory) -> Policy:
    raise AssertionError("tensorstash: Auto decides itself; this is a bug in tensorstash")


def _nothing() -> None:
    return None
