"""The plan: which modules to recompute and where each call site's tensors go, for a budget.

# NOTE [ Plan ]
1. The budget covers the eligible saved bytes the device holds (for CPU
   training, host RAM): what a ``Keep`` session counts past parameters, buffers
   and tensors under ``min_bytes``. "Activation bytes" are those of one step.
2. A run whose activation bytes fit costs nothing: the plan keeps every site.
3. Otherwise each way to save bytes has a cost in step time, and the plan takes
   the cheapest saving per byte first until the held bytes fit. A saving's
   bytes are those it takes off the peak held: the most of the bytes held when
   forward ends and while backward recomputes each module chosen (what was
   saved before it and is still held, its inputs, and all it saves again).
   Recomputing the last block, or a whole model's body, takes nothing off
   that peak: backward reaches it while everything before it is still held,
   so a plan that counted its bytes as saved would peak as high as no stash.
   Once no saving lowers the peak, the held bytes count:
   - recomputing a module saves the bytes saved inside it, less its inputs
     (which its region keeps), and costs its forward time; a module inside one
     already chosen is not counted twice, and choosing a module replaces the
     choices made inside it: it is ranked by what it adds to them, and then
     costs its whole forward time (counted at only what it added, a plan
     that took a block's part and then the block is predicted short of the
     block's recompute); each region also costs what checkpointing runs for it beyond the recompute,
     Python for the region and for each tensor it saves, in forward and in
     backward (``Rates.region_s`` and ``saved_s``, probed once per device:
     ``_rates.region_cost``; the tensors are its sites and its parameters).
     On a step bound by launching kernels that is most of the cost, more
     than the recompute itself. So fewer, larger regions cost less than the
     same modules split;
   - on a CUDA device, copying a site to host RAM is free while the link can
     move it during forward and bring it back during backward (the sites saved
     earliest first: they come back last); past that it costs its transfer;
   - on the CPU, host RAM is the device: a site is compressed (lz4) or spilled
     (disk) at the cost of the CPU time that takes, on the cores the step uses.
4. Modules the user forbids, modules unsafe to recompute (NOTE [ Profile ]
   rule 2) and the model itself are never recomputed; modules the user names
   are always recomputed first.
5. A budget below what every saving together reaches cannot be held, nor one
   below the largest tensor (a session holds the tensor it packs): the plan
   takes every saving, and ``reachable_bytes`` says the smallest budget it can hold.
6. Predictions come from the measured steps (their medians, NOTE [ Profile ]
   rules 5 and 6, warm steps once there are): the step time with nothing
   recomputed or moved is the measured time less what the measured step's own
   plan cost (its recompute as timed in its backward: NOTE [ Recompute ]
   rule 7, and its regions' own cost, rule 3); the new plan adds its costs, a
   module's recompute at its forward time scaled by the median of timed over
   forward seconds in those steps, and its regions' own cost.
   The modules the user checkpoints (``recompute``, Hugging Face's gradient
   checkpointing) are recomputed by every step whatever the plan: what that
   took (timed in backward for ``recompute``'s, NOTE [ Recompute ] rule 7;
   for Hugging Face's, their forward time at that scale) is taken out of the
   base and added to every prediction (``Plan.checkpointed_s``), so the base
   is a plain step's.
   The real peak is what the steps that took it under the last plan that
   did held besides their eligible saved bytes (the median of their peaks
   less the bytes held at each one's moment), plus the new plan's: the
   held bytes when forward ends, or more while backward recomputes a module
   (the tensors saved before it are still held, and its own are made again).
7. A plan that moves nothing runs without hooks (NOTE [ Quiet steps ] in
   auto.py); one that moves a site runs every saved tensor through them. The
   hooks' cost is what the steps with them took over the quiet steps, each
   less what it recomputed (``Profile.history`` against
   ``Profile.quiet_history``); before a quiet step was timed, ``HOOK_S``
   per call site. A quiet plan is predicted from the quiet steps' base (or
   the hooked base less that cost). Where the cheapest plan moves sites, the
   plan that only recomputes is made too, and taken when it fits and is
   predicted no slower: on a model whose step is bound by launching kernels
   the hooks cost more than recomputing a few modules. Within the noise of a
   step's time (the median distance from the median, over the quiet steps or
   the hooked ones: a plan that moves runs no quiet step), the plan that only
   recomputes is taken: its costs were measured, while the hooks and a
   writer's are what a hooked step's noise hides, so a plan that moves a few
   bytes to squeeze under the budget is predicted faster than its steps run.
   Until a step that recomputed and moved nothing was timed it is taken
   whenever it fits: what the hooks cost, and what its steps fault in and
   hand back, are guesses till then, and a plan that moves, once measured,
   would be weighed against them, so the plan that only recomputes, though
   faster, would never be tried (rule 9 is the same on CUDA).
8. A step's time includes the pages it faults in: fresh memory it touches.
   How many depends on the plan and on the heap: on the CPU a plan that saves
   bytes hands freed memory back to the OS as the step runs (``Auto``'s
   ``Watch``: NOTE [ Returning memory ] in _trim.py), and the step faults
   those pages in again, which takes time of its own; a step begun from a
   heap handed back to the OS (the bench's, the acceptance checks') faults in
   all it touches, which a plan holding less touches less of, enough to pay
   for what it recomputes.
   So each step's faulted bytes are counted (``StepRecord.faulted_bytes``,
   minor faults), a measured step's time less their cost at ``Rates.refault``
   is its time without them (rule 6), and a plan adds the faults of the steps
   that ran it (their median) or, before one did, those of the measured step
   less what its held bytes touched, plus what the plan's do; where the plan's
   steps hand memory back and none ran yet, at least the step's activation
   bytes. ``Rates.refault`` is probed as pages handed back and written again.
   The calls that hand memory back take time of their own, walking the free
   heap, a share of the step the predictions would otherwise miss: they are
   timed (``StepRecord.trim_s``) and priced as the faults are, from the steps
   that ran the plan, or before one did, where its steps hand memory back,
   from the steps that did. Where the session pool serves (NOTE [ Session
   pool ] in _pool.py) those calls are its mappings and unmappings
   (``PoolCounts.mapping_s``), and a quiet step's time runs until its lease
   was let go, the blocks waiting unmapped.
   On CUDA the pages are host memory, faulted in while the kernels run, and
   are not priced: a profile's first step faults in the pinned buffers its
   copies allocate, and priced as on the CPU they would make a plain step's
   predicted time a multiple of what it is.
9. What a move costs is measured against a step that moved nothing. On CUDA
   a profile's first step moves what does not fit, and the policies' seconds
   a step counts miss most of what copies cost the host (launching them,
   pinning, the hooks' Python) or overlap the kernels: a base taken from
   such a step less its policies' seconds makes the copies look free, and
   the plan that only recomputes, faster on a step bound by launching
   kernels, is never chosen. So on CUDA:
   - until a step moved nothing, the base is the steps' time (copies hidden);
   - where no step has moved nothing yet and the plan that only recomputes
     fits, that plan runs first: its steps measure the base;
   - then a warm step that copied (not the first, whose time is mostly
     allocating the pinned buffers) gives what a copied byte cost
     (``copy_s_per_byte``: its time over the base, less its recompute, per
     byte), and copies are priced at it, plus the link's time for the bytes
     the link cannot move while forward runs. Where the kernels hide the
     copies that is next to nothing, and copies stay cheaper than
     recomputing.
   On either device, no step that moved more bytes to a tier than any before
   it prices that tier (``StepRecord.first_move``), even where no warm step
   ran yet: it made what moving there uses (CUDA's pinned buffers; on the
   CPU the spill directory, its file and the pages the page cache takes),
   and where every measured step is cold (each takes its plan's real peak),
   the first one's time would price every byte moved, the plan would
   recompute every block instead, and a plan that spills every site, as
   fast and holding less, would never run again. Other cold steps do: with
   every cold step skipped, a plan that moves can go unpriced through a
   whole run, slower than the plan that recomputes. Until a step priced
   a tier, its bytes cost what the probe took (``_rates.disk_rate`` times
   what ``DiskSpill`` does to a value, on this thread).
   Steps that leave the history are kept aside by kind
   (``Profile.calibration_steps``), so what was measured stays known while
   the other plan runs, and the plan does not flip back to try it again.
   What a byte moved to a tier costs is the median over every warm step that
   moved bytes to that tier alone, kept aside or not, each counted by the
   bytes it moved: a step that moved a few bytes shows their cost within its
   noise, often as nothing, and counted step by step it makes a plan that
   moves many bytes look cheaper than it runs, and the plan flips between
   the two every step or two.
10. On CUDA a tensor copied to the host stays on the device until its copy
   ends, and those bytes count toward the budget: ``Auto`` lets the copies
   hold the budget less what the plan keeps when forward ends. A plan that
   keeps its whole budget leaves them nothing, and each save waits for the
   copy before it, which makes its step as slow as moving every byte to the host.
   So a plan that copies to the host keeps at most the budget less a quarter
   of it, up to 1 GiB (``COPY_ROOM_SHARE``, ``COPY_ROOM_MAX``), where that is
   reachable; a plan that copies nothing keeps up to the budget.
11. Moving every site is weighed as a plan of its own (no module recomputed,
   every site to its cheapest tier: on the CPU, as fast as a step that
   recomputes every block on a model like the bench's small one, and
   holding less). The greedy of rule 3 stops once the held bytes fit, and
   rule 7 keeps the plan that only recomputes within the noise, so neither
   reaches it. It is taken where it fits and is predicted faster beyond the
   noise, or no slower than the plan chosen by more than the noise and
   ``STEP_TIE`` of its step, where the steps that ran each took the real
   peak and those that moved sites to the same tiers without recomputing
   held ``PEAK_TIE`` less than those of the chosen plan: what the steps
   measured, not what the model predicts, since the model takes what a step
   holds besides its saved bytes as the same under every plan, which a
   spill's mapped pages are not (they come back as its tensors do). On the
   CPU, a whole-model plan predicted as fast that no step has run yet runs
   until a step under it took its real peak (where the profile measures
   memory): without it, the two plans' steps could only be compared where
   the other had run for another reason, and which plan a run kept at a
   tie was chance.

The measurements behind these rules, with the runs that made them:
docs/figures/planning.md. The search (rule 3) is in _solver.py; what the
steps say a plan's parts cost (rules 6 to 9) is in _calibration.py.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tensorstash.core import _support
from tensorstash.core.stats import human_bytes
from tensorstash.planning._calibration import (
    CALIBRATION_SPREAD,
    HOOK_S,
    Calibration,
    step_noise,
    under,
    weighted_median,
)
from tensorstash.planning._rates import (
    DISK_BYTES_PER_S,
    LINK_BYTES_PER_S,
    LZ4_BYTES_PER_S,
    LZ4_RATIO,
    REFAULT_BYTES_PER_S,
    Rates,
)
from tensorstash.planning._records import plan_of
from tensorstash.planning._solver import Choice, Excluded, Solver
from tensorstash.planning.profile import Profile, Site, StepRecord

__all__ = [
    "CALIBRATION_SPREAD",
    "COPY_ROOM_MAX",
    "COPY_ROOM_SHARE",
    "DISK_BYTES_PER_S",
    "HOOK_S",
    "LINK_BYTES_PER_S",
    "LZ4_BYTES_PER_S",
    "LZ4_RATIO",
    "REFAULT_BYTES_PER_S",
    "RETURNS_BELOW",
    "Choice",
    "Excluded",
    "Plan",
    "Rates",
    "Tier",
    "make_plan",
    "weighted_median",
]

Tier = Literal["keep", "host", "compressed", "disk"]

RETURNS_BELOW = 2 / 3
"""A plan holding more than this share of a step's activation bytes hands no memory back
to the OS when ``trim_every`` is "auto" (rule 8): it frees too little for that to pay."""
COPY_ROOM_SHARE = 0.25
"""Rule 10: the share of the budget a plan that copies to the host leaves to the copies
still running, up to :data:`COPY_ROOM_MAX`."""
COPY_ROOM_MAX = 1 << 30
"""Rule 10: at most ``CpuOffload``'s default ``max_inflight_bytes``."""
PEAK_TIE = 0.02
"""Rule 11: a whole-model plan is taken where it holds this share less at the real peak..."""
STEP_TIE = 0.03
"""...and is predicted slower by at most this share of the step (and the step's noise)."""


@dataclass(frozen=True)
class Plan:
    """What ``Auto`` does in a step: the modules it recomputes, each site's tier, and why.

    Attributes:
        budget: eligible bytes the device may hold.
        activation_bytes: the eligible bytes of a step with nothing moved.
        held_bytes: what the plan holds when forward ends.
        reachable_bytes: the fewest bytes any plan holds (rule 5).
        recompute: module paths recomputed, in the model's order.
        tiers: the tier of each site that does not stay ("keep" for the others).
        choices: the savings taken, cheapest per byte first.
        base_step_s: the predicted time of a plain step: nothing recomputed or
            moved, no hooks (rule 7), with the pages it faults in (rule 8).
        predicted_step_s: forward and backward seconds with this plan.
        predicted_peak_bytes: the real peak memory growth over a step, or None
            before a step's peak was measured.
        hooks_s: what the saved-tensor hooks cost a step (rule 7): in
            ``base_step_s``, and in a hooked plan's predicted step, not in a
            quiet one's.
        faulted_bytes: the pages a step of the plan faults in (rule 8).
        faults_s: what faulting them in costs a step (rule 8): in
            ``predicted_step_s`` (``base_step_s`` has a plain step's).
        trim_s: what handing memory back to the OS costs a step, the calls
            themselves (rule 8): in ``predicted_step_s``.
        returns_memory: whether ``Auto`` hands memory back to the OS while a
            CPU step of the plan runs (rule 8; NOTE [ Returning memory ] in _trim.py).
        checkpointed_s: what backward spends recomputing the modules the user
            checkpoints (rule 6): in ``predicted_step_s``, not in ``base_step_s``.
        limit_bytes: under a memory limit, the limit (NOTE [ Memory limit ] in
            _limit.py); the budget is then the one the plan was made for.
        base_bytes: under a memory limit, what the device held at the step's start:
            the limit less this is the room the plan's real peak growth must fit.
    """

    budget: int
    activation_bytes: int
    held_bytes: int
    reachable_bytes: int
    recompute: tuple[str, ...] = ()
    tiers: dict[Site, Tier] = field(default_factory=dict)
    choices: tuple[Choice, ...] = ()
    base_step_s: float = 0.0
    predicted_step_s: float = 0.0
    predicted_peak_bytes: int | None = None
    hooks_s: float = 0.0
    faulted_bytes: int = 0
    faults_s: float = 0.0
    trim_s: float = 0.0
    returns_memory: bool = False
    checkpointed_s: float = 0.0
    limit_bytes: int | None = None
    base_bytes: int | None = None

    @property
    def quiet(self) -> bool:
        """Whether a step can run it without hooks: it moves nothing and fits (rule 7)."""
        return not self.tiers and self.fits

    @property
    def kind(self) -> tuple[tuple[str, ...], frozenset[str]]:
        """What the plan recomputes and the tiers it moves to: the kind a step that ran
        it has (``plan_of`` of its record)."""
        return (self.recompute, self.moved_tiers)

    @property
    def moved_tiers(self) -> frozenset[str]:
        """The stats' tiers the plan moves bytes to, as a step's record names them
        (``StepRecord.moved``: compressed bytes are the host tier's)."""
        return frozenset(
            "disk" if t == "disk" else "host" for t in self.tiers.values() if t != "keep"
        )

    def tier(self, site: Site) -> Tier:
        """Where ``site``'s tensors go ("keep" unless the plan moves them)."""
        return self.tiers.get(site, "keep")

    def keeps_all(self, budget: int) -> bool:
        """Whether this plan keeps every site and ``budget`` holds them (it serves that budget)."""
        return not self.choices and self.activation_bytes <= budget

    @property
    def fits(self) -> bool:
        """Whether the budget can be held (rule 5)."""
        return self.held_bytes <= self.budget and self.reachable_bytes <= self.budget

    def table(self) -> str:
        """The plan for people: the budget, each saving, the predictions."""
        lines = []
        if self.limit_bytes is not None and self.base_bytes is not None:
            room = self.limit_bytes - self.base_bytes
            growth = self.predicted_peak_bytes
            reaches = ""
            if growth is not None:
                over = "" if growth <= room else " (over: the least any plan reaches)"
                reaches = f"; predicted real peak {human_bytes(self.base_bytes + growth)}{over}"
            lines.append(
                f"limit {human_bytes(self.limit_bytes)}: {human_bytes(self.base_bytes)} held "
                f"before the step, {human_bytes(room)} left for it{reaches}"
            )
        lines += [
            f"budget {human_bytes(self.budget)} of {human_bytes(self.activation_bytes)} "
            f"activation bytes; held at the end of forward {human_bytes(self.held_bytes)}"
            + ("" if self.fits else f" (the least reachable: {human_bytes(self.reachable_bytes)})"),
        ]
        if not self.choices:
            lines.append("nothing to move: every site is kept")
        for choice in self.choices:
            saved = human_bytes(choice.saved_bytes)
            lines.append(
                f"  {choice.kind:<10} {choice.target:<40} saves {saved:>10}"
                f"  costs {1e3 * choice.cost_s:8.2f} ms"
            )
        overhead = self.predicted_step_s / self.base_step_s if self.base_step_s > 0 else 1.0
        peak = "-" if self.predicted_peak_bytes is None else human_bytes(self.predicted_peak_bytes)
        hooks = "no hooks (a quiet step)" if self.quiet else f"hooks {1e3 * self.hooks_s:.1f} ms"
        if self.faulted_bytes:
            hooks += f"; faults in {human_bytes(self.faulted_bytes)}, {1e3 * self.faults_s:.1f} ms"
        if self.trim_s:
            hooks += f"; hands memory back, {1e3 * self.trim_s:.1f} ms"
        if self.checkpointed_s:
            hooks += f"; recomputes what you checkpoint, {1e3 * self.checkpointed_s:.1f} ms"
        lines.append(
            f"predicted step {self.predicted_step_s:.3f} s ({overhead:.2f}x of a plain step; "
            f"{hooks}), real peak growth {peak}"
        )
        missing = _compiled_missing()
        if missing is not None:
            lines.append(f"compiled code: {missing}; planned as eager code")
        return "\n".join(lines)


def _compiled_missing() -> str | None:
    """Why a step that runs compiled code is planned as eager code here (NOTE [ Support
    range ] rule 2), where dynamo compiled something in this process; else None."""
    if "torch._dynamo" not in sys.modules:
        return None
    missing = _support.missing(_support.COMPILED)
    if missing is None:
        return None
    from torch._dynamo.utils import counters

    return missing if counters["stats"]["unique_graphs"] else None


def make_plan(
    profile: Profile,
    budget: int,
    *,
    device: str = "cpu",
    recompute: bool = True,
    never: Excluded = lambda path: False,
    always: Iterable[str] = (),
    rates: Rates | None = None,
    trims: bool | Literal["auto"] = False,
    seen: list[Plan] | None = None,
) -> Plan | None:
    """The plan for ``budget`` from what ``profile`` measured; None before a step was measured.

    Args:
        profile: measurements of the last steps.
        budget: eligible bytes the device may hold.
        device: "cuda" or "cpu": which savings exist (rule 3).
        recompute: whether modules may be recomputed at all.
        never: ``never(path)`` is True for modules the user forbids.
        always: module paths recomputed whatever the budget.
        rates: the speeds of the cost model.
        trims: whether a step that saves bytes hands freed memory back to the
            OS (rule 8: ``Auto`` on the CPU); "auto": where the plan holds at
            most :data:`RETURNS_BELOW` of the activation bytes.
        seen: where given, every plan weighed is appended to it (a memory limit
            weighs them by their real peak: NOTE [ Memory limit ] rule 3).
    """
    step = profile.measured()
    if step is None:
        return None
    speeds = rates or Rates()
    solve = functools.partial(
        _solve, profile, step, budget, device, speeds, never=never, recompute=recompute
    )
    if seen is not None:
        solve = functools.partial(_seen, solve, seen)
    plan = solve(always, moves=True, trims=trims)
    if device == "cuda" and "host" in plan.tiers.values():  # rule 10: room for the copies
        room = min(COPY_ROOM_MAX, int(budget * COPY_ROOM_SHARE))
        roomy = solve(always, moves=True, trims=trims, room=room)
        if roomy.held_bytes <= budget - room:
            plan = roomy
    noise = step_noise(profile)
    if plan.tiers and recompute:  # rule 7: without the hooks, recomputing may cost less
        alone = solve(always, moves=False, trims=trims)
        steps = profile.calibration_steps()
        measured = profile.quiet_history or any(s.recomputed and not s.moved for s in steps)
        if alone.fits and not measured:
            return alone
        if alone.fits and alone.predicted_step_s <= plan.predicted_step_s + noise:
            plan = alone
    if not plan.choices:
        return plan
    # Rule 11: moving every site, where that is faster, or as fast and held less.
    whole = solve(always, moves=True, trims=trims, room=budget, recompute=False)
    if not whole.fits:
        return plan
    if whole.predicted_step_s + noise < plan.predicted_step_s:
        return whole
    tie = min(noise, STEP_TIE * plan.predicted_step_s)
    if whole.predicted_step_s > plan.predicted_step_s + tie:
        return plan
    measures = device == "cpu" and profile.measure_memory
    untried = measures and _measured_peak(profile, whole) is None
    if untried or _holds_less(profile, whole, plan):
        return whole  # as fast: run until its real peak is taken, then kept where it holds less
    return plan


def _seen(solve: Callable[..., Plan], seen: list[Plan], *args: Any, **kwargs: Any) -> Plan:
    plan = solve(*args, **kwargs)
    seen.append(plan)
    return plan


def _holds_less(profile: Profile, one: Plan, other: Plan) -> bool:
    """Rule 11: whether the steps that ran ``one`` held less at the real peak than those
    that ran ``other``, by more than :data:`PEAK_TIE` (False unless steps of both took it)."""
    low, high = _measured_peak(profile, one), _measured_peak(profile, other)
    return low is not None and high is not None and low < (1 - PEAK_TIE) * high


def _measured_peak(profile: Profile, plan: Plan) -> float | None:
    """The median real peak of the steps that ran ``plan`` (its recompute, its tiers)."""
    peaks = [
        s.peak_bytes for s in profile.peaks if s.peak_bytes is not None and plan_of(s) == plan.kind
    ]
    return statistics.median(peaks) if peaks else None


def _solve(
    profile: Profile,
    step: StepRecord,
    budget: int,
    device: str,
    rates: Rates,
    always: Iterable[str],
    *,
    never: Excluded,
    recompute: bool,
    moves: bool,
    trims: bool | Literal["auto"],
    room: int = 0,
) -> Plan:
    """One greedy plan (rule 3) from the medians ``step``, holding at most ``budget - room``
    bytes (rule 10; rule 11's whole-model plans hold none); ``moves``: may sites leave
    the device; ``recompute``: may modules be recomputed."""
    calibration = Calibration(profile, device, rates)
    calibration.calibrate()
    capacity = rates.link * min(step.forward_s, step.backward_s)
    solver = Solver(calibration, budget - room, capacity)
    for path in always:
        solver.take_recompute(path)
    if solver.taken.held > solver.target:
        if device == "cuda" and moves and calibration.copy_s_per_byte is None:
            solver.take_hidden_copies()
        solver.take_cheapest(recompute, never, moves=moves)
    return _priced(solver, budget, trims, step)


def _priced(solver: Solver, budget: int, trims: bool | Literal["auto"], step: StepRecord) -> Plan:
    """The plan ``solver`` chose, with its predictions (rules 5 to 8)."""
    calibration, taken = solver.calibration, solver.taken
    recompute = tuple(path for path in calibration.modules if path in taken.recomputed)
    tiers: dict[Site, Tier] = {}
    for site, choice in taken.moved.items():
        if not any(under(site[0], m) for m in recompute):
            tiers[site] = choice.kind  # type: ignore[assignment]
    choices = sorted(
        [*taken.recomputed.values(), *taken.moved.values()],
        key=lambda c: c.cost_s / max(c.saved_bytes, 1),
    )
    held = max(taken.held, 0)
    largest = max((record.nbytes for record in calibration.sites.values()), default=0)
    reachable = largest if held <= budget else _reachable(calibration)
    base = calibration.base_s - calibration.hooks_s  # a plain step (rule 7), without faults
    quiet = not tiers and held <= budget and reachable <= budget  # Plan.quiet
    activation = calibration.activation
    returns = bool(choices) and (
        trims is True or (trims == "auto" and held <= RETURNS_BELOW * activation)
    )
    at_peak = taken.held_at_peak
    faulted = (
        0
        if calibration.device == "cuda"
        else calibration.faulted(recompute, bool(tiers), held, step, returns, at_peak)
    )
    faults_s = calibration.faults_s(faulted)
    trim_s = calibration.trimmed(recompute, bool(tiers), returns)
    predicted = base + (0.0 if quiet else calibration.hooks_s) + sum(c.cost_s for c in choices)
    predicted += faults_s + trim_s + calibration.checkpointed_s
    plain_faulted = calibration.faulted((), False, activation, step, False, at_peak)
    base += calibration.faults_s(plain_faulted) + calibration.trimmed((), False, False)
    other = _held_besides(calibration.profile, recompute, tiers, at_peak)
    peak = None if other is None else max(0, other + at_peak(recompute, held))
    return Plan(
        budget=budget,
        activation_bytes=activation,
        held_bytes=held,
        reachable_bytes=reachable,
        recompute=recompute,
        tiers=tiers,
        choices=tuple(choices),
        base_step_s=base,
        predicted_step_s=predicted,
        predicted_peak_bytes=peak,
        hooks_s=calibration.hooks_s,
        faulted_bytes=faulted,
        faults_s=faults_s,
        trim_s=trim_s,
        returns_memory=returns,
        checkpointed_s=calibration.checkpointed_s,
    )


def _held_besides(
    profile: Profile,
    recompute: tuple[str, ...],
    tiers: dict[Site, Tier],
    at_peak: Callable[[tuple[str, ...], int], int],
) -> int | None:
    """What a step of the plan holds at its real peak besides its saved bytes (rule 6):
    the median over the steps that took the peak under a plan that recomputed and moved
    as this one does; for a plan no such step ran, the median of the kinds of plan that,
    as it does, recompute (or do not), else of every kind: the peak of a plan that
    recomputes comes while backward recomputes, that of one that does not at the start
    of backward, with other tensors alive beside the saved ones (a prediction for one
    made from the other's steps was short by a fifth of a step's room:
    docs/figures/auto.md). None where no step took the real peak."""
    moved = frozenset("disk" if t == "disk" else "host" for t in tiers.values() if t != "keep")
    kinds: dict[tuple[object, ...], list[int]] = {}
    for step in profile.peaks or profile.peak_steps():
        if step.peak_bytes is not None:
            besides = step.peak_bytes - at_peak(step.recomputed, step.held_bytes)
            kinds.setdefault(plan_of(step), []).append(besides)
    if not kinds:
        return None
    medians = {kind: int(statistics.median(held)) for kind, held in kinds.items()}
    found = medians.get((recompute, moved))
    if found is not None:
        return found
    alike = [held for (done, _), held in medians.items() if bool(done) == bool(recompute)]
    return int(statistics.median(alike or medians.values()))


def _reachable(calibration: Calibration) -> int:
    """The fewest bytes held (rule 5): every saving taken (the same greedy, budget 0, at
    the speeds ``calibration`` measured and nothing else it measured), and never less
    than the largest tensor, which a session holds while it packs it. Asked only of a
    plan that does not fit: for one that fits, the largest tensor."""
    other = Solver(Calibration(calibration.profile, calibration.device, calibration.rates), 0)
    other.take_cheapest(True, lambda path: False)
    largest = max((record.nbytes for record in calibration.sites.values()), default=0)
    return max(other.taken.held, largest)
