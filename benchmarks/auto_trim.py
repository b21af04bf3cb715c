"""Auto's ``trim_every`` against no stash and checkpointing (NOTE [ Returning memory ] rule 6).

An HF GPT-2 config (4 layers, d=256, batch 4x128; needs transformers) on the
CPU, 2 threads. Per round, interleaved (the order reversed every other round):
no stash; Hugging Face's gradient checkpointing of every block; and Auto at a
share of the step's eligible activation bytes, with a Profile, once per
``trim_every`` value. Measured per step: time, and the real peak growth of the
resident set (Linux's ``VmHWM``, reset before the step, after
``gc.collect()`` and ``malloc_trim(0)``). Rounds after ``--warmup`` count;
figures are medians of same-round ratios. Where the session pool is built,
``trim_every`` is its cap; ``TENSORSTASH_POOL=0`` in the environment measures the
trimming instead (NOTE [ Session pool ] in tensorstash/memory/_pool.py).

Run: python benchmarks/auto_trim.py [--budget 0.5] [--trim none,64,48,32,16]
     [--rounds 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

from gpt2_step import gpt2_step, median_ratio
from torch import Tensor

import tensorstash as ts
from tensorstash.bench import PeakRss, return_free_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5, help="share of activation bytes")
    parser.add_argument("--trim", default="none,64,48,32,16", help="MiB values, or none, auto")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    step = gpt2_step()
    model, forward, checkpointed = step.model, step.forward, step.checkpointed
    activation = step.activation_bytes
    budget = int(activation * args.budget)

    variants: dict[str, Callable[[], Tensor]] = {"none": forward, "checkpoint": checkpointed}
    plans: dict[str, ts.Plan | None] = {}
    for value in args.trim.split(","):
        every = None if value == "none" else value if value == "auto" else int(value) << 20
        auto, profile = ts.Auto(device_budget=budget, trim_every=every), ts.Profile()
        name = f"auto trim_every={value}"

        def planned(auto: ts.Auto = auto, prof: ts.Profile = profile, name: str = name) -> Tensor:
            with ts.stash(auto, profile=prof) as session:
                loss = forward()
            plans[name] = session.plan
            return loss

        variants[name] = planned

    times: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, list[int]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.warmup + args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            model.zero_grad(set_to_none=True)
            return_free_memory()
            with PeakRss() as meter:
                start = time.perf_counter()
                variants[name]().backward()
                took = time.perf_counter() - start
            if round_ >= args.warmup:
                times[name].append(took)
                peaks[name].append(meter.delta_bytes)

    ratio = median_ratio
    print(
        f"HF GPT-2 (4 layers, d=256, batch 4x128), CPU, 2 threads: activations "
        f"{activation / 2**20:.1f} MiB, Auto's budget {budget / 2**20:.1f} MiB "
        f"({args.budget:.0%}); medians of {args.rounds} rounds"
    )
    header = ("variant", "real peak +", "vs none", "step", "vs none", "vs ckpt")
    print("{:<24} {:>12} {:>8} {:>8} {:>8} {:>8}".format(*header))
    for name in names:
        peak = statistics.median(peaks[name]) / 2**20
        step = statistics.median(times[name])
        print(
            f"{name:<24} {peak:>8.1f} MiB {ratio(peaks, name, 'none'):>7.2f}x {step:>7.3f}s "
            f"{ratio(times, name, 'none'):>7.2f}x {ratio(times, name, 'checkpoint'):>7.2f}x"
        )

    for name, plan in plans.items():
        print(f"{name}, the last step's plan:")
        print("\n".join("  " + line for line in (plan.table() if plan else "none").splitlines()))


if __name__ == "__main__":
    main()
