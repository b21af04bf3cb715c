"""Pack then unpack throughput of each policy on each kind of data, against the raw limits.

Each policy (``keep``, ``cpu``, ``lz4``, ``disk``) packs a tensor and unpacks it
at once, through its ``pack``/``unpack`` with a :class:`tensorstash.Context`,
as a session would (workers included). In the same run and on the same bytes,
two references measure what the machine allows:

- ``raw lz4``: python-lz4's ``lz4.block.compress`` then ``decompress`` over
  1 MiB chunks, on one thread, no transform;
- ``raw file``: ``os.write`` of 1 MiB chunks to a file in the same directory,
  then ``os.preadv`` back into a fresh buffer, no checksum.

``extra_info`` holds ``mb_per_s`` (original bytes through pack+unpack per
second, MB = 10**6 bytes) and, for ``lz4`` and ``disk``, ``ratio_vs_raw``:
the policy's MB/s over its reference's (1.0 = as fast as the raw limit),
from medians of the two run alternately after the benchmark.
On the CPU, ``keep`` and ``cpu`` move nothing: they measure the per-call floor.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import lz4.block
import pytest
import torch
from conftest import Size, interleaved, record_ratio, run
from torch import Tensor

import tensorstash as ts
from tensorstash.core.policy import Context, Held
from tensorstash.core.stats import StashStats

CHUNK = 1 << 20
KINDS = ("random fp32", "relu fp32", "bool mask", "bf16")
POLICIES = ("keep", "cpu", "lz4", "disk")
REFERENCE = {"lz4": "raw lz4", "disk": "raw file"}


def make_data(kind: str, nbytes: int) -> Tensor:
    """``nbytes`` of one kind of saved tensor, from a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    if kind == "random fp32":
        return torch.randn(nbytes // 4, generator=generator)
    if kind == "relu fp32":  # half zeros, as after a ReLU
        return torch.randn(nbytes // 4, generator=generator).relu()
    if kind == "bool mask":
        return torch.rand(nbytes, generator=generator) > 0.5
    if kind == "bf16":
        return torch.randn(nbytes // 2, generator=generator).bfloat16()
    raise ValueError(f"benchmarks: unknown data kind {kind!r}; use one of {', '.join(KINDS)}")


@pytest.fixture(scope="module", params=KINDS)
def data(request: pytest.FixtureRequest, size: Size) -> tuple[str, Tensor]:
    return request.param, make_data(request.param, size.data_bytes)


def byte_view(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def chunks(view: memoryview) -> list[memoryview]:
    return [view[start : start + CHUNK] for start in range(0, view.nbytes, CHUNK)]


def raw_lz4(tensor: Tensor) -> list[bytes]:
    """Compress 1 MiB chunks, then decompress them; the decompressed chunks."""
    parts = chunks(byte_view(tensor))
    blocks = [lz4.block.compress(part, store_size=False) for part in parts]
    return [
        lz4.block.decompress(block, uncompressed_size=part.nbytes)
        for block, part in zip(blocks, parts, strict=True)
    ]


def raw_file(tensor: Tensor, path: Path) -> Tensor:
    """Write the bytes to ``path`` in 1 MiB chunks and read them back into a fresh buffer."""
    view = byte_view(tensor)
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    try:
        for part in chunks(view):
            while part.nbytes:
                part = part[os.write(fd, part) :]
    finally:
        os.close(fd)
    out = torch.empty(view.nbytes, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, part in enumerate(chunks(byte_view(out))):
            got = 0
            while got < part.nbytes:
                n = os.preadv(fd, [part[got:]], offset * CHUNK + got)
                if n == 0:
                    raise OSError(f"benchmarks: {path} is shorter than the {view.nbytes} written")
                got += n
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def make_policy(name: str, spill_root: Path) -> Any:
    if name == "keep":
        return ts.Keep()
    if name == "cpu":
        return ts.CpuOffload()
    if name == "lz4":
        return ts.Lz4()
    return ts.DiskSpill(directory=spill_root)


def round_trip(policy: Any, tensor: Tensor, ctx: Context) -> Tensor:
    """Pack then unpack, as a session does without prefetch; the tensor unpacked."""
    packed = policy.pack(tensor, ctx)
    out = policy.unpack(packed, ctx)
    return out.value() if isinstance(out, Held) else out


def mb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


@pytest.mark.parametrize("reference", ["raw lz4", "raw file"])
def test_raw(
    benchmark: Any,
    size: Size,
    spill_root: Path,
    data: tuple[str, Tensor],
    reference: str,
) -> None:
    kind, tensor = data
    benchmark.group = f"pack+unpack {kind}"
    nbytes = tensor.numel() * tensor.element_size()
    if reference == "raw lz4":
        parts, median = run(benchmark, lambda: raw_lz4(tensor), size)
        out = b"".join(parts)
        stored = sum(
            len(lz4.block.compress(p, store_size=False)) for p in chunks(byte_view(tensor))
        )
        benchmark.extra_info["compression_ratio"] = nbytes / stored
    else:
        path = spill_root / "raw.bin"
        buffer, median = run(benchmark, lambda: raw_file(tensor, path), size)
        out = bytes(byte_view(buffer))
    benchmark.extra_info.update(kind=kind, nbytes=nbytes, mb_per_s=mb_per_s(nbytes, median))
    assert out == bytes(byte_view(tensor)), f"{reference} did not give the bytes back"


@pytest.mark.parametrize("policy", POLICIES)
def test_pack_unpack(
    benchmark: Any,
    size: Size,
    spill_root: Path,
    data: tuple[str, Tensor],
    policy: str,
) -> None:
    kind, tensor = data
    benchmark.group = f"pack+unpack {kind}"
    nbytes = tensor.numel() * tensor.element_size()
    chosen = make_policy(policy, spill_root)
    ctx = Context(StashStats())
    ctx.opened()  # keeps the workers and the spill directory until closed()
    try:
        out, median = run(benchmark, lambda: round_trip(chosen, tensor, ctx), size)
        info: dict[str, Any] = {
            "kind": kind,
            "nbytes": nbytes,
            "mb_per_s": mb_per_s(nbytes, median),
        }
        reference = REFERENCE.get(policy)
        if reference is not None:
            path = spill_root / "reference.bin"
            raw = {"raw lz4": lambda: raw_lz4(tensor), "raw file": lambda: raw_file(tensor, path)}
            raw_s, policy_s = interleaved(
                raw[reference], lambda: round_trip(chosen, tensor, ctx), size.rounds
            )
            info.update(reference=reference, ratio_vs_raw=raw_s / policy_s)
            record_ratio(f"{policy} {kind} / {reference} (MB/s)", info["ratio_vs_raw"])
    finally:
        ctx.closed()
    benchmark.extra_info.update(info)
    assert torch.equal(out, tensor), f"{policy} did not give {kind} back bit for bit"
    assert info["mb_per_s"] > 0
