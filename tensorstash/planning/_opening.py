"""How an ``Auto`` step opens (NOTE [ Quiet-step machine ] in session/quiet.py): with the
session's hooks, quiet, or with a compiler's pair (NOTE [ Compiled code ] in compiler.py).

Only a session alone (no other hooks, no ``record`` or ``verify``, grad enabled) with
a profile opens otherwise than hooked:

1. Where the profile's steps ran compiled code, the step is planned whole by
   the compiler's search (rule 6 of NOTE [ Compiled code ]): it opens quiet,
   with the pair of the setting the search gives it, or with nothing pushed
   where what the compiled graphs keep fits.
2. Else, where the last step went quiet and this one measures nothing, it
   opens quiet and waits for the model's call (rule 9 of NOTE [ Profile ]).
3. Else, while the profile does not know yet whether its steps run compiled
   code, it opens hooked under the default partitioner's pair, which hands
   eager code's tensors to the session's hooks and tells, at the step's end,
   whether compiled graphs ran (rule 5 of NOTE [ Compiled code ]).
4. On a torch without AOTAutograd's inlined hooks (NOTE [ Support range ] in
   core/_support.py) rules 1 and 3 step aside: the step opens as an eager
   one, its hooks around the compiled graphs; once something was compiled, a
   warning says so (once), and the plan's table says so.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tensorstash.core import _support
from tensorstash.core.policy import Context
from tensorstash.planning import _limit, compiler
from tensorstash.session.quiet import HOOKED, Opening, State
from tensorstash.tiers.disk import DiskSpill

OPENED_QUIET = Opening(State.OPENED_QUIET)


class CompiledPair:
    """A compiler's pair for one step (the :class:`~tensorstash.session.quiet.Pair` the
    session pushes in its place), and what the step told the profile."""

    def __init__(
        self,
        step: compiler.CompiledStep,
        profile: Any,
        *,
        whole: bool,
        stow: tuple[Any, Context] | None = None,
    ) -> None:
        self.step = step
        self.profile = profile
        self.whole = whole  # the step is planned whole (rule 1), not detecting (rule 3)
        self.stow = stow  # the tier and context the compiled forwards stow with (rule 12)
        self.pack = step.pair.pack
        self.unpack = step.pair.unpack
        self.plan: compiler.CompilerPlan | None = None

    def hand(self, pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
        compiler.handing(pack, unpack, self.stow)

    def closed(self) -> None:
        compiler.handed()
        search = self.step.exited()
        known = compiler.known(self.profile)
        if search is None and not self.whole:
            known.compiled = False
        elif search is not None:
            known.compiled = True
            self.plan = search.plan()


class CompiledStepPlanning:
    """The planning of a step of compiled code planned whole (rule 1): nothing to
    choose for eager tensors, which stay where they are."""

    choose = None

    def __init__(self, opening: Opening, search: compiler.CompiledSearch) -> None:
        self.opening = opening
        self.search = search

    @property
    def plan(self) -> compiler.CompilerPlan:
        return self.search.plan()

    def woke(self) -> None:
        return None

    def end(self) -> None:
        return None


def compiled_planning(auto: Any, ctx: Context, min_bytes: int) -> CompiledStepPlanning | None:
    """Rule 1: the planning of a step of compiled code, or None where the profile's steps
    did not run compiled code (or it is not known yet)."""
    profile = ctx.profile
    if not _planned_whole(profile):
        return None
    if not compiler.known(profile).compiled:
        return None
    device = compiler.known(profile).device or torch.device("cpu")
    search = _search(auto, ctx, profile, device)
    setting = search.setting_for_step()
    if setting is None:
        return CompiledStepPlanning(Opening(State.QUIET), search)
    # Rule 5: a settled plan's steps are timed, and take no real peak.
    step = compiler.CompiledStep(
        search,
        setting,
        min_bytes,
        device,
        known=True,
        peak=not search.settled,
        moving=search.moving,
        model_device=functools.partial(_model_device, profile),
    )
    stow = (_disk(auto.directory), ctx) if search.moving else None
    pair = CompiledPair(step, profile, whole=True, stow=stow)
    return CompiledStepPlanning(Opening(State.QUIET, pair), search)


def _search(auto: Any, ctx: Context, profile: Any, device: torch.device) -> Any:
    """The profile's search for ``auto``: for its budget of kept bytes, or under its
    memory limit (rule 13 of NOTE [ Compiled code ]): the budget the room leaves now."""
    limit = auto._parsed[2]
    if limit is None:
        return compiler.search_for(profile, auto.device_budget, auto.budget_bytes(ctx, device))
    limit_bytes = _limit.limit_bytes(limit, device)
    base = _limit.base_now(device)
    room = limit_bytes - base
    if room <= 0:
        _limit.refuse(limit_bytes, base, device)
    search = compiler.search_for(profile, ("limit", limit), 0, limited=True)
    cap = None
    if auto._parsed[0] is not None:  # a device_budget beside the limit holds too
        choice = auto.state(ctx).choice
        choice.budget_on(device)
        cap = choice.user_budget
    search.under_limit(limit_bytes, base, cap)
    return search


@functools.cache
def _disk(directory: str | None) -> DiskSpill:
    """The disk tier compiled forwards stow to (rule 12 of NOTE [ Compiled code ]): written
    by the training thread as the tensor is stowed, since the compiled graph may write
    over the tensor's buffer once its last use is past."""
    return DiskSpill(directory, background=False)


def detecting(auto: Any, ctx: Context, min_bytes: int, quiet: bool) -> Opening:
    """Rules 2 and 3: how a step that is not planned whole opens."""
    profile = ctx.profile
    if quiet:
        return OPENED_QUIET
    if not _planned_whole(profile) or compiler.known(profile).compiled is not None:
        return HOOKED
    compiler.prepare()  # before the profile's step begins: one-time work

    def search(device: torch.device) -> compiler.CompiledSearch:
        compiler.known(profile).device = device
        return _search(auto, ctx, profile, device)

    model_device = functools.partial(_model_device, profile)
    step = compiler.CompiledStep(search, 1.0, min_bytes, None, model_device=model_device)
    return Opening(State.HOOKED, CompiledPair(step, profile, whole=False))


def _planned_whole(profile: Any) -> bool:
    """Rules 1, 3 and 4: whether a step of ``profile`` may be planned through the compiler."""
    if profile is None or not compiler.dynamo_live():
        return False
    missing = _support.missing(_support.COMPILED)
    if missing is None:
        return True
    if not _warned and compiler.compiled_some():
        _warned.append(missing)
        warnings.warn(
            f"tensorstash.Auto: {missing}; steps that run compiled code are planned as eager "
            f"code, the session's hooks around the compiled graphs. pip install "
            f"'torch>={_support.COMPILED_FLOOR}' to plan them through the compiler",
            RuntimeWarning,
            stacklevel=5,
        )
    return False


_warned: list[str] = []


def _model_device(profile: Any) -> torch.device | None:
    """Rule 13 of NOTE [ Compiled code ]: where the profile's model has its parameters."""
    root = profile.root
    parameter = next(root.parameters(), None) if root is not None else None
    return None if parameter is None else parameter.device
