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
   steps would be measured, with hooks. Between steps that saved some (a
   short batch between long ones) it counts and records nothing: the sites,
   times and real peaks of the steps before it stay as they were, or the plan
   for the long batches would be made from the short batch's real peak and
   module times, and hold more than its budget.
4. The sites inside a module that the plan recomputes are not saved in its
   steps (its region's own hooks keep them): they keep what an earlier step
   measured.
5. A plan is made from the medians of the last few steps (``history``), so it
   changes only when a cost moves beyond its noise (see NOTE [ Plan ]). Steps
   that leave ``history`` are kept aside, the last few of each kind of move
   (the tiers a step moved bytes to, or none): what a plan that moves costs
   is known only against steps that move nothing, and stays known while
   another plan runs (``calibration_steps``).
6. Module timings cost time in every module call: they are taken in the
   first ``measure_steps`` steps, again in two steps every
   ``remeasure_every`` steps (not while the steps run quiet and recompute
   nothing: such a plan keeps every site whatever its modules cost, and one
   made again when the budget moves is made from the times taken, so timing
   them again would only run those steps with hooks, the first from a heap
   handed back to the OS), and in the two steps after a site's bytes change
   (another batch shape), and, with ``measure_memory``, in the steps after one
   whose plan (the modules it recomputes, the tiers it moves bytes to) took the
   real peak in fewer than ``PEAK_SAMPLES`` (3) steps: a plan's real peak is
   predicted from steps that ran under it (backward's peak moves with what it
   recomputes), the median of what they held besides their saved bytes, and
   one step's real peak is not the next one's. Three, so that one step far
   off does not move the median (the median of two is their mean, which one
   step far off moves by half its distance).
   A measured step whose own plan is such a plan takes its peak too (the
   first step of a new plan, measured anyway, is the first sample). These
   steps, and the first of each run of measured steps, take the real peak,
   each begun from a heap handed back to the OS (``malloc_trim`` under glibc):
   a training loop's warm heap reuses the last step's pages, and its steps
   would show no growth at all (NOTE [ Real memory ]). Such a step is cold:
   every page it touches is faulted in again, which slows its modules'
   forward and the whole step well past their times in training.
   Its times count only until a warm step measured the same thing, and the
   plan is made again after that warm step, measured or not: a plan that
   first moved bytes in a cold step learns what moving cost only from it
   (NOTE [ Plan ] rule 9).
   A step in which the process imported Python modules takes no peak, and
   the next step takes it again: what an import allocates stays for good,
   and is no step's. The first ``torch.utils.checkpoint`` of a process
   imports ``torch._dynamo``, whose memory and import time would be counted
   as the step's and as its plan's. So ``Auto`` runs checkpointing once at the
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
   step, and whenever their median time moves by more than ``QUIET_NOISE``,
   not when they fill ``quiet_history``: a plan made again then (to price it
   from their recompute) may change, and the new plan's first steps run
   with hooks, which costs more than its better prices gain. A step may be
   quiet only with the same model
   inputs (shapes and dtypes, positional and keyword) as the last step that
   recorded its sites: another batch shape changes the bytes the plan counts,
   and that step runs with hooks to measure them. Once ``quiet_history`` is
   full of steps of the plan, one quiet step in ``QUIET_TIMED_EVERY`` is
   timed: timing one (events, a hook on the output, a callback at backward's
   end, the page faults read) is a large part of what a quiet step adds to a
   small model's step, and a step bound by launching kernels (on a GPU) pays
   all the host time a quiet step adds.
9. A session may open quiet (rule 11 of NOTE [ Session ]) where the last
   step went quiet and the step opening measures nothing (rule 6: no module
   timing, no peak due). No step begins then: the model's call says whether
   the step stays quiet (the same inputs as the last recorded step, in
   training; :meth:`Profile.stays_quiet`), timed as rule 8 says from there,
   or the session wakes and the step begins at that call. A session that
   opened quiet and did not go quiet lets the next open as usual.

The measurements that back these rules, with the command, date and machine of
each, are in ``docs/figures/profile.md``. The parts: the records
(``_records.py``), the cadence (``_schedule.py``), the measuring of one step
(``_measure.py``) and the checkpoint's format (``_persist.py``).
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tensorstash.planning._measure import QuietStep, Step, device_held, read_quiet
from tensorstash.planning._persist import STATE_VERSION, load_into, state_of
from tensorstash.planning._records import (
    ALREADY_RECOMPUTED,
    HISTORY,
    ORDER,
    ModuleRecord,
    Site,
    SiteRecord,
    StepRecord,
    inside,
    median_modules,
    median_step,
    plan_of,
    signature,
)
from tensorstash.planning._schedule import (
    PEAK_SAMPLES,
    QUIET_NOISE,
    QUIET_TIMED_EVERY,
    Schedule,
)
from tensorstash.session import _modules
from tensorstash.tiers.recompute import (
    drop_recompute_seconds,
    drop_user_recompute_seconds,
    take_recompute_seconds,
)

__all__ = [
    "ALREADY_RECOMPUTED",
    "HISTORY",
    "ORDER",
    "PEAK_SAMPLES",
    "QUIET_NOISE",
    "QUIET_TIMED_EVERY",
    "STATE_VERSION",
    "ModuleRecord",
    "Profile",
    "Site",
    "SiteRecord",
    "StepRecord",
    "device_held",
    "signature",
]


@dataclass(eq=False)
class Profile:
    """Per-step measurements a session updates, carried from step to step (NOTE [ Profile ]).

    Pass the same profile to the session of every step:
    ``stash("auto", profile=profile)``. ``Auto`` plans from it from the second
    step on (NOTE [ Plan ] in plan.py): which modules to recompute and where
    each call site's tensors go, within its budget, at the least step time.

    Args:
        clock: seconds, monotonic; injected for tests.
        stall_s: an unpack taking longer than this stalled backward (seconds, >= 0).
        measure_steps: steps whose module timings are always taken (rule 6; at
            least 1: a plan is made from what a step measured).
        remeasure_every: then every this many steps; 0 never again.
        measure_memory: take the real peak memory of each step (it resets
            the process's or device's peak; NOTE [ Real memory ] in _memory.py).

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range, with
            what to pass instead. What a profile learns is not an argument: it
            starts empty, or from :meth:`load_state_dict`.

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
    # What the profile learns (not arguments: it starts empty, or from load_state_dict).
    steps: int = field(default=0, init=False)
    last: dict[Site, SiteRecord] = field(default_factory=dict, init=False)
    current: dict[Site, SiteRecord] = field(default_factory=dict, init=False)
    stalls: set[Site] = field(default_factory=set, init=False)
    modules: dict[str, ModuleRecord] = field(default_factory=dict, init=False)
    history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY), init=False)
    quiet_history: deque[StepRecord] = field(
        default_factory=lambda: deque(maxlen=HISTORY), init=False
    )
    aside: dict[frozenset[str], deque[StepRecord]] = field(default_factory=dict, init=False)
    inputs: tuple[Any, ...] | None = field(default=None, init=False)
    module_history: deque[tuple[bool, dict[str, ModuleRecord]]] = field(
        default_factory=lambda: deque(maxlen=HISTORY), init=False
    )
    peak: StepRecord | None = field(default=None, init=False)
    peaks: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=HISTORY), init=False)
    codec_methods: dict[tuple[Any, ...], str] = field(default_factory=dict, init=False)
    _seen: Counter[tuple[Any, ...]] = field(default_factory=Counter, init=False)
    _step: Step | None = field(default=None, init=False)
    _objects: dict[str, weakref.ref[nn.Module]] = field(default_factory=dict, init=False)
    _root: weakref.ref[nn.Module] | None = field(default=None, init=False)
    _root_name: str | None = field(default=None, init=False)
    # When steps measure (rule 6).
    _schedule: Schedule = field(default_factory=Schedule, init=False)
    _warned: set[int] = field(default_factory=set, init=False)
    # Quiet steps waiting for their times (rule 8).
    _quiet: list[QuietStep] = field(default_factory=list, init=False)
    _most_moved: dict[str, int] = field(default_factory=dict, init=False)  # per tier

    def __post_init__(self) -> None:
        api = "tensorstash.Profile"
        if not callable(self.clock):
            raise TypeError(
                f"{api}: clock must be callable as clock() -> seconds (monotonic), such as "
                f"time.perf_counter; got {self.clock!r}"
            )
        stall = self.stall_s
        if isinstance(stall, bool) or not isinstance(stall, (int, float)):
            raise TypeError(f"{api}: stall_s must be seconds (a number); got {stall!r}")
        if not 0 <= stall < math.inf:
            raise ValueError(
                f"{api}: stall_s must be finite seconds >= 0 (an unpack slower than it "
                f"stalled backward; 0.002 by default); got {stall}"
            )
        counts = {
            "measure_steps": (1, "the first step always measures: a plan is made from it"),
            "remeasure_every": (0, "0 never measures again after measure_steps"),
        }
        for name, (least, why) in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{api}: {name} must be a whole number of steps; got {value!r}")
            if value < least:
                raise ValueError(f"{api}: {name} must be >= {least} ({why}); got {value}")
        if not isinstance(self.measure_memory, bool):
            raise TypeError(
                f"{api}: measure_memory must be True or False; got {self.measure_memory!r}"
            )

    def __getstate__(self) -> dict[str, Any]:
        """What pickles (a spawned process's copy): the measurements, not the live links.

        The step in progress, the module objects and the plans made are left
        out; the copy finds the modules again by their paths.
        """
        state = dict(self.__dict__)
        state.update(
            _step=None, _objects={}, _root=None, _quiet=[], _schedule=self._schedule.copied()
        )
        return state

    # -- a step ---------------------------------------------------------------------

    def begin(self, ctx: Any, min_bytes: int) -> Step | None:
        """A session opens: start a step (rules 2 and 3), or None under ``no_grad``.

        The step before, if its backward never came, is dropped.
        """
        self._step = None
        self._read_quiet(final=False)
        if not torch.is_grad_enabled():
            return None  # evaluation: the next training step may still open quiet (rule 9)
        self._seen.clear()
        self.current = {}
        measure = self._measures()
        cold = self._schedule.began(measure, self.peak_due)
        drop_user_recompute_seconds()  # left by backwards that were not this profile's
        step = Step(self, ctx, min_bytes, measure=measure, cold=cold)
        self._step = step
        return step

    def _measures(self) -> bool:
        """Whether the step beginning measures (rule 6); it counts the step down."""
        measure = self._measure_due()
        self._schedule.count_down()
        return measure

    def _measure_due(self) -> bool:
        return self._schedule.due(
            steps=self.steps,
            measure_steps=self.measure_steps,
            remeasure_every=self.remeasure_every,
            timed=bool(self.modules),
            peak_due=self.peak_due,
        )

    def may_open_quiet(self) -> bool:
        """Whether a session opening now may leave its hooks off until the model's call
        (rule 9): the last step went quiet, and this one measures nothing."""
        return self._schedule.quiet_last and self.root is not None and not self._measure_due()

    def began_quiet(self) -> None:
        """A session opened quiet (rule 9): take the times of quiet steps that ended."""
        self._step = None
        self._read_quiet(final=False)

    def did_not_stay_quiet(self) -> None:
        """A session that opened quiet did not go quiet at the model's call (rule 9):
        the next opens as a session does."""
        self._schedule.quiet_last = False

    @property
    def peak_due(self) -> bool:
        """Whether the next step takes the real peak for the plan of the last one: fewer
        than PEAK_SAMPLES steps took it under that plan (rule 6)."""
        return bool(self.history) and self._needs_peak(plan_of(self.history[-1]))

    def _needs_peak(self, plan: tuple[Any, ...]) -> bool:
        """Rule 6: fewer than PEAK_SAMPLES steps took the real peak under ``plan``."""
        return self.measure_memory and self._schedule.needs_peak(plan)

    def _finished(self, step: Step, record: StepRecord | None) -> None:
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
                if site not in self.current and inside(site[0], record.recomputed)
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
        if step.modules:
            measured = {path: rec for path, rec in step.modules.items() if rec.calls}
            self.module_history.append((record.cold, measured))
            self.modules = median_modules(self.module_history)
        self._schedule.ended(record, resized=resized, measured=step.measure)

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
    ) -> QuietStep | None:
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
        self.steps += 1
        history = self.quiet_history
        known = len(history) == history.maxlen and history[-1].recomputed == recomputed
        if not self._schedule.went_quiet(recomputes=bool(recomputed), known=known, timed=timed):
            return None
        quiet = QuietStep(self, root, device, recomputed, stats, faults)
        self._quiet.append(quiet)
        return quiet

    def _read_quiet(self, *, final: bool) -> None:
        """Take the times of quiet steps whose backward ended and whose events completed."""
        if not self._quiet:
            return
        records, self._quiet = read_quiet(self._quiet, final=final)
        if records:
            self.quiet_history.extend(records)
            now = statistics.median(rec.seconds for rec in self.quiet_history)
            self._schedule.quiet_median(now)

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
        return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make ``state`` (from :meth:`state_dict`) what this profile learned.

        Raises:
            ValueError: the state is not one :meth:`state_dict` of this version wrote.
        """
        load_into(self, state)
        self._schedule.loaded(plan_of(rec) for rec in self.peaks)
        self._objects, self._root = {}, None

    # -- for the plan ----------------------------------------------------------------

    def plan_for(self, key: Any, budget: int, make: Callable[[], Any]) -> Any:
        """The plan for ``budget`` and options ``key``, made again only once the
        measurements changed: after a step that timed modules or saw other sizes (rule 5).

        A plan that keeps everything serves every budget its bytes fit (Auto's
        default budget, half of the free memory, moves a little every step).
        """
        return self._schedule.plan_for(key, budget, make)

    def recomputing(
        self, paths: tuple[str, ...], moves: frozenset[str] = frozenset(), *, peak: bool = False
    ) -> None:
        """The plan recomputes ``paths`` in the step being measured (rule 4), and moves
        bytes to the tiers ``moves`` ("host", "disk").

        A measured step that runs a plan under which fewer than
        :data:`PEAK_SAMPLES` steps took the real peak takes it (rule 6); with ``peak``
        (a memory limit's steps: NOTE [ Memory limit ] rule 3), any step that does.
        """
        step = self._step
        if step is not None:
            step.recomputed = paths
            # Seconds left from a step whose backward never ended are not this step's.
            self.drop_recompute_seconds(paths)
            if (step.measure or peak) and self._needs_peak((paths, moves)):  # as plan_of
                step.take_peak()

    def needs_peak(self, kind: tuple[tuple[str, ...], frozenset[str]]) -> bool:
        """Whether fewer than :data:`PEAK_SAMPLES` steps took the real peak under a plan
        of ``kind`` (``Plan.kind``: what it recomputes, the tiers it moves to; rule 6)."""
        return self._needs_peak(kind)

    def planned_room(self, room: int) -> None:
        """The step being measured runs under a memory limit that leaves it ``room``
        bytes over its base (NOTE [ Memory limit ] rule 6 compares its peak with it)."""
        if self._step is not None:
            self._step.room = room

    def overrun(self) -> int:
        """NOTE [ Memory limit ] rule 6: the second most a recent step that took the real
        peak went past the room it was planned for (0 where fewer than two did)."""
        over = sorted(
            rec.peak_bytes - rec.room_bytes
            for rec in self.peaks
            if rec.peak_bytes is not None and rec.room_bytes is not None
        )
        return max(0, over[-2]) if over[1:] else 0

    def set_up_ran(self) -> None:
        """A one-time set-up ran at the model's first call, before its forward: the step
        being measured is timed, and its memory and faults taken, from now (rule 6)."""
        if self._step is not None:
            self._step.restart()

    def peak_steps(self) -> list[StepRecord]:
        """The steps that took the real peak under the plan of the last one (rule 6)."""
        if self.peak is None:
            return []
        plan = plan_of(self.peak)
        return [rec for rec in self.peaks if plan_of(rec) == plan] or [self.peak]

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
        return median_step(self.history)

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
