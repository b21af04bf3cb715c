"""Real memory and step time over a training loop: each variant alone in a fresh process.

``tensorstash bench`` measures single steps, each from a heap handed back to the
OS first (rule 3 of NOTE [ Real memory ]), with the variants interleaved in one
process. A training loop differs: nothing hands memory back between its
steps, so a step begins with the free memory the last one left resident, and
its plain step faults nothing. Here each variant trains alone in a process of
its own: the reference step and a ``Keep`` step (the activation bytes a budget
in percent is a share of), memory handed back once, then ``--steps`` SGD steps
back to back. Reported per variant: the most the resident set grew over the
steps (sampled every half millisecond: an Auto profile resets Linux's
high-water mark for its own steps), over all of them and from the sixth on
(an Auto profile's first step keeps everything, to measure the model), and
the median step from the sixth on, each as a median over the rounds of ratios
against no stash's run of the same round. Rounds alternate the variants' order.

Variants: any ``tensorstash bench`` policy name (``none``, ``checkpoint``,
``auto:50%``, ``disk``, ...), and ``disk-untrimmed`` (``trim_every=None``).

Run: python benchmarks/training_loop.py [--model small] [--dtype float32]
     [--policies none,checkpoint,auto:50%,disk] [--steps 20] [--rounds 4]
     [--directory DIR]

The processes inherit the environment: with ``LD_PRELOAD`` naming jemalloc they
train under it (the title names the allocator; README, "The allocator").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import tensorstash as ts
from tensorstash._memory import current_rss
from tensorstash._trim import ALLOCATOR
from tensorstash.bench import PeakRss, builtin_workload, return_free_memory
from tensorstash.bench.measure import StepRunner, resolve_dtype
from tensorstash.bench.variants import variant_context
from tensorstash.bench.workloads import checked_loss

MiB = 1 << 20
BASELINE = "none"
LEARNING = 5
"""Steps an Auto profile may still be learning in (its first measures with everything kept):
the step time, and the second memory figure, are taken after them."""


@contextlib.contextmanager
def _variant(name: str, runner: StepRunner, directory: Path) -> Iterator[None]:
    if name == "disk-untrimmed":
        with ts.stash(ts.DiskSpill(directory=directory, trim_every=None)):
            yield
        return
    with variant_context(
        name,
        runner.workload,
        runner.device,
        runner.profiles,
        activation_bytes=runner.activation_bytes,
    ):
        yield


def train_alone(model: str, dtype: str, name: str, steps: int, directory: Path) -> dict[str, Any]:
    """``steps`` training steps under variant ``name`` in this process."""
    runner = StepRunner(builtin_workload(model, 0), torch.device("cpu"), resolve_dtype(dtype), 0)
    runner.take_reference()
    net = runner.model
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
    autocast = runner.dtype != torch.float32
    seconds, peaks = [], []
    os.environ["TMPDIR"] = str(directory)  # where "disk" spills
    tempfile.tempdir = None
    net.zero_grad(set_to_none=True)
    return_free_memory()
    base = current_rss()
    for _ in range(steps):
        begun = current_rss()
        # Sampled: an Auto profile resets the high-water mark for its own steps.
        with PeakRss(0.0005, resettable=False) as meter:
            start = time.perf_counter()
            net.zero_grad(set_to_none=True)
            with _variant(name, runner, directory):
                with torch.autocast("cpu", dtype=runner.dtype, enabled=autocast):
                    loss = checked_loss(net(*runner.batch), runner.workload)
                loss.backward()
            optimizer.step()
            del loss
            seconds.append(time.perf_counter() - start)
        peaks.append(begun + meter.delta_bytes - base)
    return {"peaks": peaks, "seconds": seconds}


def run(args: argparse.Namespace, directory: Path) -> dict[str, dict[str, list[float]]]:
    """Every variant's runs, round after round; the ratios printed, and returned."""
    variants = [BASELINE, *(p for p in args.policies.split(",") if p != BASELINE)]
    peaks: dict[str, list[int]] = {v: [] for v in variants}
    steady: dict[str, list[int]] = {v: [] for v in variants}
    steps: dict[str, list[float]] = {v: [] for v in variants}
    for index in range(args.rounds):
        for name in variants if index % 2 == 0 else list(reversed(variants)):
            command = [sys.executable, __file__, "--alone", name, "--model", args.model]
            command += ["--dtype", args.dtype, "--steps", str(args.steps)]
            command += ["--threads", str(args.threads), "--directory", str(directory)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            found = json.loads(out.strip().splitlines()[-1])
            peaks[name].append(max(found["peaks"]))
            steady[name].append(max(found["peaks"][LEARNING:] or found["peaks"]))
            steps[name].append(statistics.median(found["seconds"][LEARNING:] or found["seconds"]))
    print(
        f"{args.model} {args.dtype}, {args.threads} thread(s), allocator {ALLOCATOR.name}: "
        f"{args.rounds} round(s) of "
        f"{args.steps} steps, each variant alone in its own process; medians of ratios "
        "against none of the same round"
    )
    ratios: dict[str, dict[str, list[float]]] = {}
    for name in variants:
        held = [p / max(b, 1) for p, b in zip(peaks[name], peaks[BASELINE], strict=True)]
        late = [p / max(b, 1) for p, b in zip(steady[name], steady[BASELINE], strict=True)]
        over = [s / b for s, b in zip(steps[name], steps[BASELINE], strict=True)]
        ratios[name] = {"peak": held, "steady": late, "step": over}
        print(
            f"  {name:14s} step {statistics.median(steps[name]) * 1e3:6.0f} ms "
            f"x{statistics.median(over):.2f}  most RSS grew: over the loop "
            f"{statistics.median(peaks[name]) / MiB:6.1f} MiB "
            f"({statistics.median(held):.2f} of none's), from step {LEARNING + 1} "
            f"{statistics.median(steady[name]) / MiB:6.1f} MiB ({statistics.median(late):.2f})"
        )
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--policies", default="none,checkpoint,auto:50%,disk")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--directory", default=None, help="parent of the spill directory")
    parser.add_argument("--alone", default=None, help=argparse.SUPPRESS)  # one run, here
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.alone is not None:
        found = train_alone(args.model, args.dtype, args.alone, args.steps, Path(args.directory))
        print(json.dumps(found))
        return
    with tempfile.TemporaryDirectory(prefix="ts-loop-bench-", dir=args.directory) as name:
        run(args, Path(name))


if __name__ == "__main__":
    sys.exit(main())
