"""The embedded model and the measurements behind ``tensorstash bench``.

# NOTE [ Fair comparison ]
Every variant (no stash, each policy, each peer) runs in one process on one
model, and the numbers are only comparable if nothing but the variant differs:

1. Variants are interleaved step by step (A B C A B C ...), so a burst of
   machine noise hits every variant alike instead of one variant's steps.
2. Every step starts from the same weights (a ``state_dict`` copy is
   restored), the same batch and the same RNG seed (dropout masks), so
   a lossless variant must produce gradients bitwise equal to plain autograd.
3. The first rounds are untimed: a warm-up round runs one-time work (lazy
   imports, thread pools, kernel caches), then one round measures the resident
   memory of a step, after free heap memory has been returned to the
   operating system (see rule 5). Later rounds are timed and reported as a
   median, with the heap left warm as in a training loop.
4. The reference gradients come from one plain-autograd step taken before
   the first round; "none" is compared against them as well, which checks that
   the step itself is deterministic.
5. Memory is reported two ways, because no single CPU number covers all
   variants. ``peak_bytes``: on the CPU, the most bytes a stash session held
   in RAM, the sum of the "kept" and "host" tier peaks from its stats (tiers
   peak at different moments, so this is an upper bound when both hold
   bytes; tensors the session skipped, such as parameters and tensors under
   ``min_bytes``, are not in it), ``None`` for variants without a session; on
   CUDA, ``torch.cuda.max_memory_allocated`` over the step, for every variant.
   ``peak_rss_bytes``: the growth of the process's resident set over rule 3's
   memory step, for every variant. glibc keeps freed memory in its heap, so
   without rule 3's trim a step would reuse it and show no growth at all.
6. Variants that run ``Auto`` learn a :class:`~tensorstash.Profile` across
   their steps. Its profile starts afresh at the first timed round, so the
   first timed step shows Auto without a plan and the later ones Auto
   following the plan learned from the step before (``step_times``). One
   step against another is noise on a busy machine, so each ``auto:<budget>``
   variant also has a twin run in the same rounds that never plans (a fresh
   Profile every step): the plan's effect is the median, over the steps that
   follow a plan, of the variant's step over its twin's in the same round
   (``no_plan_step_times``). The two run side by side, in turn first.
7. Timelines (``--plot``) and allocator snapshots (``--memory-snapshot``)
   come from extra untimed rounds after the timed ones: their hooks cost time,
   so no timed step carries them.
8. On CUDA the whole run uses deterministic algorithms
   (``torch.use_deterministic_algorithms``, and ``CUBLAS_WORKSPACE_CONFIG``
   set to ":4096:8" unless the user set it), restored afterwards: some CUDA
   kernels (atomic adds in attention and embedding backward) give different
   bits on every run, and rule 4's check would then say nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tensorstash.bench.measure import PeakRss, StepResult, StepRunner, resolve_device, resolve_dtype
from tensorstash.bench.report import Row
from tensorstash.bench.variants import (
    AUTO_PREFIX,
    BASELINE,
    DEFAULT_POLICIES,
    NO_PLAN,
    check_blocks,
    resolve_policies,
)
from tensorstash.bench.workloads import Workload, builtin_workload


def check_memory_snapshot(device: str | torch.device) -> None:
    """Raise ValueError unless ``device`` can record allocator snapshots (CUDA)."""
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"tensorstash bench: --memory-snapshot records the CUDA caching allocator's "
            f"history and needs --device cuda (got {str(device)!r}); on the CPU use --plot "
            "for live bytes per tier over a step"
        )


def snapshot_file(directory: Path, policy: str) -> Path:
    """Where ``--memory-snapshot`` writes the snapshot of ``policy``: a safe file name."""
    return directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', policy)}.pickle"


def planned_steps(
    policies: Sequence[str],
    steps: int,
    warmup: int = 1,
    *,
    timeline: bool = False,
    memory_snapshot: bool = False,
) -> int:
    """How many steps :func:`run_bench` runs: the reference, untimed, timed and extra rounds."""
    names = resolve_policies(policies)
    rounds = warmup + 1 + steps + int(timeline) + int(memory_snapshot)
    twins = len(_with_twins(names, steps)) - len(names)
    return 1 + len(names) * rounds + twins * (warmup + 1 + steps)


def _with_twins(names: Sequence[str], steps: int) -> list[str]:
    """``names``, each ``auto:<budget>`` followed by its twin that never plans (rule 6).

    Side by side in every round, the two run in the same state of the heap
    and the page cache, whatever the variants before them left.
    """
    if steps < 2:  # no step follows a plan
        return list(names)
    every: list[str] = []
    for name in names:
        every.append(name)
        if name.startswith(AUTO_PREFIX):
            every.append(name + NO_PLAN)
    return every


def _round_order(every: list[str], index: int) -> list[str]:
    """The variants of timed round ``index``: a twin goes first in every other round.

    Whichever of two variants runs first pays for what the variant before
    them left behind, so the pair alternates (rule 6 of the NOTE).
    """
    order = list(every)
    if index % 2:
        for position, name in enumerate(order):
            if name.endswith(NO_PLAN):
                order[position - 1], order[position] = name, order[position - 1]
    return order


def run_bench(
    config_name: str = "small",
    policies: Sequence[str] = DEFAULT_POLICIES,
    steps: int = 3,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    *,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    workload: Workload | None = None,
    timeline: bool = False,
    memory_snapshot: str | Path | None = None,
) -> list[Row]:
    """Train a model for a few steps under each policy and measure them.

    The variants are interleaved and compared as NOTE [ Fair comparison ]
    describes; "none" (plain autograd) is always run first, as the baseline.

    Args:
        config_name: a key of :data:`CONFIGS`: "tiny", "small", "medium" or "large".
        policies: names from :data:`ALL_POLICIES` or ``auto:<budget>``.
        steps: timed steps per variant.
        device: "cpu" or "cuda".
        dtype: "float32" or "bfloat16": the model's parameter dtype.
        seed: seeds the weights, the batch and dropout.
        warmup: untimed warm-up steps per variant, before the one untimed step
            that measures resident memory.
        progress: called with the variant's name after every step.
        workload: a model of your own (see :func:`script_workload`) instead of
            the embedded one; ``config_name`` is then unused.
        timeline: run one more untimed step per variant that records live
            bytes per tier (``Row.timeline``, for :func:`tensorstash.bench.plot.plot`).
        memory_snapshot: a directory: run one more untimed step per variant
            under ``torch.cuda.memory._record_memory_history`` and dump it to
            ``<directory>/<policy>.pickle`` for https://pytorch.org/memory_viz
            (CUDA only).

    Returns:
        One :class:`Row` per variant, "none" first.

    Raises:
        ValueError: an unknown model, policy or dtype, ``steps < 1``, CUDA
            requested without a CUDA device, a snapshot asked for off CUDA, or
            "checkpoint"/"recompute" asked for on a workload without blocks.
        ModelScriptError: the model does not return a scalar loss.

    Example:
        >>> for row in run_bench("tiny", ["lz4", "disk"], steps=2):
        ...     print(row.policy, row.overhead, row.grads_equal)
    """
    names = resolve_policies(policies)
    if steps < 1 or warmup < 0:
        raise ValueError(
            f"tensorstash bench: steps={steps}, warmup={warmup}; pass steps >= 1 "
            "(--steps 1) and warmup >= 0"
        )
    resolved_device, resolved_dtype = resolve_device(device), resolve_dtype(dtype)
    if memory_snapshot is not None:
        check_memory_snapshot(resolved_device)
    if workload is None:
        workload = builtin_workload(config_name, seed)
    check_blocks(names, workload)
    with _deterministic(resolved_device):
        bench = StepRunner(workload, resolved_device, resolved_dtype, seed)
        return _rounds(bench, names, steps, warmup, progress, timeline, memory_snapshot)


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """Rule 8 of NOTE [ Fair comparison ]: deterministic CUDA kernels for the run."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _rounds(
    bench: StepRunner,
    names: list[str],
    steps: int,
    warmup: int,
    progress: Callable[[str], None] | None,
    timeline: bool,
    memory_snapshot: str | Path | None,
) -> list[Row]:
    """The rounds of :func:`run_bench`, in the order NOTE [ Fair comparison ] gives."""
    tick = progress or (lambda name: None)
    bench.take_reference()
    tick(BASELINE)
    every = _with_twins(names, steps)
    untimed, rss = _untimed_rounds(bench, every, warmup, tick)
    bench.profiles.clear()  # rule 6: Auto starts learning at the first timed step
    timed: dict[str, list[StepResult]] = {name: [] for name in every}
    for index in range(steps):  # rule 1: interleaved
        for name in _round_order(every, index):
            timed[name].append(bench.step(name))
            tick(name)
    traces: dict[str, dict[str, Any] | None] = dict.fromkeys(names)
    if timeline:  # rule 7
        for name in names:
            traces[name] = bench.step(name, timeline=True).timeline
            tick(name)
    if memory_snapshot is not None:
        _snapshot_round(bench, names, Path(memory_snapshot), tick)
    baseline = [r.seconds for r in timed[BASELINE]]
    rows = []
    for name in names:
        row = _row(name, untimed[name], timed[name], rss[name], baseline, traces[name])
        twin = timed.get(name + NO_PLAN)
        if twin is not None:
            checked = untimed[name + NO_PLAN] + twin
            row = replace(
                row,
                grads_equal=row.grads_equal and all(r.grads_equal for r in checked),
                no_plan_step_times=tuple(r.seconds for r in twin),
                no_plan_peak_bytes=tuple(_peak_bytes([r]) for r in twin),
            )
        rows.append(row)
    return rows


def _untimed_rounds(
    bench: StepRunner, names: list[str], warmup: int, tick: Callable[[str], None]
) -> tuple[dict[str, list[StepResult]], dict[str, int]]:
    """Rule 3 of the NOTE: warm-up rounds, then one round that measures resident memory.

    Returns:
        Each variant's untimed steps, and its resident memory growth in bytes.
    """
    results: dict[str, list[StepResult]] = {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            results[name].append(bench.step(name))
            tick(name)
    rss: dict[str, int] = {}
    for name in names:
        meter = PeakRss()
        results[name].append(bench.step(name, meter=meter))
        rss[name] = meter.delta_bytes
        tick(name)
    return results, rss


def _snapshot_round(
    bench: StepRunner, names: list[str], directory: Path, tick: Callable[[str], None]
) -> None:
    """Rule 7 of the NOTE: one step per variant under the CUDA allocator's history."""
    from torch.cuda import memory as cuda_memory

    directory.mkdir(parents=True, exist_ok=True)
    # Each file holds one step: the history of the step before is dropped where torch can.
    fresh = "clear_history" in inspect.signature(cuda_memory._record_memory_history).parameters
    options: dict[str, Any] = {"clear_history": True} if fresh else {}
    for name in names:
        torch.cuda.synchronize(bench.device)
        cuda_memory._record_memory_history(max_entries=200_000, device=bench.device, **options)
        try:
            bench.step(name)
            cuda_memory._dump_snapshot(str(snapshot_file(directory, name)))
        finally:
            cuda_memory._record_memory_history(enabled=None, device=bench.device)
        tick(name)


def _row(
    name: str,
    untimed: list[StepResult],
    timed: list[StepResult],
    rss_bytes: int,
    baseline: list[float],
    timeline: dict[str, Any] | None,
) -> Row:
    """Summarise a variant's steps (see ``Row`` for what each field means)."""
    every = untimed + timed
    step_s = statistics.median(r.seconds for r in timed)
    baseline_s = statistics.median(baseline)
    last = every[-1].stats
    return Row(
        policy=name,
        peak_bytes=_peak_bytes(every),
        peak_rss_bytes=rss_bytes,
        step_s=step_s,
        step_times=tuple(r.seconds for r in timed),
        overhead=step_s / baseline_s if baseline_s > 0 else float("nan"),
        grads_equal=all(r.grads_equal for r in every),
        tiers=None if last is None else last["tiers"],
        compression_ratio=None if last is None else float(last["compression_ratio"]),
        step_overheads=tuple(
            r.seconds / base if base > 0 else float("nan")
            for r, base in zip(timed, baseline, strict=True)
        ),
        step_peak_bytes=tuple(_peak_bytes([r]) for r in timed),
        timeline=timeline,
    )


def _peak_bytes(results: list[StepResult]) -> int | None:
    """The largest peak over the steps (see ``Row.peak_bytes``)."""
    peaks: list[int] = []
    for result in results:
        if result.cuda_peak_bytes is not None:
            peaks.append(result.cuda_peak_bytes)
        elif result.stats is not None:
            tiers = result.stats["tiers"]
            peaks.append(int(tiers["kept"]["peak_bytes"]) + int(tiers["host"]["peak_bytes"]))
    return max(peaks) if peaks else None
