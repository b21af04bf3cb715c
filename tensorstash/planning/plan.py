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
   that peak: backward reaches it while everything before it is still held
   (on HF GPT-2 the plan recomputed ``model.transformer``, and its step's real
   peak was no stash's). Once no saving lowers the peak, the held bytes count:
   - recomputing a module saves the bytes saved inside it, less its inputs
     (which its region keeps), and costs its forward time; a module inside one
     already chosen is not counted twice, and choosing a module replaces the
     choices made inside it: it is ranked by what it adds to them, and then
     costs its whole forward time (counted at what it added, the plans on
     the HF GPT-2 config under bf16 autocast, which take a block's MLP or
     activation before the block, were predicted 2-5 ms short of their
     recompute); each region also costs what checkpointing runs for it
     beyond the recompute, Python for the region and for each tensor it
     saves, in forward and in backward (``Rates.region_s`` and ``saved_s``,
     probed once per device: ``_rates.region_cost``; the tensors are its
     sites and its parameters). On a step bound by launching kernels that
     is most of the cost: the bench's ``medium`` on an H200, every block
     recomputed as twelve regions, took 14.5 ms over no stash's 13.5 ms
     step, of which backward's recompute was 5 ms. So fewer, larger regions
     cost less than the same modules split;
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
   recomputes is taken: its costs were measured,
   while the hooks and a writer's are what a hooked step's noise hides (on
   the HF GPT-2 config under bf16 autocast at a quarter of its activation
   bytes, a plan that spilled one 256 KiB tensor to squeeze under the budget
   ran every step with hooks at 1.53x no stash's step, predicted at 1.13x;
   the plan that recomputed one module more ran quiet at 1.33x). Until a step that
   recomputed and moved nothing was timed it is taken whenever it fits: what
   the hooks cost, and what its steps fault in and hand back, are guesses
   till then, and a plan that moves, once measured, would be weighed against
   them (rule 9 is the same on CUDA). On the bench's
   ``small`` at a quarter of its activation bytes (CPU, 2 cores) a plan that
   spilled 40.5 MiB was measured first, and the plan that recomputed five
   modules, predicted with the faults of a step that hands memory back and
   never ran, was never tried: 1.44x no stash's step at 0.57 of its real
   peak, against 1.39x at 0.53 once tried.
8. A step's time includes the pages it faults in: fresh memory it touches,
   about 0.2 ms per MiB on a 2-core machine. How many depends on the plan and
   on the heap: on the CPU a plan that saves bytes hands freed memory back to
   the OS as the step runs (``Auto``'s ``Watch``: NOTE [ Returning memory ] in
   _trim.py), and the step faults those pages in again (on an HF GPT-2 config,
   4 layers, d=256, batch 4x128, 2 cores, the plans at 25-75% of its
   activation bytes handed back 67-107 MiB a step, which cost 0.17-0.52 ms
   per MiB); a step begun from a heap handed back to the OS (the bench's, the
   acceptance checks') faults in all it touches, which a plan holding less
   touches less of (the bench's ``medium`` on the CPU, at half its activation
   bytes, recomputed 0.7 s of forward and its step took no longer than none's).
   So each step's faulted bytes are counted (``StepRecord.faulted_bytes``,
   minor faults), a measured step's time less their cost at ``Rates.refault``
   is its time without them (rule 6), and a plan adds the faults of the steps
   that ran it (their median) or, before one did, those of the measured step
   less what its held bytes touched, plus what the plan's do; where the plan's
   steps hand memory back and none ran yet, at least the step's activation
   bytes. ``Rates.refault`` is probed as pages handed back and written again.
   The calls that hand memory back take time of their own, walking the free
   heap (on the GPT-2 config, ``Auto`` at half its activation bytes: about 2
   calls a step, 4-5 ms each, 7% of the step, which the predictions missed):
   they are timed (``StepRecord.trim_s``) and priced as the faults are, from
   the steps that ran the plan, or before one did, where its steps hand
   memory back, from the steps that did. Where the session pool serves
   (NOTE [ Session pool ] in _pool.py) those calls are its mappings and
   unmappings (``PoolCounts.mapping_s``: about 3.5 ms a step on the GPT-2
   config under bf16 autocast, a third of what recomputing cost there), and a
   quiet step's time runs until its lease was let go, the blocks waiting
   unmapped.
   On CUDA the pages are host memory, faulted in while the kernels run, and
   are not priced: a profile's first step on an H200 faulted in 4.6 GiB of
   new pinned buffers, and priced as on the CPU they made a plain step's
   predicted time 3x what it was.
9. What a move costs is measured against a step that moved nothing. On CUDA
   a profile's first step moves what does not fit, and the policies' seconds
   a step counts miss most of what copies cost the host (launching them,
   pinning, the hooks' Python) or overlap the kernels. On the bench's
   ``medium`` (H200, a 21 ms step bound by launching kernels) a step that
   copied 490 MiB the link could hide took 80 ms, of which its policies
   counted 21: the planner took a 59 ms base, saw the copies as free, and
   never chose the recompute-only plan (1.9x against 4.3x). So on CUDA:
   - until a step moved nothing, the base is the steps' time (copies hidden);
   - where no step has moved nothing yet and the plan that only recomputes
     fits, that plan runs first: its steps measure the base;
   - then a warm step that copied (not the first, which allocates the pinned
     buffers: 1.8 s of a 2.1 s step on the bench's ``large``) gives what a
     copied byte cost (``copy_s_per_byte``: its time over the base, less its
     recompute, per byte), and copies are priced at it, plus the link's time
     for the bytes the link cannot move while forward runs. On ``large``,
     whose kernels hide its copies, that is next to nothing, and copies stay
     cheaper than recomputing. No step that copied more bytes than any
     before it prices a copy (``StepRecord.first_copy``), even where no warm
     step ran yet: on ``large`` at a quarter of its activation bytes each
     measured step was cold (it took its plan's real peak), the first one's
     3.6 s priced every copy, and the plan recomputed every block (1.27x no
     stash's step; copying, 1.03x). Other cold steps do: with every cold
     step skipped, ``medium`` at a quarter copied through the bench's 8 timed
     rounds (3.3x no stash's step, against 2.3x for the plan that recomputes).
   Steps that leave the history are kept aside by kind
   (``Profile.calibration_steps``), so what was measured stays known while
   the other plan runs, and the plan does not flip back to try it again.
   What a byte moved to a tier costs is the median over every warm step that
   moved bytes to that tier alone, kept aside or not, each counted by the
   bytes it moved: on the bench's ``small`` at a quarter of its activation
   bytes (CPU, 2 cores), a plan that recomputed four modules and spilled
   1.5 MiB showed the disk's cost per byte within its noise, often as
   nothing; counted step by step, that made the plan that spilled 40.5 MiB
   and recomputed nothing look 0.16 s a step, and it took 0.19 s, against
   0.17 s for the first, and the plan flipped between the two every step or two.
10. On CUDA a tensor copied to the host stays on the device until its copy
   ends, and those bytes count toward the budget: ``Auto`` lets the copies
   hold the budget less what the plan keeps when forward ends. A plan that
   keeps its whole budget leaves them nothing, and each save waits for the
   copy before it: on the bench's ``large`` (H200) at half its activation
   bytes, 1.15x no stash's step, against 1.02x with 1 GiB of copies running
   (then over the budget) and 1.15x for ``cpu``, which moves twice the bytes.
   So a plan that copies to the host keeps at most the budget less a quarter
   of it, up to 1 GiB (``COPY_ROOM_SHARE``, ``COPY_ROOM_MAX``), where that is
   reachable; a plan that copies nothing keeps up to the budget.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tensorstash.core.stats import human_bytes
from tensorstash.planning.profile import (
    ALREADY_RECOMPUTED,
    ModuleRecord,
    Profile,
    Site,
    SiteRecord,
    StepRecord,
)

Tier = Literal["keep", "host", "compressed", "disk"]

DISK_BYTES_PER_S = 0.45e9
"""Spill write, read and checksum, per second of a busy 2-core CPU (DESIGN.md, measured facts)."""
RETURNS_BELOW = 2 / 3
"""A plan holding more than this share of a step's activation bytes hands no memory back
to the OS when ``trim_every`` is "auto" (rule 8): it frees too little for that to pay."""
LZ4_BYTES_PER_S = 0.6e9
"""lz4 compression and decompression of activations, per second of CPU."""
LZ4_RATIO = 1.5
"""What lz4 keeps of float activations, as original over stored bytes."""
LINK_BYTES_PER_S = 20e9
"""Device to host and back (PCIe); measured on the device where it can be."""
COPY_ROOM_SHARE = 0.25
"""Rule 10: the share of the budget a plan that copies to the host leaves to the copies
still running, up to :data:`COPY_ROOM_MAX`."""
COPY_ROOM_MAX = 1 << 30
"""Rule 10: at most ``CpuOffload``'s default ``max_inflight_bytes``."""
CALIBRATION_SPREAD = 4.0
"""A measured cost per byte moved counts down to 1/CALIBRATION_SPREAD of the assumed one."""
REFAULT_BYTES_PER_S = 5e9
"""Handing memory back to the OS and faulting it in again, per second (rule 8), until probed."""
HOOK_S = 70e-6
"""What the hooks cost a step per call site, until steps with and without them were timed
(an H200 host, the bench's ``medium`` model: 9 ms a step over its 124 sites and 93 module
calls)."""


@dataclass(frozen=True)
class Rates:
    """Speeds the cost model uses (bytes per second; NOTE [ Plan ] rule 3)."""

    link: float = LINK_BYTES_PER_S
    disk: float = DISK_BYTES_PER_S
    compress: float = LZ4_BYTES_PER_S
    ratio: float = LZ4_RATIO
    refault: float = REFAULT_BYTES_PER_S
    region_s: float = 0.0
    """What a recomputed region costs beyond its recompute, per region (``_rates.region_cost``)."""
    saved_s: float = 0.0
    """The same per tensor the region saves."""


@dataclass(frozen=True)
class Choice:
    """One saving the plan took: what, how many bytes, at what cost."""

    kind: Literal["recompute", "host", "compressed", "disk"]
    target: str
    saved_bytes: int
    cost_s: float


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

    @property
    def quiet(self) -> bool:
        """Whether a step can run it without hooks: it moves nothing and fits (rule 7)."""
        return not self.tiers and self.fits

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
        lines = [
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
        return "\n".join(lines)


Excluded = Callable[[str], bool]


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
    """
    step = profile.measured()
    if step is None:
        return None
    speeds = rates or Rates()
    solve = functools.partial(_solve, profile, step, budget, device, speeds, recompute, never)
    plan = solve(always, moves=True, trims=trims)
    if device == "cuda" and "host" in plan.tiers.values():  # rule 10: room for the copies
        room = min(COPY_ROOM_MAX, int(budget * COPY_ROOM_SHARE))
        roomy = solve(always, moves=True, trims=trims, room=room)
        if roomy.held_bytes <= budget - room:
            plan = roomy
    if plan.tiers and recompute:  # rule 7: without the hooks, recomputing may cost less
        alone = solve(always, moves=False, trims=trims)
        steps = profile.calibration_steps()
        measured = profile.quiet_history or any(s.recomputed and not s.moved for s in steps)
        noise = _step_noise(profile)
        if alone.fits and (not measured or alone.predicted_step_s <= plan.predicted_step_s + noise):
            return alone
    return plan


def _step_noise(profile: Profile) -> float:
    """Rule 7: how far a step's time strays: the median of the distances from the
    median, over the quiet steps or over the hooked ones, the larger (0.0 where
    neither has three)."""
    spreads = [0.0]
    for steps in (profile.quiet_history, profile.history):
        seconds = [s.seconds for s in steps]
        if len(seconds) >= 3:
            middle = statistics.median(seconds)
            spreads.append(statistics.median(abs(t - middle) for t in seconds))
    return max(spreads)


def _solve(
    profile: Profile,
    step: StepRecord,
    budget: int,
    device: str,
    rates: Rates,
    recompute: bool,
    never: Excluded,
    always: Iterable[str],
    *,
    moves: bool,
    trims: bool | Literal["auto"],
    room: int = 0,
) -> Plan:
    """One greedy plan (rule 3) from the medians ``step``, holding at most ``budget - room``
    bytes (rule 10); ``moves``: may sites leave the device."""
    solver = _Solver(profile, budget, device, rates, trims)
    solver.target = budget - room
    solver.calibrate()
    solver.capacity = rates.link * min(step.forward_s, step.backward_s)
    for path in always:
        solver.take_recompute(path)
    if solver.held > solver.target:
        if device == "cuda" and moves and solver.copy_s_per_byte is None:
            solver.take_hidden_copies()
        solver.take_cheapest(recompute, never, moves=moves)
    return solver.plan(step)


class _Solver:
    """The greedy of rule 3 over one profile's sites and modules."""

    def __init__(
        self,
        profile: Profile,
        budget: int,
        device: str,
        rates: Rates,
        trims: bool | Literal["auto"] = False,
    ) -> None:
        self.profile = profile
        self.trims = trims
        self.budget = budget
        self.target = budget  # the held bytes the greedy aims at (rule 10: less on CUDA)
        self.device = device
        self.rates = rates
        self.sites: dict[Site, SiteRecord] = dict(profile.last)
        self._inside = _index(profile.modules, self.sites)
        self.modules: dict[str, ModuleRecord] = _pooled(profile.modules, self._inside, self.sites)
        self.root = profile._root_name
        self.activation = sum(record.nbytes for record in self.sites.values())
        self.held = self.activation
        self.recomputed: dict[str, Choice] = {}
        self.moved: dict[Site, Choice] = {}
        self.unsafe = {path for path, record in self.modules.items() if record.unsafe}
        self.base_s = 0.0
        self.hooks_s = 0.0
        self.recompute_factor = 1.0
        self.capacity = 0.0  # bytes the link moves while forward runs (rule 3, CUDA)
        self.copied = 0  # bytes copied to host so far, against that capacity
        self.copy_s_per_byte: float | None = None  # what a copy cost the steps (rule 9)
        self.checkpointed_s = 0.0  # the user's own recompute (rule 6)
        self._region_tensors: dict[str, int] = {}  # tensors a region saves (region_s)

    # What a module holds --------------------------------------------------------------

    def inside(self, path: str) -> list[Site]:
        return self._inside.get(path, [])

    def recompute_saving(self, path: str) -> tuple[int, float]:
        """Bytes and seconds that recomputing ``path`` adds to the choices taken so far."""
        record = self.modules[path]
        saved = sum(self.sites[site].nbytes for site in self.inside(path)) - record.input_bytes
        cost = self.recompute_cost(path)
        for inner, choice in self.recomputed.items():
            if _under(inner, path):
                saved -= choice.saved_bytes
                cost -= choice.cost_s
        for site, choice in self.moved.items():
            if _under(site[0], path):
                saved -= choice.saved_bytes
                cost -= choice.cost_s
        return saved, max(cost, 0.0)

    def recomputable(self, path: str, never: Excluded) -> bool:
        if path == self.root or path == "" or never(path) or path not in self.modules:
            return False
        if self.modules[path].forward_s <= 0:
            return False  # never timed: its cost is unknown, not free
        if any(_under(bad, path) for bad in self.unsafe):
            return False  # rule 4: it or a module inside it is unsafe
        return not any(_under(path, outer) for outer in self.recomputed)

    # Taking savings ---------------------------------------------------------------------

    def take_recompute(self, path: str) -> None:
        if path not in self.modules or any(_under(path, outer) for outer in self.recomputed):
            return
        saved, _ = self.recompute_saving(path)
        self.held -= saved  # what it adds to the choices it replaces
        # It replaces the choices inside it: its own are all they saved and more, at
        # its whole forward time (they are no longer made, nor paid for).
        for inner in [p for p in self.recomputed if _under(p, path)]:
            saved += self.recomputed.pop(inner).saved_bytes
        for site in [s for s in self.moved if _under(s[0], path)]:
            saved += self.moved.pop(site).saved_bytes
        self.recomputed[path] = Choice("recompute", path, saved, self.recompute_cost(path))

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

    def take_move(
        self, site: Site, kind: Literal["host", "compressed", "disk"], cost: float
    ) -> None:
        nbytes = self.sites[site].nbytes
        saved = nbytes - int(nbytes / self.rates.ratio) if kind == "compressed" else nbytes
        self.moved[site] = Choice(kind, _site_name(site), saved, cost)
        self.held -= saved
        if kind == "host" and self.device == "cuda":
            self.copied += nbytes

    def take_hidden_copies(self) -> None:
        """Rule 3, CUDA: copies to host RAM that the link hides, earliest sites first
        (until a step measured what copies cost: rule 9)."""
        for site, record in sorted(self.sites.items(), key=lambda item: item[1].order):
            if self.held <= self.target or self.copied + record.nbytes > self.capacity:
                return
            self.take_move(site, "host", 0.0)

    def move_option(self, site: Site) -> tuple[Literal["host", "compressed", "disk"], int, float]:
        """The cheapest way to move a site off the device: its tier, bytes saved, cost."""
        nbytes = self.sites[site].nbytes
        rates = self.rates
        if self.device == "cuda":
            if self.copy_s_per_byte is None:
                return "host", nbytes, nbytes / rates.link
            stall = nbytes / rates.link if self.copied + nbytes > self.capacity else 0.0
            return "host", nbytes, nbytes * self.copy_s_per_byte + stall
        compressed = nbytes - int(nbytes / rates.ratio)
        disk_cost, lz4_cost = nbytes / rates.disk, nbytes / rates.compress
        if compressed > 0 and lz4_cost / compressed < disk_cost / nbytes:
            return "compressed", compressed, lz4_cost
        return "disk", nbytes, disk_cost

    def options(self, recompute: bool, never: Excluded, moves: bool = True) -> list[_Option]:
        """Every saving still open, valued by how far it lowers the peak held (rule 3).

        The peak held is the most of the held bytes when forward ends and
        while backward recomputes each module chosen. A saving is worth the
        bytes it takes off that peak, at most the bytes it takes off the held
        ones: recomputing a whole model holds as much again while backward
        recomputes it. Once no saving lowers the peak, each is worth the
        held bytes it saves, which the budget is about.
        """
        before = self.held_before()
        peaks = self.region_peaks(before)
        now = max([self.held, *peaks.values()])

        def lowered(saved: int, order: int, own: int = 0, replaced: str | None = None) -> int:
            """How far the peak held falls with ``saved`` bytes fewer from ``order`` on."""
            others = [
                peak - saved if self.modules[r].first_order > order else peak
                for r, peak in peaks.items()
                if replaced is None or not _under(r, replaced)
            ]
            return now - max([self.held - saved, own, *others])

        found: list[tuple[_Option, int]] = []
        if recompute:
            for path, record in self.modules.items():
                if not self.recomputable(path, never):
                    continue
                saved, cost = self.recompute_saving(path)
                first = record.first_order
                own = before(first) + record.input_bytes + self.inside_bytes(path)
                if saved > 0:
                    option = _Option(cost, saved, first, "recompute", path)
                    found.append((option, lowered(saved, first, own, path)))
        for site, site_record in self.sites.items() if moves else ():
            if site in self.moved or any(_under(site[0], m) for m in self.recomputed):
                continue
            tier, saved, cost = self.move_option(site)
            order = site_record.order
            if saved > 0:
                found.append((_Option(cost, saved, order, tier, site), lowered(saved, order)))
        if any(lowered > 0 for _, lowered in found):
            return [
                dataclasses.replace(option, saved=min(option.saved, lowered))
                for option, lowered in found
                if lowered > 0
            ]
        return [option for option, _ in found]

    # The peak held (rule 3) --------------------------------------------------------------

    def region_peaks(self, before: Callable[[int], int]) -> dict[str, int]:
        """Bytes held while backward recomputes each module chosen: what was saved
        before it and is still held (``before``), its inputs, and everything saved inside it."""
        return {
            path: before(self.modules[path].first_order)
            + self.modules[path].input_bytes
            + self.inside_bytes(path)
            for path in self.recomputed
        }

    def held_before(self) -> Callable[[int], int]:
        """``before(order)``: bytes held for sites saved before ``order``, and the inputs
        of regions begun before it, with the choices taken so far (one pass, then a search)."""
        held: list[tuple[int, int]] = []
        for site, record in self.sites.items():
            if any(_under(site[0], m) for m in self.recomputed):
                continue
            moved = self.moved.get(site)
            held.append((record.order, record.nbytes - (0 if moved is None else moved.saved_bytes)))
        for path in self.recomputed:
            held.append((self.modules[path].first_order, self.modules[path].input_bytes))
        held.sort()
        orders = [order for order, _ in held]
        totals = list(itertools.accumulate((nbytes for _, nbytes in held), initial=0))
        return lambda order: totals[bisect.bisect_left(orders, order)]

    def inside_bytes(self, path: str) -> int:
        return sum(self.sites[site].nbytes for site in self.inside(path))

    def take_cheapest(self, recompute: bool, never: Excluded, *, moves: bool = True) -> None:
        """Rule 3: the cheapest saving per byte first, until the held bytes fit.

        Costs per byte within about 10% of each other count as equal (a timing's
        noise), and the earlier module or site goes first: its tensors come back
        last in backward, while less is held. A single saving that covers what
        is left, for no more than the cheapest per byte, ends the search.
        """
        while self.held > self.target:
            options = self.options(recompute, never, moves)
            if not options:
                return
            best = min(options, key=_Option.rank)
            need = self.held - self.target
            covering = [o for o in options if o.saved >= need]
            if covering:
                cover = min(covering, key=lambda o: (o.cost, o.order))
                if cover.cost <= best.cost:
                    best = cover
            self.take(best)

    def take(self, option: _Option) -> None:
        if option.kind == "recompute":
            self.take_recompute(str(option.target))
        else:
            site: Site = option.target  # type: ignore[assignment]
            self.take_move(site, option.kind, option.cost)  # type: ignore[arg-type]

    # The result ----------------------------------------------------------------------------

    def plan(self, step: StepRecord) -> Plan:
        recompute = tuple(path for path in self.modules if path in self.recomputed)
        tiers: dict[Site, Tier] = {}
        for site, choice in self.moved.items():
            if not any(_under(site[0], m) for m in recompute):
                tiers[site] = choice.kind  # type: ignore[assignment]
        choices = sorted(
            [*self.recomputed.values(), *self.moved.values()],
            key=lambda c: c.cost_s / max(c.saved_bytes, 1),
        )
        held = max(self.held, 0)
        largest = max((record.nbytes for record in self.sites.values()), default=0)
        reachable = largest if held <= self.budget else self._reachable()
        base = self.base_s - self.hooks_s  # a plain step (rule 7), without its faults (rule 8)
        quiet = not tiers and held <= self.budget and reachable <= self.budget  # Plan.quiet
        returns = bool(choices) and (
            self.trims is True or (self.trims == "auto" and held <= RETURNS_BELOW * self.activation)
        )
        faulted = (
            0
            if self.device == "cuda"
            else self._faulted(recompute, bool(tiers), held, step, returns)
        )
        faults_s = self._faults_s(faulted)
        trim_s = self._trimmed(recompute, bool(tiers), returns)
        predicted = base + (0.0 if quiet else self.hooks_s) + sum(c.cost_s for c in choices)
        predicted += faults_s + trim_s + self.checkpointed_s
        plain_faulted = self._faulted((), False, self.activation, step, False)
        base += self._faults_s(plain_faulted) + self._trimmed((), False, False)  # a plain step's
        peak = None
        measured = [s for s in self.profile.peak_steps() if s.peak_bytes is not None]
        if measured:  # the steps that took the real peak under the last plan that took it
            other = statistics.median(
                s.peak_bytes - self._effective_held(s.recomputed, s.held_bytes)  # type: ignore[operator]
                for s in measured
            )
            peak = max(0, int(other) + self._effective_held(recompute, held))
        return Plan(
            budget=self.budget,
            activation_bytes=self.activation,
            held_bytes=held,
            reachable_bytes=reachable,
            recompute=recompute,
            tiers=tiers,
            choices=tuple(choices),
            base_step_s=base,
            predicted_step_s=predicted,
            predicted_peak_bytes=peak,
            hooks_s=self.hooks_s,
            faulted_bytes=faulted,
            faults_s=faults_s,
            trim_s=trim_s,
            returns_memory=returns,
            checkpointed_s=self.checkpointed_s,
        )

    def _faulted(
        self,
        recompute: tuple[str, ...],
        moves: bool,
        held: int,
        step: StepRecord,
        returns: bool,
    ) -> int:
        """Rule 8: the pages a step of this plan faults in: as the steps that ran it did
        (this recompute, and moving or not), or as ``step`` (the measured medians) did,
        less the bytes it held and plus the plan's (``returns``: its steps hand memory back)."""
        profile = self.profile
        steps = _ran(recompute, moves, (*profile.history, *profile.quiet_history))
        if steps:
            return int(statistics.median(s.faulted_bytes for s in steps))
        estimate = step.faulted_bytes + self._effective_held(recompute, held)
        estimate -= self._effective_held(step.recomputed, step.held_bytes)
        if returns:
            estimate = max(estimate, self.activation)  # the pages its trims hand back
        return max(estimate, 0)

    def _trimmed(self, recompute: tuple[str, ...], moves: bool, returns: bool) -> float:
        """Rule 8: the seconds a step of this plan spends handing memory back: as the
        steps that ran it did, or, where its steps hand memory back (a disk spill's
        writer, or ``returns``: ``Auto``'s watch), as those that did."""
        profile = self.profile
        ran = (*profile.calibration_steps(), *profile.quiet_history)
        steps = _ran(recompute, moves, ran)
        if steps:
            return statistics.median(s.trim_s for s in steps)
        trimmed = [s.trim_s for s in ran if s.trim_s > 0]
        if trimmed and (moves or returns):
            return statistics.median(trimmed)
        return 0.0

    def _faults_s(self, faulted: int) -> float:
        if self.device == "cuda" or self.rates.refault <= 0:
            return 0.0  # rule 8: host pages; a CUDA step's kernels run while they fault
        return faulted / self.rates.refault

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
            (s.recompute_s, self._forward_of(s.recomputed))
            for s in (*steps, *self.profile.quiet_history)
            if s.recompute_s is not None and self._forward_of(s.recomputed) > 0
        ]
        if timed:
            factor = statistics.median(taken / forward for taken, forward in timed)
            self.recompute_factor = min(max(factor, 1 / CALIBRATION_SPREAD), CALIBRATION_SPREAD)
        clean = [s.seconds - self._cost_of(s) for s in steps if not s.moved] or [
            s.seconds - self._cost_of(s) for s in history if not s.moved
        ]
        quiet = [s.seconds - self._cost_of(s) for s in self.profile.quiet_history]
        if clean:
            self.base_s = statistics.median(clean)
        elif quiet:  # no hooked step moved nothing: the quiet steps' base and the hooks
            self.base_s = statistics.median(quiet)
            self.base_s += min(HOOK_S * len(self.sites), self.base_s / 2)
        else:  # on CUDA the policies' seconds overlap the kernels (rule 9)
            hidden = self.device == "cuda"
            self.base_s = statistics.median(
                s.seconds - (0.0 if hidden else s.policy_s) - self._cost_of(s) for s in steps[-3:]
            )
        if quiet and clean:
            self.hooks_s = max(self.base_s - statistics.median(quiet), 0.0)
        else:
            self.hooks_s = min(HOOK_S * len(self.sites), self.base_s / 2)
        per_byte: dict[str, list[tuple[float, int]]] = {}
        for s in self._moving_steps(steps):
            if len(s.moved) != 1 or (s.first_copy and self.device == "cuda"):
                continue  # rule 9: its copies include allocating pinned buffers
            ((tier, nbytes),) = s.moved.items()
            extra = s.seconds - self.base_s - self._cost_of(s)
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
        if "host" in per_byte and self.device == "cuda" and (clean or quiet):
            # What copies cost the steps, hidden or not; no floor: the link may hide them.
            self.copy_s_per_byte = weighted_median(per_byte["host"])
        if changes:
            self.rates = dataclasses.replace(self.rates, **changes)
        # What the modules the user checkpoints cost every step (rule 6): out of the base.
        self.checkpointed_s = max(min(self._checkpointed(steps), self.base_s / 2), 0.0)
        self.base_s -= self.checkpointed_s

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
        return self._forward_of(tuple(checkpointed)) * self.recompute_factor

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

    def _reachable(self) -> int:
        """The fewest bytes held (rule 5): every saving taken (the same greedy, budget 0),
        and never less than the largest tensor, which a session holds while it packs it.
        Asked only of a plan that does not fit: for one that fits, the largest tensor."""
        other = _Solver(self.profile, 0, self.device, self.rates)
        other.take_cheapest(True, lambda path: False)
        largest = max((record.nbytes for record in self.sites.values()), default=0)
        return max(other.held, largest)

    def _forward_of(self, recomputed: tuple[str, ...]) -> float:
        """Forward seconds of the modules a step recomputed (none inside another)."""
        return sum(self.modules[p].forward_s for p in _outermost(recomputed) if p in self.modules)

    def _cost_of(self, step: StepRecord) -> float:
        """What ``step`` spent past a plain step's work and moving bytes: its recompute,
        as timed in its backward or as the model says, the pages it faulted in, and its
        calls that handed memory back (rule 8)."""
        faults = self._faults_s(step.faulted_bytes) + step.trim_s
        outer = _outermost(step.recomputed)
        regions = sum(self.region_s(p) for p in outer if p in self.modules)
        if step.recompute_s is not None:
            return step.recompute_s + regions + faults
        return self._forward_of(step.recomputed) * self.recompute_factor + regions + faults

    def _effective_held(self, recomputed: tuple[str, ...], held: int) -> int:
        """Rule 6: the held bytes at the peak: when forward ends, or while backward recomputes."""
        peak = held
        for path in recomputed:
            record = self.modules.get(path)
            if record is None:
                continue
            before = sum(
                r.nbytes
                for site, r in self.sites.items()
                if r.order < record.first_order
                and not any(_under(site[0], m) for m in recomputed)
                and site not in self.moved
            )
            inside = sum(self.sites[site].nbytes for site in self.inside(path))
            peak = max(peak, before + record.input_bytes + inside)
        return peak


def _outermost(recomputed: tuple[str, ...]) -> list[str]:
    """The modules of ``recomputed`` that are inside no other of them."""
    return [p for p in recomputed if not any(_under(p, o) and p != o for o in recomputed)]


def _ran(recompute: tuple[str, ...], moves: bool, steps: Iterable[StepRecord]) -> list[StepRecord]:
    """The steps that ran a plan: its recompute, and moving bytes or not; warm ones once
    there are (NOTE [ Profile ] rule 6)."""
    same = [s for s in steps if s.recomputed == recompute and bool(s.moved) == moves]
    return [s for s in same if not s.cold] or same


def _index(
    modules: dict[str, ModuleRecord], sites: dict[Site, SiteRecord]
) -> dict[str, list[Site]]:
    """The sites saved inside each module (itself and the modules in it), by their paths."""
    inside: dict[str, list[Site]] = {path: [] for path in modules}
    for site in sites:
        parts = site[0].split(".")
        for end in range(1, len(parts) + 1):
            found = inside.get(".".join(parts[:end]))
            if found is not None:
                found.append(site)
    return inside


def _pooled(
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
    pooled = dict(modules)
    for paths in twins.values():
        if len(paths) > 1:
            median = statistics.median(modules[p].forward_s for p in paths)
            for path in paths:
                pooled[path] = dataclasses.replace(modules[path], forward_s=median)
    return pooled


@dataclass(frozen=True)
class _Option:
    """A saving the solver may take: its cost, bytes, place in the step, kind and target."""

    cost: float
    saved: int
    order: int
    kind: str
    target: object

    def rank(self) -> tuple[int, int]:
        """Cost per byte in steps of about 10%, then the earlier first (see take_cheapest)."""
        per_byte = self.cost / self.saved
        return (round(math.log(per_byte) / _BUCKET) if per_byte > 0 else -(10**9), self.order)


_BUCKET = math.log(1.1)


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


def _under(path: str, module: str) -> bool:
    """Whether ``path`` is ``module`` or a module inside it."""
    return path == module or path.startswith(module + ".")


def _site_name(site: Site) -> str:
    module, op, occurrence = site
    return f"{module or '(top level)'}:{op}#{occurrence}"
