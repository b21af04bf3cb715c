"""Auto with a Profile: step time from step 1 to step 4 at the same kept peak.

Runs the bench model under ``Auto(device_budget=BUDGET)`` with a fresh
``Profile`` for several trials, each step interleaved with a no-stash step
(the ratio is taken against it), and prints the median overhead and the kept
peak per step.

Run: python benchmarks/adaptive_auto.py [BUDGET] [TRIALS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import tensorstash as ts
from tensorstash.bench import CONFIGS, BenchGPT, make_batch


def main(budget: str = "8MiB", trials: int = 3, steps: int = 4) -> None:
    config = CONFIGS["small"]
    torch.manual_seed(0)
    model = BenchGPT(config).train()
    tokens, targets = make_batch(config, seed=0)

    def step(policy: object = None, profile: ts.Profile | None = None) -> tuple[float, int]:
        model.zero_grad()
        torch.manual_seed(1)
        start = time.perf_counter()
        if policy is None:
            model(tokens, targets).backward()
            return time.perf_counter() - start, 0
        with ts.stash(policy, profile=profile) as session:  # type: ignore[arg-type]
            loss = model(tokens, targets)
        loss.backward()
        peak = session.stats.to_dict()["tiers"]["kept"]["peak_bytes"]
        return time.perf_counter() - start, peak

    step()
    step(ts.Auto(device_budget=budget))  # warm up both
    ratios: list[list[float]] = [[] for _ in range(steps)]
    peaks: list[int] = [0] * steps
    for _ in range(trials):
        profile = ts.Profile()
        for k in range(steps):
            base, _ = step()
            seconds, peaks[k] = step(ts.Auto(device_budget=budget), profile)
            ratios[k].append(seconds / base)
    print(f"Auto(device_budget={budget!r}) with a Profile, median of {trials} trials")
    for k in range(steps):
        overhead = statistics.median(ratios[k])
        print(f"step {k + 1}: overhead {overhead:.2f}x  kept peak {peaks[k] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["8MiB"]), *(int(a) for a in sys.argv[2:3]))
