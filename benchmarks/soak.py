"""Soak: many training steps under each lossless policy, watching for anything that grows.

Every ``--every`` steps it samples the process's resident memory, open file
descriptors and threads, the bytes in the spill directory and the session's
live bytes. After ``--warmup`` steps nothing may grow: descriptors, threads,
spill bytes and live bytes must stay exactly where they were, resident memory
within ``--rss-tolerance`` MiB. It prints, per policy, the first sample after
warm-up, the last one and the slope per 1000 steps, and exits 1 if anything
grew.

Run: python benchmarks/soak.py [--steps 2000] [--policies keep,lz4,disk] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import tensorstash as ts

POLICIES: dict[str, Callable[[Path], Any]] = {
    "keep": lambda d: ts.Keep(),
    "cpu": lambda d: ts.CpuOffload(),
    "lz4": lambda d: ts.Lz4(),
    "disk": lambda d: ts.DiskSpill(d),
    "lz4+disk": lambda d: ts.Chain(ts.Lz4(), ts.DiskSpill(d)),
    "auto": lambda d: ts.Auto(device_budget="256KiB", directory=str(d)),
}
"""The lossless policies soaked; ``auto`` has a budget small enough to use every tier."""

EXACT = ("fds", "threads", "spill_bytes", "live_bytes")
"""Figures that must not change at all after warm-up."""


@dataclass
class Sample:
    step: int
    rss: int
    fds: int
    threads: int
    spill_bytes: int
    live_bytes: int


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256)
    )


def spill_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def settle_threads(timeout: float = 2.0) -> None:
    """Wait for stopped sessions' worker threads to exit (they stop asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        t.name.startswith("tensorstash") for t in threading.enumerate()
    ):
        time.sleep(0.005)


def soak(policy_name: str, steps: int, every: int, directory: Path) -> list[Sample]:
    """Run ``steps`` training steps under one policy; a sample every ``every`` steps."""
    process = psutil.Process()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(128, 256)
    samples: list[Sample] = []
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        with ts.stash(POLICIES[policy_name](directory), min_bytes=0) as session:
            loss = net(x).square().mean()
        loss.backward()
        optimizer.step()
        del loss
        if step % every == 0:
            gc.collect()
            settle_threads()
            samples.append(
                Sample(
                    step,
                    process.memory_info().rss,
                    process.num_fds(),
                    threading.active_count(),
                    spill_bytes(directory),
                    session.stats.live_bytes,
                )
            )
    return samples


def slope(samples: list[Sample], field: str) -> float:
    """Least-squares growth of ``field`` per 1000 steps."""
    xs = [s.step for s in samples]
    ys = [getattr(s, field) for s in samples]
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def growth(samples: list[Sample], warmup: int, rss_tolerance: int) -> list[str]:
    """What grew after warm-up (empty if nothing did)."""
    after = [s for s in samples if s.step > warmup]
    if len(after) < 2:
        return []
    first, problems = after[0], []
    for field in EXACT:
        values = {getattr(s, field) for s in after}
        if values != {getattr(first, field)}:
            problems.append(f"{field} changed after warm-up: {sorted(values)}")
    rss_growth = max(s.rss for s in after) - first.rss
    if rss_growth > rss_tolerance:
        problems.append(f"rss grew {rss_growth / 2**20:.1f} MiB after warm-up")
    return problems


def table(results: dict[str, list[Sample]], warmup: int) -> str:
    header = f"{'policy':10} {'figure':12} {'after warmup':>14} {'last':>14} {'per 1000 steps':>15}"
    lines = [header, "-" * len(header)]
    for name, samples in results.items():
        after = [s for s in samples if s.step > warmup] or samples
        for field in ("rss", *EXACT):
            first, last = getattr(after[0], field), getattr(after[-1], field)
            lines.append(
                f"{name:10} {field:12} {first:>14,} {last:>14,} {slope(after, field):>15,.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--every", type=int, default=0, help="default: steps // 20")
    parser.add_argument("--warmup", type=int, default=0, help="default: steps // 5")
    parser.add_argument("--rss-tolerance", type=float, default=16.0, help="MiB")
    parser.add_argument("--json", type=Path, help="write the samples and verdicts here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    every = args.every or max(1, args.steps // 20)
    warmup = args.warmup or args.steps // 5
    tolerance = int(args.rss_tolerance * 2**20)
    torch.set_num_threads(1)
    results: dict[str, list[Sample]] = {}
    problems: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        directory = Path(scratch)
        for name in names:
            results[name] = soak(name, args.steps, every, directory)
            problems[name] = growth(results[name], warmup, tolerance)
    print(f"{args.steps} steps per policy, a sample every {every}, warm-up {warmup} steps")
    print(table(results, warmup))
    for name, found in problems.items():
        for problem in found:
            print(f"GREW {name}: {problem}")
    if args.json:
        data = {
            "steps": args.steps,
            "every": every,
            "warmup": warmup,
            "samples": {n: [asdict(s) for s in samples] for n, samples in results.items()},
            "problems": problems,
        }
        args.json.write_text(json.dumps(data, indent=2))
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
