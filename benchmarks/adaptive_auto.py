"""Auto with a Profile: step time and kept peak from step 1 on, against Auto without a plan.

Runs the bench model for several trials of ``STEPS`` steps. In each step three
variants run interleaved: no stash, ``Auto(device_budget=BUDGET)`` with the
trial's ``Profile`` (step 1 has no plan yet, later steps follow the plan made
from the step before), and the same Auto with a fresh ``Profile`` every step
(never a plan). Overheads are against the no-stash step of the same round;
the script prints their medians over the trials, per step, and the kept peak.

Run: python benchmarks/adaptive_auto.py [BUDGET] [TRIALS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import tensorstash as ts
from tensorstash.bench import CONFIGS, BenchGPT, make_batch


def main(budget: str = "8MiB", trials: int = 5, steps: int = 4) -> None:
    config = CONFIGS["small"]
    torch.manual_seed(0)
    model = BenchGPT(config).train()
    tokens, targets = make_batch(config, seed=0)

    def step(profile: ts.Profile | None = None, stash: bool = True) -> tuple[float, int]:
        model.zero_grad()
        torch.manual_seed(1)
        start = time.perf_counter()
        if not stash:
            model(tokens, targets).backward()
            return time.perf_counter() - start, 0
        with ts.stash(ts.Auto(device_budget=budget), profile=profile) as session:
            loss = model(tokens, targets)
        loss.backward()
        peak = session.stats.to_dict()["tiers"]["kept"]["peak_bytes"]
        return time.perf_counter() - start, peak

    step(stash=False)
    step(ts.Profile())  # warm up both
    planned: list[list[float]] = [[] for _ in range(steps)]
    fresh: list[list[float]] = [[] for _ in range(steps)]
    peaks: list[tuple[int, int]] = [(0, 0)] * steps
    for _ in range(trials):
        profile = ts.Profile()
        for k in range(steps):
            base, _ = step(stash=False)
            seconds, peak = step(profile)
            fresh_seconds, fresh_peak = step(ts.Profile())
            planned[k].append(seconds / base)
            fresh[k].append(fresh_seconds / base)
            peaks[k] = (peak, fresh_peak)
    print(f"Auto(device_budget={budget!r}), median overhead against no stash over {trials} trials")
    print("step  with its Profile     without a plan")
    for k in range(steps):
        mib = [p / 2**20 for p in peaks[k]]
        print(
            f"{k + 1:>4}  {statistics.median(planned[k]):.2f}x, {mib[0]:5.1f} MiB   "
            f"{statistics.median(fresh[k]):.2f}x, {mib[1]:5.1f} MiB"
        )
    later = [r for ratios in planned[1:] for r in ratios]
    never = [r for ratios in fresh[1:] for r in ratios]
    print(
        f"steps 2-{steps}: {statistics.median(later):.2f}x with the plan, "
        f"{statistics.median(never):.2f}x without (kept peak as above)"
    )


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["8MiB"]), *(int(a) for a in sys.argv[2:3]))
