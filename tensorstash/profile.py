"""Profile: what a session learns per call site, carried from one step to the next.

# NOTE [ Profile ]
1. A call site is where a tensor is saved: the module path, the operation that
   produced the tensor, its shape and dtype, and which occurrence of those it
   is within the step (a module called twice has two sites).
2. A step runs from a session's enter to the next enter of a session with the
   same profile; the sites recorded in it (bytes, pack order, seconds backward
   spent unpacking each) become ``last`` when the next step starts.
3. From the second step a selector can plan with ``last``: backward needs the
   tensors saved last first, so offloading the earliest ones leaves the most
   time to bring them back; a site whose unpack stalled backward is kept.
   See ``Auto`` in auto.py.
4. Times come from an injected clock, so tests can make a site stall.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

STATE_VERSION = 1
"""The format of :meth:`Profile.state_dict`."""

_RECORD_FIELDS = ("order", "nbytes", "unpack_s", "offloaded")

Site = tuple[str, str | None, tuple[int, ...], str, int]
"""``(module, op, shape, dtype, occurrence)``: rule 1 of NOTE [ Profile ]."""


@dataclass(slots=True)
class SiteRecord:
    """One call site in one step.

    Attributes:
        order: its position among the step's eligible packs.
        nbytes: the tensor's size.
        unpack_s: seconds backward spent in its unpacks (waiting included).
        offloaded: whether its bytes left the device.
    """

    order: int
    nbytes: int
    unpack_s: float = 0.0
    offloaded: bool = False


@dataclass(eq=False)
class Profile:
    """Per-call-site measurements a session updates each step (NOTE [ Profile ]).

    Pass the same profile to the session of every step:
    ``stash("auto", profile=profile)``. ``Auto`` uses it from the second step
    on to keep what backward needs at once or what stalled it, and to offload
    the tensors saved earliest instead.

    Args:
        clock: seconds, monotonic; injected for tests.
        stall_s: an unpack taking longer than this stalled backward.

    Example:
        >>> profile = tensorstash.Profile()
        >>> for batch in loader:
        ...     with tensorstash.stash("auto", profile=profile):
        ...         loss = model(batch)
        ...     loss.backward()
    """

    clock: Callable[[], float] = time.perf_counter
    stall_s: float = 0.002
    steps: int = 0
    last: dict[Site, SiteRecord] = field(default_factory=dict)
    current: dict[Site, SiteRecord] = field(default_factory=dict)
    stalls: set[Site] = field(default_factory=set)
    codec_methods: dict[tuple[Any, ...], str] = field(default_factory=dict)
    _seen: Counter[tuple[Any, ...]] = field(default_factory=Counter)

    def start_step(self) -> None:
        """Rule 2: the sites recorded so far become ``last``.

        ``stalls`` keeps the sites whose unpack stalled backward the last time
        they were offloaded: a site kept since is still one that stalls.
        """
        if self.current:
            self.last, self.current = self.current, {}
            self.steps += 1
            for site, record in self.last.items():
                if record.offloaded and record.unpack_s > self.stall_s:
                    self.stalls.add(site)
                elif record.offloaded:
                    self.stalls.discard(site)
        self._seen.clear()

    # -- checkpoints -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What this profile learned, as lists, strings and numbers (for a checkpoint).

        The sites of the last finished step (``current`` when a step ran since
        the last :meth:`start_step`, else ``last``), ``steps`` counting it, and
        which sites stalled. :meth:`load_state_dict` restores it.
        """
        sites, steps = (self.current, self.steps + 1) if self.current else (self.last, self.steps)
        stalls = set(self.stalls)
        for site, record in sites.items():  # as start_step would count that step
            if record.offloaded:
                stalls.discard(site)
                if record.unpack_s > self.stall_s:
                    stalls.add(site)
        rows = [
            {
                "module": module,
                "op": op,
                "shape": list(shape),
                "dtype": dtype,
                "occurrence": occurrence,
                "stalled": (module, op, shape, dtype, occurrence) in stalls,
                **{name: getattr(record, name) for name in _RECORD_FIELDS},
            }
            for (module, op, shape, dtype, occurrence), record in sites.items()
        ]
        methods = [
            [op, str(dtype).removeprefix("torch."), list(shape), list(stride), method]
            for (op, dtype, shape, stride), method in self.codec_methods.items()
        ]
        return {"version": STATE_VERSION, "steps": steps, "sites": rows, "codec_methods": methods}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make ``state`` (from :meth:`state_dict`) this profile's last step.

        Raises:
            ValueError: the state is not one :meth:`state_dict` of this version wrote.
        """
        version = state.get("version") if isinstance(state, dict) else None
        if version != STATE_VERSION:
            raise ValueError(
                f"tensorstash.Profile: a saved state of version {version!r} cannot be loaded: "
                f"this tensorstash reads version {STATE_VERSION}. Start from a new Profile "
                "(it learns again from the next step)"
            )
        last: dict[Site, SiteRecord] = {}
        stalls: set[Site] = set()
        for row in state["sites"]:
            site = (row["module"], row["op"], tuple(row["shape"]), row["dtype"], row["occurrence"])
            last[site] = SiteRecord(**{name: row[name] for name in _RECORD_FIELDS})
            if row.get("stalled"):
                stalls.add(site)
        self.steps, self.last, self.current, self.stalls = int(state["steps"]), last, {}, stalls
        self.codec_methods = {
            (op, getattr(torch, dtype), tuple(shape), tuple(stride)): method
            for op, dtype, shape, stride, method in state.get("codec_methods", [])
        }

    def site(self, module: str, tensor: Tensor) -> Site:
        """The call site of a tensor being saved now (rule 1)."""
        grad_fn = tensor.grad_fn
        op = type(grad_fn).__name__ if grad_fn is not None else None
        key = (module, op, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        self._seen[key] += 1
        return (*key, self._seen[key])

    def record_pack(self, site: Site, nbytes: int) -> SiteRecord:
        record = SiteRecord(len(self.current), nbytes)
        self.current[site] = record
        return record

    def stalled(self, site: Site) -> bool:
        """Whether unpacking this site stalled backward the last time it was offloaded."""
        return site in self.stalls

    def plan(self, budget: int, recent: int = 0) -> dict[Site, tuple[bool, str]]:
        """From ``last``: which sites to keep and which to offload (rule 3).

        Kept, while the kept bytes fit in ``budget``: first the sites saved
        last, until they hold ``recent`` bytes (backward needs them at once;
        Auto keeps them in its recent window in a first step too); then the
        sites whose reload stalled; then the other sites from the end of the
        step backwards. Each group goes latest first. The rest, saved
        earliest, are offloaded.

        Returns:
            ``{site: (keep, why)}``: whether to keep the site, and why, in words.
        """
        plan: dict[Site, tuple[bool, str]] = {}
        kept = 0
        latest_first = sorted(self.last.items(), key=lambda item: -item[1].order)
        for site, record in latest_first:
            if kept >= recent or kept + record.nbytes > budget:
                break
            plan[site] = (True, "keep: backward needs it first (saved last)")
            kept += record.nbytes
        for site, record in latest_first:
            if site not in plan and self.stalled(site) and kept + record.nbytes <= budget:
                plan[site] = (True, "keep: its reload stalled backward last step")
                kept += record.nbytes
        for site, record in latest_first:
            if site in plan:
                continue
            if kept + record.nbytes <= budget:
                plan[site] = (True, "keep: backward needs it soon (saved late)")
                kept += record.nbytes
            else:
                plan[site] = (False, "offload: saved early, time to bring it back")
        return plan
