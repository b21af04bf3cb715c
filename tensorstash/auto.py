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
   available bytes (psutil), and the bytes this session holds per tier.
3. Probes are arguments with defaults and their readings are cached for
   ``refresh_s`` seconds of the injected clock, so a decision costs a few
   microseconds, not a system call.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import Tensor

from tensorstash import _reasons
from tensorstash._names import resolve
from tensorstash._reasons import Reason, Why, reason
from tensorstash.compress import Lz4
from tensorstash.cpu import CpuOffload
from tensorstash.disk import DiskSpill, check_directory
from tensorstash.policy import Chain, Context, Defer, Keep, Policy
from tensorstash.stats import Tier

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
    """Free and total bytes of a device; the host's for a CPU tensor."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return host_memory(device)


def host_memory(device: torch.device | None = None) -> tuple[int, int]:
    """Available and total bytes of host RAM."""
    info = psutil.virtual_memory()
    return int(info.available), int(info.total)


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
        host_probe: ``(device) -> (available, total)`` of host RAM; default psutil.
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
            return Defer(resolve(policy.policy, api="Select"), policy.window), given
        return resolve(policy, api="Select"), given

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
    """The default selector: keep what fits, move the rest outwards.

    Rules, in order, for each eligible tensor (the functions of ``_AutoState``
    named after them):

    1. ``planned``: from the second step of a session given a
       :class:`~tensorstash.Profile`, follow the plan made from the last step
       (see NOTE [ Profile ]): keep sites whose reload stalled backward, then
       the sites saved last, while they fit in the budget; offload those saved
       earliest.
    2. ``host_low``: a CPU tensor whose device is host RAM, which this tensor
       would bring under ``host_reserve``: compress and spill it to disk ("host
       memory low"), even under the budget.
    3. ``under_budget``: while the tensors this session keeps on their device
       stay within three quarters of ``device_budget``: keep it ("under device
       budget").
    4. ``outwards``: past that, move it out, deferred through the recent window:
       it waits, kept, until the tensors saved after it reach the last quarter
       of the budget (NOTE [ Recent window ] in stash.py), so the tensors
       backward needs first stay and kept bytes stay within the budget plus
       one tensor. Where it goes:

       - host RAM available, less this tensor, under ``host_reserve``:
         compressed and spilled to disk ("host memory low");
       - a CPU tensor, whose device is host RAM: compressed and spilled;
       - host RAM under twice ``host_reserve``: compressed in host RAM
         ("host memory tight"; lz4 decides per tensor from a sample whether
         compression pays);
       - otherwise copied to host RAM as it is ("device budget reached"): the
         link to the host moves bytes an order of magnitude faster than lz4
         compresses them.

    Args:
        device_budget: bytes kept on the device per session: an int, a size
            such as "2GiB", or a fraction of the device's total memory. Default:
            half of the device memory free when the first tensor is saved.
        host_reserve: host RAM to leave free before spilling to disk (int, size
            string or fraction of host RAM). Default "2GiB".
        directory: where DiskSpill makes its private directory.
        device_probe, host_probe, clock: injected probes (see :class:`Select`).

    Example:
        >>> with tensorstash.stash(tensorstash.Auto(device_budget="4GiB")) as session:
        ...     loss = model(x).sum()
    """

    device_budget: int | float | str | None = None
    host_reserve: int | float | str = "2GiB"
    directory: str | None = None
    device_probe: Probe = device_memory
    host_probe: Probe = host_memory
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.device_budget is not None:
            parse_bytes(self.device_budget, "tensorstash.Auto", "device_budget")
        parse_bytes(self.host_reserve, "tensorstash.Auto", "host_reserve")
        check_directory(self.directory, "tensorstash.Auto")
        check_probes(self, "tensorstash.Auto")

    def state(self, ctx: Context) -> _AutoState:
        """This session's state: its probes, its budget (fixed when first needed), its plan."""
        state: _AutoState | None = ctx.resources.get(id(self))  # the hot path: no lock
        if state is None:
            state = ctx.resource(id(self), lambda: _AutoState(self, ctx))
        return state

    def choose(
        self, tensor: Tensor, ctx: Context, site: Any = None
    ) -> tuple[Policy | Defer, Reason]:
        """Where ``tensor`` goes, by the rules above, and why."""
        return self.state(ctx).decide(tensor, site)

    def pack(self, value: Tensor, ctx: Context) -> Any:
        return Select.pack(self, value, ctx)  # type: ignore[arg-type]

    def unpack(self, packed: Any, ctx: Context) -> Tensor:
        return Select.unpack(self, packed, ctx)  # type: ignore[arg-type]


RECENT_SHARE = 4
"""Auto keeps the tensors saved last in the last 1/RECENT_SHARE of its budget (rule 4)."""

Choice = tuple[Policy | Defer, Reason]
"""A policy (or a deferral) and why."""


class _AutoState:
    """Per-session state of an :class:`Auto`: its probes, its resolved limits, this step's plan."""

    def __init__(self, auto: Auto, ctx: Context) -> None:
        self.auto = auto
        self.ctx = ctx
        self.kept = ctx.stats.tiers["kept"]
        self.hot = ctx.stats.hot  # kept bytes the session counts without a lock
        self.select = Select(_unused_rule, auto.device_probe, auto.host_probe, clock=auto.clock)
        self.keep = Keep()
        self.offload = CpuOffload()
        self.compress = Chain(CpuOffload(), Lz4())
        self.spill = Chain(CpuOffload(), Lz4(), DiskSpill(auto.directory))  # CPU: kept, Lz4, disk
        self.budget = -1
        self.window = 0
        self.reserve = 0
        self.plan: dict[Any, tuple[bool, str]] | None = None

    def decide(self, tensor: Tensor, site: Any = None) -> Choice:
        """The rules of :class:`Auto`, in order."""
        if self.budget < 0:
            self._resolve_limits(tensor)
        nbytes = tensor.nbytes
        held = self.hot.live + self.kept.live_bytes + nbytes
        return (
            self.planned(tensor, nbytes, held, site)
            or self.host_low(tensor, nbytes)
            or self.under_budget(held)
            or self.outwards(tensor, nbytes)
        )

    # The rules -----------------------------------------------------------------

    def planned(self, tensor: Tensor, nbytes: int, held: int, site: Any) -> Choice | None:
        """Rule 1: the plan of the profile for this call site, from step two."""
        profile = self.ctx.profile
        if site is None or profile is None or not profile.steps:
            return None
        if self.plan is None:
            self.plan = profile.plan(self.budget, recent=self.window)
        planned = self.plan.get(site)
        if planned is None:
            return None
        keep, text = planned
        if keep and held <= self.budget:
            return self.keep, reason(Why.PLANNED, text)
        policy, why = self._outwards(tensor, nbytes)
        if why.why is Why.HOST_LOW:
            return policy, reason(Why.PLANNED_HOST_LOW, text)
        return policy, reason(Why.OVER_PLAN if keep else Why.PLANNED, text)

    def host_low(self, tensor: Tensor, nbytes: int) -> Choice | None:
        """Rule 2: a CPU tensor would bring host RAM under ``host_reserve``."""
        if tensor.is_cpu and self._host_available() - nbytes < self.reserve:
            return self.spill, _HOST_LOW
        return None

    def under_budget(self, held: int) -> Choice | None:
        """Rule 3: the kept bytes stay within the budget less the recent window."""
        if held <= self.budget - self.window:
            return self.keep, _reasons.UNDER_BUDGET
        return None

    def outwards(self, tensor: Tensor, nbytes: int) -> Choice:
        """Rule 4: out of the device, through the recent window."""
        policy, why = self._outwards(tensor, nbytes)
        return (Defer(policy, self.window) if self.window else policy), why

    # Helpers -----------------------------------------------------------------

    def _outwards(self, tensor: Tensor, nbytes: int) -> tuple[Policy, Reason]:
        """Where a tensor goes past the budget (the list of rule 4)."""
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

    def _resolve_limits(self, tensor: Tensor) -> None:
        api = "tensorstash.Auto"
        free, total = self.select._read("device", tensor.device, self.auto.device_probe)
        budget = self.auto.device_budget
        parsed = None if budget is None else parse_bytes(budget, api, "device_budget")
        self.budget = free // 2 if parsed is None else _resolve_budget(parsed, total)
        self.window = self.budget // RECENT_SHARE
        reserve = parse_bytes(self.auto.host_reserve, api, "host_reserve")
        self.reserve = _resolve_budget(reserve, self.auto.host_probe(_HOST)[1])


_HOST_LOW = Reason(Why.HOST_LOW)
_TO_DISK = Reason(Why.TO_DISK)
_HOST_TIGHT = Reason(Why.HOST_TIGHT)
_BUDGET_REACHED = Reason(Why.BUDGET_REACHED)


def _unused_rule(tensor: Tensor, memory: Memory) -> Policy:
    raise AssertionError("tensorstash: Auto decides itself; this is a bug in tensorstash")
