"""When a profile's step measures (NOTE [ Profile ] rule 6 in profile.py), which quiet steps
are timed (rule 8), when a session may open quiet (rule 9), and when the plan is made
again (rules 5, 6 and 8).

The profile keeps its settings (``measure_steps``, ``remeasure_every``,
``measure_memory``) and what it measured; :class:`Schedule` keeps what the
cadence remembers from one step to the next, and is told each step's facts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tensorstash.planning._records import StepRecord, plan_of

PEAK_SAMPLES = 3
"""Steps that take the real peak under each plan (rule 6): one step's real peak is not the
next one's, and now and then far from it; the median of three leaves one such step out."""

QUIET_NOISE = 0.25
"""How far the quiet steps' median time moves before the plan is made again (rule 8)."""

QUIET_TIMED_EVERY = 4
"""Once ``quiet_history`` is full, one quiet step in this many is timed (rule 8)."""


@dataclass(eq=False)
class Schedule:
    """What a profile's cadence remembers between steps (rules 5, 6, 8 and 9).

    Attributes:
        revision: counts the times the measurements changed enough for the plan
            to be made again (rule 5); plans are cached per revision.
        remeasure: steps still to measure after a site's bytes changed (rule 6).
        measured_last: the last step measured (the first of a run is cold).
        cold_last: the last step was cold (the next warm one makes the plan again).
        idle: the last step ran quiet and recomputed nothing (rule 6).
        quiet_last: the last step went quiet: the next may open quiet (rule 9).
        quiet_untimed: quiet steps not timed since the last timed one (rule 8).
        quiet_seen: the quiet steps' median time when the plan was last made again.
        peak_counts: per plan (:func:`plan_of`), the steps that took its real peak.
        plans: per key, the revision and budget a plan was made for, and the plan.
    """

    revision: int = 0
    remeasure: int = 0
    measured_last: bool = False
    cold_last: bool = False
    idle: bool = False
    quiet_last: bool = False
    quiet_untimed: int = 0
    quiet_seen: float | None = None
    peak_counts: Counter[tuple[Any, ...]] = field(default_factory=Counter)
    plans: dict[Any, tuple[int, int, Any]] = field(default_factory=dict)

    def due(
        self, *, steps: int, measure_steps: int, remeasure_every: int, timed: bool, peak_due: bool
    ) -> bool:
        """Whether the step beginning after ``steps`` steps measures (rule 6).

        Args:
            steps: the steps the profile counted.
            measure_steps, remeasure_every: the profile's settings.
            timed: some module timings were taken already.
            peak_due: the plan of the last step needs more samples of its real peak.
        """
        if steps < measure_steps or not timed or self.remeasure or peak_due:
            return True
        return bool(remeasure_every) and steps % remeasure_every in (0, 1) and not self.idle

    def count_down(self) -> None:
        """A step begins: one step fewer is left of those that measure new shapes (rule 6)."""
        self.remeasure = max(self.remeasure - 1, 0)

    def began(self, measure: bool, peak_due: bool) -> bool:
        """A step began (it measures where ``measure``): whether it takes the real peak,
        cold. The first of a run of measured steps does, and so does the step that takes
        a new plan's peak (rule 6)."""
        # Both are earned again by this step going quiet (went_quiet).
        self.quiet_last = False
        self.idle = False
        cold = measure and (not self.measured_last or peak_due)
        self.measured_last = measure
        return cold

    def needs_peak(self, plan: tuple[Any, ...]) -> bool:
        """Rule 6: fewer than PEAK_SAMPLES steps took the real peak under ``plan``."""
        return self.peak_counts[plan] < PEAK_SAMPLES

    def ended(self, record: StepRecord, *, resized: bool, measured: bool) -> None:
        """A step that recorded its sites ended as ``record``; ``resized``: a site's bytes
        changed; ``measured``: it timed modules."""
        if record.peak_bytes is not None:
            self.peak_counts[plan_of(record)] += 1
        if resized:
            self.remeasure = 2  # rule 6: measure the new shapes
        # Rule 6: a cold step's times count until a warm one measured the same plan.
        warmed = self.cold_last and not record.cold
        self.cold_last = record.cold
        if resized or measured or warmed:
            self.revision += 1  # the plan is made again (rule 5)

    def went_quiet(self, *, recomputes: bool, known: bool, timed: bool) -> bool:
        """A step went quiet (rule 8): whether it is timed.

        Args:
            recomputes: its plan recomputes modules (module timings still decide it).
            known: ``quiet_history`` is full of steps of its plan.
            timed: the caller waits for the step's end, and times it anyway.
        """
        self.quiet_last = True
        self.idle = not recomputes  # rule 6: no module timing decides its plan
        if known and not timed and self.quiet_untimed < QUIET_TIMED_EVERY - 1:
            self.quiet_untimed += 1
            return False
        self.quiet_untimed = 0
        return True

    def quiet_median(self, seconds: float) -> None:
        """The quiet steps' median time is ``seconds``: a plan's quiet base (NOTE [ Plan ]
        rule 7) is made again once it moved beyond its noise, and the plan changes only
        then (rule 5)."""
        seen = self.quiet_seen
        if seen is None or abs(seconds - seen) > QUIET_NOISE * seen:
            self.quiet_seen = seconds
            self.revision += 1

    def loaded(self, plans: Iterable[tuple[Any, ...]]) -> None:
        """Steps under ``plans`` took the real peak in a saved state: what was learnt counts
        as learnt, and a loaded plan takes no more cold steps."""
        self.peak_counts = Counter(dict.fromkeys(plans, PEAK_SAMPLES))

    def plan_for(self, key: Any, budget: int, make: Callable[[], Any]) -> Any:
        """The plan cached for ``key`` where the measurements did not change since, and
        it was made for ``budget`` or keeps everything within it; else ``make()``."""
        found = self.plans.get(key)
        if found is not None and found[0] == self.revision:
            _, made_for, plan = found
            if made_for == budget or (plan is not None and plan.keeps_all(budget)):
                return plan
        plan = make()
        self.plans[key] = (self.revision, budget, plan)
        return plan

    def copied(self) -> Schedule:
        """What a pickled copy of the profile keeps: no plan made, and no step that went
        quiet (a spawned process opens its first session as usual)."""
        return replace(self, quiet_last=False, plans={})
