"""``tensorstash bench --loop``: real memory and step time over a training loop.

# NOTE [ Training loops ]
1. The bench's single steps each begin from a heap handed back to the OS (rule
   3 of NOTE [ Real memory ]), with the variants interleaved in one process. A
   training loop differs: nothing hands memory back between its steps, so a
   step begins with the free memory the last one left resident (glibc's malloc
   keeps it: NOTE [ Returning memory ] in _trim.py), and its plain step faults
   nothing. So ``--loop N`` trains each variant alone in a fresh process (a
   child running ``tensorstash bench --loop-alone``): the reference step and a
   ``Keep`` step (the activation bytes a budget in percent is a share of),
   memory handed back once, then ``N`` SGD steps back to back.
2. Per variant: the most the resident set grew over the steps (sampled every
   half millisecond: an Auto profile resets Linux's high-water mark for its
   own steps), over all of them and from step ``LEARNING + 1`` on (an Auto
   profile's first step keeps everything, to measure the model), and the
   median step from there, each a median over the rounds of the ratios
   against no stash's run of the same round. Rounds alternate the variants'
   order.
3. The children inherit the environment, ``LD_PRELOAD`` included: run under
   another allocator, the loop measures that allocator (docs/cpu-memory.md,
   "The allocator").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorstash.bench.measure import StepRunner
from tensorstash.bench.report import cpu_text, dtype_text, threads_text
from tensorstash.bench.variants import BASELINE
from tensorstash.bench.workloads import checked_loss
from tensorstash.core.stats import human_bytes
from tensorstash.memory._memory import PeakRss, current_rss, return_free_memory
from tensorstash.memory._trim import ALLOCATOR

LEARNING = 5
"""Steps an Auto profile may still be learning in (its first measures with everything
kept): the step time, and the second memory figure, are taken after them (rule 2)."""

Variant = Callable[[str, StepRunner], contextlib.AbstractContextManager[Any]]


def bench_variant(name: str, runner: StepRunner) -> contextlib.AbstractContextManager[Any]:
    """The context a bench variant's step runs in (``tensorstash bench`` policy names)."""
    return runner.variant(name)


def train_alone(
    runner: StepRunner, name: str, steps: int, variant: Variant = bench_variant
) -> dict[str, list[float]]:
    """``steps`` SGD steps of variant ``name`` back to back in this process (rule 1).

    Returns:
        ``peaks``: each step's most resident bytes above the resident set before the
        first step; ``seconds``: each step's time, the optimizer's step included.
    """
    runner.take_reference()
    workload = runner.model_for(name)
    net = workload.model
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
    seconds: list[float] = []
    peaks: list[float] = []
    net.zero_grad(set_to_none=True)
    return_free_memory()
    base = current_rss()
    for _ in range(steps):
        begun = current_rss()
        # Sampled: an Auto profile resets the high-water mark for its own steps.
        with PeakRss(0.0005) as meter:
            start = time.perf_counter()
            net.zero_grad(set_to_none=True)
            with variant(name, runner):
                with runner.autocast():
                    loss = checked_loss(net(*runner.batch), workload)
                loss.backward()
            optimizer.step()
            del loss
            seconds.append(time.perf_counter() - start)
        peaks.append(begun + meter.delta_bytes - base)
    return {"peaks": peaks, "seconds": seconds}


@dataclass(frozen=True)
class LoopRow:
    """One variant over the rounds (rule 2): medians, and medians of same-round ratios.

    Attributes:
        policy: the variant's name.
        peak_bytes: the most the resident set grew over a loop.
        steady_bytes: the same from step ``LEARNING + 1`` on.
        step_s: the median step from there.
        peak_ratio, steady_ratio, step_ratio: the same against no stash's run of
            the same round.
    """

    policy: str
    peak_bytes: float
    steady_bytes: float
    step_s: float
    peak_ratio: float
    steady_ratio: float
    step_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def loop_rows(runs: dict[str, list[dict[str, list[float]]]]) -> list[LoopRow]:
    """The rows of each variant's runs, one run a round, ``BASELINE``'s among them."""
    summary = {name: [_summary(run) for run in found] for name, found in runs.items()}
    baseline = summary[BASELINE]
    rows = []
    for name, found in summary.items():
        medians = [statistics.median(run[index] for run in found) for index in range(3)]
        ratios = [_ratio(found, baseline, index) for index in range(3)]
        rows.append(LoopRow(name, *medians, *ratios))
    return rows


def _summary(run: dict[str, list[float]]) -> tuple[float, float, float]:
    """A run's most growth, its most growth after the learning steps, its median step."""
    peaks, seconds = run["peaks"], run["seconds"]
    return max(peaks), max(peaks[LEARNING:]), statistics.median(seconds[LEARNING:])


def _ratio(
    mine: list[tuple[float, float, float]], base: list[tuple[float, float, float]], index: int
) -> float:
    """The median over the rounds of a figure's ratio to the baseline's of the same round."""
    pairs = zip(mine, base, strict=True)
    return statistics.median(m[index] / b[index] if b[index] > 0 else math.nan for m, b in pairs)


def run_loops(
    names: Sequence[str],
    rounds: int,
    command: Callable[[str], list[str]],
    directory: str | None = None,
) -> dict[str, list[dict[str, list[float]]]]:
    """Each variant's runs: ``command(name)`` run in a fresh process, round after round,
    the order alternating (rule 1); it prints the run as JSON on its last line.

    The processes spill into a temporary directory made in ``directory`` (default the
    system's), removed at the end.
    """
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="tensorstash-loop-", dir=directory) as spills:
        env = {**os.environ, "TMPDIR": spills}  # where a DiskSpill's default directory is
        for index in range(rounds):
            for name in names if index % 2 == 0 else list(reversed(names)):
                done = subprocess.run(
                    command(name), capture_output=True, text=True, check=False, env=env
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"the training loop of {name!r} failed (exit status "
                        f"{done.returncode}):\n{done.stderr.strip()}"
                    )
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def format_loop_table(
    rows: Sequence[LoopRow], description: str, dtype: str, steps: int, rounds: int
) -> str:
    """The title, the table and what its columns measure."""
    threads = threads_text(torch.get_num_threads())
    title = (
        f"{description}, {cpu_text(dtype)} {dtype_text(dtype)}, {threads}, "
        f"allocator {ALLOCATOR.name}: "
        f"{rounds} round(s) of a {steps}-step SGD loop, each variant alone in a fresh process"
    )
    steady = f"from step {LEARNING + 1}"
    header = (
        f"{'policy':14s} {'loop peak +':>12s} {'vs none':>8s} {steady:>14s} {'vs none':>8s} "
        f"{'step':>9s} {'overhead':>9s}"
    )
    lines = [title, header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.policy:14s} {human_bytes(int(row.peak_bytes)):>12s} {row.peak_ratio:7.2f}x "
            f"{human_bytes(int(row.steady_bytes)):>14s} {row.steady_ratio:7.2f}x "
            f"{row.step_s:7.3f} s {row.step_ratio:8.2f}x"
        )
    lines += [
        "",
        "loop peak +: the most the resident set grew over the loop, above where it was before",
        f"    the first step (sampled every 0.5 ms); {steady}: the same after an Auto",
        "    profile's learning steps; step: the median step from there, the optimizer's",
        "    step included",
        "vs none, overhead: medians over the rounds of the ratios to none in the same round",
    ]
    return "\n".join(lines)
