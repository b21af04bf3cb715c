"""The bench's results: one Row per variant, and the table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tensorstash.bench.variants import AUTO_PREFIX
from tensorstash.stats import human_bytes


@dataclass(frozen=True)
class Row:
    """One variant's result (see NOTE [ Fair comparison ] for how it is measured).

    Attributes:
        policy: the variant's name.
        peak_bytes: CPU: the most activation bytes the stash held in RAM
            ("kept" plus "host" tier peaks, rule 5 of the NOTE; None without a
            stash session). CUDA: ``torch.cuda.max_memory_allocated`` over a step.
        peak_rss_bytes: growth of the resident set over the variant's memory step.
        step_s: median seconds of a forward and backward over the timed steps.
        step_times: every timed step, in seconds, in order.
        overhead: ``step_s`` over the ``step_s`` of "none".
        grads_equal: every step's gradients bitwise equal to plain autograd's.
        tiers: the stash's per-tier counters of the last step (None without a session).
        compression_ratio: original over stored bytes of what left the device
            (None without a session).
        step_overheads: each timed step over the step of "none" in the same round.
        step_peak_bytes: each timed step's peak, as ``peak_bytes`` measures it.
        no_plan_step_times: ``auto:<budget>`` rows, with two timed steps or
            more: each timed step of the same Auto without a plan (a fresh
            Profile every step), run in the same rounds (rule 6 of the NOTE).
        no_plan_peak_bytes: the peak of each of those steps.
        timeline: live bytes per tier over one untimed step (see :class:`Timeline`),
            when the bench was asked for timelines; else None.
    """

    policy: str
    peak_bytes: int | None
    peak_rss_bytes: int
    step_s: float
    step_times: tuple[float, ...]
    overhead: float
    grads_equal: bool
    tiers: dict[str, dict[str, int]] | None
    compression_ratio: float | None
    step_overheads: tuple[float, ...] = ()
    step_peak_bytes: tuple[int | None, ...] = ()
    no_plan_step_times: tuple[float, ...] = ()
    no_plan_peak_bytes: tuple[int | None, ...] = ()
    timeline: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        data = asdict(self)
        for name in _SEQUENCES:
            data[name] = list(data[name])
        return data

    def plan_effect(self) -> PlanEffect | None:
        """Rule 6 of the NOTE: this row's steps 2 on against its twin without a plan.

        None unless an ``auto:<budget>`` row has two timed steps or more and
        its twin's steps.
        """
        count = len(self.step_times)
        twin = self.no_plan_step_times
        if not self.policy.startswith(AUTO_PREFIX) or count < 2 or len(twin) != count:
            return None
        mine = self.step_times[1:]
        return PlanEffect(
            steps=count,
            ratio=statistics.median(a / b for a, b in zip(mine, twin[1:], strict=True)),
            step_s=statistics.median(mine),
            no_plan_step_s=statistics.median(twin[1:]),
            peak_bytes=_largest(self.step_peak_bytes[1:]),
            no_plan_peak_bytes=_largest(self.no_plan_peak_bytes[1:]),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        """The row :meth:`to_dict` wrote (e.g. read back from ``--json``)."""
        fields = dict(data)
        for name in _SEQUENCES:
            fields[name] = tuple(fields.get(name, ()))
        return cls(**fields)


@dataclass(frozen=True)
class PlanEffect:
    """Auto following its plan against its twin without one (see :meth:`Row.plan_effect`).

    Attributes:
        steps: the timed steps; the comparison covers steps 2 to ``steps``.
        ratio: median over those steps of the row's step over its twin's, same round.
        step_s, no_plan_step_s: median step time of each over those steps.
        peak_bytes, no_plan_peak_bytes: largest known peak of each over those steps.
    """

    steps: int
    ratio: float
    step_s: float
    no_plan_step_s: float
    peak_bytes: int | None
    no_plan_peak_bytes: int | None


def _largest(peaks: Sequence[int | None]) -> int | None:
    known = [peak for peak in peaks if peak is not None]
    return max(known) if known else None


_SEQUENCES = (
    "step_times",
    "step_overheads",
    "step_peak_bytes",
    "no_plan_step_times",
    "no_plan_peak_bytes",
)


# -- the table -----------------------------------------------------------------------

_HEADERS = (
    "policy",
    "peak memory",
    "peak RSS +",
    "kept / host / disk",
    "ratio",
    "step",
    "overhead",
    "grads equal",
)
_LEFT = {0, 3}


def _cells(row: Row) -> list[str]:
    """A row's table cells, in the order of ``_HEADERS``."""
    if row.tiers is None:
        tiers = "-"
    else:
        tiers = " / ".join(human_bytes(row.tiers[t]["bytes"]) for t in ("kept", "host", "disk"))
    return [
        row.policy,
        _human(row.peak_bytes),
        human_bytes(row.peak_rss_bytes),
        tiers,
        "-" if row.compression_ratio is None else f"{row.compression_ratio:.2f}x",
        f"{row.step_s:.3f} s",
        f"{row.overhead:.2f}x",
        "yes" if row.grads_equal else "NO",
    ]


def format_table(rows: Sequence[Row], *, device: str | torch.device = "cpu") -> str:
    """The rows as an aligned plain-text table, one line per policy, with a legend.

    Args:
        rows: results of :func:`run_bench`.
        device: where they were measured (changes what "peak memory" means).

    Returns:
        The table, without a trailing newline.
    """
    table = [list(_HEADERS), *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(_HEADERS))]
    lines = [
        "  ".join(
            cell.ljust(width) if i in _LEFT else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.extend(_legend(torch.device(device)))
    lines.extend(_learning(rows))
    return "\n".join(lines)


def _legend(device: torch.device) -> list[str]:
    """Lines under the table that say what each column measures."""
    if device.type == "cuda":
        peak = "peak memory: torch.cuda.max_memory_allocated over a step, weights included"
    else:
        peak = 'peak memory: most activation bytes a stash held in RAM at once ("kept" + "host")'
    return [
        "",
        peak,
        "peak RSS +: growth of resident memory over an untimed step, after trimming the heap",
        "kept / host / disk: original bytes saved per tier; ratio: original / stored bytes moved",
        "step: median of the timed steps (variants interleaved); overhead: step / step of none",
        "grads equal: bitwise equal to plain autograd on every parameter, every step",
    ]


def _learning(rows: Sequence[Row]) -> list[str]:
    """Lines on ``auto:<budget>`` rows: their plan against their twin without one (rule 6).

    Plain "auto" is left out: on the CPU its default budget keeps everything,
    so its plan changes nothing.
    """
    lines: list[str] = []
    for row in rows:
        effect = row.plan_effect()
        if effect is None:
            continue
        span = "step 2" if effect.steps == 2 else f"steps 2-{effect.steps}"
        lines.append(
            f"{row.policy}: {span}, step time {effect.ratio:.2f}x that without a plan "
            f"(median of same-round ratios); peak {_human(effect.peak_bytes)} "
            f"against {_human(effect.no_plan_peak_bytes)} without"
        )
    if lines:
        lines[:0] = [
            "",
            "Auto planning from its Profile (step 1 has no plan yet), against the same Auto",
            "without a plan (a fresh Profile every step), run in the same rounds:",
        ]
    return lines


def _human(nbytes: int | None) -> str:
    return "-" if nbytes is None else human_bytes(nbytes)
