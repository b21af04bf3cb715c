"""What ``stash(..., verify=True)`` costs: step time with and without it, per policy.

Run: ``python benchmarks/verify_cost.py [--model small] [--steps 12] [--policies keep,lz4,disk]``.

Trains the bench's embedded model for ``--steps`` rounds; in each round every
policy runs one step without verify and one with it (interleaved, so machine
noise hits both alike). It prints the median step time of each and their
ratio, leaving out the first two rounds (warm-up). Gradients are checked equal
between the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tensorstash as ts
from tensorstash.bench import CONFIGS, BenchGPT, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--policies", default="keep,lz4,disk")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = CONFIGS[args.model]
    model, batch = BenchGPT(config), make_batch(config, seed=0)

    def step(policy: str, verify: bool) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        start = time.perf_counter()
        with ts.stash(policy, verify=verify):
            loss = model(*batch)
        loss.backward()
        seconds = time.perf_counter() - start
        return seconds, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    policies = args.policies.split(",")
    times: dict[tuple[str, bool], list[float]] = {
        (p, v): [] for p in policies for v in (False, True)
    }
    for _ in range(args.steps):
        for policy in policies:
            plain_s, plain = step(policy, False)
            checked_s, checked = step(policy, True)
            assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
            times[(policy, False)].append(plain_s)
            times[(policy, True)].append(checked_s)
    print(f"model {args.model}, median of {max(args.steps - 2, 1)} steps after 2 warm-up rounds")
    for policy in policies:
        off = statistics.median(times[(policy, False)][2:] or times[(policy, False)])
        on = statistics.median(times[(policy, True)][2:] or times[(policy, True)])
        print(f"{policy:6s} verify off {off:.3f} s  on {on:.3f} s  {on / off:.2f}x")


if __name__ == "__main__":
    main()
