"""DiskSpill against raw file I/O, and against no stash on real models (docs/disk.md).

Two measurements; in each the variants run interleaved, round after round, in
one process, and every figure is the median over the rounds of a ratio taken
within one round (the machine's speed drifts between rounds, not within one).

- ``throughput``: for 16 MiB of random fp32 and of bf16, the time a DiskSpill
  session adds to a step that saves the tensor (``(x * 1.0).sin()`` then
  backward, against the same step without a stash), against raw I/O of the
  same bytes in the same directory (``os.write`` of the whole buffer to a new
  file, ``os.readv`` back into a reused buffer, unlink). Prints raw / added:
  1.0 is raw speed. ``--reads mapped,copied`` runs both ways of reading a
  value back (rule 4 of NOTE [ Spill files ]) as variants of the same rounds:
  ``copied`` reads every value into a buffer, as values under 1 MiB are.
- ``memory``: a training step of the bench's ``small`` model and of an HF
  GPT-2 config (4 layers, d=256, batch 4x128; needs transformers) with no
  stash and with ``disk`` (and any other policy named): the step time against
  no stash, the real peak RSS growth over the step (Linux's ``VmHWM``, reset
  before the step, after ``gc.collect()`` and ``malloc_trim(0)``), and the
  bytes the step faulted in (rule 7 of NOTE [ Real memory ]): memory a spill
  hands back to the OS is faulted in again when the heap reuses it.
  ``disk-untrimmed`` (``trim_every=None``) shows that trade.

In a training loop a step begins with the free memory the last one left
resident: ``benchmarks/training_loop.py`` measures that.

Run: python benchmarks/disk_spill.py [throughput|memory|all] [--rounds 8]
     [--directory DIR] [--models small,gpt2] [--policies disk,lz4+disk]
     [--reads mapped,copied]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tensorstash as ts
from tensorstash.bench import HF_GPT2, PeakRss, builtin_workload, return_free_memory
from tensorstash.tiers import _spillfile

MiB = 1 << 20
KINDS = {
    "random fp32": lambda: torch.randn(4 * MiB, requires_grad=True),
    "bf16": lambda: torch.randn(8 * MiB).bfloat16().requires_grad_(),
}
POLICIES: dict[str, Callable[[Path], Any]] = {
    "disk": lambda root: ts.DiskSpill(directory=root),
    "disk-untrimmed": lambda root: ts.DiskSpill(directory=root, trim_every=None),
    "lz4+disk": lambda root: ts.Chain(ts.Lz4(), ts.DiskSpill(directory=root)),
    "lz4": lambda root: ts.Lz4(),
}


# -- throughput ---------------------------------------------------------------------------


def _plain(x: torch.Tensor) -> float:
    start = time.perf_counter()
    (x * 1.0).sin().sum().backward()
    return time.perf_counter() - start


def _spilled(x: torch.Tensor, root: Path, reads: str = "mapped") -> float:
    mapped_from = _spillfile.MAP_FROM
    if reads == "copied":
        _spillfile.MAP_FROM = 1 << 62  # every value read into a buffer
    try:
        start = time.perf_counter()
        with ts.stash(ts.DiskSpill(directory=root), min_bytes=0):
            y = (x * 1.0).sin()  # saves the non-leaf x * 1.0
        y.sum().backward()
        return time.perf_counter() - start
    finally:
        _spillfile.MAP_FROM = mapped_from


def _raw(data: bytes, buffer: bytearray, root: Path) -> float:
    start = time.perf_counter()
    path = root / "raw.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    got = os.readv(fd, [buffer])
    os.close(fd)
    os.unlink(path)
    if got != len(buffer):
        raise OSError(f"benchmarks: read {got} of {len(buffer)} bytes back from {path}")
    return time.perf_counter() - start


def throughput(root: Path, rounds: int, reads: tuple[str, ...] = ("mapped",)) -> dict[str, float]:
    """Raw file I/O time over the time DiskSpill adds, per kind of data and way of
    reading back (median of rounds).

    The kinds take turns within each round, first one then the other: run one
    after the other, whichever ran second saw raw I/O about 25% faster (the page
    cache still writing back the first one's files), and its ratio fell.
    """
    inputs = {}
    for kind, make in KINDS.items():
        x = make()
        nbytes = x.numel() * x.element_size()
        inputs[kind] = (x, os.urandom(nbytes), bytearray(nbytes))
    for _ in range(2):  # warm up all three, for every kind
        for x, data, buffer in inputs.values():
            _plain(x), _raw(data, buffer, root)
            for way in reads:
                _spilled(x, root, way)
    keys = [(kind, way) for kind in inputs for way in reads]
    ratios: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    added: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    raw: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for index in range(rounds):
        order = keys if index % 2 == 0 else list(reversed(keys))
        for kind, way in order:
            x, data, buffer = inputs[kind]
            p, s, r = _plain(x), _spilled(x, root, way), _raw(data, buffer, root)
            ratios[kind, way].append(r / max(s - p, 1e-6))
            added[kind, way].append(s - p)
            raw[kind, way].append(r)
    results: dict[str, float] = {}
    for kind, way in keys:
        name = kind if reads == ("mapped",) else f"{kind}, {way}"
        results[name] = statistics.median(ratios[kind, way])
        print(
            f"{name:20s} 16 MiB: raw / added {results[name]:.2f}  (added "
            f"{statistics.median(added[kind, way]) * 1e3:.1f} ms, raw "
            f"{statistics.median(raw[kind, way]) * 1e3:.1f} ms, {rounds} rounds)"
        )
    return results


# -- memory -------------------------------------------------------------------------------


def _workload(name: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """The bench's model called ``name`` ("gpt2" is its gpt2-hf), and its loss."""
    workload = builtin_workload(HF_GPT2 if name == "gpt2" else name, seed=0)
    batch = workload.batch
    return workload.model, lambda m: m(*batch)


def _step(model: torch.nn.Module, loss_of: Callable[..., torch.Tensor], policy: Any) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if policy is None:
        loss = loss_of(model)
    else:
        with ts.stash(policy):
            loss = loss_of(model)
    loss.backward()
    return time.perf_counter() - start


def memory(root: Path, rounds: int, models: list[str], policies: list[str]) -> None:
    """Step time against no stash and peak RSS growth, per model and policy."""
    for name in models:
        model, loss_of = _workload(name)
        variants: dict[str, Any] = {"none": lambda: None}
        variants.update({p: (lambda p=p: POLICIES[p](root)) for p in policies})
        for make in variants.values():
            for _ in range(2):
                _step(model, loss_of, make())
        times: dict[str, list[float]] = {v: [] for v in variants}
        peaks: dict[str, list[int]] = {v: [] for v in variants}
        faulted: dict[str, list[int]] = {v: [] for v in variants}
        for index in range(rounds):
            order = list(variants) if index % 2 == 0 else list(reversed(variants))
            for variant in order:
                return_free_memory()
                with PeakRss() as meter:
                    times[variant].append(_step(model, loss_of, variants[variant]()))
                peaks[variant].append(meter.delta_bytes)
                faulted[variant].append(meter.faulted_bytes or 0)
        none_peak = statistics.median(peaks["none"])
        print(f"{name}: {rounds} rounds, medians; step against none of the same round")
        for variant in variants:
            over = statistics.median(
                t / base for t, base in zip(times[variant], times["none"], strict=True)
            )
            peak = statistics.median(peaks[variant])
            print(
                f"  {variant:14s} step {statistics.median(times[variant]) * 1e3:6.0f} ms "
                f"x{over:.2f}  peak RSS growth {peak / MiB:6.1f} MiB "
                f"({peak / max(none_peak, 1):.2f} of none's)  "
                f"faulted {statistics.median(faulted[variant]) / MiB:6.1f} MiB"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="all", choices=["throughput", "memory", "all"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--directory", default=None, help="parent of the spill directory")
    parser.add_argument("--models", default="small,gpt2")
    parser.add_argument("--policies", default="disk")
    parser.add_argument(
        "--reads", default="mapped", help="ways to read values back: mapped, copied or both"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="ts-disk-bench-", dir=args.directory) as name:
        root = Path(name)
        if args.what in ("throughput", "all"):
            reads = tuple(args.reads.split(","))
            if not set(reads) <= {"mapped", "copied"}:
                parser.error(f"--reads takes mapped and copied; got {args.reads!r}")
            throughput(root, args.rounds, reads)
        if args.what in ("memory", "all"):
            memory(root, args.rounds, args.models.split(","), args.policies.split(","))


if __name__ == "__main__":
    sys.exit(main())
