"""The plan an Auto step follows (NOTE [ Plan ] in plan.py): made from what the profile
measured, Auto's parameters and the speeds of moving bytes probed now, once per budget
and setting (``Profile.plan_for``).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from tensorstash.core.stats import human_bytes
from tensorstash.memory import _pool
from tensorstash.planning import _limit, _rates
from tensorstash.planning._calibration import step_noise
from tensorstash.planning._records import plan_of
from tensorstash.planning.plan import Plan, Rates, make_plan
from tensorstash.tiers._spillwork import usable_cores
from tensorstash.tiers.recompute import matches

CPU_CONTENTION = 3.0
"""How much more a byte moved on a busy CPU costs the step than a probe of it took."""
NO_DISK = 1.0
"""The disk's bytes per second where its probe could not write a file."""


def plan_step(
    auto: Any, profile: Any, budget: int, device_type: str, root: nn.Module
) -> Plan | None:
    """The plan for a step of ``root`` within ``budget``; warns once per budget that
    cannot be held."""
    key, make = planner(auto, profile, device_type, root)
    plan = profile.plan_for(key, budget, lambda: make(budget))
    if plan is not None and not plan.fits and profile.warn_unreachable(budget):
        warnings.warn(
            f"tensorstash.Auto: device_budget {human_bytes(budget)} cannot be held: "
            f"with every module that is safe to recompute recomputed and every site "
            f"moved, a step holds {human_bytes(plan.reachable_bytes)}. Pass "
            f"device_budget >= {plan.reachable_bytes} (or allow more modules to be "
            "recomputed); until then Auto holds what it can. (Shown once per budget.)",
            RuntimeWarning,
            stacklevel=2,
        )
    return plan


def plan_within(
    auto: Any,
    profile: Any,
    room: int,
    device_type: str,
    root: nn.Module,
    *,
    cap: int | None = None,
) -> Plan | None:
    """The plan for a step of ``root`` whose predicted real peak fits ``room`` (NOTE
    [ Memory limit ] rule 3), its budget at most ``cap`` where given; made again only once
    the measurements or the room moved."""
    # NOTE [ Memory limit ] rule 7: no plan recomputes before torch._dynamo is imported,
    # whose import holds host memory (a limit on a CUDA device does not count it).
    recompute = auto.recompute and (device_type == "cuda" or "torch._dynamo" in sys.modules)
    key, make = planner(auto, profile, device_type, root, recompute=recompute)

    def weighed(budget: int) -> tuple[Plan, list[Plan]] | None:
        seen: list[Plan] = []
        chosen = make(budget if cap is None else min(cap, budget), seen)
        return None if chosen is None else (chosen, seen)

    steps = room // _limit.ROOM_STEP
    room = steps * _limit.ROOM_STEP  # rounded down: the plan serves the rooms it rounds from
    other = _limit.held_besides(profile)

    def tried(plan: Plan) -> bool:
        return not profile.needs_peak(plan.kind)

    def search() -> Plan | None:
        last = profile.history[-1] if profile.history else None
        running = None if last is None else plan_of(last)
        noise = step_noise(profile)
        return _limit.within(room, weighed, other, tried, running=running, noise=noise)

    return profile.plan_for(("limit", cap, *key), steps, search)


def planner(
    auto: Any, profile: Any, device_type: str, root: nn.Module, *, recompute: bool | None = None
) -> tuple[tuple[Any, ...], Callable[..., Plan | None]]:
    """The key of ``auto``'s options for plans of ``root``, and what makes one for a budget
    (``recompute``: whether its plans may recompute, where not ``auto``'s)."""
    device = "cuda" if device_type == "cuda" else "cpu"
    trims = trims_memory(device, auto.trim_every)
    if recompute is None:
        recompute = auto.recompute
    key = (device, recompute, auto.never_recompute, auto.always_recompute, trims)

    def make(budget: int, seen: list[Plan] | None = None) -> Plan | None:
        return make_plan(
            profile,
            budget,
            device=device,
            recompute=recompute,
            never=lambda path: matches(path, profile.module(path), auto.never_recompute),
            always=paths(profile, auto.always_recompute) if recompute else [],
            rates=rates(auto, profile, budget, device_type, root, recompute=recompute),
            trims=trims,  # as the step's watch does
            seen=seen,
        )

    return key, make


def rates(
    auto: Any,
    profile: Any,
    budget: int,
    device_type: str,
    root: nn.Module,
    *,
    recompute: bool | None = None,
) -> Rates:
    """The speeds of moving bytes, probed now (see _rates.py)."""
    device = next((p.device for p in root.parameters()), torch.device(device_type))
    may = auto.recompute if recompute is None else recompute
    region_s, saved_s = region_cost(auto, profile, budget, device) if may else (0.0, 0.0)
    if profile.clock is not time.perf_counter:
        # A test's ticks: the probes' seconds would not be the clock's, and what they read
        # would change the plan from one run to the next. The defaults stand.
        return Rates(region_s=region_s, saved_s=saved_s)
    if device_type == "cuda":
        return Rates(link=_rates.link_rate(device), region_s=region_s, saved_s=saved_s)
    # On the CPU the compressor, and the writer where it has a core of its own (NOTE
    # [ Spill files ] rule 3), run on threads that take the interpreter from the step
    # between their calls: a probe alone says too little. Until a step measured it (Plan
    # rule 6), a byte they move costs CPU_CONTENTION times what the probe took. Where
    # the step's cores are all torch's, the training thread spills as it packs, as the
    # probe does: a byte costs what the probe took.
    disk, lz4 = _rates.disk_rate(auto.directory), _rates.compress_rate()
    if disk <= 0:
        disk = NO_DISK  # the directory took no file: a spill there is never the cheaper saving
    elif usable_cores() > torch.get_num_threads():
        disk /= CPU_CONTENTION
    refault = _rates.refault_rate() or Rates.refault  # what the step pays: NOTE [ Plan ] 8
    return Rates(
        disk=disk,
        compress=lz4 / CPU_CONTENTION,
        refault=refault,
        region_s=region_s,
        saved_s=saved_s,
    )


def region_cost(auto: Any, profile: Any, budget: int, device: torch.device) -> tuple[float, float]:
    """What a recomputed region costs beyond its recompute (``_rates.region_cost``),
    probed only where a plan may recompute: a run that fits runs no checkpointing.
    Nothing where the profile's clock is not ``time.perf_counter`` (a test's ticks):
    the probe's seconds would not be the clock's."""
    activation = sum(record.nbytes for record in profile.last.values())
    if not auto.recompute or (activation <= budget and not auto.always_recompute):
        return 0.0, 0.0
    if profile.clock is not time.perf_counter:
        return 0.0, 0.0
    return _rates.region_cost(device)


def trims_memory(device: str, every: int | str | None) -> bool | Literal["auto"]:
    """Whether a planned CPU step that saves bytes hands memory back: with the session
    pool, or a size given, always; trimming the heap by default, "auto": where the
    plan frees enough (NOTE [ Returning memory ] in _trim.py, rule 6)."""
    if device != "cpu" or every is None:
        return False
    return "auto" if every == "auto" and _pool.compiled is None else True


def paths(profile: Any, names: tuple[str, ...]) -> list[str]:
    """The measured module paths ``names`` stand for (paths, or class names)."""
    found = []
    for path in profile.modules:
        if matches(path, profile.module(path), names):
            found.append(path)
    return found
