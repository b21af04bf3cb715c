"""Lz4: lossless compression of saved tensors' bytes in host memory, on worker threads.

# NOTE [ Compression ]
The stage runs any :class:`~tensorstash.tiers._codec.Codec` (rule 1 of NOTE
[ Tiers ] in policy.py) through :func:`pack_with` and :func:`unpack_with`;
:class:`Lz4` is the stage with ``_codec``'s lz4 encodings.

1. A sampled trial (``codec.choose``) picks the encoding that pays:
   bit-packed bools, a zero bitmap for mostly-zero data (ReLU outputs, dropout
   masks), byte-shuffled floats, plain lz4, or nothing ("raw"). The trial runs
   once per kind of tensor in a session: the tensors that the same operation
   saves with the same dtype, shape and stride (one per layer, say) reuse the
   method picked for the first of them. A session given a profile keeps these
   methods in it (``Profile.codec_methods``), so later steps run no trial.
2. "raw" never copies: the bytes stay where they are (a CPU tensor's own
   storage, tier "kept"; host bytes copied from a device, tier "host"),
   counted in ``stats.fallbacks["incompressible"]``.
3. The trial and the compression run on the session's worker threads while
   forward goes on: pack itself only describes the tensor and submits. The
   packed value keeps the source bytes alive until its compression is done;
   then its tier and stored size are updated in the stats.
4. Back-pressure: when more than ``max_pending_bytes`` wait to be compressed,
   pack waits for the oldest (counted as wait time) so memory stays bounded.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from tensorstash.core._layout import Layout, unfilled
from tensorstash.core._reasons import Reason, Why, reason
from tensorstash.core._sizes import size_fields
from tensorstash.core.policy import (
    Context,
    HostBytes,
    Packed,
    Pending,
    Returns,
    bug,
    device_of,
    from_host,
    to_host,
)
from tensorstash.core.stats import Tier
from tensorstash.tiers import _codec


@dataclass(eq=False, slots=True, weakref_slot=True)
class Compressed(Packed):
    """A tensor's bytes, lz4-compressed (or being compressed) in host memory.

    Attributes:
        layout: how to rebuild the tensor.
        kind: what unpack returns (see ``policy.from_host``).
        future: resolves to the ``_codec.Encoded`` bytes.
        source: the uncompressed bytes (or the host bytes that will hold
            them once copied), held until compression is done.
        restored: decompressed bytes prepared by prefetch (a cache, not a resource).
    """

    layout: Layout | None = None
    kind: Returns = "tensor"
    future: Future[_codec.Encoded] | None = None
    source: Tensor | HostBytes | None = None
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

    def spill_buffers(self, ctx: Context) -> tuple[Compressed, list[memoryview]]:
        """The compressed bytes as buffers, and a shell without them (NOTE [ Tiers ] rule 2)."""
        encoded = self.encoded(ctx)
        shell = Compressed(
            self.tier, self.nbytes, self.stored_bytes, self.layout, self.kind,
            future=_resolved(encoded.hollow()),
        )  # fmt: skip
        return shell, encoded.buffers()

    def from_buffers(self, pieces: list[Tensor]) -> Compressed:
        """This shell with its compressed bytes back, as views of ``pieces``."""
        if self.future is None or not self.future.done():
            raise bug("Compressed shell without its hollow encoding")
        encoded = self.future.result().with_buffers(pieces)
        return Compressed(
            "host", self.nbytes, self.stored_bytes, self.layout, self.kind,
            future=_resolved(encoded),
        )  # fmt: skip


def _resolved(encoded: _codec.Encoded) -> Future[_codec.Encoded]:
    future: Future[_codec.Encoded] = Future()
    future.set_result(encoded)
    return future


Kind = tuple[Any, ...]
"""What the trial's result is shared by (rule 1): operation, dtype, shape, stride."""


def _kind(value: Tensor | Packed, layout: Layout) -> Kind:
    grad_fn = value.grad_fn if isinstance(value, Tensor) else None
    op = type(grad_fn).__name__ if grad_fn is not None else None
    return (op, layout.dtype, layout.shape, layout.stride)


def _compress(
    payload: Tensor | HostBytes,
    dtype: torch.dtype,
    codec: _codec.Codec,
    methods: dict[Kind, str],
    kind: Kind,
    pool: Executor,
) -> _codec.Encoded:
    """A worker's job: the sampled trial (unless known, rule 1), then encoding."""
    if isinstance(payload, HostBytes):
        payload = payload.ready()
    method = methods.get(kind)
    if method is None:
        method = methods[kind] = codec.choose(payload, dtype)
    if method != "raw":
        encoded = codec.encode(payload, dtype, method, pool)
        if encoded.method != "raw":
            return encoded
    # Rule 2: no copy, also when a method reused for this kind did not pay;
    # the payload view keeps the bytes alive.
    return _codec.Encoded("raw", payload.numel(), (payload,))


def _finished(
    ref: weakref.ref[Compressed], ctx: Context, future: Future[_codec.Encoded], raw_tier: Tier
) -> None:
    if future.exception() is not None:
        return
    encoded = future.result()
    packed = ref()
    if packed is None:
        return
    packed.source = None
    if encoded.method == "raw":
        ctx.stats.fallback("incompressible")
        ctx.update(packed, raw_tier, encoded.nbytes, Reason(Why.INCOMPRESSIBLE))
    else:
        ratio = encoded.nbytes / max(encoded.stored_bytes, 1)
        outcome = reason(Why.COMPRESSED, f"{ratio:.1f}x ({encoded.method})")
        ctx.update(packed, "host", encoded.stored_bytes, outcome)


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
        size_fields(self, "tensorstash.Lz4", "max_pending_bytes")
        value = self.acceleration
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"tensorstash.Lz4: acceleration must be an int; got {value!r}")
        if value < 1:
            raise ValueError(f"tensorstash.Lz4: acceleration must be >= 1; got {value}")
        if self.acceleration > 65537:
            raise ValueError(
                "tensorstash.Lz4: acceleration must be between 1 and 65537; "
                f"got {self.acceleration}"
            )

    @property
    def codec(self) -> _codec.Lz4Codec:
        """The codec this stage runs (rule 1 of NOTE [ Tiers ] in policy.py)."""
        return _codec.Lz4Codec(self.acceleration)

    def pack(self, value: Tensor | Packed, ctx: Context) -> Packed:
        return pack_with(self.codec, value, ctx, self.max_pending_bytes)

    def unpack(self, packed: Packed, ctx: Context) -> Tensor | Packed:
        return unpack_with(self.codec, packed, ctx)

    def prefetch(self, packed: Packed, ctx: Context) -> None:
        prefetch_with(self.codec, packed, ctx)


def pack_with(
    codec: _codec.Codec, value: Tensor | Packed, ctx: Context, max_pending_bytes: int
) -> Compressed:
    """A compression stage's pack with ``codec`` (rules 1 to 4)."""
    # Host bytes still being copied from the device (CpuOffload before this
    # stage) are waited for by the worker, not here: rule 3.
    host, kind = to_host(value, wait=False)
    layout, payload = host.layout, host if kind == "host" else host.ready()
    if layout is None:
        raise bug("HostBytes without a layout")
    pending: Pending = ctx.resource("compress-pending", Pending)
    pending.wait_under(max_pending_bytes, ctx)
    profile = ctx.profile
    methods: dict[Kind, str] = (
        profile.codec_methods if profile is not None else ctx.resource("codec-methods", dict)
    )
    pool = ctx.pool()
    future = pool.submit(
        _compress, payload, layout.dtype, codec, methods, _kind(value, layout), pool
    )
    # Rule 2: bytes left raw stay where they were: in the tensor's own
    # storage for a CPU tensor, in host memory for anything copied there.
    raw_tier: Tier = "kept" if device_of(value).type == "cpu" and kind != "host" else "host"
    packed = Compressed(
        "host", host.nbytes, layout.nbytes, layout, kind, future=future, source=payload
    )
    pending.add(future, layout.nbytes)
    ref = weakref.ref(packed)
    future.add_done_callback(lambda done: _finished(ref, ctx, done, raw_tier))
    return packed


def unpack_with(codec: _codec.Codec, packed: Packed, ctx: Context) -> Tensor | Packed:
    """A compression stage's unpack with ``codec``: the value its pack was given."""
    if not isinstance(packed, Compressed):
        raise bug(f"a compression stage cannot unpack {type(packed).__name__}")
    restored = packed.restored
    packed.restored = None
    if restored is not None:
        start = time.perf_counter()
        payload = restored.result()
        ctx.stats.timed("wait", time.perf_counter() - start)
    else:
        payload = _decode(codec, packed.encoded(ctx), pool=ctx.pool())
    layout = packed.layout
    if layout is None:
        raise bug("Compressed without a layout")
    return from_host(layout, payload, packed.kind)


def prefetch_with(codec: _codec.Codec, packed: Packed, ctx: Context) -> None:
    """Start decoding ``packed`` on a worker, for its unpack to take."""
    if isinstance(packed, Compressed) and packed.restored is None and packed.future:
        future = packed.future
        packed.restored = ctx.pool().submit(lambda: _decode(codec, future.result(), pool=None))


def _decode(codec: _codec.Codec, encoded: _codec.Encoded, pool: Any) -> Tensor:
    part = encoded.parts[0] if encoded.parts else None
    if encoded.method == "raw" and isinstance(part, Tensor):
        return part  # the bytes as they were (rule 2): no copy
    out = unfilled(encoded.nbytes, torch.uint8)
    codec.decode(encoded, out, pool)
    return out
