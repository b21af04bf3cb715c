"""A memory limit: the most real memory a step may hold, and the plan that keeps it.

# NOTE [ Memory limit ]
1. ``Auto(limit=...)`` is absolute, as the device counts it: on CUDA the
   bytes the caching allocator hands out (``max_memory_allocated``), on the
   CPU the process's resident set. Everything counts: parameters, gradients,
   optimizer state, activations, what backward recomputes, workspaces, and
   tensorstash's own buffers, pools, threads and profile. A share (0.9,
   "90%") is of the device's capacity: a CUDA device's total memory; on the
   CPU the cgroup's memory limit where one is set, else physical RAM.
2. Each step, at the model's first call, the limit less what the device holds
   then (the base) is the step's room: what the step may add. On the CPU the
   base is the resident set less the blocks the session pool keeps waiting
   (they serve the step's first allocations); on CUDA the allocated bytes.
   A base that moved since the last step (an optimizer's state made at its
   first ``step()``, the last batch's outputs still referenced) moves the
   room with it, before the step runs.
3. A plan's predicted real peak is its growth over the base (NOTE [ Plan ]
   rule 6: what the steps that took the real peak held besides their saved
   bytes, per kind of plan, plus the plan's held bytes at its peak). Plans
   are weighed for a few budgets of saved bytes: the first is the room less
   what the measured steps held besides their saved bytes, each next one the
   last less what its chosen plan was predicted over, and the budget of
   nothing where none fitted; each budget's chosen plan and every plan
   weighed for it (NOTE [ Plan ] rules 7, 10 and 11) are candidates. Of those
   whose predicted peak fits the room less a margin, the fastest runs. The
   margin is ``MARGIN_SHARE`` of the room (at least ``MARGIN_LEAST``), plus how
   far steps' peaks lay above their kind's median (:func:`spread`) or rule 6's
   widening, whichever is more. Both look past a single step: one step's
   one-time work (the first spill files, a writer thread's stack) lay 19 MiB
   over its kind's median on the tiny GPT, and counted once it widened the
   margin of a 5 MiB room for good. A plan of a kind no step measured must fit with
   ``UNTRIED_SHARE`` of the room to spare (its prediction borrows other kinds'
   measurements), and runs with hooks, taking its real peak, until
   ``PEAK_SAMPLES`` of its steps did (a quiet step takes none), unless its
   predicted peak is under ``LOOSE_SHARE`` of the room: a prediction off by
   half still fits, and the plan that keeps everything of a model far under
   its limit (the default limit's common case) runs quiet from its second
   step (the peaks' hooked steps, and the sampler thread beside them, cost a
   GPT-2 step 3-6%). The plan the
   last step ran stays where the fastest is faster by no more than a step's
   noise. The plan is kept while the measurements and the room (rounded down
   to a ``ROOM_STEP``) stay.
4. A step with no real peak measured yet (the profile's first) knows nothing
   of what the step holds besides its saved bytes, and runs under a budget
   that surely fits: ``FIRST_SHARE`` of the room, less the gradients its
   backward will make (the parameters that require one and have none), every
   tensor past it moved out from the first (rule 5 of ``Auto``; Auto's rule 3,
   which keeps a profile's first step whole to time it, does not apply under
   a limit). A session without a profile does the same every step: it has no
   measurement to plan from.
5. No silent overrun. A room of nothing (a limit under what the device holds
   already) raises :class:`MemoryLimitError` at the model's first call,
   before the step runs. A room that no plan fits (every module that may be
   recomputed recomputed and every site moved, still predicted over) is
   warned of once per limit, naming the limit, the least real peak a plan
   reaches and what reaches it; ``Auto`` then runs that least plan. The
   warning waits until ``PEAK_SAMPLES`` steps of that plan's own kind took
   their real peak: a prediction drawn from other kinds' steps, or from the
   first step of its kind (which opens the spill files and starts the
   writer), may be far off (on the tiny GPT, a plan moving every site to disk
   was predicted at 14 MiB, and held 3 MiB), and the plan runs either way.
6. Calibration: where two of the recent measured steps went past the room
   they were planned for, later plans' margin widens by the lesser of the two
   overruns, so that a plan predicted short is not made again (one overrun
   alone is rule 3's one-time work).
7. Under a limit, no plan recomputes before ``torch._dynamo`` is imported:
   PyTorch's non-reentrant checkpointing imports it at its first call, and
   what that import holds (about 80 MiB on the CPU) stays in the process
   for good, more than most plans that recompute save, and it would land in
   the step that first recomputes, past the room that step was planned for.
   Where it is imported already (a Hugging Face model imports it, as does
   ``torch.compile`` or the user's own checkpointing), plans recompute as
   they would without a limit; ``always_recompute`` waits for it too. A
   limit on a CUDA device does not count host memory: there plans recompute
   from the first.

The figures behind these choices: docs/figures/auto.md ("A memory limit").
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tensorstash.core.stats import human_bytes
from tensorstash.memory import _pool
from tensorstash.memory._memory import device_capacity, real_memory_now
from tensorstash.planning._records import plan_of

__all__ = [
    "FIRST_SHARE",
    "MARGIN_LEAST",
    "MARGIN_SHARE",
    "ROOM_STEP",
    "MemoryLimitError",
    "base_now",
    "first_budget",
    "held_besides",
    "gradient_bytes",
    "limit_bytes",
    "within",
]

MARGIN_SHARE = 0.04
"""Rule 3: the share of a step's room its plan leaves free, for a peak measured short."""
MARGIN_LEAST = 1 << 20
"""Rule 3: the least margin a plan leaves free."""
FIRST_SHARE = 0.5
"""Rule 4: the share of the room a step with nothing measured keeps in saved bytes."""
ROOM_STEP = 1 << 20
"""Rule 3: rooms that differ by less than this share a plan."""
SEARCHES = 4
"""Rule 3: how many budgets the search tries at most."""
UNTRIED_SHARE = 0.15
"""Rule 3: the share of the room a plan of a kind no step measured must leave to spare."""
LOOSE_SHARE = 0.5
"""Rule 3: a plan predicted to peak under this share of its room takes no peaks of its own."""


class MemoryLimitError(RuntimeError):
    """A memory limit no step can keep: the device already holds more (rule 5 of
    NOTE [ Memory limit ])."""


def limit_bytes(limit: int | float, device: torch.device) -> int:
    """The limit in bytes on ``device``: a share (a float) is of its capacity (rule 1)."""
    if isinstance(limit, float):
        return int(limit * device_capacity(device))
    return int(limit)


def base_now(device: torch.device) -> int:
    """What ``device`` holds now, as a limit counts it (rule 2)."""
    held = real_memory_now(device)
    if device.type != "cuda":
        pooled = _pool.counts()
        if pooled is not None:
            held -= pooled.cached_bytes
    return held


def gradient_bytes(root: nn.Module | None) -> int:
    """The bytes of the gradients a backward through ``root`` will make (rule 4)."""
    if root is None:
        return 0
    return sum(p.nbytes for p in root.parameters() if p.requires_grad and p.grad is None)


def first_budget(room: int, root: nn.Module | None) -> int:
    """Rule 4: the saved bytes a step with nothing measured may keep within ``room``."""
    return max(0, int(FIRST_SHARE * room) - gradient_bytes(root))


def rounded(limit: int) -> int:
    """``limit`` to two significant digits: limits that differ by less are one limit to
    warn of (a limit set from each step's base moves a little every step)."""
    digits = max(len(str(limit)) - 2, 0)
    return round(limit, -digits)


def margin(room: int, widened: int = 0) -> int:
    """Rule 3 (and 6): what a plan leaves free of ``room``."""
    return max(MARGIN_LEAST, int(MARGIN_SHARE * room)) + widened


def within(
    room: int,
    plans_for: Callable[[int], tuple[Any, list[Any]] | None],
    other: int,
    tried: Callable[[Any], bool] = lambda plan: True,
    *,
    running: Any = None,
    noise: float = 0.0,
) -> Any:
    """Rule 3: the fastest plan whose predicted real peak fits ``room``, its budget
    what it holds at least; None before a step was measured.

    Args:
        room: what the limit leaves the step, less the margin.
        plans_for: ``plans_for(budget)``: the plan chosen for a budget (NOTE [ Plan ])
            and every plan weighed for it, or None before a step was measured.
        other: what the measured steps held besides their saved bytes.
        tried: whether a step of the plan's kind took the real peak; a plan of a kind
            none did must fit with ``UNTRIED_SHARE`` of the room to spare.
        running: the kind of plan the last step ran (``plan_of`` its record), kept where
            a plan of it still fits and the fastest is faster by no more than ``noise``
            seconds (a plan does not flip for less).
    """

    def over(plan: Any) -> int:
        spare = 0 if tried(plan) else int(UNTRIED_SHARE * room)
        return _peak(plan) + spare - room

    budget = max(0, room - other)
    weighed: list[Any] = []
    budgets: set[int] = set()
    for _ in range(SEARCHES):
        if budget in budgets:
            break
        budgets.add(budget)
        made = plans_for(budget)
        if made is None:
            return None
        plan, seen = made
        weighed += [plan, *seen]
        if over(plan) <= 0 or budget == 0:
            break
        budget = max(0, budget - over(plan))
    if 0 not in budgets and not any(over(plan) <= 0 for plan in weighed):
        made = plans_for(0)
        if made is not None:
            weighed += [made[0], *made[1]]
    fitting = [plan for plan in weighed if over(plan) <= 0]
    if not fitting:
        chosen = min(weighed, key=_peak)
    else:
        chosen = min(fitting, key=lambda p: (p.predicted_step_s, -p.budget))
        if running is not None:
            same = [p for p in fitting if p.kind == running]
            if same:
                kept = min(same, key=lambda p: (p.predicted_step_s, -p.budget))
                if kept.predicted_step_s <= chosen.predicted_step_s + noise:
                    chosen = kept
    return dataclasses.replace(chosen, budget=max(chosen.budget, chosen.held_bytes))


def spread(profile: Any) -> int:
    """Rule 3: how far steps' real peaks lie above their kind's median: of the kinds of
    plan (what they recompute, where they move) whose steps took the peak, the most the
    second-highest step held besides its saved bytes over its kind's median."""
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for step in profile.peaks:
        if step.peak_bytes is not None:
            kind = plan_of(step)
            kinds.setdefault(kind, []).append(step.peak_bytes - step.held_bytes)
    kinds = {kind: held for kind, held in kinds.items() if held[1:]}
    above = (sorted(held)[-2] - int(statistics.median(held)) for held in kinds.values())
    return max([0, *above])


def _peak(plan: Any) -> int:
    peak = plan.predicted_peak_bytes
    return 0 if peak is None else int(peak)


def held_besides(profile: Any) -> int:
    """What the steps that took the real peak held at it besides their saved bytes
    (their median; NOTE [ Plan ] rule 6), 0 where none took it."""
    steps = [s for s in profile.peak_steps() if s.peak_bytes is not None]
    if not steps:
        return 0
    return int(statistics.median(s.peak_bytes - s.held_bytes for s in steps))


def refuse(limit: int, base: int, device: torch.device) -> None:
    """Rule 5: a limit under what the device holds already."""
    where = "the process's resident set" if device.type != "cuda" else f"{device} allocated"
    raise MemoryLimitError(
        f"tensorstash.Auto: limit {human_bytes(limit)} is under what the device holds before "
        f"the step runs ({where}: {human_bytes(base)}); no plan can keep a step under it. "
        f"Pass a limit above {human_bytes(base)} plus what a step must add (its gradients "
        "and the inputs of its largest module), or free memory before the step"
    )


def warn_unreachable(limit: int, base: int, plan: Any, margin: int) -> None:
    """Rule 5: no plan's predicted peak fits the room less ``margin`` (rule 3): the least,
    what reaches it, and the limit it needs."""
    least = plan.predicted_peak_bytes
    what = []
    if plan.recompute:
        what.append(f"recomputing {len(plan.recompute)} module(s)")
    if plan.tiers:
        what.append(f"moving {len(plan.tiers)} call site(s) off the device")
    reaches = " and ".join(what) or "keeping every site"
    warnings.warn(
        f"tensorstash.Auto: limit {human_bytes(limit)} cannot be held: the device holds "
        f"{human_bytes(base)} before the step, and the least real peak a plan reaches is "
        f"{human_bytes(base + least)} ({reaches}), with a margin of {human_bytes(margin)} for "
        f"its steps' spread. Pass limit >= {base + least + margin} bytes, allow "
        "more modules to be recomputed, or hold less before the step; until then Auto runs "
        "that plan. (Shown once per limit.)",
        RuntimeWarning,
        stacklevel=3,
    )
