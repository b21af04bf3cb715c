"""From measured steps to what the solver weighs (NOTE [ Plan ] rules 6 to 9).

A :class:`~tensorstash.planning.profile.Profile` records steps; the solver
needs prices. :class:`Calibration` turns the one into the other for one
plan: the sites and modules of the last step (the forward times of twin
modules pooled), the time of a plain step, what the hooks cost, what a
second of forward costs when recomputed, what a byte moved to a tier costs,
and what a plan's steps fault in and spend handing memory back. Every figure
is a median over steps, so one noisy step does not swing it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable
from typing import Any

from tensorstash.planning._rates import Rates
from tensorstash.planning.profile import (
    ALREADY_RECOMPUTED,
    ModuleRecord,
    Profile,
    Site,
    SiteRecord,
    StepRecord,
)

CALIBRATION_SPREAD = 4.0
"""A measured cost per byte moved counts down to 1/CALIBRATION_SPREAD of the assumed one."""
HOOK_S = 70e-6
"""What the hooks cost a step per call site, until steps with and without them were
timed (rule 7)."""

HeldAtPeak = Callable[[tuple[str, ...], int], int]
"""``held_at_peak(recomputed, held)``: the held bytes at a plan's peak (rule 6)."""


class Calibration:
    """What the steps of ``profile`` say a plan's parts cost on ``device`` (rules 6 to 9).

    Built with the solver's defaults (nothing measured: a recompute costs its
    forward time, copies cost the link's time); :meth:`calibrate` reads the
    steps. ``rates`` are the probed speeds, which :meth:`calibrate` replaces
    by what the steps that moved bytes measured.
    """

    def __init__(self, profile: Profile, device: str, rates: Rates) -> None:
        self.profile = profile
        self.device = device
        self.rates = rates
        self.sites: dict[Site, SiteRecord] = dict(profile.last)
        self._inside = index(profile.modules, self.sites)
        self.modules: dict[str, ModuleRecord] = pooled(profile.modules, self._inside, self.sites)
        self.activation = sum(record.nbytes for record in self.sites.values())
        self.base_s = 0.0
        self.hooks_s = 0.0
        self.recompute_factor = 1.0
        self.copy_s_per_byte: float | None = None  # what a copy cost the steps (rule 9)
        self.checkpointed_s = 0.0  # the user's own recompute (rule 6)
        self._region_tensors: dict[str, int] = {}  # tensors a region saves (region_s)

    def inside(self, path: str) -> list[Site]:
        """The sites saved inside module ``path`` (itself and the modules in it)."""
        return self._inside.get(path, [])

    def inside_bytes(self, path: str) -> int:
        return sum(self.sites[site].nbytes for site in self.inside(path))

    # From the steps ---------------------------------------------------------------------

    def calibrate(self) -> None:
        """Rule 6: the step time with nothing moved, and what moving a byte cost, from the steps.

        The base is the median over the measured steps that moved nothing
        (warm ones, once there are) of their time less what they recomputed
        and the pages they faulted in (rule 8); before such a step, of the quiet
        steps plus the hooks, or of the last steps (on the CPU less the time
        spent in policies as well: rule 9). A step that moved bytes to one tier
        gives that tier's cost per byte: its time over the base, less its
        recompute and faults, per byte moved (on the CPU, the host tier is
        lz4's; on CUDA it is what a copy cost, ``copy_s_per_byte``, once the
        base was measured: rule 9), the median over such steps weighted by
        their bytes. Steps whose backward timed its recompute, quiet ones
        too (a plan that only recomputes runs quiet once measured), give what
        a second of forward costs when recomputed (``recompute_factor``). The
        steps are the history and, of those that left it, the last of each
        kind of move it lacks (rule 9).
        """
        history = self.profile.calibration_steps()  # rule 9
        steps = [s for s in history if not s.cold] or history  # warm ones: NOTE [ Profile ] 6
        timed = [
            (s.recompute_s, self.forward_of(s.recomputed))
            for s in (*steps, *self.profile.quiet_history)
            if s.recompute_s is not None and self.forward_of(s.recomputed) > 0
        ]
        if timed:
            factor = statistics.median(taken / forward for taken, forward in timed)
            self.recompute_factor = min(max(factor, 1 / CALIBRATION_SPREAD), CALIBRATION_SPREAD)
        clean = [s.seconds - self.cost_of(s) for s in steps if not s.moved] or [
            s.seconds - self.cost_of(s) for s in history if not s.moved
        ]
        quiet = [s.seconds - self.cost_of(s) for s in self.profile.quiet_history]
        if clean:
            self.base_s = statistics.median(clean)
        elif quiet:  # no hooked step moved nothing: the quiet steps' base and the hooks
            self.base_s = statistics.median(quiet)
            self.base_s += min(HOOK_S * len(self.sites), self.base_s / 2)
        else:  # on CUDA the policies' seconds overlap the kernels (rule 9)
            hidden = self.device == "cuda"
            self.base_s = statistics.median(
                s.seconds - (0.0 if hidden else s.policy_s) - self.cost_of(s) for s in steps[-3:]
            )
        if quiet and clean:
            self.hooks_s = max(self.base_s - statistics.median(quiet), 0.0)
        else:
            self.hooks_s = min(HOOK_S * len(self.sites), self.base_s / 2)
        self._calibrate_moves(steps, measured_base=bool(clean or quiet))
        # What the modules the user checkpoints cost every step (rule 6): out of the base.
        self.checkpointed_s = max(min(self._checkpointed(steps), self.base_s / 2), 0.0)
        self.base_s -= self.checkpointed_s

    def _calibrate_moves(self, steps: list[StepRecord], *, measured_base: bool) -> None:
        """Rule 9: what a byte moved to each tier cost the steps that moved bytes to it
        alone, the median weighted by their bytes."""
        per_byte: dict[str, list[tuple[float, int]]] = {}
        for s in self._moving_steps(steps):
            if len(s.moved) != 1 or s.first_move:
                continue  # rule 9: it made what moving uses (pinned buffers, a spill file)
            ((tier, nbytes),) = s.moved.items()
            extra = s.seconds - self.base_s - self.cost_of(s)
            per_byte.setdefault(tier, []).append((max(extra, 0.0) / nbytes, nbytes))
        changes: dict[str, float] = {}
        # A step's time cannot show a byte moved for much less than a probe took:
        # below that, what it shows is noise (rule 6).
        if "disk" in per_byte:
            floor = 1 / (CALIBRATION_SPREAD * self.rates.disk)
            changes["disk"] = 1 / max(weighted_median(per_byte["disk"]), floor)
        if "host" in per_byte and self.device != "cuda":
            floor = 1 / (CALIBRATION_SPREAD * self.rates.compress)
            changes["compress"] = 1 / max(weighted_median(per_byte["host"]), floor)
        if "host" in per_byte and self.device == "cuda" and measured_base:
            # What copies cost the steps, hidden or not; no floor: the link may hide them.
            self.copy_s_per_byte = weighted_median(per_byte["host"])
        if changes:
            self.rates = dataclasses.replace(self.rates, **changes)

    def _checkpointed(self, steps: list[StepRecord]) -> float:
        """Rule 6: what backward spends recomputing the modules the user checkpoints: as
        timed in ``steps`` and the quiet ones, or their forward time at the recompute
        factor (Hugging Face's checkpointing calls the module itself: its recompute is
        not timed)."""
        timed = [
            s.checkpointed_s
            for s in (*steps, *self.profile.quiet_history)
            if s.checkpointed_s is not None
        ]
        if timed:
            return statistics.median(timed)
        checkpointed = [p for p, r in self.modules.items() if r.unsafe == ALREADY_RECOMPUTED]
        return self.forward_of(tuple(checkpointed)) * self.recompute_factor

    def _moving_steps(self, steps: list[StepRecord]) -> list[StepRecord]:
        """The warm steps that say what moving a byte costs (rule 9): ``steps``, and every
        step kept aside that moved bytes, also of a kind the history has (a plan that
        moves a few bytes says little of what moving many costs)."""
        present = {id(record) for record in steps}
        aside = [
            record
            for kind, kept in self.profile.aside.items()
            if kind
            for record in kept
            if not record.cold and id(record) not in present
        ]
        return [*aside, *steps]

    # What a plan's parts cost -----------------------------------------------------------

    def forward_of(self, recomputed: tuple[str, ...]) -> float:
        """Forward seconds of the modules a step recomputed (none inside another)."""
        return sum(self.modules[p].forward_s for p in outermost(recomputed) if p in self.modules)

    def recompute_cost(self, path: str) -> float:
        """Rule 3: ``path``'s forward time at the recompute factor, and its region's own
        cost (checkpointing's Python for the region and each tensor it saves)."""
        return self.modules[path].forward_s * self.recompute_factor + self.region_s(path)

    def region_s(self, path: str) -> float:
        """What recomputing ``path`` costs a step beyond its recompute (rule 3): per
        region, and per tensor it saves (its sites, and its parameters where the module
        is known: the weights its layers save, a count short of the tensors under
        ``min_bytes`` and long of the biases no layer saves)."""
        rates = self.rates
        if not (rates.region_s or rates.saved_s):
            return 0.0
        found = self._region_tensors.get(path)
        if found is None:
            module = self.profile.module(path)
            params = 0 if module is None else sum(1 for _ in module.parameters())
            found = self._region_tensors[path] = len(self.inside(path)) + params
        return rates.region_s + rates.saved_s * found

    def cost_of(self, step: StepRecord) -> float:
        """What ``step`` spent past a plain step's work and moving bytes: its recompute,
        as timed in its backward or as the model says, the pages it faulted in, and its
        calls that handed memory back (rule 8)."""
        faults = self.faults_s(step.faulted_bytes) + step.trim_s
        outer = outermost(step.recomputed)
        regions = sum(self.region_s(p) for p in outer if p in self.modules)
        if step.recompute_s is not None:
            return step.recompute_s + regions + faults
        return self.forward_of(step.recomputed) * self.recompute_factor + regions + faults

    def faults_s(self, faulted: int) -> float:
        if self.device == "cuda" or self.rates.refault <= 0:
            return 0.0  # rule 8: host pages; a CUDA step's kernels run while they fault
        return faulted / self.rates.refault

    def faulted(
        self,
        recompute: tuple[str, ...],
        moves: bool,
        held: int,
        step: StepRecord,
        returns: bool,
        held_at_peak: HeldAtPeak,
    ) -> int:
        """Rule 8: the pages a step of this plan faults in: as the steps that ran it did
        (this recompute, and moving or not), or as ``step`` (the measured medians) did,
        less the bytes it held and plus the plan's (``returns``: its steps hand memory back)."""
        profile = self.profile
        steps = ran(recompute, moves, (*profile.history, *profile.quiet_history))
        if steps:
            return int(statistics.median(s.faulted_bytes for s in steps))
        estimate = step.faulted_bytes + held_at_peak(recompute, held)
        estimate -= held_at_peak(step.recomputed, step.held_bytes)
        if returns:
            estimate = max(estimate, self.activation)  # the pages its trims hand back
        return max(estimate, 0)

    def trimmed(self, recompute: tuple[str, ...], moves: bool, returns: bool) -> float:
        """Rule 8: the seconds a step of this plan spends handing memory back: as the
        steps that ran it did, or, where its steps hand memory back (a disk spill's
        writer, or ``returns``: ``Auto``'s watch), as those that did."""
        profile = self.profile
        ran_steps = (*profile.calibration_steps(), *profile.quiet_history)
        steps = ran(recompute, moves, ran_steps)
        if steps:
            return statistics.median(s.trim_s for s in steps)
        trimmed = [s.trim_s for s in ran_steps if s.trim_s > 0]
        if trimmed and (moves or returns):
            return statistics.median(trimmed)
        return 0.0


def step_noise(profile: Profile) -> float:
    """Rule 7: how far a step's time strays: the median of the distances from the
    median, over the quiet steps or over the hooked ones, the larger (0.0 where
    neither has three). A step that first moved so many bytes (rule 9) is left out:
    its time is what making the tier took, not noise."""
    spreads = [0.0]
    for steps in (profile.quiet_history, profile.history):
        seconds = [s.seconds for s in steps if not s.first_move]
        if len(seconds) >= 3:
            middle = statistics.median(seconds)
            spreads.append(statistics.median(abs(t - middle) for t in seconds))
    return max(spreads)


def ran(recompute: tuple[str, ...], moves: bool, steps: Iterable[StepRecord]) -> list[StepRecord]:
    """The steps that ran a plan: its recompute, and moving bytes or not; warm ones once
    there are (NOTE [ Profile ] rule 6)."""
    same = [s for s in steps if s.recomputed == recompute and bool(s.moved) == moves]
    return [s for s in same if not s.cold] or same


def index(modules: dict[str, ModuleRecord], sites: dict[Site, SiteRecord]) -> dict[str, list[Site]]:
    """The sites saved inside each module (itself and the modules in it), by their paths."""
    inside: dict[str, list[Site]] = {path: [] for path in modules}
    for site in sites:
        parts = site[0].split(".")
        for end in range(1, len(parts) + 1):
            found = inside.get(".".join(parts[:end]))
            if found is not None:
                found.append(site)
    return inside


def pooled(
    modules: dict[str, ModuleRecord],
    inside: dict[str, list[Site]],
    sites: dict[Site, SiteRecord],
) -> dict[str, ModuleRecord]:
    """Modules with the forward time of their twins pooled (rule 3).

    Layers of one kind that save the same bytes from inputs of the same size
    (the blocks of a transformer) cost the same: each gets their median time,
    so timing noise does not pick one block over another.
    """
    twins: dict[tuple[Any, ...], list[str]] = {}
    for path, module in modules.items():
        saved = sum(sites[site].nbytes for site in inside[path])
        key = (module.kind, module.calls, module.input_bytes, saved)
        twins.setdefault(key, []).append(path)
    result = dict(modules)
    for paths in twins.values():
        if len(paths) > 1:
            median = statistics.median(modules[p].forward_s for p in paths)
            for path in paths:
                result[path] = dataclasses.replace(modules[path], forward_s=median)
    return result


def weighted_median(values: list[tuple[float, int]]) -> float:
    """The median of ``(value, weight)`` pairs, each value counted ``weight`` times.

    A step's cost per byte moved, weighted by its bytes (rule 9): a step that
    moved a few bytes shows its cost per byte through its noise.
    """
    ordered = sorted(values)
    half = sum(weight for _, weight in ordered) / 2
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    raise ValueError("weighted_median of no values")


def outermost(recomputed: tuple[str, ...]) -> list[str]:
    """The modules of ``recomputed`` that are inside no other of them."""
    return [p for p in recomputed if not any(under(p, o) and p != o for o in recomputed)]


def under(path: str, module: str) -> bool:
    """Whether ``path`` is ``module`` or a module inside it."""
    return path == module or path.startswith(module + ".")
