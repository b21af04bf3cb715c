"""Lz4: lossless compression of saved tensors' bytes in host memory, on worker threads.

# NOTE [ Compression ]
1. A sampled trial (``_codec.choose``) picks, per tensor, the encoding that pays:
   bit-packed bools, a zero bitmap for mostly-zero data (ReLU outputs, dropout
   masks), byte-shuffled floats, plain lz4, or nothing ("raw").
2. "raw" never copies a host tensor: it stays where it is (tier "kept",
   counted in ``stats.fallbacks["incompressible"]``).
3. Compression runs on the session's worker threads while forward goes on.
   The packed value keeps the source bytes alive until its compression is
   done; then its stored size drops to the compressed size in the stats.
4. Back-pressure: when more than ``max_pending_bytes`` wait to be compressed,
   pack waits for the oldest (counted as wait time) so memory stays bounded.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from tensorstash import _codec
from tensorstash._layout import Layout
from tensorstash.policy import (
    Context,
    Held,
    HostBytes,
    Packed,
    Pending,
    Returns,
    bug,
    from_host,
    to_host,
)


@dataclass(eq=False, slots=True, weakref_slot=True)
class Compressed(Packed):
    """A tensor's bytes, lz4-compressed (or being compressed) in host memory.

    Attributes:
        layout: how to rebuild the tensor.
        kind: what unpack returns (see ``policy.from_host``).
        future: resolves to the ``_codec.Encoded`` bytes.
        source: the uncompressed bytes, held until compression is done.
        restored: decompressed bytes prepared by prefetch (a cache, not a resource).
    """

    layout: Layout | None = None
    kind: Returns = "tensor"
    future: Future[_codec.Encoded] | None = None
    source: Tensor | None = None
    restored: Future[Tensor] | None = None

    def encoded(self, ctx: Context) -> _codec.Encoded:
        """The compressed bytes, waiting for compression if it is still running."""
        if self.future is None:
            raise bug("Compressed without a future")
        if not self.future.done():
            start = time.perf_counter()
            result = self.future.result()
            ctx.stats.timed("wait", time.perf_counter() - start)
            return result
        return self.future.result()


def _finished(ref: weakref.ref[Compressed], ctx: Context, future: Future[_codec.Encoded]) -> None:
    packed = ref()
    if packed is None or future.exception() is not None:
        return
    packed.source = None
    ctx.update(packed, "host", future.result().stored_bytes)


@dataclass(frozen=True)
class Lz4:
    """Compress saved tensors losslessly with lz4 in host memory.

    Device tensors are first copied to the host (use ``Chain(CpuOffload(),
    Lz4())`` on CUDA for an asynchronous copy). See NOTE [ Compression ].

    Args:
        acceleration: lz4's speed/ratio trade-off, 1 (best ratio) to 65537.
        max_pending_bytes: uncompressed bytes allowed to wait for compression
            before pack waits.

    Raises:
        TypeError, ValueError: an argument out of range.

    Example:
        >>> with tensorstash.stash(tensorstash.Lz4()) as session:
        ...     loss = model(x).sum()
        >>> session.stats.compression_ratio
    """

    acceleration: int = 1
    max_pending_bytes: int = 256 << 20

    stage_rank: ClassVar[int] = 1

    def __post_init__(self) -> None:
        for name, low in (("acceleration", 1), ("max_pending_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"tensorstash.Lz4: {name} must be an int; got {value!r}")
            if value < low:
                raise ValueError(f"tensorstash.Lz4: {name} must be >= {low}; got {value}")
        if self.acceleration > 65537:
            raise ValueError(
                f"tensorstash.Lz4: acceleration must be between 1 and 65537; got {self.acceleration}"
            )

    def pack(self, value: Tensor | Packed, ctx: Context) -> Packed:
        host, kind = to_host(value)
        layout, payload = host.layout, host.ready()
        if layout is None:
            raise bug("HostBytes without a layout")
        method = _codec.choose(payload, layout.dtype)
        if method == "raw" and (isinstance(value, Packed) or value.device.type == "cpu"):
            return self._raw(value, host, ctx)
        pending: Pending = ctx.resource("lz4-pending", Pending)
        pending.wait_under(self.max_pending_bytes, ctx)
        future = ctx.pool().submit(
            _codec.encode, payload, layout.dtype, method, acceleration=self.acceleration
        )
        packed = Compressed(
            "host", host.nbytes, layout.nbytes, layout, kind, future=future, source=payload
        )
        pending.add(future, layout.nbytes)
        ref = weakref.ref(packed)
        future.add_done_callback(lambda done: _finished(ref, ctx, done))
        return packed

    @staticmethod
    def _raw(value: Tensor | Packed, host: HostBytes, ctx: Context) -> Packed:
        """Rule 2 of NOTE [ Compression ]: incompressible host bytes stay where they are."""
        ctx.stats.fallback("incompressible")
        if isinstance(value, Packed):
            return value
        return Held("kept", host.nbytes, host.nbytes, value.detach())

    def unpack(self, packed: Packed, ctx: Context) -> Tensor | Packed:
        if not isinstance(packed, Compressed):
            return packed  # left as it was by rule 2 of NOTE [ Compression ]
        restored = packed.restored
        packed.restored = None
        if restored is not None:
            start = time.perf_counter()
            payload = restored.result()
            ctx.stats.timed("wait", time.perf_counter() - start)
        else:
            payload = _decode(packed.encoded(ctx), pool=ctx.pool())
        layout = packed.layout
        if layout is None:
            raise bug("Compressed without a layout")
        return from_host(layout, payload, packed.kind)

    def prefetch(self, packed: Packed, ctx: Context) -> None:
        if isinstance(packed, Compressed) and packed.restored is None and packed.future:
            future = packed.future
            packed.restored = ctx.pool().submit(lambda: _decode(future.result(), pool=None))


def _decode(encoded: _codec.Encoded, pool: Any) -> Tensor:
    out = torch.empty(encoded.nbytes, dtype=torch.uint8)
    _codec.decode(encoded, out, pool=pool)
    return out
