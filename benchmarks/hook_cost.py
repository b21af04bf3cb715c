"""The per-tensor cost of the hooks, against any Python hook: a chain of saved tensors.

Run: ``python benchmarks/hook_cost.py [--tensors 300] [--rounds 41] [--json PATH]``.

One torch thread, 256-byte tensors (so kernels cost next to nothing), and one
session per round around a chain of ``--tensors`` ``sin`` calls (each saves its
input) and its backward, so opening the session is spread over the chain. Per
round, interleaved: no hooks; identity ``saved_tensors_hooks`` (what any Python
hook costs: the floor); ``Keep`` and ``Auto`` with ``min_bytes=0`` (every tensor
eligible; Auto's default budget keeps it); ``Keep`` with the default
``min_bytes`` (every tensor under it). Each cost is the median over the rounds
less the median without hooks, per tensor (pack and unpack), and each is shown
as a multiple of the identity hooks' cost. ``benchmarks/test_hooks.py`` is the
pytest-benchmark version. ``TENSORSTASH_PURE_PYTHON=1`` in the environment measures
the Python hooks (NOTE [ Fast path ] in tensorstash/core/_fastpath.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tensorstash as ts
from tensorstash.core import _fastpath

Variant = Callable[[], contextlib.AbstractContextManager[Any]]

VARIANTS: dict[str, Variant] = {
    "none": contextlib.nullcontext,
    "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "keep (eligible)": lambda: ts.stash(ts.Keep(), min_bytes=0),
    "auto (under budget)": lambda: ts.stash(ts.Auto(), min_bytes=0),
    "under min_bytes": lambda: ts.stash(ts.Keep()),
}
"""Each variant's context, opened once per round around the chain."""

TARGETS = {"keep (eligible)": 3.0, "auto (under budget)": 4.0, "under min_bytes": 2.0}
"""The multiple of the identity hooks' cost each path should stay under."""


def measure(tensors: int, rounds: int) -> dict[str, float]:
    """Microseconds per saved tensor over no hooks, for each variant but "none"."""
    x = torch.randn(8, 8, requires_grad=True)  # 256 bytes

    def step(make: Variant) -> float:
        start = time.perf_counter()
        with make():
            y = x * 1.0
            for _ in range(tensors):
                y = y.sin()
        y.sum().backward()
        return time.perf_counter() - start

    for make in VARIANTS.values():  # warm up
        step(make)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, make in VARIANTS.items():
            times[name].append(step(make))
    base = statistics.median(times["none"])
    return {
        name: (statistics.median(values) - base) / tensors * 1e6
        for name, values in times.items()
        if name != "none"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hooks = "C" if _fastpath.compiled is not None else "Python"
    print(f"the kept path's hooks: {hooks}")
    costs = measure(args.tensors, args.rounds)
    floor = max(costs["identity hooks"], 1e-3)
    rows = []
    for name, cost in costs.items():
        multiple = cost / floor
        target = TARGETS.get(name)
        bar = f"  (target <= {target:.0f}x)" if target is not None else ""
        print(f"{name:22s} {cost:6.2f} us per tensor  {multiple:5.2f}x identity{bar}")
        rows.append(
            {"variant": name, "hooks": hooks, "us_per_tensor": cost, "x_identity": multiple}
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
