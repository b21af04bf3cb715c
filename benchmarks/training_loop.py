"""Real memory and step time over a training loop: each variant alone in a fresh process.

What ``tensorstash bench --loop`` measures (NOTE [ Training loops ] in
tensorstash/bench/loop.py), with one more variant, ``disk-untrimmed``
(``DiskSpill(trim_every=None)``), beside any ``tensorstash bench`` policy name
(``none``, ``checkpoint``, ``auto:50%``, ``disk``, ...).

Run: python benchmarks/training_loop.py [--model small] [--dtype float32]
     [--policies none,checkpoint,auto:50%,disk] [--steps 20] [--rounds 4]
     [--directory DIR]

Here ``--steps`` is the loop's length and ``--rounds`` the rounds (``tensorstash bench
--loop 20 --steps 4`` is ``--steps 20 --rounds 4`` here). The processes inherit the
environment: with ``LD_PRELOAD`` naming jemalloc they train under it (the title names
the allocator; docs/cpu-memory.md, "The allocator").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from typing import Any

import torch

import tensorstash as ts
from tensorstash.bench import builtin_workload
from tensorstash.bench.loop import (
    bench_variant,
    format_loop_table,
    loop_rows,
    run_loops,
    train_alone,
)
from tensorstash.bench.measure import StepRunner, resolve_dtype
from tensorstash.bench.variants import BASELINE


def _variant(name: str, runner: StepRunner) -> contextlib.AbstractContextManager[Any]:
    if name == "disk-untrimmed":
        return ts.stash(ts.DiskSpill(trim_every=None))
    return bench_variant(name, runner)


def main(argv: list[str] | None = None) -> int:
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
        runner = StepRunner(
            builtin_workload(args.model, 0), torch.device("cpu"), resolve_dtype(args.dtype), 0
        )
        print(json.dumps(train_alone(runner, args.alone, args.steps, _variant)))
        return 0
    names = [BASELINE, *(p for p in args.policies.split(",") if p != BASELINE)]

    def command(name: str) -> list[str]:
        return [
            sys.executable, __file__, "--alone", name, "--model", args.model,
            "--dtype", args.dtype, "--steps", str(args.steps), "--threads", str(args.threads),
        ]  # fmt: skip

    runs = run_loops(names, args.rounds, command, args.directory)
    model = builtin_workload(args.model, 0).description
    print(format_loop_table(loop_rows(runs), model, args.dtype, args.steps, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
