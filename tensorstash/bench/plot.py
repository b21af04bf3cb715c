"""The figure of ``tensorstash bench --plot``: memory over a step, and the Pareto front.

Needs matplotlib (``pip install tensorstash[plot]``); nothing here imports it
until a figure is drawn, so the rest of the package works without it.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tensorstash.bench.rows import Row, pareto_front
from tensorstash.bench.variants import BASELINE

MIB = 2**20
TIER_STYLE = (
    ("kept", "kept (on the device)", "#4c72b0"),
    ("host", "host RAM (moved, compressed)", "#dd8452"),
    ("disk", "disk (spilled)", "#55a868"),
)
DTYPE_STYLE = {"float32": ("#c44e52", "o"), "bfloat16": ("#8172b3", "s")}
COLUMNS = 4


class PlotUnavailable(ImportError):
    """matplotlib is missing: ``--plot`` cannot draw."""


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` with the install command if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise PlotUnavailable(
            "tensorstash bench: --plot draws with matplotlib, which is not installed; "
            "run `pip install tensorstash[plot]` (or `pip install matplotlib`), or leave "
            "--plot out"
        ) from error


def plot(rows: Sequence[Row], path: str | Path, *, title: str = "", device: str = "cpu") -> Path:
    """Draw the bench's figure into a PNG.

    Top: one small panel per variant with a timeline (``Row.timeline``): the
    live bytes of each tier over one step, stacked, forward rising and backward
    falling, and the real memory above the step's start as a line. Below: the
    real peak against the step time (no stash's median step times the same-round
    ratio), one point per variant and dtype,
    the Pareto front of each dtype drawn through its points; Auto rows with a
    prediction also show it (hollow, joined to the measurement), and rows run
    with a twin an arrow from the twin without a plan.

    Args:
        rows: results of :func:`tensorstash.bench.run_bench` or ``run_sweep``
            (rows without a timeline get no panel; skipped rows no point).
        path: where the PNG goes.
        title: the figure's title (the model and the machine).
        device: where the rows were measured ("cpu" or "cuda"): what real memory means.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cuda = device.startswith("cuda")
    traced = [row for row in rows if row.timeline is not None and _has_data(row.timeline)]
    grid_rows = math.ceil(len(traced) / COLUMNS)
    figure = Figure(figsize=(12, 2.3 * grid_rows + 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(grid_rows + 1, COLUMNS, height_ratios=[1] * grid_rows + [2.4])
    first: Any = None
    top = max((_highest(row.timeline or {}) for row in traced), default=1.0)
    for index, row in enumerate(traced):
        axes = figure.add_subplot(grid[index // COLUMNS, index % COLUMNS], sharey=first)
        first = first or axes
        _timeline_panel(axes, row, cuda=cuda, labels=index % COLUMNS == 0)
        axes.set_ylim(0, 1.05 * top)
    if traced:
        handles, labels = first.get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=8)
    _front_panel(figure.add_subplot(grid[grid_rows, :]), rows, cuda=cuda)
    figure.suptitle(textwrap.fill(title, 150), fontsize=10, x=0.01, ha="left")
    target = Path(path)
    figure.savefig(target, dpi=80)
    return target


def _has_data(timeline: dict[str, Any]) -> bool:
    return bool(timeline.get("real")) or any(
        any(timeline.get(tier, ())) for tier, _, _ in TIER_STYLE
    )


def _highest(timeline: dict[str, Any]) -> float:
    """The most MiB a timeline panel shows: the stacked tiers or the real memory."""
    stacked = [sum(values) for values in zip(*(timeline[t] for t, _, _ in TIER_STYLE), strict=True)]
    return max([*stacked, *timeline.get("real", ()), 1]) / MIB


def _timeline_panel(axes: Any, row: Row, *, cuda: bool, labels: bool) -> None:
    """Stacked live bytes per tier and the real memory over one step (ms on x, MiB on y)."""
    timeline = row.timeline or {}
    times = [t * 1e3 for t in timeline["t_s"]]
    base = [0.0] * len(times)
    for tier, label, color in TIER_STYLE:
        top = [b + v / MIB for b, v in zip(base, timeline[tier], strict=True)]
        axes.fill_between(times, base, top, step="post", color=color, alpha=0.85, lw=0, label=label)
        base = top
    if timeline.get("real"):
        label = "CUDA allocated" if cuda else "resident set (real)"
        real = [v / MIB for v in timeline["real"]]
        axes.step(times, real, where="post", color="black", lw=1, label=label)
    axes.axvline(timeline["backward_at_s"] * 1e3, color="grey", ls="--", lw=0.8)
    axes.set_title(row.policy, fontsize=9, loc="left")
    axes.tick_params(labelsize=7)
    axes.set_xlabel("ms into the step (dashed: backward starts)", fontsize=7)
    if labels:
        axes.set_ylabel("MiB above the start", fontsize=8)
    axes.set_xlim(0, max(times[-1], 1e-3))


def _front_panel(axes: Any, rows: Sequence[Row], *, cuda: bool) -> None:
    """Real peak (MiB) against step time (s): a point per variant and dtype, the fronts.

    A row's step time is no stash's median step times the row's overhead (its
    median same-round ratio to no stash's step), where the dtype has a row of
    no stash: the ratio the tables and the Pareto front use. On a noisy
    machine the medians of the steps themselves, taken in different rounds,
    can place two variants the other way round (docs/figures/planning.md).
    """
    measured = [row for row in rows if row.skipped is None and row.real_peak_bytes is not None]
    highest = max((_mib(row.real_peak_bytes) for row in measured), default=1.0) or 1.0
    placed: list[tuple[float, float]] = []
    times: list[float] = []
    for dtype in dict.fromkeys(row.dtype for row in measured):
        color, marker = DTYPE_STYLE.get(dtype, ("#555555", "^"))
        mine = [row for row in measured if row.dtype == dtype]
        at = _step_axis(mine)
        times += [at(row) for row in mine]
        axes.scatter(
            [at(row) for row in mine],
            [_mib(row.real_peak_bytes) for row in mine],
            color=color, marker=marker, s=36, zorder=3, label=dtype,
        )  # fmt: skip
        front = sorted(pareto_front(mine), key=at)
        axes.step(
            [at(row) for row in front],
            [_mib(row.real_peak_bytes) for row in front],
            where="post", color=color, lw=1, alpha=0.6, label=f"Pareto front, {dtype}",
        )  # fmt: skip
        for row in mine:
            _label(axes, row, at(row), placed, highest)
            _prediction(axes, row, at(row), color)
            _twin_arrow(axes, row, at(row), color)
    times = times or [1.0]
    if len(measured) and max(times) > 4 * min(times):
        axes.set_xscale("log")
    else:
        axes.set_xlim(0, 1.15 * max(times))
    peak = "peak CUDA allocated over a step" if cuda else "peak resident set growth over a step"
    axes.set_xlabel(
        "step time, forward + backward (s): no stash's median step x the same-round ratio",
        fontsize=9,
    )
    axes.set_ylabel(f"real peak (MiB): {peak}", fontsize=9)
    axes.set_title("real memory against time per variant (lower left is better)", fontsize=9)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.tick_params(labelsize=8)
    axes.legend(fontsize=8, loc="lower right")


def _step_axis(rows: Sequence[Row]) -> Callable[[Row], float]:
    """Where a row of ``rows`` (one dtype) sits on the time axis (see :func:`_front_panel`)."""
    plain = next((row for row in rows if row.policy == BASELINE), None)
    if plain is None:
        return lambda row: row.step_s
    base = plain.step_s
    return lambda row: base * row.overhead


def _label(
    axes: Any, row: Row, x: float, placed: list[tuple[float, float]], highest: float
) -> None:
    """The variant's name by its point; labels of points close together are stacked upwards."""
    y = _mib(row.real_peak_bytes)
    near = sum(abs(math.log(a / x)) < 0.08 and abs(b - y) < 0.04 * highest for a, b in placed)
    placed.append((x, y))
    axes.annotate(
        row.policy, (x, y), xytext=(4, 3 + 9 * near), textcoords="offset points", fontsize=8
    )


def _prediction(axes: Any, row: Row, x: float, color: str) -> None:
    """The planner's predicted point, hollow, joined to the measured one by a dotted line:
    its step where the measured overhead over the bracket puts it (the bracket is the
    measured overhead over the predicted one)."""
    if row.predicted_step_s is None or row.predicted_peak_bytes is None:
        return
    scale = row.step_over_predicted or (row.step_s / row.predicted_step_s)
    predicted = (x / scale, _mib(row.predicted_peak_bytes))
    axes.scatter(*predicted, facecolors="none", edgecolors=color, s=36, zorder=3)
    axes.plot(
        [predicted[0], x], [predicted[1], _mib(row.real_peak_bytes)],
        color=color, ls=":", lw=0.8,
    )  # fmt: skip


def _twin_arrow(axes: Any, row: Row, x: float, color: str) -> None:
    """Rule 6 of NOTE [ Fair comparison ]: an arrow from the twin without a plan to the row,
    the twin's step at the row's place times the twin's own median ratio."""
    effect = row.plan_effect()
    if effect is None:
        return
    start = (x / effect.ratio, effect.no_plan_peak_bytes / MIB)
    end = (x, effect.peak_bytes / MIB)
    axes.scatter(*start, marker="x", color=color, s=28, zorder=3)
    axes.annotate("", end, xytext=start, arrowprops={"arrowstyle": "->", "color": color, "lw": 0.8})


def _mib(nbytes: int | None) -> float:
    return 0.0 if nbytes is None else nbytes / MIB
