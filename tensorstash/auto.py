"""Select and Auto: a policy chosen per tensor from its size and the memory left.

# NOTE [ Selection ]
1. A selector has ``choose(tensor, ctx) -> Policy``; the session calls it for
   each eligible tensor and keeps the chosen policy beside the packed value,
   so unpack dispatches on what pack chose (no registry, no ids).
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
        return Memory(free, total, available, held)

    def _read(self, kind: str, device: torch.device, probe: Probe) -> tuple[int, int]:
        now = self.clock()
        key = (kind, device)
        found = self._cache.get(key)
        if found is None or now - found[0] > self.refresh_s:
            found = self._cache[key] = (now, probe(device))
        return found[1]

    def choose(self, tensor: Tensor, ctx: Context) -> tuple[Policy | Defer, str | None]:
        """The rule's policy for ``tensor``, and its reason when the rule gives one."""
        from tensorstash.stash import resolve

        choice = self.rule(tensor, self.memory(tensor, ctx))
        policy, reason = choice if isinstance(choice, tuple) else (choice, None)
        if isinstance(policy, Defer):
            return Defer(resolve(policy.policy), policy.window), reason
        return resolve(policy), reason

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

    Rules, in order, for each eligible tensor:

    0. From the second step of a session given a :class:`~tensorstash.Profile`:
       follow the plan made from the last step (see NOTE [ Profile ]): keep
       sites whose reload stalled backward, then the sites saved last, while
       they fit in the budget; offload those saved earliest.
    1. While the tensors this session keeps on their device stay within
       three quarters of ``device_budget``: keep it ("under device budget"),
       unless rule 2 holds for a CPU tensor, whose device is that host RAM.
    2. Host RAM available, less this tensor, would fall under ``host_reserve``:
       compress and spill it to disk ("host memory low").
    3. Otherwise: move it to host RAM ("device budget reached"), as it is: the
       link to the host moves bytes an order of magnitude faster than lz4
       compresses them. Under twice ``host_reserve`` compressed (lz4 decides per
       tensor from a sample whether compression pays; "host memory tight"). A
       CPU tensor's device is host RAM, so it is compressed and spilled to disk.
    4. Rules 2 and 3 move a tensor only once the tensors saved after it
       reach the last quarter of the budget: until then it waits, kept, in a
       window (NOTE [ Recent window ] in stash.py). So the tensors saved last
       before backward (the output head, the loss), which backward needs
       first, stay on the device, and kept bytes stay within the budget plus
       one tensor. With a plan (rule 0) the plan decides instead.

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
        state: _AutoState = ctx.resource(("auto", id(self)), lambda: _AutoState(self))
        return state

    def choose(self, tensor: Tensor, ctx: Context) -> tuple[Policy | Defer, str]:
        state = self.state(ctx)
        return state.decide(tensor, state.select.memory(tensor, ctx), ctx)

    def pack(self, value: Tensor, ctx: Context) -> Any:
        return Select.pack(self, value, ctx)  # type: ignore[arg-type]

    def unpack(self, packed: Any, ctx: Context) -> Tensor:
        return Select.unpack(self, packed, ctx)  # type: ignore[arg-type]


RECENT_SHARE = 4
"""Auto keeps the tensors saved last in the last 1/RECENT_SHARE of its budget (rule 4)."""


class _AutoState:
    """Per-session state of an :class:`Auto`: its resolved limits and this step's plan."""

    def __init__(self, auto: Auto) -> None:
        self.auto = auto
        self.select = Select(_unused_rule, auto.device_probe, auto.host_probe, clock=auto.clock)
        self.keep = Keep()
        self.offload = CpuOffload()
        self.compress = Chain(CpuOffload(), Lz4())
        self.spill = Chain(CpuOffload(), Lz4(), DiskSpill(auto.directory))  # CPU: kept, Lz4, disk
        self.budget: int | None = None
        self.reserve = 0
        self.plan: dict[Any, str] | None = None

    def _limits(self, memory: Memory) -> int:
        if self.budget is None:
            api = "tensorstash.Auto"
            budget = self.auto.device_budget
            parsed = None if budget is None else parse_bytes(budget, api, "device_budget")
            self.budget = (
                memory.device_free // 2
                if parsed is None
                else _resolve_budget(parsed, memory.device_total)
            )
            reserve = parse_bytes(self.auto.host_reserve, api, "host_reserve")
            host_total = self.auto.host_probe(torch.device("cpu"))[1]
            self.reserve = _resolve_budget(reserve, host_total)
        return self.budget

    def decide(self, tensor: Tensor, memory: Memory, ctx: Context) -> tuple[Policy | Defer, str]:
        """The rules of :class:`Auto`, the plan of its profile first (from step two)."""
        budget = self._limits(memory)
        nbytes = tensor.numel() * tensor.element_size()
        held = memory.held["kept"] + nbytes
        if memory.host_available - nbytes < self.reserve:
            outwards: tuple[Policy, str] = (self.spill, "host memory low")
        elif tensor.device.type == "cpu":
            outwards = (self.spill, "device budget reached; the device is host RAM: to disk")
        elif memory.host_available - nbytes < 2 * self.reserve:
            outwards = (self.compress, "device budget reached; host memory tight: compressed")
        else:
            outwards = (self.offload, "device budget reached")
        profile = ctx.profile
        if profile is not None and profile.steps and ctx.site is not None:
            if self.plan is None:
                self.plan = profile.plan(budget, recent=budget // RECENT_SHARE)
            planned = self.plan.get(ctx.site)
            if planned is not None:
                if planned.startswith("keep") and held <= budget:
                    return self.keep, planned
                policy, why = outwards
                return policy, f"{planned}; {why}" if why == "host memory low" else planned
        window = budget // RECENT_SHARE
        host_low = outwards[1] == "host memory low"
        if host_low and tensor.device.type == "cpu":
            return outwards  # rule 2 first: a CPU tensor's device is the host RAM that is low
        if held <= budget - window:
            return self.keep, "under device budget"
        policy, why = outwards
        return (Defer(policy, window) if window else policy), why


def _unused_rule(tensor: Tensor, memory: Memory) -> Policy:
    raise AssertionError("tensorstash: Auto decides itself; this is a bug in tensorstash")
