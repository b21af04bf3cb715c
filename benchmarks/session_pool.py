"""The session pool against trimming the heap (NOTE [ Session pool ] in memory/_pool.py).

An HF GPT-2 config (4 layers, d=256, batch 4x128; needs transformers) on the
CPU, 2 threads. Per round, interleaved (the order reversed every other round):
no stash; Hugging Face's gradient checkpointing of every block; a disk spill
and Auto at a share of the step's eligible activation bytes (with a Profile),
each with the session pool and without it (as where it is not built: the heap
is trimmed). Measured per step: time, the real peak growth of the resident set
(after ``gc.collect()`` and ``malloc_trim(0)``) and the bytes faulted in.
Rounds after ``--warmup`` count; figures are medians of same-round ratios.

Run: python benchmarks/session_pool.py [--budget 0.5] [--rounds 16] [--warmup 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

from gpt2_step import gpt2_step, median_ratio
from torch import Tensor

import tensorstash as ts
from tensorstash.bench import PeakRss, return_free_memory
from tensorstash.memory import _pool


def main() -> None:
    args = _arguments()
    with tempfile.TemporaryDirectory(prefix="ts-pool-bench-", dir=args.directory) as name:
        measure(args, name)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5, help="Auto's share of activations")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--directory", default=None, help="where the disk spill writes")
    return parser.parse_args()


def measure(args: argparse.Namespace, directory: str) -> None:
    if _pool.compiled is None:
        raise SystemExit("the session pool is not built here (see docs/cpu-memory.md)")
    warnings.filterwarnings("ignore")
    step = gpt2_step()
    model, forward, checkpointed = step.model, step.forward, step.checkpointed
    activation = step.activation_bytes
    budget = int(activation * args.budget)

    def spilled() -> Tensor:
        with ts.stash(ts.DiskSpill(directory)):
            return forward()

    profiles = {True: ts.Profile(), False: ts.Profile()}

    def planned(pooled: bool) -> Callable[[], Tensor]:
        def step() -> Tensor:
            with ts.stash(ts.Auto(device_budget=budget), profile=profiles[pooled]):
                return forward()

        return step

    variants: dict[str, tuple[Callable[[], Tensor], bool]] = {
        "none": (forward, True),
        "checkpoint": (checkpointed, True),
        "disk, pool": (spilled, True),
        "disk, trimmed": (spilled, False),
        f"auto:{args.budget:.0%}, pool": (planned(True), True),
        f"auto:{args.budget:.0%}, trimmed": (planned(False), False),
    }
    compiled = _pool.compiled
    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, list[int]] = {name: [] for name in variants}
    faults: dict[str, list[int]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.warmup + args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            run, pooled = variants[name]
            _pool.compiled = compiled if pooled else None  # as where it is not built
            try:
                model.zero_grad(set_to_none=True)
                return_free_memory()
                with PeakRss() as meter:
                    start = time.perf_counter()
                    run().backward()
                    took = time.perf_counter() - start
            finally:
                _pool.compiled = compiled
            while _pool.installed():  # Auto's watch lets it go once it sees the graph freed
                time.sleep(0.001)
            if round_ >= args.warmup:
                times[name].append(took)
                peaks[name].append(meter.delta_bytes)
                faults[name].append(meter.faulted_bytes or 0)

    ratio = median_ratio
    print(
        f"HF GPT-2 (4 layers, d=256, batch 4x128), CPU, 2 threads: activations "
        f"{activation / 2**20:.1f} MiB, Auto's budget {budget / 2**20:.1f} MiB; "
        f"medians of {args.rounds} rounds"
    )
    header = ("variant", "real peak +", "vs none", "faulted", "step", "vs none", "vs ckpt")
    print("{:<20} {:>12} {:>8} {:>11} {:>8} {:>8} {:>8}".format(*header))
    for name in names:
        peak = statistics.median(peaks[name]) / 2**20
        faulted = statistics.median(faults[name]) / 2**20
        print(
            f"{name:<20} {peak:>8.1f} MiB {ratio(peaks, name, 'none'):>7.2f}x "
            f"{faulted:>7.0f} MiB {statistics.median(times[name]):>7.3f}s "
            f"{ratio(times, name, 'none'):>7.2f}x {ratio(times, name, 'checkpoint'):>7.2f}x"
        )


if __name__ == "__main__":
    main()
