"""What installing the session pool costs a process (NOTE [ Session pool ] in
memory/_pool.py, rule 4): the pool is PyTorch's CPU allocator from the first lease on.

Each round starts two processes, in turn (the order reversed every other round): one
that never takes a lease (PyTorch's CPU allocator is c10's own), and one whose pool is
installed and idle (one lease taken and closed, as after a CPU session that freed
memory, or as every process was when the pool was installed at import). Each times
allocating and freeing CPU tensors of a few sizes (one torch thread; the median of
repeats, in ns per tensor) and plain steps of the HF GPT-2 config (needs transformers),
and the installed one times its first lease (installing) and a later one. Figures are
medians over rounds of the same-round ratio installed / not installed.

Run: python benchmarks/pool_install.py [--rounds 8] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SIZES = {"256 B": 256, "64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}

_CHILD = """
import json, statistics, sys, time
import torch
import tensorstash
from tensorstash.memory import _pool

installed, sizes, steps = sys.argv[1] == "1", json.loads(sys.argv[2]), int(sys.argv[3])
found = {}
if installed:
    start = time.perf_counter()
    lease = _pool.lease(1 << 20)
    found["first_lease_us"] = (time.perf_counter() - start) * 1e6
    lease.close()
    start = time.perf_counter()
    lease = _pool.lease(1 << 20)
    found["later_lease_us"] = (time.perf_counter() - start) * 1e6
    lease.close()
found["state"] = _pool.compiled.state()
torch.set_num_threads(1)
for name, size in sizes.items():
    count = 20000 if size <= 1 << 20 else 2000
    repeats = []
    for _ in range(7):
        start = time.perf_counter_ns()
        for _ in range(count):
            torch.empty(size, dtype=torch.uint8)
        repeats.append((time.perf_counter_ns() - start) / count)
    found[name] = statistics.median(repeats)
if steps:
    sys.path.insert(0, sys.argv[4])
    from gpt2_step import gpt2_step
    step = gpt2_step()
    times = []
    for _ in range(steps + 2):
        step.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step.forward().backward()
        times.append(time.perf_counter() - start)
    found["step_s"] = statistics.median(times[2:])
print(json.dumps(found))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="GPT-2 steps a process (0: none)")
    args = parser.parse_args()
    here = str(Path(__file__).parent)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for installed in (False, True) if round_ % 2 == 0 else (True, False):
            child = [str(int(installed)), json.dumps(SIZES), str(args.steps), here]
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, *child],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ, OMP_NUM_THREADS="2"),
            )
            runs[installed].append(json.loads(done.stdout.strip().splitlines()[-1]))
    states = {run["state"] for run in runs[False]}, {run["state"] for run in runs[True]}
    print(f"pool state (0: not installed, 1: installed): {states[0]} and {states[1]}")
    print(f"medians of {args.rounds} rounds; installed / not installed in the same round")
    print(f"{'':<24} {'not installed':>14} {'installed':>10} {'ratio':>7}")
    names = [*SIZES, *(["step_s"] if args.steps else [])]
    for name in names:
        plain = statistics.median(run[name] for run in runs[False])
        pooled = statistics.median(run[name] for run in runs[True])
        ratio = statistics.median(
            b[name] / a[name] for a, b in zip(runs[False], runs[True], strict=True)
        )
        label = "GPT-2 step, s" if name == "step_s" else f"torch.empty({name}), ns"
        digits = 3 if name == "step_s" else 0
        print(f"{label:<24} {plain:>14.{digits}f} {pooled:>10.{digits}f} {ratio:>7.3f}")
    first = statistics.median(run["first_lease_us"] for run in runs[True])
    later = statistics.median(run["later_lease_us"] for run in runs[True])
    print(f"first lease (installs): {first:.0f} us; a later lease: {later:.0f} us")


if __name__ == "__main__":
    main()
