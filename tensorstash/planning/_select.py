"""Select and what a selector reads of memory: the probes, their cached readings, and
sizes given as bytes, strings or fractions (NOTE [ Selection ] in auto.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tensorstash.core._names import NAMES
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.core._sizes import parse_size, resolve_size
from tensorstash.core.policy import Context, Defer, Policy
from tensorstash.core.stats import Tier
from tensorstash.memory._memory import host_ram
from tensorstash.tiers._names import POLICIES, resolve

HOST = torch.device("cpu")

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
    would fall with whatever the process's earlier work left cached, and
    ``Auto`` would move bytes where nothing had to move. Both are read from
    one nested reading of the allocator's statistics: ``memory_reserved`` and
    ``memory_allocated`` each flatten and sort all of them, and a session
    opens every step (docs/figures/auto.md has the figures).
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
        available, _ = self._read("host", HOST, self.host_probe)
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
            return Defer(_placing(policy.policy), policy.window), given
        return _placing(policy), given

    def pack(self, value: Tensor, ctx: Context) -> Any:
        raise TypeError(
            "tensorstash.Select: a selector chooses a policy per tensor; pass it to "
            "tensorstash.stash(), not as a stage of a Chain"
        )

    def unpack(self, packed: Any, ctx: Context) -> Tensor:
        raise TypeError("tensorstash.Select: unpack is dispatched to the chosen policy")


def _placing(policy: Any) -> Policy:
    """The policy a rule returned, resolved; a selector (``Auto``, ``Select``) chooses per
    tensor itself, and cannot be what a rule chose."""
    if isinstance(policy, str) and policy in NAMES and policy not in POLICIES:
        policy = NAMES[policy]()  # "auto": a selector's name
    if getattr(type(policy), "choose", None) is not None:
        raise TypeError(
            f"tensorstash.Select: the rule returned {type(policy).__name__}(...), a selector, "
            "which chooses per tensor itself; a rule says where one tensor goes: return a "
            "policy (tensorstash.Keep(), CpuOffload(), Lz4(), DiskSpill(), a Chain of them, "
            "or Defer(policy, window)) or its name ('keep', 'cpu', 'lz4', 'disk'). To let "
            "Auto decide every tensor, pass tensorstash.Auto() to stash() in place of the Select"
        )
    return resolve(policy, POLICIES, api="Select")


_SHARED: dict[tuple[Any, ...], Select] = {}


def shared_probes(device: Probe, host: Probe, clock: Callable[[], float]) -> Select:
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


def _unused_rule(tensor: Tensor, memory: Memory) -> Policy:
    raise AssertionError("tensorstash: Auto decides itself; this is a bug in tensorstash")


# -- sizes ---------------------------------------------------------------------------------


def parse_bytes(value: int | float | str, api: str, name: str) -> int | float:
    """A size or a share, in the one grammar of NOTE [ Sizes ] (core/_sizes.py):
    ``"2GiB"`` -> 2147483648, ints pass through, ``0.5`` and ``"50%"`` are shares."""
    return parse_size(value, api, name)


def resolve_budget(budget: int | float, total: int) -> int:
    """Bytes of a size that ``parse_bytes`` gave: a share is of ``total``."""
    return resolve_size(budget, total)
