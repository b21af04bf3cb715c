"""Auto's choice for each tensor a session saves: the session's limits (budget, recent
window, host reserve), the tiers made on first use, the rules of :class:`~tensorstash.Auto`
in order, and the keeps posted for the C pack (rule 5 of NOTE [ Fast path ] in
core/_fastpath.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tensorstash.core import _reasons
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.core.policy import Chain, Context, Defer, Keep, Policy
from tensorstash.planning import _limit
from tensorstash.planning._select import HOST, Select, resolve_budget
from tensorstash.planning.plan import Plan
from tensorstash.tiers.compress import Lz4
from tensorstash.tiers.cpu import CpuOffload
from tensorstash.tiers.disk import DiskSpill

RECENT_SHARE = 4
"""Auto keeps the tensors saved last in the last 1/RECENT_SHARE of its budget (rule 5)."""

POSTED_KEEPS = 64
"""How many tensors the C pack keeps under Auto's posted limit before asking it again."""

Choice = tuple[Policy | Defer, Reason]
"""A policy (or a deferral) and why."""


class Chooser:
    """Where each tensor of a session goes under an :class:`~tensorstash.Auto`, and why.

    The limits are fixed when first needed (the model's first call, or the
    first tensor saved); the plan, when the step has one, is the step
    planning's (``follow``).
    """

    def __init__(self, auto: Any, ctx: Context) -> None:
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
        # Fixed for a step; never under a memory limit (NOTE [ Memory limit ] rule 4).
        self.learning_now = profile is not None and profile.learning and auto._parsed[2] is None
        self.headroom = 0
        self.headroom_until = float("-inf")
        self.plan: Plan | None = None
        self.device_type = "cpu"
        self.limit: int | None = None  # in bytes, once resolved (NOTE [ Memory limit ])
        self.user_budget: int | None = None  # device_budget in bytes, once resolved
        # Told the device of each tensor moved out: a session under a limit without a
        # profile returns what it moves from its first (NOTE [ Memory limit ] rule 4).
        self.moves_out: Callable[[torch.device], None] | None = None

    def new_step(self, learning: bool) -> None:
        """A step begins: whether it is a profile's first, and nothing posted carries over."""
        self.learning_now = learning
        self.hot.unpost()

    def follow(self, plan: Plan | None) -> None:
        """The step's plan decides from here (what was posted no longer holds), and the
        tiers that copy to the host take their room for copies in flight from it."""
        self.plan = plan
        self.hot.unpost()
        self._remake_tiers()

    def _remake_tiers(self) -> None:
        """The tiers made so far are made again at first use, with the room of the plan
        in force (``inflight_room``, ``pending_room``): a session may run several steps,
        and a tier made in a step without a plan would wait for every copy after it."""
        for tier in ("offload", "compress", "spill"):
            self.__dict__.pop(tier, None)

    def budget_on(self, device: torch.device) -> int:
        """The session's device budget in bytes, the limits resolved on ``device`` if not yet."""
        if self.budget < 0:
            self.resolve_limits(device)
        return self.budget

    def resolve_limits(self, device: torch.device, room: int | None = None) -> None:
        """The session's limits on ``device``: its budget of saved bytes (under a memory
        limit, what the limit leaves the step, ``room`` where the step read it), and the
        host reserve."""
        self.device_type = device.type
        parsed, reserve, limit = self.auto._parsed
        budget = None
        if parsed is not None:
            total = self.select._read("device", device, self.auto.device_probe)[1]
            budget = self.user_budget = resolve_budget(parsed, total)
        if limit is not None:
            self.limit = _limit.limit_bytes(limit, device)
            if room is None:  # no profile: NOTE [ Memory limit ] rule 4, every step
                base = _limit.base_now(device)
                room = self.limit - base
                if room <= 0:
                    _limit.refuse(self.limit, base, device)
            first = _limit.first_budget(room, None)
            budget = first if budget is None else min(budget, first)
        elif budget is None:
            budget = self.select._read("device", device, self.auto.device_probe)[0] // 2
        self.set_budget(budget)
        host_total = self.select._read("host", HOST, self.auto.host_probe)[1]
        self.reserve = resolve_budget(reserve, host_total)
        self._remake_tiers()  # their room follows the budget

    def set_budget(self, budget: int) -> None:
        """The saved bytes this session may hold on the device from now (rules 4 and 5)."""
        self.budget = max(0, budget)
        self.window = self.budget // RECENT_SHARE
        self.keep_below = self.budget - self.window

    # The tiers, made when first chosen: a step that keeps everything makes none
    # (a DiskSpill checks its directory when made); made again when the plan or the
    # budget changes, which their room depends on.

    @functools.cached_property
    def offload(self) -> Policy:
        return CpuOffload(max_inflight_bytes=self.inflight_room())

    @functools.cached_property
    def compress(self) -> Policy:
        return Chain(CpuOffload(max_inflight_bytes=self.inflight_room()), Lz4())

    @functools.cached_property
    def spill(self) -> Policy:
        # Written as they are: lz4 before the disk cost the step more than it saved where
        # the page cache takes the writes, and held more meanwhile (docs/figures/auto.md).
        # A CPU tensor goes to disk; a device tensor's copy is held as the offload's is.
        return Chain(
            CpuOffload(max_inflight_bytes=self.inflight_room()),
            DiskSpill(self.auto.directory, max_pending_bytes=self.pending_room()),
        )

    def inflight_room(self) -> int:
        """The device bytes whose copy to the host may still run (the held bytes of
        ``Auto``'s docstring): the budget less what this step's plan holds when forward
        ends; none without a plan that fits, whose kept bytes reach the budget."""
        plan = self.plan
        if plan is None or not plan.fits:
            return 0
        return max(0, self.budget - plan.held_bytes)

    def pending_room(self) -> int:
        """The bytes that may wait for the disk writer (DiskSpill's ``max_pending_bytes``).

        They are in host RAM: on the CPU, the device, where they count toward the
        budget as a copy's bytes do on CUDA, so they may hold what the plan leaves of
        it, or without a plan that fits the recent window (rules 4 and 5 count them
        and keep the rest under the budget less the window). On CUDA they count
        toward host RAM, which ``host_reserve`` guards: DiskSpill's default."""
        if self.device_type != "cpu":
            return DiskSpill.max_pending_bytes
        plan = self.plan
        return self.inflight_room() if plan is not None and plan.fits else self.window

    # The rules -----------------------------------------------------------------

    def choose(self, tensor: Tensor, ctx: Any = None, site: Any = None) -> Choice:
        """The rules of :class:`~tensorstash.Auto`, in order.

        The session calls this for every eligible tensor, so the common case is
        answered first: with no plan (rule 1 cannot apply), outside a profile's
        first step on the CPU (nor can rule 3), under the budget less the window
        and with host RAM far from its reserve (nor can rule 2), rule 4 keeps it.
        """
        if self.budget < 0:
            self.resolve_limits(tensor.device)
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
            hot.post(limit, on_host, POSTED_KEEPS)
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
        """Rule 3: a CPU tensor in a profile's first step stays (see Auto's docstring)."""
        if self.learning_now and tensor.is_cpu:
            return self.keep, _LEARNING
        return None

    def under_budget(self, held: int) -> Choice | None:
        """Rule 4: the held bytes stay within the budget less the recent window."""
        if held <= self.budget - self.window:
            return self.keep, _reasons.UNDER_BUDGET
        return None

    def outwards(self, tensor: Tensor, nbytes: int) -> Choice:
        """Rule 5: out of the device, through the recent window."""
        if self.moves_out is not None:
            self.moves_out(tensor.device)  # a step that moves nothing starts no watch
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
        return self.select._read("host", HOST, self.auto.host_probe)[0]

    def _headroom(self) -> int:
        """Host RAM available over the reserve, read again every ``refresh_s``."""
        now = self.auto.clock()
        if now > self.headroom_until:
            self.headroom = self._host_available() - self.reserve
            self.headroom_until = now + self.select.refresh_s
        return self.headroom


_HOST_LOW = Reason(Why.HOST_LOW)
_LEARNING = Reason(Why.LEARNING)
_TO_DISK = Reason(Why.TO_DISK)
_HOST_TIGHT = Reason(Why.HOST_TIGHT)
_BUDGET_REACHED = Reason(Why.BUDGET_REACHED)
_PLANNED_KEEP = reason(Why.PLANNED, "plan: keep")
_OVER_PLAN = reason(Why.OVER_PLAN, "plan: keep")
_PLANNED = {tier: reason(Why.PLANNED, f"plan: {tier}") for tier in ("host", "compressed", "disk")}
