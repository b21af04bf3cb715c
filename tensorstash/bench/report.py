"""The bench's table: real peak first, time, the planner's prediction, the stash's counts."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorstash.bench.rows import Row, pareto_front
from tensorstash.bench.variants import is_relative
from tensorstash.core.stats import TIERS, human_bytes
from tensorstash.memory._trim import ALLOCATOR

_HEADERS = (
    "policy",
    "real peak +",
    "vs none",
    "step",
    "overhead",
    "predicted step",
    "predicted peak",
    "stash peak kept / host / disk",
    "ratio",
    "grads equal",
)
_LEFT = {0, 7}


def _cells(row: Row) -> list[str]:
    """A measured row's table cells, in the order of ``_HEADERS``."""
    stash = "-"
    if row.stash_peak_bytes is not None:
        stash = " / ".join(human_bytes(row.stash_peak_bytes[tier]) for tier in TIERS)
    if row.quiet_steps:
        quiet = f"quiet {row.quiet_steps}/{len(row.step_times)}"
        stash = quiet if row.stash_peak_bytes is None else f"{stash} ({quiet})"
    return [
        row.policy,
        _human(row.real_peak_bytes),
        _times(row.peak_vs_none),
        f"{row.step_s:.3f} s",
        _times(row.overhead),
        _predicted(row.predicted_step_s, row.step_over_predicted, lambda s: f"{s:.3f} s"),
        _predicted(row.predicted_peak_bytes, row.peak_over_predicted, human_bytes),
        stash,
        "-" if row.compression_ratio is None else f"{row.compression_ratio:.2f}x",
        "yes" if row.grads_equal else "close" if row.grads_close else "NO",
    ]


def _predicted(value: float | None, ratio: float | None, show: Callable[[Any], str]) -> str:
    """A prediction and, in brackets, the measurement over it."""
    if value is None:
        return "-"
    text = show(value)
    return text if ratio is None else f"{text} ({ratio:.2f}x)"


def format_table(
    rows: Sequence[Row], *, device: str | torch.device = "cpu", legend: bool = True
) -> str:
    """The rows as an aligned plain-text table, one line per policy, and notes under it.

    Args:
        rows: results of :func:`~tensorstash.bench.run_bench` (one dtype).
        device: where they were measured (changes what "real peak" means).
        legend: add the lines that say what each column measures.

    Returns:
        The table, without a trailing newline.
    """
    measured = [row for row in rows if row.skipped is None]
    table = [list(_HEADERS), *(_cells(row) for row in measured)]
    widths = [max(len(line[i]) for line in table) for i in range(len(_HEADERS))]
    lines = [
        "  ".join(
            cell.ljust(width) if i in _LEFT else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    for row in rows:
        if row.skipped is not None:
            lines.append(f"{row.policy.ljust(widths[0])}  skipped: {row.skipped}")
    lines.extend(_notes(rows))
    if legend:
        lines.extend(_legend(torch.device(device)))
    return "\n".join(lines)


def _notes(rows: Sequence[Row]) -> list[str]:
    """Budgets, the Pareto front, the plans' recomputed modules, plans against their twins."""
    lines = [""]
    front = pareto_front(rows)
    if front:
        names = ", ".join(row.policy for row in front)
        lines.append(
            "Pareto front (no variant with right gradients is as small and as fast, and "
            "either 2% smaller or faster in enough rounds that chance would not do it "
            f"once in 100): {names}"
        )
    limited = [row for row in rows if row.limit_bytes is not None]
    if limited:
        text = ", ".join(
            f"{row.policy} = +{_human(row.limit_bytes)}"
            + (
                f" ({row.over_limit} step(s) over)"
                if row.over_limit
                else " (every step within)"
                if row.over_limit == 0
                else ""
            )
            for row in limited
        )
        growth = limited[0].plain_growth
        if growth is not None and any(is_relative(row.policy) for row in limited):
            text += f"; shares of no stash's real peak growth, {human_bytes(growth)}"
        lines.append(f"limits over each step's base: {text}")
    for row in rows:
        if row.plan_recompute:
            lines.append(f"{row.policy}: the plan recomputes {', '.join(row.plan_recompute)}")
        if row.plan_compiler is not None:
            lines.append(f"{row.policy}: the compiler is asked for {row.plan_compiler}")
        if row.plan_advice is not None:
            lines.append(f"{row.policy}: {row.plan_advice}")
    lines.extend(_learning(rows))
    lines.extend(_compiles(rows))
    return lines


def _compiles(rows: Sequence[Row]) -> list[str]:
    """Rule 5 of NOTE [ Compiled runs ]: compile time and graphs, apart from step time."""
    compiled = [row for row in rows if row.skipped is None and row.graphs]
    if not compiled:
        return []
    parts = [f"{row.policy} {row.graphs} in {row.compile_s or 0.0:.1f} s" for row in compiled]
    lines = [f"graphs compiled (warm-up steps, time beyond a step): {', '.join(parts)}"]
    looping = [f"{row.policy} {row.timed_graphs}" for row in compiled if row.timed_graphs]
    if looping:
        lines.append(f"compiled again in timed steps (a recompile loop): {', '.join(looping)}")
    return lines


def _legend(device: torch.device) -> list[str]:
    """Lines under the table that say what each column measures."""
    if device.type == "cuda":
        real = "real peak +: torch.cuda.max_memory_allocated over a step, less the allocated bytes"
        start = "    at its start (weights, gradients)"
    else:
        real = "real peak +: growth of the resident set over a step (VmHWM), from a trimmed heap:"
        start = "    all the process held, bytes waiting for the disk writer included"
    held = [start]
    if device.type != "cuda" and ALLOCATOR.name == "glibc":
        held = [
            f"{start},",
            "    and the free memory glibc's malloc walks over and keeps (jemalloc keeps less:",
            "    docs/cpu-memory.md, The allocator)",
        ]
    return [
        "",
        real,
        *held,
        "vs none, overhead: median over the timed rounds of the ratio to none in the same round",
        "step: median of the timed steps, forward + backward (variants interleaved)",
        "predicted step / peak: the planner's prediction for the step (session.plan); in",
        "    brackets the measurement over the prediction, median of same-step ratios (step:",
        "    its overhead over none in its round, over the predicted step over the plan's base)",
        "stash peak: most stored bytes the stash counted per tier (disk: from pack, bytes",
        "    still in RAM waiting for the writer included); quiet n/m: n of the m timed steps",
        "    ran with no hooks (Auto's plan moved nothing) and counted nothing;",
        "    ratio: original / stored bytes moved",
        "grads equal: bitwise equal to plain autograd on every parameter, every step (with",
        "    --compile: to the compiled model alone); close: within float tolerance only, as",
        "    a compiler that recomputes may fuse what it recomputes another way (bfloat16:",
        "    each gradient's difference within 1.6e-2 of its norm, twice bfloat16's epsilon)",
    ]


def _learning(rows: Sequence[Row]) -> list[str]:
    """Lines on ``auto:<budget>`` rows run with twins: their plan against no plan (rule 6)."""
    lines: list[str] = []
    for row in rows:
        effect = row.plan_effect()
        if effect is None:
            continue
        lines.append(
            f"{row.policy}: step time {effect.ratio:.2f}x that without a plan over "
            f"{effect.steps} rounds (median of same-round ratios); real peak "
            f"{human_bytes(effect.peak_bytes)} against {human_bytes(effect.no_plan_peak_bytes)}"
        )
    if lines:
        lines[:0] = [
            "Auto planning from its Profile against the same Auto without a plan (a fresh",
            "Profile every step), run beside it in the same rounds:",
        ]
    return lines


def format_title(
    description: str,
    device: str | torch.device,
    dtype: str,
    rows: Sequence[Row],
    *,
    threads: int,
    warmup: int,
    compiled: bool = False,
) -> str:
    """The line above a table: the model, compiled or not, the machine, the dtype, the
    allocator serving ``malloc``, the activations, the rounds."""
    measured = [row for row in rows if row.skipped is None]
    rounds = len(measured[0].step_times) if measured else 0
    activations = next((row.activation_bytes for row in rows if row.activation_bytes), None)
    kind = torch.device(device).type
    machine = cpu_text(dtype) if kind == "cpu" else kind
    parts = [description, f"{machine} {dtype_text(dtype)}", threads_text(threads)]
    if compiled:
        parts.insert(1, "torch.compile (inductor), deterministic algorithms")
    if kind == "cpu":
        parts.append(f"allocator {ALLOCATOR.name}")  # the real peaks depend on it
    if activations is not None:
        parts.append(f"activations {human_bytes(activations)} per step")
    parts.append(f"medians of {rounds} timed round(s) after {rounds_before(warmup, measured)}")
    return ", ".join(parts)


def rounds_before(warmup: int, rows: Sequence[Row]) -> str:
    """The untimed rounds that ran before the timed ones, and why: ``--warmup``'s, and
    those added while a planner still learned its plan (rule 3 of NOTE [ Fair
    comparison ] in rounds.py)."""
    ran = max([warmup, *(row.warmup_steps for row in rows)])
    text = f"{warmup} warm-up round(s)"
    if ran > warmup:
        text += f" and {ran - warmup} more while Auto learned its plan"
    return text


def cpu_text(dtype: str) -> str:
    """``'cpu (AVX2)'``: the vector instructions torch's CPU kernels use here,
    and, for a bfloat16 run on an x86 CPU without AVX512-BF16 or AMX, that it has no
    bfloat16 instructions: there bfloat16 steps run many times slower than float32
    ones (the bench's ``small``: 4.1 s against 0.15 s on an AVX2 EPYC), so figures
    from two CPUs compare only where this reads the same."""
    capability = str(torch.backends.cpu.get_cpu_capability())
    if dtype != "bfloat16" or not capability.startswith("AVX"):
        return f"cpu ({capability})"
    native = (
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)()
        or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    )
    return f"cpu ({capability})" if native else f"cpu ({capability}, no bfloat16 instructions)"


def dtype_text(dtype: str) -> str:
    """``'float32'``, ``'bfloat16 autocast'``: how a step ran, for a title."""
    return "bfloat16 autocast" if dtype == "bfloat16" else dtype


def threads_text(threads: int) -> str:
    """``'1 thread'``, ``'2 threads'``: torch's CPU threads, for a title."""
    return f"{threads} thread" if threads == 1 else f"{threads} threads"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _human(nbytes: int | None) -> str:
    return "-" if nbytes is None else human_bytes(nbytes)
