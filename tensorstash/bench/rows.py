"""One variant's result, summarised from its steps: medians of same-round ratios.

Rule 9 of NOTE [ Fair comparison ] (rounds.py): every ratio is the median over
the timed rounds of a ratio taken inside one round, never a ratio of medians.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from tensorstash.bench.measure import StepResult
from tensorstash.bench.variants import AUTO_PREFIX
from tensorstash.core.stats import TIERS

NAN = float("nan")


@dataclass(frozen=True)
class Row:
    """One variant's result in one dtype (see NOTE [ Fair comparison ] for how it is measured).

    Attributes:
        policy: the variant's name.
        dtype: "float32", or "bfloat16" (the forward under autocast).
        step_s: median seconds of a forward and backward over the timed steps.
        overhead: median over the timed rounds of the step over the step of
            "none" in the same round.
        real_peak_bytes: median over the timed steps of the real peak growth
            (NOTE [ Real memory ] in memory/_memory.py: resident set on the CPU,
            allocated memory on CUDA).
        peak_vs_none: median over the timed rounds of the real peak over that
            of "none" in the same round.
        grads_equal: every step's gradients bitwise equal to plain autograd's
            (None for a skipped row: nothing was checked).
        grads_close: every step's gradients within float tolerance of them.
        tiers: the stash's per-tier counters of the last step (None without a session).
        stash_peak_bytes: per tier, the most stored bytes the stash counted at
            once over the timed steps: what it counted, not what the process
            held ("disk" counts bytes from pack on, those still waiting for
            the writer included, which are in RAM). Quiet steps count nothing
            and are left out (None if every step was quiet).
        quiet_steps: the timed steps that ran as plain autograd (Auto's plan
            moved nothing: NOTE [ Quiet steps ] in auto.py).
        compression_ratio: original over stored bytes of what left the device
            (None without a session).
        step_times, step_overheads, step_peak_bytes: per timed step, in order.
        activation_bytes: the eligible bytes one step saves (a Keep session's
            kept peak).
        limit_bytes: what an ``auto:<limit>`` row's steps may add to their base,
            in bytes (each step's limit is its base plus this).
        plain_growth: no stash's real peak growth over a step, the base of a limit
            given as a share.
        over_limit: of the timed steps, those whose real peak growth went past
            ``limit_bytes`` (an ``auto:<limit>`` row).
        predicted_step_s, predicted_peak_bytes: the planner's prediction
            (``session.plan``), median over the timed steps that had one.
        step_over_predicted, peak_over_predicted: median over those steps of
            the measurement over the prediction of the same step. For the step
            time, the ratios are of overheads: the step over none's in the
            same round, over the predicted step over the plan's base (its step
            with nothing moved). A shared machine's speed drifts between the
            steps a plan learns from and the steps it predicts; none's step in
            the same round carries that drift, and the ratio cancels it
            (rule 9 of the NOTE). A variant that wraps the blocks itself
            ("recompute") has a base that recomputes them all: its ratio is the
            step over the predicted step. A plan for compiled code has no base:
            its ratio is the step over the predicted step too.
        plan_recompute: the modules the last timed step's plan recomputed.
        plan_compiler: what the last timed step's plan asked the compiler for (a
            plan for compiled code), else None.
        plan_advice: where that plan's budget buys no real memory, which budget
            would (rule 11 of NOTE [ Compiled code ]), else None.
        no_plan_step_times, no_plan_peak_bytes: with ``twins``, each timed step
            of the same Auto without a plan (rule 6 of the NOTE).
        skipped: why the variant did not run (an optional peer), else None.
        timeline: memory over one untimed step (``--plot``), else None.
        warmup_steps: the untimed steps it ran before the timed ones: the
            warm-up rounds, and the rounds added while a planner learned
            (rule 3 of the NOTE).
        graphs: the graphs torch.compile compiled in its steps, warm-up included
            (NOTE [ Compiled runs ] rule 5 in compiled.py).
        timed_graphs: those compiled in its timed steps (a recompile loop).
        compile_s: the seconds its steps that compiled took beyond its median
            timed step (None: none compiled).
    """

    policy: str
    dtype: str
    step_s: float
    overhead: float
    real_peak_bytes: int | None
    peak_vs_none: float
    grads_equal: bool | None
    tiers: dict[str, dict[str, int]] | None = None
    stash_peak_bytes: dict[str, int] | None = None
    quiet_steps: int = 0
    compression_ratio: float | None = None
    step_times: tuple[float, ...] = ()
    step_overheads: tuple[float, ...] = ()
    step_peak_bytes: tuple[int, ...] = ()
    activation_bytes: int | None = None
    limit_bytes: int | None = None
    plain_growth: int | None = None
    over_limit: int | None = None
    predicted_step_s: float | None = None
    predicted_peak_bytes: int | None = None
    step_over_predicted: float | None = None
    peak_over_predicted: float | None = None
    plan_recompute: tuple[str, ...] = ()
    plan_compiler: str | None = None
    plan_advice: str | None = None
    no_plan_step_times: tuple[float, ...] = ()
    no_plan_peak_bytes: tuple[int, ...] = ()
    skipped: str | None = None
    timeline: dict[str, Any] | None = None
    warmup_steps: int = 0
    graphs: int = 0
    timed_graphs: int = 0
    compile_s: float | None = None
    grads_close: bool | None = None

    @classmethod
    def skip(cls, policy: str, dtype: str, reason: str) -> Row:
        """The row of a variant that could not run here, and why."""
        return cls(policy, dtype, NAN, NAN, None, NAN, grads_equal=None, skipped=reason)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (NaN, for what was not measured, as None)."""
        data = asdict(self)
        for name, value in data.items():
            if isinstance(value, tuple):
                data[name] = list(value)
            elif isinstance(value, float) and not math.isfinite(value):
                data[name] = None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        """The row :meth:`to_dict` wrote (e.g. read back from ``--json``)."""
        values = dict(data)
        for field in fields(cls):
            value = values.get(field.name)
            if field.name in _FLOATS and value is None:
                values[field.name] = NAN
            elif isinstance(value, list):
                values[field.name] = tuple(value)
        return cls(**values)

    def plan_effect(self) -> PlanEffect | None:
        """Rule 6 of the NOTE: this row's timed steps against its twin without a plan.

        None unless an ``auto:<budget>`` row has its twin's steps (``twins``).
        """
        twin = self.no_plan_step_times
        if not self.policy.startswith(AUTO_PREFIX) or not twin:
            return None
        return PlanEffect(
            steps=len(twin),
            ratio=same_round_median(self.step_times, twin),
            step_s=statistics.median(self.step_times),
            no_plan_step_s=statistics.median(twin),
            peak_bytes=int(statistics.median(self.step_peak_bytes)),
            no_plan_peak_bytes=int(statistics.median(self.no_plan_peak_bytes)),
        )


_FLOATS = ("step_s", "overhead", "peak_vs_none")


@dataclass(frozen=True)
class PlanEffect:
    """Auto following its plan against its twin without one (see :meth:`Row.plan_effect`).

    Attributes:
        steps: the timed steps compared.
        ratio: median over them of the row's step over its twin's, same round.
        step_s, no_plan_step_s: median step time of each.
        peak_bytes, no_plan_peak_bytes: median real peak of each.
    """

    steps: int
    ratio: float
    step_s: float
    no_plan_step_s: float
    peak_bytes: int
    no_plan_peak_bytes: int


def same_round_median(values: Sequence[float], baseline: Sequence[float]) -> float:
    """Median of ``value / base`` over rounds where the base is positive (NaN if none is)."""
    ratios = [v / b for v, b in zip(values, baseline, strict=True) if b > 0]
    return statistics.median(ratios) if ratios else NAN


def summarize(
    name: str,
    dtype: str,
    steps: list[StepResult],
    baseline: list[StepResult],
    checked: Iterable[StepResult] = (),
) -> Row:
    """A variant's row from its timed steps and those of "none" in the same rounds.

    Args:
        name: the variant.
        dtype: the run's dtype name.
        steps: its timed steps, one per round.
        baseline: the timed steps of "none", one per round.
        checked: its other steps (warm-up), whose gradients count too.
    """
    checked = list(checked)
    times = tuple(r.seconds for r in steps)
    peaks = tuple(r.peak_bytes for r in steps)
    last = steps[-1].stats
    plans = [(r, r.plan) for r in steps if r.plan is not None]
    overheads = tuple(
        r.seconds / b.seconds if b.seconds > 0 else NAN
        for r, b in zip(steps, baseline, strict=True)
    )
    step_plans = [(r.seconds, p.predicted_step_s) for r, p in plans if p.predicted_step_s]
    # A plan's base is a plain step, nothing recomputed or moved, the blocks a variant
    # recomputes itself ("recompute") included: its prediction adds them.
    overhead_plans = [
        (overhead, p.predicted_step_s / p.base_step_s)
        for r, overhead in zip(steps, overheads, strict=True)
        if (p := r.plan) is not None and p.predicted_step_s and p.base_step_s
    ]
    peak_plans = [
        (r.peak_bytes, p.predicted_peak_bytes) for r, p in plans if p.predicted_peak_bytes
    ]
    return Row(
        policy=name,
        dtype=dtype,
        step_s=statistics.median(times),
        overhead=same_round_median(times, [r.seconds for r in baseline]),
        real_peak_bytes=int(statistics.median(peaks)),
        peak_vs_none=same_round_median(peaks, [r.peak_bytes for r in baseline]),
        grads_equal=all(r.grads_equal for r in (*checked, *steps)),
        grads_close=all(r.grads_close for r in (*checked, *steps)),
        tiers=None if last is None else last["tiers"],
        stash_peak_bytes=_stash_peaks(steps),
        quiet_steps=sum(1 for r in steps if _quiet(r)),
        compression_ratio=None if last is None else float(last["compression_ratio"]),
        step_times=times,
        step_overheads=overheads,
        step_peak_bytes=peaks,
        predicted_step_s=_median_of(p for _, p in step_plans),
        predicted_peak_bytes=_int_or_none(_median_of(p for _, p in peak_plans)),
        # A plan with no base (compiled code's: its steps at the default partitioner are
        # not all timed) is held against the steps themselves.
        step_over_predicted=_median_of(m / p for m, p in overhead_plans or step_plans),
        peak_over_predicted=_median_of(m / p for m, p in peak_plans),
        plan_recompute=plans[-1][1].recompute if plans else (),
        plan_compiler=plans[-1][1].compiler if plans else None,
        plan_advice=plans[-1][1].advice if plans else None,
        warmup_steps=len(checked),
        graphs=sum(r.graphs for r in (*checked, *steps)),
        timed_graphs=sum(r.graphs for r in steps),
        compile_s=_compile_seconds([*checked, *steps], statistics.median(times)),
    )


def _compile_seconds(steps: list[StepResult], step_s: float) -> float | None:
    """Rule 5 of NOTE [ Compiled runs ]: what the steps that compiled took beyond a step."""
    compiling = [r.seconds for r in steps if r.graphs]
    return sum(max(0.0, s - step_s) for s in compiling) if compiling else None


def _stash_peaks(steps: list[StepResult]) -> dict[str, int] | None:
    """Per tier, the largest ``peak_bytes`` over the steps that counted (None: none did)."""
    counted = [r.stats["tiers"] for r in steps if r.stats is not None and not _quiet(r)]
    if not counted:
        return None
    return {tier: max(int(tiers[tier]["peak_bytes"]) for tiers in counted) for tier in TIERS}


def _quiet(step: StepResult) -> bool:
    """Whether the step ran as plain autograd (its session counted nothing)."""
    return step.stats is not None and bool(step.stats.get("quiet"))


def _median_of(values: Iterable[float]) -> float | None:
    known = list(values)
    return statistics.median(known) if known else None


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


STEP_MARGIN = 0.03
"""Without steps round by round to compare, a step is faster than another's where its
overhead is under 0.97 of the other's."""
PEAK_MARGIN = 0.02
"""A real peak is lower than another's where it is under 0.98 of it."""
SIGNIFICANCE = 0.01
"""A row's step is faster than another's where it was the faster of the two in so many of
their rounds that a coin would do as well at most this often (a sign test)."""


def pareto_front(rows: Sequence[Row]) -> list[Row]:
    """The rows no other row beats on both real peak and step time (skipped rows aside,
    and rows whose gradients are wrong: neither equal nor close to the reference's).

    A row is dominated when another is better on one of the two beyond the
    measurement's noise, and no worse on the other. A real peak is better
    where it is :data:`PEAK_MARGIN` lower. A step is better where, round by
    round, the other row's step was the shorter so often that chance would
    do it at most :data:`SIGNIFICANCE` of the time (:func:`faster`): two rows
    of one plan, whose medians differ by 10% on a noisy machine, do not beat
    each other. Step times
    compare as the rows' overheads, medians of same-round ratios to no stash's
    step (rule 9 of the NOTE): on a noisy machine the medians of the steps
    themselves, taken in different rounds, can rank two variants the other way
    round (docs/figures/planning.md).
    """
    measured = [
        (row, row.real_peak_bytes)
        for row in rows
        if row.skipped is None and (row.grads_equal is not False or row.grads_close)
    ]
    points = [(row, peak, row.overhead) for row, peak in measured if peak is not None]

    def beaten(row: Row, peak: int, step_s: float) -> bool:
        return any(
            p <= peak and s <= step_s and (p < peak * (1 - PEAK_MARGIN) or faster(other, row))
            for other, p, s in points
            if other is not row
        )

    return [row for row, peak, step_s in points if not beaten(row, peak, step_s)]


def faster(a: Row, b: Row) -> bool:
    """Whether ``a``'s step is shorter than ``b``'s beyond noise: in the rounds both ran,
    ``a`` was the faster so often that a fair coin would match it at most
    :data:`SIGNIFICANCE` of the time, or, with every round won and too few rounds for
    that, in all of them. Rows without their rounds compare overheads (:data:`STEP_MARGIN`).
    """
    n = len(a.step_times)
    if not n or n != len(b.step_times):
        return a.overhead < b.overhead * (1 - STEP_MARGIN)
    wins = sum(x < y for x, y in zip(a.step_times, b.step_times, strict=True))
    chance = sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n
    return wins == n or chance <= SIGNIFICANCE
