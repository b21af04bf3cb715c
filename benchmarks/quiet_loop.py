"""Auto at its default budget over a training loop, step by step, against no stash.

With nothing to move, ``Auto``'s steps run quiet (no hooks) once its profile
has learned; this shows what every step of a long loop costs, including the
steps that run with hooks (learning, timing modules again: NOTE [ Profile ]
rule 6), which a bench of a few rounds does not reach. Both variants run in one
process, alternated (A B, B A, ...), each step timed from the model's call to
the end of its backward.

Run: python benchmarks/quiet_loop.py [--model gpt2-hf] [--steps 80] [--threads 2]
     [--skip 8]

It prints the steps that ran with hooks, and, over the steps after ``--skip``, the
median and the mean of the per-step ratios to no stash's step of the same pair
(the mean counts the hooked steps, the median hardly does), and the median time a
step of Auto adds to no stash's of the same pair: on a small model run long
(``--model tiny --threads 1 --steps 2000``) that is what a quiet step's session
costs, which on a GPU bound by launching kernels is added to the step as it is.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tensorstash as ts
from tensorstash.bench.workloads import builtin_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-hf")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", type=int, default=8, help="first steps left out (learning)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = builtin_workload(args.model, 0)
    model = workload.model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    profile = ts.Profile()
    seconds: dict[str, list[float]] = {"none": [], "auto": []}
    hooked = []
    for index in range(args.steps):
        for name in ("none", "auto") if index % 2 == 0 else ("auto", "none"):
            optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            if name == "none":
                loss = model(*workload.batch)
            else:
                with ts.stash("auto", profile=profile) as session:
                    loss = model(*workload.batch)
            loss.backward()
            seconds[name].append(time.perf_counter() - start)
            if name == "auto" and not session.stats.quiet:
                hooked.append(index)
            optimizer.step()
    pairs = list(zip(seconds["auto"], seconds["none"], strict=True))[args.skip :]
    ratios = [a / n for a, n in pairs]
    extra = statistics.median(a - n for a, n in pairs)
    print(
        f"{args.model}: {args.steps} steps, no stash's median step "
        f"{statistics.median(seconds['none']) * 1e3:.1f} ms"
    )
    print(f"steps with hooks: {hooked}")
    print(
        f"auto / none, steps {args.skip}+: median {statistics.median(ratios):.3f}x, "
        f"mean {statistics.mean(ratios):.3f}x; median time added {extra * 1e6:.0f} us a step"
    )


if __name__ == "__main__":
    main()
