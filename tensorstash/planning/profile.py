"""Profile: what a session measures each step, carried from one step to the next.

# NOTE [ Profile ]
1. A call site is where a tensor is saved: the module path, the operation that
   produced the tensor, and which occurrence of that pair it is in the step (a
   module called twice has two sites). Shapes are not part of it: a batch of
   another size or length keeps its sites, and their bytes scale.
2. A step runs from a session's enter, with grad enabled, to the end of the
   backward that uses it. The profile measures in it:
   - per site: bytes, pack order, whether the bytes left the device, and how
     long backward waited to unpack them;
   - per module (module steps, rule 6): calls, forward seconds (its
     submodules included), bytes of the tensors it is given, and whether it is
     safe to recompute: no buffer or input changed in place by it, not inside
     or around a region the user already checkpoints;
   - the step: forward and backward seconds, the eligible bytes held when
     forward ends, and the real peak memory growth (NOTE [ Real memory ]).
3. What saves nothing (``no_grad``) and evaluation forwards (the first module
   called is not in training) are not steps: they change nothing here. A
   training forward whose saved tensors are all under ``min_bytes`` is a step
   with no site: it has nothing to plan, and its steps run quiet (rule 8)
   like any plan that moves nothing; were it not counted, every one of its
   steps would be measured, with hooks (2x the step of a small MLP). Between
   steps that saved some (a short batch between long ones) it counts and
   records nothing: the sites, times and real peaks of the steps before it
   stay as they were (a 4-row batch that took a real peak sample and its
   module times made a plan for 512 rows from them, which held more than its
   budget).
4. The sites inside a module that the plan recomputes are not saved in its
   steps (its region's own hooks keep them): they keep what an earlier step
   measured.
5. A plan is made from the medians of the last few steps (``history``), so it
   changes only when a cost moves beyond its noise (see NOTE [ Plan ]). Steps
   that leave ``history`` are kept aside, the last few of each kind of move
   (the tiers a step moved bytes to, or none): what a plan that moves costs
   is known only against steps that move nothing, and stays known while
   another plan runs (``calibration_steps``).
6. Module timings cost a few microseconds per module call: they are taken in
   the first ``measure_steps`` steps, again in two steps every
   ``remeasure_every`` steps (not while the steps run quiet and recompute
   nothing: such a plan keeps every site whatever its modules cost, and one
   made again when the budget moves is made from the times taken; on the HF
   GPT-2 config at Auto's default budget, 2 cores, the first of each two
   took 1.5x no stash's step, running with hooks from a heap handed back to
   the OS, and a loop of 80 steps 1.032x no stash's mean step against 0.983x
   without them: ``benchmarks/quiet_loop.py``), and in the two steps after a
   site's bytes change
   (another batch shape), and, with ``measure_memory``, in the steps after one
   whose plan (the modules it recomputes, the tiers it moves bytes to) took the
   real peak in fewer than ``PEAK_SAMPLES`` (3) steps: a plan's real peak is
   predicted from steps that ran under it (backward's peak moves with what it
   recomputes), the median of what they held besides their saved bytes, and
   one step's real peak is not the next one's (on an HF GPT-2 config, 4
   layers, d=256, batch 4x128, 2 cores, no stash's ranged over 97-119 MiB in
   8 steps; predicted from one step, Auto's real peaks were off by up to 14%).
   Three, so that one step far off does not move the median: under bf16
   autocast at half its activation bytes, a plan there that spilled 6.5 MiB
   took 36.3 and 57.4 MiB in its first two samples, about one step in seven
   as high, and 35.9 MiB in the median of 8 later steps; predicted from two,
   its peak was 1.3x the measured one.
   A measured step whose own plan is such a plan takes its peak too (the
   first step of a new plan, measured anyway, is the first sample). These
   steps, and the first of each run of measured steps, take the real peak,
   each begun from a heap handed back to the OS (``malloc_trim`` under glibc):
   a training loop's warm heap reuses the last step's pages, and its steps
   would show no growth at all (NOTE [ Real memory ]). Such a step is cold:
   every page it touches is faulted in again, which made a module's forward
   time 2-3x what it is in training (HF GPT-2, 4 layers, d=256: a block 25 ms
   against 12 ms, its GELU 8 ms against 2.7 ms) and a step 1.5-2x. Its times
   count only until a warm step measured the same thing, and the plan is
   made again after that warm step, measured or not: a plan that first
   moved bytes in a cold step learns what moving cost only from it (NOTE
   [ Plan ] rule 9).
   A step in which the process imported Python modules takes no peak, and
   the next step takes it again: what an import allocates stays for good,
   and is no step's. The first ``torch.utils.checkpoint`` of a process
   imports ``torch._dynamo``, about 70 MiB and a second: on the bench's
   ``small`` model with every block recomputed, that step grew by 126-144
   MiB against 49-53 in the steps after, and the plan's predicted real peak
   was 2.4x the measured one. So ``Auto`` runs checkpointing once at the
   model's first call of the first step whose plan recomputes (never where
   no plan does: a run that fits imports nothing), and that step is measured
   from there (:meth:`Profile.set_up_ran`).
7. Times come from an injected clock; on CUDA, module and step times are
   taken with events, read once the step's backward has ended.
8. A quiet step (rule 10 of NOTE [ Session ]) records no site and times no
   module: it counts as a step (``steps``, so rule 6's cadence holds), and
   only its forward and backward seconds are taken, from the model's call to
   the end of the backward through its output (a hook on that one tensor; on
   CUDA, events read once they completed, never waited for), into
   ``quiet_history``: what a step costs with no hooks, beside ``history``,
   what it costs with them. The plan is made again after the first quiet
   step, and whenever their median time moves by more than ``QUIET_NOISE``:
   a plan made again once they filled ``quiet_history`` (to price it from
   their recompute) changed on the bf16 GPT-2 config at a quarter of its
   activation bytes, and the new plan's first steps, hooked, took 2-3 of
   the bench's 8 timed rounds (1.49-1.57x no stash's step, against
   1.31-1.38x). A step may be quiet only with the same model
   inputs (shapes and dtypes, positional and keyword) as the last step that
   recorded its sites: another batch shape changes the bytes the plan counts,
   and that step runs with hooks to measure them. Once ``quiet_history`` is
   full of steps of the plan, one quiet step in ``QUIET_TIMED_EVERY`` is
   timed: timing one (events, a hook on the output, a callback at backward's
   end, the page faults read) is about 0.3 ms of the 1.1 ms a quiet step
   added to the bench's ``tiny`` model on the CPU (one thread), and a quiet
   step added 0.9 ms to the 13 ms step of its ``medium`` model on an H200,
   a step bound by launching kernels.
9. A session may open quiet (rule 11 of NOTE [ Session ]) where the last
   step went quiet and the step opening measures nothing (rule 6: no module
   timing, no peak due). No step begins then: the model's call says whether
   the step stays quiet (the same inputs as the last recorded step, in
   training; :meth:`Profile.stays_quiet`), timed as rule 8 says from there,
   or the session wakes and the step begins at that call. A session that
   opened quiet and did not go quiet lets the next open as usual.
"""

from __future__ import annotations

import statistics
import sys
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from tensorstash.core._timers import CpuTimer, CudaTimer
from tensorstash.core.stats import StashStats
from tensorstash.memory import _pool
from tensorstash.memory._memory import CudaPeak, PeakRss, faulted_since, meter, minor_faults
from tensorstash.memory._trim import release_free_heap
from tensorstash.session import _modules
from tensorstash.tiers.recompute import (
    drop_recompute_seconds,
    drop_user_recompute_seconds,
    in_plan_region,
    is_checkpointed,
    take_recompute_seconds,
    take_user_recompute_seconds,
    use_clock,
)

STATE_VERSION = 3
"""The format of :meth:`Profile.state_dict`."""

HISTORY = 5
"""Steps whose measurements a plan is made from (their medians)."""

PEAK_SAMPLES = 3
"""Steps that take the real peak under each plan (rule 6): one step's real peak moves
by up to a tenth from the next one's, and now and then by a half."""

QUIET_NOISE = 0.25
"""How far the quiet steps' median time moves before the plan is made again (rule 8)."""

QUIET_TIMED_EVERY = 4
"""Once ``quiet_history`` is full, one quiet step in this many is timed (rule 8)."""

Site = tuple[str, str | None, int]
"""``(module, op, occurrence)``: rule 1 of NOTE [ Profile ]."""

ORDER = 1 << 16
"""Sites a module call may save before the next call's orders begin (see SiteRecord.order)."""


@dataclass(slots=True)
class SiteRecord:
    """One call site in one step.

    Attributes:
        order: where it is saved in the step: the module calls before it, then
            the packs in its module call (``ORDER`` of them per call); it does
            not change when other sites are recomputed and not saved.
        nbytes: the tensor's size.
        unpack_s: seconds backward spent in its unpacks (waiting included).
        offloaded: whether its bytes left the device.
    """

    order: int
    nbytes: int
    unpack_s: float = 0.0
    offloaded: bool = False


@dataclass(slots=True)
class ModuleRecord:
    """One module in one step (rule 2).

    Attributes:
        calls: how many times it ran.
        forward_s: seconds its calls took, submodules included.
        input_bytes: bytes of the tensors given to it that recompute would keep.
        first_order: the order a tensor saved first inside it would have.
        unsafe: why it must not be recomputed, or None.
        kind: its class name.
    """

    calls: int = 0
    forward_s: float = 0.0
    input_bytes: int = 0
    first_order: int = 0
    unsafe: str | None = None
    kind: str = ""


@dataclass(slots=True)
class StepRecord:
    """One step (rule 2).

    Attributes:
        forward_s, backward_s: seconds of forward and of backward.
        held_bytes: eligible bytes the device held when forward ended
            (:func:`device_held`).
        peak_bytes: real peak memory growth over the step, or None.
        recomputed: the modules the plan recomputed in it.
        policy_s: seconds the step spent in policies and waiting for them.
        moved: original bytes moved off the device, per tier ("host", "disk").
        cold: it began from a heap handed back to the OS, to take the real
            peak; its times are not those of training (rule 6).
        recompute_s: seconds backward spent recomputing the plan's modules,
            or None where they were not timed (NOTE [ Recompute ] rule 7).
        faulted_bytes: the pages the process faulted in over the step (minor
            faults times the page size; 0 where there is no ``getrusage``):
            fresh memory the step touched, memory a trim handed back to the OS
            included (NOTE [ Plan ] rule 8).
        trim_s: seconds the step's calls that handed memory back to the OS took
            (``StashStats.returned_seconds``, and the session pool's mapping and
            unmapping, ``PoolCounts.mapping_s``; NOTE [ Plan ] rule 8).
        checkpointed_s: seconds backward spent recomputing the modules the
            user wraps with ``recompute`` (NOTE [ Recompute ] rule 7), or None
            where none was timed.
        first_copy: it moved more bytes to the host tier than any step of
            this process before it: on CUDA it allocated the pinned buffers
            its copies use, and its time does not say what a copy costs
            (NOTE [ Plan ] rule 9).
    """

    forward_s: float
    backward_s: float
    held_bytes: int
    peak_bytes: int | None
    recomputed: tuple[str, ...] = ()
    policy_s: float = 0.0
    moved: dict[str, int] = field(default_factory=dict)
    cold: bool = False
    recompute_s: float | None = None
    faulted_bytes: int = 0
    trim_s: float = 0.0
    checkpointed_s: float | None = None
    first_copy: bool = False

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(eq=False)
class Profile:
    """Per-step measurements a session updates, carried from step to step (NOTE [ Profile ]).

    Pass the same profile to the session of every step:
    ``stash("auto", profile=profile)``. ``Auto`` plans from it from the second
    step on (NOTE [ Plan ] in plan.py): which modules to recompute and where
    each call site's tensors go, within its budget, at the least step time.

    Args:
        clock: seconds, monotonic; injected for tests.
        stall_s: an unpack taking longer than this stalled backward.
        measure_steps: steps whose module timings are always taken (rule 6).
        remeasure_every: then every this many steps; 0 never again.
        measure_memory: take the real peak memory of each step (it resets
            the process's or device's peak; NOTE [ Real memory ] in _memory.py).

    Example:
        >>> profile = tensorstash.Profile()
        >>> for batch in loader:
        ...     with tensorstash.stash("auto", profile=profile):
        ...         loss = model(batch)
        ...     loss.backward()
    """

    clock: Callable[[], float] = time.perf_counter
    stall_s: float = 0.002
    measure_steps: int = 3
    remeasure_every: int = 25
    measure_memory: bool = True
    steps: int = 0
    last: dict[Site, SiteRecord] = field(default_factory=dict)
    current: dict[Site, SiteRecord] = field(default_factory=dict)
    stalls: set[Site] = field(default_factory=set)
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))
    quiet_history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))
    aside: dict[frozenset[str], deque[StepRecord]] = field(default_factory=dict)
    inputs: tuple[Any, ...] | None = None
    module_history: deque[tuple[bool, dict[str, ModuleRecord]]] = field(
        default_factory=lambda: deque(maxlen=HISTORY)
    )
    peak: StepRecord | None = None
    peaks: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))
    codec_methods: dict[tuple[Any, ...], str] = field(default_factory=dict)
    _seen: Counter[tuple[Any, ...]] = field(default_factory=Counter)
    _step: _Step | None = None
    _objects: dict[str, weakref.ref[nn.Module]] = field(default_factory=dict)
    _root: weakref.ref[nn.Module] | None = None
    _root_name: str | None = None
    _remeasure: int = 0
    _measured_last: bool = False
    _cold_last: bool = False
    _revision: int = 0
    _plans: dict[Any, tuple[int, int, Any]] = field(default_factory=dict)
    _warned: set[int] = field(default_factory=set)
    _peak_counts: Counter[tuple[Any, ...]] = field(default_factory=Counter)
    _quiet: list[_QuietStep] = field(default_factory=list)
    _quiet_seen: float | None = None
    _quiet_untimed = 0  # quiet steps not timed since the last timed one (rule 8)
    _idle = False  # the last step ran quiet and recomputed nothing (rule 6)
    _quiet_last = False  # the last step went quiet: the next may open quiet (rule 9)
    _most_copied = 0  # the most bytes a step of this process moved to host (first_copy)

    def __getstate__(self) -> dict[str, Any]:
        """What pickles (a spawned process's copy): the measurements, not the live links.

        The step in progress, the module objects and the plans made are left
        out; the copy finds the modules again by their paths.
        """
        state = dict(self.__dict__)
        state.update(_step=None, _objects={}, _root=None, _plans={}, _quiet=[], _quiet_last=False)
        return state

    # -- a step ---------------------------------------------------------------------

    def begin(self, ctx: Any, min_bytes: int) -> _Step | None:
        """A session opens: start a step (rules 2 and 3), or None under ``no_grad``.

        The step before, if its backward never came, is dropped.
        """
        self._step = None
        self._read_quiet(final=False)
        if not torch.is_grad_enabled():
            return None  # evaluation: the next training step may still open quiet (rule 9)
        self._quiet_last = False  # earned again by this step going quiet (went_quiet)
        self._seen.clear()
        self.current = {}
        measure = self._measures()
        self._idle = False  # earned again by this step going quiet (went_quiet)
        # The first of a run, or the step that takes a new plan's peak (rule 6).
        cold = measure and (not self._measured_last or self.peak_due)
        self._measured_last = measure
        drop_user_recompute_seconds()  # left by backwards that were not this profile's
        step = _Step(self, ctx, min_bytes, measure=measure, cold=cold)
        self._step = step
        return step

    def _measures(self) -> bool:
        """Whether the step beginning measures (rule 6); it counts down ``_remeasure``."""
        measure = self._measure_due()
        self._remeasure = max(self._remeasure - 1, 0)
        return measure

    def _measure_due(self) -> bool:
        if self.steps < self.measure_steps or not self.modules or self._remeasure:
            return True
        if self.peak_due:
            return True
        every = self.remeasure_every
        return bool(every) and self.steps % every in (0, 1) and not self._idle

    def may_open_quiet(self) -> bool:
        """Whether a session opening now may leave its hooks off until the model's call
        (rule 9): the last step went quiet, and this one measures nothing."""
        return self._quiet_last and self.root is not None and not self._measure_due()

    def began_quiet(self) -> None:
        """A session opened quiet (rule 9): take the times of quiet steps that ended."""
        self._step = None
        self._read_quiet(final=False)

    def did_not_stay_quiet(self) -> None:
        """A session that opened quiet did not go quiet at the model's call (rule 9):
        the next opens as a session does."""
        self._quiet_last = False

    @property
    def peak_due(self) -> bool:
        """Whether the next step takes the real peak for the plan of the last one: fewer
        than PEAK_SAMPLES steps took it under that plan (rule 6)."""
        return bool(self.history) and self._needs_peak(_plan_of(self.history[-1]))

    def _needs_peak(self, plan: tuple[Any, ...]) -> bool:
        """Rule 6: fewer than PEAK_SAMPLES steps took the real peak under ``plan``."""
        return self.measure_memory and self._peak_counts[plan] < PEAK_SAMPLES

    def _finished(self, step: _Step, record: StepRecord | None) -> None:
        """A step's backward ended (or it was not a step: ``record`` is None)."""
        if self._step is step:
            self._step = None
        if record is None:
            return
        if not self.current and self.last:  # rule 3: nothing saved between steps that saved
            self.steps += 1
            return
        resized = any(
            site in self.last and self.last[site].nbytes != rec.nbytes
            for site, rec in self.current.items()
        )
        if self.current:  # a step that saved nothing eligible keeps the sites (rule 3)
            carried = {
                site: rec
                for site, rec in self.last.items()
                if site not in self.current and _inside(site[0], record.recomputed)
            }  # rule 4
            self.last = {**carried, **self.current}
        self.current = {}
        self.inputs = step.inputs
        self.steps += 1
        for site, rec in self.last.items():
            if rec.offloaded and rec.unpack_s > self.stall_s:
                self.stalls.add(site)
            elif rec.offloaded:
                self.stalls.discard(site)
        if len(self.history) == self.history.maxlen:  # rule 5: kept by what it moved
            left = self.history[0]
            kind = frozenset(left.moved)
            self.aside.setdefault(kind, deque(maxlen=HISTORY)).append(left)
        self.history.append(record)
        if record.peak_bytes is not None:
            self.peak = record
            self.peaks.append(record)
            self._peak_counts[_plan_of(record)] += 1
        if step.modules:
            measured = {path: rec for path, rec in step.modules.items() if rec.calls}
            self.module_history.append((record.cold, measured))
            self.modules = _median_modules(self.module_history)
        if resized:
            self._remeasure = 2  # rule 6: measure the new shapes
        # Rule 6: a cold step's times count until a warm one measured the same plan.
        warmed = self._cold_last and not record.cold
        self._cold_last = record.cold
        if resized or step.measure or warmed:
            self._revision += 1  # the plan is made again (rule 5)

    # -- what the session records ---------------------------------------------------

    def site(self, module: str, tensor: Tensor) -> Site:
        """The call site of a tensor being saved now (rule 1)."""
        grad_fn = tensor.grad_fn
        op = type(grad_fn).__name__ if grad_fn is not None else None
        key = (module, op)
        self._seen[key] += 1
        return (module, op, self._seen[key])

    def record_pack(self, site: Site, nbytes: int) -> SiteRecord:
        step = self._step
        if step is None:
            order = len(self.current)
        else:
            order = step.calls * ORDER + step.packs
            step.packs += 1
        record = SiteRecord(order, nbytes)
        self.current[site] = record
        return record

    def stalled(self, site: Site) -> bool:
        """Whether unpacking this site stalled backward the last time it was offloaded."""
        return site in self.stalls

    # -- quiet steps (rule 8) -------------------------------------------------------------

    def model_called(self, inputs: tuple[Any, ...]) -> bool:
        """The model was called with ``inputs`` (:func:`signature`): whether the step may be quiet.

        It may where the step measures nothing (no module timings, no peak
        due) and the inputs are those of the last step that recorded its sites.
        """
        step = self._step
        if step is None:
            return False
        step.inputs = inputs
        return not step.measure and step.training is not False and inputs == self.inputs

    def stays_quiet(self, root: nn.Module, inputs: tuple[Any, ...]) -> bool:
        """The model was called in a session that opened quiet (rule 9): whether the
        step may stay quiet, as :meth:`model_called` says of a step that began."""
        return root.training and inputs == self.inputs

    def went_quiet(
        self,
        root: nn.Module,
        recomputed: tuple[str, ...],
        *,
        timed: bool = False,
        opened: tuple[torch.device, Any] | None = None,
    ) -> _QuietStep | None:
        """The session runs this step as plain autograd: time it and nothing else (rule 8).

        None where the step is not timed: the profile has the quiet steps it
        needs of this plan, and ``timed`` (the caller waits for its end) is False.
        ``opened`` is the device and the session's stats of a session that
        opened quiet (rule 9), where no step began.
        """
        step = self._step
        if step is not None:
            step.cancel()
            device, stats, faults = step.device, step.ctx.stats, step.faults
        elif opened is not None:
            (device, stats), faults = opened, None
            # Left by untimed quiet steps: a step that began took them (recomputing).
            self.drop_recompute_seconds(recomputed)
            drop_user_recompute_seconds()
        else:
            return None
        self._quiet_last = True
        self.steps += 1
        self._idle = not recomputed  # rule 6: no module timing decides its plan
        history = self.quiet_history
        known = len(history) == history.maxlen and history[-1].recomputed == recomputed
        if known and not timed and self._quiet_untimed < QUIET_TIMED_EVERY - 1:
            self._quiet_untimed += 1
            return None
        self._quiet_untimed = 0
        if faults is None and device.type != "cuda":
            faults = minor_faults()
        quiet = _QuietStep(self, root, device, recomputed, stats, faults)
        self._quiet.append(quiet)
        return quiet

    def _read_quiet(self, *, final: bool) -> None:
        """Take the times of quiet steps whose backward ended and whose events completed."""
        if not self._quiet:
            return
        pending = []
        taken = False
        for quiet in self._quiet:
            if quiet.forward_end is None:
                quiet.abandon()  # its forward never ended (it raised): its hook goes
                continue
            record = quiet.record(final=final)
            if record is not None:
                self.quiet_history.append(record)
                taken = True
            elif not quiet.over():
                pending.append(quiet)
        for old in pending[:-2]:
            old.abandon()  # no step waits on more than the two before it
        self._quiet = pending[-2:]
        if taken:
            # A plan's quiet base (NOTE [ Plan ] rule 7) is made again once it moved
            # beyond its noise: the plan changes only then (rule 5).
            now = statistics.median(rec.seconds for rec in self.quiet_history)
            seen = self._quiet_seen
            if seen is None or abs(now - seen) > QUIET_NOISE * seen:
                self._quiet_seen = now
                self._revision += 1

    # -- modules -------------------------------------------------------------------------

    def take_recompute_seconds(self, paths: tuple[str, ...]) -> float | None:
        """What backward spent recomputing the modules at ``paths`` since last asked
        (NOTE [ Recompute ] rule 7), or None where none was timed."""
        return take_recompute_seconds(m for m in map(self.module, paths) if m is not None)

    def drop_recompute_seconds(self, paths: tuple[str, ...]) -> None:
        """Forget, unread, what backward spent recomputing the modules at ``paths``."""
        drop_recompute_seconds(m for m in map(self.module, paths) if m is not None)

    def module(self, path: str) -> nn.Module | None:
        """The module object at ``path``, as last seen, or found in the root by its path."""
        ref = self._objects.get(path)
        found = ref() if ref is not None else None
        if found is not None:
            return found
        root = self._root() if self._root is not None else None
        if root is None:
            return None
        for name, child in root.named_modules():
            name = name.removeprefix("_orig_mod").removeprefix(".")
            if name == path:
                self._objects[path] = weakref.ref(child)
                return child
        return None

    @property
    def learning(self) -> bool:
        """Whether no step was measured yet: the step now measures the model as it is."""
        return not self.history

    @property
    def root(self) -> nn.Module | None:
        """The first module called in the last step (the model), while it lives."""
        return self._root() if self._root is not None else None

    def saw_root(self, module: nn.Module) -> None:
        if self._root is not None and self._root() is module:
            return  # named by the step that first saw it (a session that opened quiet has
            # no module on the stack to name it by)
        self._root = weakref.ref(module)
        self._root_name = _modules.current()

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What this profile learned, as lists, strings and numbers (for a checkpoint).

        :meth:`load_state_dict` restores it; the modules are found again by
        their paths in the first model called after.
        """
        self._read_quiet(final=True)
        sites = [
            {
                "module": module,
                "op": op,
                "occurrence": occurrence,
                "order": record.order,
                "nbytes": record.nbytes,
                "unpack_s": record.unpack_s,
                "offloaded": record.offloaded,
                "stalled": (module, op, occurrence) in self.stalls,
            }
            for (module, op, occurrence), record in self.last.items()
        ]
        methods = [
            [op, str(dtype).removeprefix("torch."), list(shape), list(stride), method]
            for (op, dtype, shape, stride), method in self.codec_methods.items()
        ]
        return {
            "version": STATE_VERSION,
            "steps": self.steps,
            "sites": sites,
            "modules": [{"path": path, **_module_row(rec)} for path, rec in self.modules.items()],
            "history": [_step_row(rec) for rec in self.history],
            "quiet_history": [_step_row(rec) for rec in self.quiet_history],
            "aside": [_step_row(rec) for kept in self.aside.values() for rec in kept],
            "inputs": None if self.inputs is None else _inputs_row(self.inputs),
            "peak": None if self.peak is None else _step_row(self.peak),
            "peaks": [_step_row(rec) for rec in self.peaks],
            "codec_methods": methods,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make ``state`` (from :meth:`state_dict`) what this profile learned.

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
            site = (row["module"], row["op"], int(row["occurrence"]))
            last[site] = SiteRecord(
                int(row["order"]), int(row["nbytes"]), row["unpack_s"], row["offloaded"]
            )
            if row["stalled"]:
                stalls.add(site)
        self.steps, self.last, self.current, self.stalls = int(state["steps"]), last, {}, stalls
        self.modules = {row["path"]: _module_record(row) for row in state["modules"]}
        self.module_history = deque([(False, dict(self.modules))], maxlen=HISTORY)
        self.history = deque((_step_record(row) for row in state["history"]), maxlen=HISTORY)
        self.quiet_history = deque(
            (_step_record(row) for row in state.get("quiet_history", ())), maxlen=HISTORY
        )
        self.aside = {}
        for row in state.get("aside", ()):  # absent in older states
            record = _step_record(row)
            self.aside.setdefault(frozenset(record.moved), deque(maxlen=HISTORY)).append(record)
        inputs = state.get("inputs")
        self.inputs = None if inputs is None else _inputs_record(inputs)
        self.peak = None if state["peak"] is None else _step_record(state["peak"])
        peaks = [_step_record(row) for row in state.get("peaks", ())]  # absent in older states
        if not peaks and self.peak is not None:
            peaks = [self.peak]
        self.peaks = deque(peaks, maxlen=HISTORY)
        # What was learnt counts as learnt: a loaded plan takes no more cold steps.
        self._peak_counts = Counter({_plan_of(rec): PEAK_SAMPLES for rec in self.peaks})
        self.codec_methods = {
            (op, getattr(torch, dtype), tuple(shape), tuple(stride)): method
            for op, dtype, shape, stride, method in state["codec_methods"]
        }
        self._objects, self._root = {}, None

    # -- for the plan ----------------------------------------------------------------

    def plan_for(self, key: Any, budget: int, make: Callable[[], Any]) -> Any:
        """The plan for ``budget`` and options ``key``, made again only once the
        measurements changed: after a step that timed modules or saw other sizes (rule 5).

        A plan that keeps everything serves every budget its bytes fit (Auto's
        default budget, half of the free memory, moves a little every step).
        """
        found = self._plans.get(key)
        if found is not None and found[0] == self._revision:
            _, made_for, plan = found
            if made_for == budget or (plan is not None and plan.keeps_all(budget)):
                return plan
        plan = make()
        self._plans[key] = (self._revision, budget, plan)
        return plan

    def recomputing(self, paths: tuple[str, ...], moves: frozenset[str] = frozenset()) -> None:
        """The plan recomputes ``paths`` in the step being measured (rule 4), and moves
        bytes to the tiers ``moves`` ("host", "disk").

        A measured step that runs a plan under which fewer than
        :data:`PEAK_SAMPLES` steps took the real peak takes it (rule 6).
        """
        step = self._step
        if step is not None:
            step.recomputed = paths
            # Seconds left from a step whose backward never ended are not this step's.
            self.drop_recompute_seconds(paths)
            if step.measure and self._needs_peak((paths, moves)):  # as _plan_of names it
                step.take_peak()

    def set_up_ran(self) -> None:
        """A one-time set-up ran at the model's first call, before its forward: the step
        being measured is timed, and its memory and faults taken, from now (rule 6)."""
        if self._step is not None:
            self._step.restart()

    def peak_steps(self) -> list[StepRecord]:
        """The steps that took the real peak under the plan of the last one (rule 6)."""
        if self.peak is None:
            return []
        plan = _plan_of(self.peak)
        return [rec for rec in self.peaks if _plan_of(rec) == plan] or [self.peak]

    def warn_unreachable(self, budget: int) -> bool:
        """True the first time a budget turns out unreachable (one warning per budget)."""
        if budget in self._warned:
            return False
        self._warned.add(budget)
        return True

    def measured(self) -> StepRecord | None:
        """The medians of the last steps with the plan of the last step (rule 5).

        Warm steps only, once there is one (rule 6). The real peak is not
        among them: it is :attr:`peak`'s, the last step that took it.
        """
        if not self.history:
            return None
        recomputed = self.history[-1].recomputed
        same = [rec for rec in self.history if rec.recomputed == recomputed]
        same = [rec for rec in same if not rec.cold] or same
        return StepRecord(
            forward_s=statistics.median(rec.forward_s for rec in same),
            backward_s=statistics.median(rec.backward_s for rec in same),
            held_bytes=int(statistics.median(rec.held_bytes for rec in same)),
            peak_bytes=None,
            recomputed=recomputed,
            policy_s=statistics.median(rec.policy_s for rec in same),
            moved=same[-1].moved,
            faulted_bytes=int(statistics.median(rec.faulted_bytes for rec in same)),
            trim_s=statistics.median(rec.trim_s for rec in same),
        )

    def calibration_steps(self) -> list[StepRecord]:
        """The last steps (``history``), and of the steps that left it, the last few
        of each kind of move (the tiers moved to, or none) that ``history`` lacks.

        A plan learns what moving a byte costs from steps that moved bytes,
        against a base from steps that moved none (NOTE [ Plan ] rule 6).
        Once a plan that never moves (or always moves) has run a few steps,
        the last few steps of the other kind are all that says what that kind cost: without
        them the next plan would be made as if it had never been measured, and
        would try again what was measured to cost more.
        """
        kinds = {frozenset(record.moved) for record in self.history}
        earlier = [rec for kind, kept in self.aside.items() if kind not in kinds for rec in kept]
        return [*earlier, *self.history]


def _mapping_s() -> float:
    """Seconds the session pool spent mapping and unmapping blocks so far, on every
    thread (NOTE [ Plan ] rule 8); 0.0 where it is not built."""
    pooled = _pool.counts()
    return 0.0 if pooled is None else pooled.mapping_s


def _inside(path: str, modules: tuple[str, ...]) -> bool:
    return any(path == m or path.startswith(m + ".") for m in modules)


def _plan_of(record: StepRecord) -> tuple[Any, ...]:
    """What a step's plan did, for rule 6: the modules it recomputed and the tiers it moved to
    (not their bytes, which change with the batch's shape)."""
    return (record.recomputed, frozenset(record.moved))


def _median_modules(
    steps: deque[tuple[bool, dict[str, ModuleRecord]]],
) -> dict[str, ModuleRecord]:
    """Each module's median over the steps that measured it (rule 5), warm ones once
    there are (rule 6); unsafe once, unsafe."""
    paths = {path for _, step in steps for path in step}
    merged: dict[str, ModuleRecord] = {}
    for path in paths:
        records = [step[path] for _, step in steps if path in step]
        warm = [step[path] for cold, step in steps if path in step and not cold]
        latest = records[-1]
        merged[path] = ModuleRecord(
            calls=latest.calls,
            forward_s=statistics.median(rec.forward_s for rec in warm or records),
            input_bytes=latest.input_bytes,
            first_order=latest.first_order,
            unsafe=next((rec.unsafe for rec in records if rec.unsafe), None),
            kind=latest.kind,
        )
    return merged


def _module_row(record: ModuleRecord) -> dict[str, Any]:
    return {
        "calls": record.calls,
        "forward_s": record.forward_s,
        "input_bytes": record.input_bytes,
        "first_order": record.first_order,
        "unsafe": record.unsafe,
        "kind": record.kind,
    }


def _module_record(row: dict[str, Any]) -> ModuleRecord:
    return ModuleRecord(
        int(row["calls"]),
        float(row["forward_s"]),
        int(row["input_bytes"]),
        int(row["first_order"]),
        row["unsafe"],
        str(row["kind"]),
    )


def _step_row(record: StepRecord) -> dict[str, Any]:
    return {
        "forward_s": record.forward_s,
        "backward_s": record.backward_s,
        "held_bytes": record.held_bytes,
        "peak_bytes": record.peak_bytes,
        "recomputed": list(record.recomputed),
        "policy_s": record.policy_s,
        "moved": dict(record.moved),
        "cold": record.cold,
        "recompute_s": record.recompute_s,
        "faulted_bytes": record.faulted_bytes,
        "trim_s": record.trim_s,
        "checkpointed_s": record.checkpointed_s,
        "first_copy": record.first_copy,
    }


def _step_record(row: dict[str, Any]) -> StepRecord:
    return StepRecord(
        float(row["forward_s"]),
        float(row["backward_s"]),
        int(row["held_bytes"]),
        None if row["peak_bytes"] is None else int(row["peak_bytes"]),
        tuple(row["recomputed"]),
        float(row["policy_s"]),
        {str(tier): int(n) for tier, n in row["moved"].items()},
        bool(row["cold"]),
        None if row["recompute_s"] is None else float(row["recompute_s"]),
        faulted_bytes=int(row.get("faulted_bytes", 0)),  # absent in older states
        trim_s=float(row.get("trim_s", 0.0)),
        checkpointed_s=None if row.get("checkpointed_s") is None else float(row["checkpointed_s"]),
        first_copy=bool(row.get("first_copy", False)),
    )


# -- measuring one step ----------------------------------------------------------------------


class _Call:
    """A module call in progress: when it began and what it may change in place."""

    __slots__ = ("buffers", "inputs", "module", "path", "start")

    def __init__(self, module: nn.Module, path: str, start: Any) -> None:
        self.module = module
        self.path = path
        self.start = start
        self.buffers: list[tuple[Tensor, int]] = []
        self.inputs: list[tuple[Tensor, int]] = []


class _Step:
    """One step being measured (rule 2): a module observer, then the backward's end.

    The session calls :meth:`end_forward` when it exits and :meth:`backward_started`
    at its first unpack; the end of that backward (an autograd callback)
    closes the step.
    """

    def __init__(
        self, profile: Profile, ctx: Any, min_bytes: int, *, measure: bool, cold: bool
    ) -> None:
        self.profile = profile
        self.ctx = ctx
        self.min_bytes = min_bytes
        self.measure = measure
        self.cold = cold and profile.measure_memory
        self.modules: dict[str, ModuleRecord] = {}
        self.recomputed: tuple[str, ...] = ()
        self.training: bool | None = None
        self.calls = 0  # module calls so far, and packs since the last one (site orders)
        self.packs = 0
        self._calls: list[_Call] = []
        self._timer: CpuTimer | CudaTimer = CpuTimer(profile.clock)
        self._meter: PeakRss | CudaPeak | None = None
        self._begun = self._timer.mark()
        self.faults = minor_faults()
        self._mapped = _mapping_s()
        self._forward_end: Any = None
        self._held = 0
        self._backward = False
        self._timings: list[tuple[str, Any, Any]] = []
        self.policy_s = 0.0
        self.inputs: tuple[Any, ...] | None = None  # the model's inputs (rule 8)
        self.device = torch.device("cpu")
        if self.cold:
            self._start_meter()
        self._imported = len(sys.modules)  # a step that imports takes no peak (rule 6)
        self._unobserve = _modules.observe(self)

    def _start_meter(self) -> None:
        """Rule 6: from a heap handed back to the OS, or a warm heap that reuses the
        last step's pages shows a step growing by nothing."""
        if self.device.type == "cuda":
            self._meter = meter(self.device, sync=False)
        else:
            release_free_heap()
            self._meter = PeakRss()
        self._meter.start()

    def restart(self) -> None:
        """Measure from now: what ran since the step began (before any module) is not its."""
        self._begun = self._timer.mark()
        self.faults = minor_faults()
        self._mapped = _mapping_s()
        self._imported = len(sys.modules)
        if self._meter is not None:
            self._meter.stop()
            self._start_meter()

    def take_peak(self) -> None:
        """Take the real peak of this step, from here on (before its forward runs): it is cold."""
        if self.cold:
            return
        self.cold = True
        self._start_meter()

    def use_device(self, device: torch.device) -> None:
        """The step runs on ``device`` (known at the first module call)."""
        self.device = device
        if device.type == "cuda" and isinstance(self._timer, CpuTimer):
            self._timer = CudaTimer(device)
            self._begun = self._timer.mark()
            if self._meter is not None:
                self._meter.stop()
                self._meter = meter(device, sync=False)
                self._meter.start()

    # Module observer (rule 2) -----------------------------------------------------------

    def entered(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        profile = self.profile
        self.calls += 1
        self.packs = 0
        path = _modules.current()
        if len(_modules._stack()) == 1 and self.training is None:  # a root: the model
            self.training = module.training
            profile.saw_root(module)
            device = _device_of(module, args)
            if device is not None:
                self.use_device(device)
        if not self.measure or not self.training:
            return
        profile._objects[path] = weakref.ref(module)
        call = _Call(module, path, self._timer.mark())
        call.buffers = [(b, b._version) for b in module._buffers.values() if b is not None]
        call.inputs = [(t, t._version) for t in args if isinstance(t, Tensor)]
        record = self.modules.get(path)
        if record is None:
            record = self.modules[path] = ModuleRecord(
                first_order=self.calls * ORDER, kind=type(module).__name__
            )
            record.input_bytes = sum(
                t.nbytes
                for t, _ in call.inputs
                if t.grad_fn is not None and t.nbytes >= self.min_bytes
            )
            record.unsafe = _already_checkpointed(module)
            if record.unsafe == ALREADY_RECOMPUTED:
                use_clock(module, profile.clock)  # its recompute, timed alike
        record.calls += 1
        self._calls.append(call)

    def left(self, module: nn.Module) -> None:
        calls = self._calls
        if not calls or calls[-1].module is not module:
            # A call inside this one that never told us it left (its module
            # stack was reset) is dropped untimed, so this call is still timed.
            inner = [i for i, call in enumerate(calls) if call.module is module]
            if not inner:
                return
            del calls[inner[-1] + 1 :]
        call = calls.pop()
        self._timings.append((call.path, call.start, self._timer.mark()))
        record = self.modules[call.path]
        if record.unsafe is None:
            if any(b._version != v for b, v in call.buffers):
                record.unsafe = "changes its buffers in forward (as BatchNorm in training)"
            elif any(t._version != v for t, v in call.inputs):
                record.unsafe = "changes its input in place"

    def cancel(self) -> None:
        """The step runs quiet (rule 8): stop observing it; it records nothing."""
        self._unobserve()
        if self._meter is not None:
            self._meter.stop()
            self._meter = None
        if self.profile._step is self:
            self.profile._step = None

    # The session's calls -----------------------------------------------------------------

    def end_forward(self) -> None:
        """Forward ended: the session exited, or backward began inside it (its first unpack).

        Whichever comes first; the eligible bytes the session holds then are
        the step's held bytes.
        """
        if self._forward_end is not None:
            return
        self._unobserve()
        self._forward_end = self._timer.mark()
        self._held = device_held(self.ctx.stats, self.device)

    def session_exited(self) -> None:
        """The session exited (after its backward, or before it)."""
        self.end_forward()
        if not self._backward and not self._a_step():
            self.profile._finished(self, None)  # rule 3: not a step

    def backward_started(self) -> None:
        """The first unpack of the step: close the step when this backward ends."""
        if self._backward:
            return
        self._backward = True
        self.end_forward()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _a_step(self) -> bool:
        """Rule 3: a training forward that saved an eligible tensor, or saved only
        tensors under ``min_bytes`` in modules in training (a step with nothing to plan)."""
        if self.training is False:
            return False
        if self.profile.current:
            return True
        stats = self.ctx.stats
        hot = stats.hot
        packed = hot.tensors + hot.small_tensors + sum(t.tensors for t in stats.tiers.values())
        return self.training is True and packed > 0

    def _backward_ended(self) -> None:
        if not self._a_step():
            self.profile._finished(self, None)  # rule 3: not a step
            return
        end = self._timer.mark()
        peak = self._meter.stop() if self._meter is not None else None
        if isinstance(self._meter, PeakRss) and len(sys.modules) != self._imported:
            peak = None  # rule 6: the modules imported stay; the next step takes the peak
        stats = self.ctx.stats
        self.policy_s = stats.pack_seconds + stats.unpack_seconds + stats.wait_seconds
        moved = {tier: stats.tiers[tier].bytes for tier in ("host", "disk")}
        timer = self._timer
        for path, start, stop in self._timings:
            self.modules[path].forward_s += timer.seconds(start, stop)
        recompute_s = self.profile.take_recompute_seconds(self.recomputed)
        checkpointed_s = take_user_recompute_seconds()
        first_copy = moved["host"] > self.profile._most_copied
        self.profile._most_copied = max(self.profile._most_copied, moved["host"])
        record = StepRecord(
            forward_s=timer.seconds(self._begun, self._forward_end),
            backward_s=timer.seconds(self._forward_end, end),
            held_bytes=self._held,
            peak_bytes=peak,
            recomputed=self.recomputed,
            policy_s=self.policy_s,
            moved={tier: nbytes for tier, nbytes in moved.items() if nbytes},
            cold=self.cold,
            recompute_s=recompute_s,
            faulted_bytes=faulted_since(self.faults) or 0,
            trim_s=stats.returned_seconds + _mapping_s() - self._mapped,
            checkpointed_s=checkpointed_s,
            first_copy=first_copy,
        )
        self.profile._finished(self, record)


class _QuietStep:
    """A step run as plain autograd (rule 8): timed from the model's call to its backward's end.

    The end of forward is the model's output; the end of backward is an
    autograd callback queued when the gradient reaches that output (a hook on
    that one tensor). ``ended`` turns True then, or when the output is freed
    without a backward, or when two later steps began and it still waits.
    """

    def __init__(
        self,
        profile: Profile,
        root: nn.Module,
        device: torch.device,
        recomputed: tuple[str, ...],
        stats: Any = None,
        faults: int | None = None,
    ) -> None:
        self.profile = weakref.ref(profile)
        self.recomputed = recomputed
        self.stats = stats  # the session's: its trim thread counts its calls there
        self.trims = self._returning()
        self.trim_s = 0.0
        self.timer: CpuTimer | CudaTimer = (
            CudaTimer(device) if device.type == "cuda" else CpuTimer(profile.clock)
        )
        self.begun = self.timer.mark()
        # Counted from the session's start (read there: a getrusage is a system call, and
        # on a busy 2-core machine one right after torch's kernels waits for a core); none
        # on CUDA, where the pages are host memory and not priced (NOTE [ Plan ] rule 8).
        self.faults = None if device.type == "cuda" else faults
        self.faulted = 0
        self.forward_end: Any = None
        self.end: Any = None
        self.ended = False
        self.when_ended: list[Callable[[], object]] = []  # called once, as it ends
        self._queued = False
        self._handle = root.register_forward_hook(self._forward_ended)

    def _forward_ended(self, module: nn.Module, args: Any, output: Any) -> None:
        self._handle.remove()
        self.forward_end = self.timer.mark()
        tensor = next(
            (t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad),
            None,
        )
        if tensor is None:
            self._end()  # no backward goes through the model's output
            return
        tensor.register_hook(self._backward_reached)
        weakref.finalize(tensor, self._freed)

    def _backward_reached(self, grad: Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end()  # what ends with the step (Auto's lease on the session pool) is in its time
        self.end = self.timer.mark()
        self.faulted = faulted_since(self.faults) or 0
        self.trim_s = self._returning() - self.trims

    def _returning(self) -> float:
        """Seconds spent handing memory back so far: the session's trims and the session
        pool's mapping and unmapping (NOTE [ Plan ] rule 8)."""
        return (0.0 if self.stats is None else self.stats.returned_seconds) + _mapping_s()

    def _freed(self) -> None:
        self._end()

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        for call in self.when_ended:
            call()
        self.when_ended = []

    def over(self) -> bool:
        """Whether nothing more will come of it: it ended, and its times were taken or lost."""
        return self.ended and self.end is None

    def abandon(self) -> None:
        self._handle.remove()
        self.ended, self.end = True, None

    def record(self, *, final: bool) -> StepRecord | None:
        """Its times, once its backward ended and (on CUDA) its events completed.

        ``final`` waits for the events instead of asking again later.
        """
        if self.end is None or self.forward_end is None:
            return None
        if not final and not self.timer.done(self.end):
            return None
        profile = self.profile()
        recompute_s = None if profile is None else profile.take_recompute_seconds(self.recomputed)
        checkpointed_s = take_user_recompute_seconds()
        timer = self.timer
        self.end, end = None, self.end
        return StepRecord(
            forward_s=timer.seconds(self.begun, self.forward_end),
            backward_s=timer.seconds(self.forward_end, end),
            held_bytes=0,
            peak_bytes=None,
            recomputed=self.recomputed,
            recompute_s=recompute_s,
            faulted_bytes=self.faulted,
            trim_s=self.trim_s,
            checkpointed_s=checkpointed_s,
        )


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The shapes and dtypes of the tensors a model is called with (rule 8)."""
    plain = not kwargs and all(type(a) is Tensor for a in args)  # the common call: no pytree
    leaves = args if plain else tree_leaves((args, kwargs))
    return tuple(
        (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for t in leaves
        if isinstance(t, Tensor)
    )


def _inputs_row(inputs: tuple[Any, ...]) -> list[Any]:
    return [[list(shape), dtype] for shape, dtype in inputs]


def _inputs_record(row: list[Any]) -> tuple[Any, ...]:
    return tuple((tuple(shape), str(dtype)) for shape, dtype in row)


ALREADY_RECOMPUTED = (
    "already recomputed (tensorstash.recompute or Hugging Face gradient checkpointing)"
)
"""``ModuleRecord.unsafe`` of a module the user checkpoints itself (its backward recomputes it)."""


def _already_checkpointed(module: nn.Module) -> str | None:
    """Why ``module`` must not be recomputed again: the user already checkpoints it or around it."""
    if is_checkpointed(module):
        return ALREADY_RECOMPUTED
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    checkpointed = getattr(top[0], "__module__", None) == "torch.utils.checkpoint" if top else False
    if checkpointed and not in_plan_region():
        return "runs inside a region already checkpointed"
    return None


def device_held(stats: StashStats, device: torch.device) -> int:
    """The eligible saved bytes a session holds on ``device`` (NOTE [ Plan ] rule 1).

    On the CPU the host is the device: bytes kept and bytes in the host tier
    (compressed, or waiting for the disk writer) are all in its RAM. On CUDA
    the host tier's bytes are in host RAM, not on the device: a step's real
    peak there (``max_memory_allocated``) holds only what stayed. Counted as
    held, they made the real peak predicted for a plan that copies to the
    host too low by the bytes copied (the bench's ``large`` on an H200, at
    half its activation bytes: 2.7 GiB predicted, 7.6 GiB measured, 5.0 GiB
    copied).
    """
    tiers = stats.tiers
    held = tiers["kept"].live_bytes + stats.hot.live
    if device.type == "cpu":
        held += tiers["host"].live_bytes
    return held


def _device_of(module: nn.Module, args: tuple[Any, ...]) -> torch.device | None:
    for value in args:
        if isinstance(value, Tensor):
            return value.device
    for parameter in module.parameters():
        return parameter.device
    return None
