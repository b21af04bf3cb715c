"""The per-tensor cost of the hooks: a chain of saved tensors with and without a stash.

Run: ``python benchmarks/hook_cost.py [--tensors 200] [--rounds 40]``.

Each round runs, one after the other, a chain of ``--tensors`` ``sin`` calls
(each saves its input) and its backward: with no hooks, with identity
``saved_tensors_hooks`` (what any Python hook costs), under ``Keep`` and under
``Auto``, for tensors of 64 KiB (eligible at the default ``min_bytes``) and of
256 bytes (kept untouched). It prints the median time of each over the
no-hooks median, per tensor, on one torch thread so the figure is the hooks'
and not the kernels'. ``benchmarks/test_hooks.py`` is the pytest-benchmark
version.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import tensorstash as ts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "none": contextlib.nullcontext,
        "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t
        ),
        "keep": lambda: ts.stash(ts.Keep()),
        "auto": lambda: ts.stash(ts.Auto()),
    }
    for label, shape in (("64 KiB tensors", (128, 128)), ("256 B tensors", (8, 8))):
        x = torch.randn(shape, requires_grad=True)

        def step(
            make: Callable[[], contextlib.AbstractContextManager[Any]], x: torch.Tensor = x
        ) -> float:
            start = time.perf_counter()
            with make():
                y = x * 1.0
                for _ in range(args.tensors):
                    y = y.sin()
            y.sum().backward()
            return time.perf_counter() - start

        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, make in variants.items():
                times[name].append(step(make))
        base = statistics.median(times["none"])
        for name in variants:
            extra = (statistics.median(times[name]) - base) / args.tensors * 1e6
            print(f"{label:15s} {name:15s} {extra:6.1f} µs per tensor (pack + unpack)")


if __name__ == "__main__":
    main()
