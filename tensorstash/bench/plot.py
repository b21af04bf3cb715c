"""The figure of ``tensorstash bench --plot``: memory over a step, and memory against time.

Needs matplotlib (``pip install tensorstash[plot]``); nothing here imports it
until a figure is drawn, so the rest of the package works without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorstash.bench.report import Row

MIB = 2**20
TIER_STYLE = (
    ("kept", "kept (on the device)", "#4c72b0"),
    ("host", "host RAM (moved, compressed)", "#dd8452"),
    ("disk", "disk (spilled)", "#55a868"),
)
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

    Top: one small panel per policy with a timeline (``Row.timeline``): the live
    bytes of each tier over one step, stacked, forward rising and backward
    falling; on CUDA also the allocator's bytes above the step's start.
    Below: peak memory against median step time, one point per policy, with
    an arrow from the first timed step of each ``auto:<budget>`` row to its
    last; under it, the legend of the tiers.

    Args:
        rows: results of :func:`tensorstash.bench.run_bench` with ``timeline=True``
            (rows without a timeline get no panel).
        path: where the PNG goes.
        title: the figure's title (the model and the machine).
        device: where the rows were measured ("cpu" or "cuda"): what peak means.

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
    figure = Figure(figsize=(12, 2.3 * grid_rows + 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(grid_rows + 1, COLUMNS, height_ratios=[1] * grid_rows + [2.2])
    first: Any = None
    for index, row in enumerate(traced):
        axes = figure.add_subplot(grid[index // COLUMNS, index % COLUMNS], sharey=first)
        first = first or axes
        _timeline_panel(axes, row, cuda=cuda, labels=index % COLUMNS == 0)
    if traced:
        handles, labels = first.get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=8)
    _tradeoff_panel(figure.add_subplot(grid[grid_rows, :]), rows, cuda=cuda)
    figure.suptitle(title, fontsize=10, x=0.01, ha="left")
    target = Path(path)
    figure.savefig(target, dpi=80)
    return target


def _has_data(timeline: dict[str, Any]) -> bool:
    device = timeline.get("device")
    return bool(device) or any(any(timeline.get(tier, ())) for tier, _, _ in TIER_STYLE)


def _timeline_panel(axes: Any, row: Row, *, cuda: bool, labels: bool) -> None:
    """Stacked live bytes per tier over one step (ms on x, MiB on y)."""
    timeline = row.timeline or {}
    times = [t * 1e3 for t in timeline["t_s"]]
    base = [0.0] * len(times)
    for tier, label, color in TIER_STYLE:
        top = [b + v / MIB for b, v in zip(base, timeline[tier], strict=True)]
        axes.fill_between(times, base, top, step="post", color=color, alpha=0.85, lw=0, label=label)
        base = top
    if cuda and timeline.get("device"):
        device = [v / MIB for v in timeline["device"]]
        axes.step(times, device, where="post", color="black", lw=1, label="CUDA allocated")
    axes.axvline(timeline["backward_at_s"] * 1e3, color="grey", ls="--", lw=0.8)
    axes.set_title(row.policy, fontsize=9, loc="left")
    axes.tick_params(labelsize=7)
    axes.set_xlabel("ms into the step (dashed: backward starts)", fontsize=7)
    if labels:
        axes.set_ylabel("live MiB", fontsize=8)
    axes.set_xlim(0, max(times[-1], 1e-3))
    axes.set_ylim(bottom=0)


def _tradeoff_panel(axes: Any, rows: Sequence[Row], *, cuda: bool) -> None:
    """Peak memory (MiB) against median step time (s), one point per policy."""
    peak_label = (
        "peak CUDA memory (max allocated)" if cuda else "stash peak in RAM (kept + host tiers)"
    )
    points = [
        (row, row.peak_rss_bytes / MIB if row.peak_bytes is None else row.peak_bytes / MIB)
        for row in rows
    ]
    slowest = max((t for row in rows for t in (row.step_s, *row.step_times)), default=1.0)
    highest = max((max(y, row.peak_rss_bytes / MIB) for row, y in points), default=1.0)
    placed: list[tuple[float, float]] = []
    for row, y in points:
        axes.scatter(row.step_s, row.peak_rss_bytes / MIB, marker="x", color="#8c8c8c", s=28)
        if row.peak_bytes is not None:
            axes.scatter(row.step_s, y, color="#c44e52", s=36, zorder=3)
        # Labels of points close together are stacked upwards instead of overprinted.
        near = sum(
            abs(x - row.step_s) < 0.06 * slowest and abs(v - y) < 0.05 * highest for x, v in placed
        )
        placed.append((row.step_s, y))
        axes.annotate(
            row.policy,
            (row.step_s, y),
            xytext=(4, 3 + 9 * near),
            textcoords="offset points",
            fontsize=8,
        )
        _learning_arrow(axes, row)
    axes.scatter([], [], color="#c44e52", s=36, label=peak_label)
    axes.scatter([], [], marker="x", color="#8c8c8c", s=28, label="resident memory growth (RSS)")
    if any(_learns(row) for row in rows):
        label = "Auto without a plan"
        axes.scatter([], [], facecolors="none", edgecolors="#c44e52", s=36, label=label)
    axes.set_xlabel("median step time, forward + backward (s)", fontsize=9)
    axes.set_ylabel("peak memory (MiB)", fontsize=9)
    axes.set_title("memory against time per policy (lower left is better)", fontsize=9, loc="left")
    axes.set_xlim(0, 1.15 * slowest)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.tick_params(labelsize=8)
    axes.legend(fontsize=8, loc="upper right")


def _learns(row: Row) -> bool:
    """An ``auto:<budget>`` row whose plan has a twin without one to compare with, peaks known."""
    effect = row.plan_effect()
    return (
        effect is not None
        and effect.peak_bytes is not None
        and effect.no_plan_peak_bytes is not None
    )


def _learning_arrow(axes: Any, row: Row) -> None:
    """Auto without a plan (its twin), with an arrow to Auto following its plan (steps 2 on)."""
    effect = row.plan_effect()
    if effect is None or effect.peak_bytes is None or effect.no_plan_peak_bytes is None:
        return
    start = (effect.no_plan_step_s, effect.no_plan_peak_bytes / MIB)
    end = (effect.step_s, effect.peak_bytes / MIB)
    axes.scatter(*start, facecolors="none", edgecolors="#c44e52", s=36, zorder=3)
    axes.annotate(
        "", end, xytext=start, arrowprops={"arrowstyle": "->", "color": "#c44e52", "lw": 0.8}
    )
