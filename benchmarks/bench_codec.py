"""Speed and ratio of the Lz4 policy next to plain chunked lz4, on typical saved tensors.

Run: ``python benchmarks/bench_codec.py [--mib 16] [--repeat 7]``.

For each kind of data (random fp32, ReLU outputs with about half zeros, a
dropout mask, a bool mask, bf16 activations) it times a whole round trip
through the ``Lz4`` policy: ``pack`` (the sampled trial and the compression,
on the policy's worker threads) until the compressed bytes are ready, then
``unpack`` back to a tensor. Next to it, in the same process and interleaved
with it, it times plain python-lz4 on the same bytes: ``lz4.block.compress``
then ``lz4.block.decompress`` over 1 MiB slices on one thread. Each figure is
the median of ``--repeat`` runs; ``policy/raw`` is the policy's speed over
plain lz4's, and the ratios are original bytes over stored bytes. Every round
trip is checked bit for bit. The machine's load average is printed, since
other processes skew every number.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import lz4.block
import torch
from torch import Tensor

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tensorstash.core.policy import Context
from tensorstash.core.stats import StashStats
from tensorstash.tiers.compress import Compressed, Lz4

CHUNK = 1 << 20


def make_data(nbytes: int) -> dict[str, Tensor]:
    """Each kind of data, about ``nbytes`` bytes of it."""
    generator = torch.Generator().manual_seed(0)
    floats = nbytes // 4
    keep = 0.9  # F.dropout(p=0.1) saves a float mask of {0, 1/(1-p)}
    return {
        "random fp32": torch.randn(floats, generator=generator),
        "relu fp32": torch.randn(floats, generator=generator).relu(),
        "dropout fp32": (torch.rand(floats, generator=generator) < keep).float() / keep,
        "bool mask": torch.rand(nbytes, generator=generator) > 0.5,
        "bf16 act": torch.nn.functional.gelu(
            torch.randn(nbytes // 2, generator=generator)
        ).bfloat16(),
    }


def plain_lz4(data: Tensor) -> tuple[float, int]:
    """Seconds to compress and decompress ``data`` in 1 MiB slices, and bytes stored."""
    nbytes = data.numel() * data.element_size()
    view = memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
    start = time.perf_counter()
    blocks = [
        lz4.block.compress(view[offset : offset + CHUNK], store_size=False)
        for offset in range(0, nbytes, CHUNK)
    ]
    for index, block in enumerate(blocks):
        lz4.block.decompress(block, uncompressed_size=min(CHUNK, nbytes - index * CHUNK))
    return time.perf_counter() - start, sum(len(block) for block in blocks)


def policy_round_trip(data: Tensor, workers: int) -> tuple[float, int, str]:
    """Seconds of Lz4 pack (until compressed) then unpack, bytes stored, the method used.

    A fresh context per run, so the sampled trial is part of every run; its
    worker threads are started before the clock starts.
    """
    ctx = Context(StashStats(), workers=workers)
    ctx.opened()
    ctx.pool().submit(lambda: None).result()
    policy = Lz4()
    start = time.perf_counter()
    packed = policy.pack(data, ctx)
    if not isinstance(packed, Compressed):
        raise SystemExit(f"bench_codec: Lz4 packed to {type(packed).__name__}")
    encoded = packed.encoded(ctx)
    restored = policy.unpack(packed, ctx)
    seconds = time.perf_counter() - start
    if not isinstance(restored, Tensor) or not torch.equal(
        restored.view(torch.uint8), data.view(torch.uint8)
    ):
        raise SystemExit("bench_codec: the Lz4 policy did not restore the bytes")
    ctx.closed()
    return seconds, encoded.stored_bytes, encoded.method


def compare(data: Tensor, repeat: int, workers: int) -> tuple[float, float, int, int, str]:
    """Median seconds of the policy's and of plain lz4's round trips, taking turns.

    Returns:
        Policy seconds, plain lz4 seconds, bytes each stored, and the policy's method.
    """
    policy_s: list[float] = []
    raw_s: list[float] = []
    for round_ in range(repeat + 1):  # round 0 warms up
        seconds, policy_bytes, method = policy_round_trip(data, workers)
        if round_:
            policy_s.append(seconds)
        seconds, raw_bytes = plain_lz4(data)
        if round_:
            raw_s.append(seconds)
    return statistics.median(policy_s), statistics.median(raw_s), policy_bytes, raw_bytes, method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB of each kind of data")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs of each, interleaved")
    parser.add_argument("--workers", type=int, default=2, help="the policy's worker threads")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.mib} MiB per "
        f"kind, {args.workers} workers, median of {args.repeat}"
    )
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    header = (
        f"{'data':<13} {'method':<8} {'policy MB/s':>11} {'raw MB/s':>9} {'policy/raw':>10} "
        f"{'ratio':>7} {'raw ratio':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, data in make_data(args.mib << 20).items():
        nbytes = data.numel() * data.element_size()
        policy_s, raw_s, policy_bytes, raw_bytes, method = compare(data, args.repeat, args.workers)
        policy_mbs = nbytes / policy_s / 1e6
        raw_mbs = nbytes / raw_s / 1e6
        print(
            f"{name:<13} {method:<8} {policy_mbs:>11.0f} {raw_mbs:>9.0f} "
            f"{policy_mbs / raw_mbs:>10.2f} {nbytes / max(1, policy_bytes):>6.2f}x "
            f"{nbytes / max(1, raw_bytes):>8.2f}x"
        )
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
