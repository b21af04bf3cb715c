"""Ratio and speed of each codec method on typical saved tensors.

Run: ``python benchmarks/bench_codec.py [--mib 64] [--repeat 3]``.

For each kind of data (random fp32, ReLU outputs, a dropout mask, bools, bf16
activations) it prints, per method, the compression ratio and the encode and
decode speed in GB/s of original bytes, with a two-thread pool and without
one, next to plain chunked lz4 (python-lz4 on 512 KiB slices, no transform,
no copy into a destination) measured in the same run. Timings are the best of
``--repeat`` runs; the machine's load average is printed, since other
processes skew every number.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import lz4.block
import torch
from torch import Tensor

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tensorstash._codec import Encoded, choose, decode, encode

CHUNK = 512 * 1024


def make_data(nbytes: int) -> dict[str, tuple[Tensor, torch.dtype]]:
    """Each kind of data as (payload bytes, dtype)."""
    generator = torch.Generator().manual_seed(0)
    floats = nbytes // 4
    relu = torch.randn(floats, generator=generator).relu()
    keep = 0.9  # F.dropout(p=0.1) saves a float mask of {0, 1/(1-p)}
    mask = (torch.rand(floats, generator=generator) < keep).float() / keep
    kinds = {
        "random fp32": torch.randn(floats, generator=generator),
        "relu fp32": relu,
        "dropout fp32": mask,
        "bool": torch.rand(nbytes, generator=generator) > 0.5,
        "bf16": torch.randn(nbytes // 2, generator=generator).bfloat16(),
    }
    return {name: (tensor.view(torch.uint8), tensor.dtype) for name, tensor in kinds.items()}


def best_time(run: Callable[[], object], repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` runs, after one warm-up."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def plain_lz4(payload: Tensor, pool: Executor | None, repeat: int) -> tuple[float, float, float]:
    """Ratio, encode and decode seconds of python-lz4 on 512 KiB slices."""
    view = memoryview((ctypes.c_char * payload.numel()).from_address(payload.data_ptr()))
    slices = [view[start : start + CHUNK] for start in range(0, payload.numel(), CHUNK)]

    def compress(data: memoryview) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def run_map(function: Callable[..., object], items: list) -> list:
        return list(pool.map(function, items)) if pool else [function(item) for item in items]

    blocks: list = run_map(compress, slices)

    def decompress(pair: tuple[bytes, int]) -> bytes:
        return lz4.block.decompress(pair[0], uncompressed_size=pair[1])

    pairs = [(block, len(part)) for block, part in zip(blocks, slices, strict=True)]
    encode_s = best_time(lambda: run_map(compress, slices), repeat)
    decode_s = best_time(lambda: run_map(decompress, pairs), repeat)
    ratio = payload.numel() / sum(len(block) for block in blocks)
    return ratio, encode_s, decode_s


def measure(
    payload: Tensor, dtype: torch.dtype, method: str, pool: Executor | None, repeat: int
) -> tuple[Encoded, float, float]:
    """The encoded payload, encode and decode seconds; checks the round trip."""
    encoded = encode(payload, dtype, method, pool=pool)
    out = torch.empty_like(payload)
    encode_s = best_time(lambda: encode(payload, dtype, method, pool=pool), repeat)
    decode_s = best_time(lambda: decode(encoded, out, pool=pool), repeat)
    if not torch.equal(out, payload):
        raise SystemExit(f"bench_codec: {method} did not round-trip")
    return encoded, encode_s, decode_s


def methods_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["raw", "lz4", "bits", "zeros"]
    return ["raw", "lz4", "shuffle", "zeros"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of each kind of data")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measurement")
    args = parser.parse_args()
    nbytes = args.mib << 20
    pool = ThreadPoolExecutor(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.mib} MiB per kind")
    # Other processes on the machine skew every number: say how busy it was.
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"{'data':<13} {'method':<11} {'ratio':>7}  {'enc GB/s':>8} {'dec GB/s':>8}")
    print(f"{'':<13} {'':<11} {'':>7}  {'pool|1thr':>9} {'pool|1thr':>9}")
    for name, (payload, dtype) in make_data(nbytes).items():
        gb = payload.numel() / 1e9
        picked = choose(payload, dtype)
        choose_ms = best_time(partial(choose, payload, dtype), args.repeat) * 1e3
        ratio, enc_p, dec_p = plain_lz4(payload, pool, args.repeat)
        _, enc_1, dec_1 = plain_lz4(payload, None, args.repeat)
        print(
            f"{name:<13} {'plain lz4':<11} {ratio:>7.2f}  "
            f"{gb / enc_p:>4.2f}|{gb / enc_1:<4.2f} {gb / dec_p:>4.2f}|{gb / dec_1:<4.2f}"
        )
        for method in methods_for(dtype):
            encoded, enc_p, dec_p = measure(payload, dtype, method, pool, args.repeat)
            _, enc_1, dec_1 = measure(payload, dtype, method, None, args.repeat)
            ratio = payload.numel() / max(1, encoded.stored_bytes)
            used = "" if encoded.method == method else f" (stored {encoded.method})"
            print(
                f"{'':<13} {method:<11} {ratio:>7.2f}  "
                f"{gb / enc_p:>4.2f}|{gb / enc_1:<4.2f} {gb / dec_p:>4.2f}|{gb / dec_1:<4.2f}{used}"
            )
        print(f"{'':<13} choose() -> {picked!r} in {choose_ms:.1f} ms")
    pool.shutdown()
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
