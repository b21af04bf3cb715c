"""The codec's chunked lz4 stream: :func:`encode` cuts a payload into segments, transforms and
compresses each into a block; :func:`decode` writes the blocks back in place.

Rules 2 and 3 of NOTE [ Codec ] (in _codec.py) are stated here.

2. Blocks. A method's output is cut into independent lz4 blocks, one for each
   segment of about ``chunk_bytes`` of the payload: lz4 is faster on blocks
   of a few hundred KiB than on one large buffer, the blocks are
   compressed and decompressed in parallel, and a transform working on one
   segment at a time stays in the CPU cache.
3. Never larger. A block that lz4 does not shrink is kept as is (a block whose
   length equals its decoded size is raw), and an encoding that ends up
   larger than the payload ("zeros" on dense data) is replaced by "raw". So
   ``stored_bytes`` never exceeds ``nbytes``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from functools import partial

import lz4.block
import torch
from torch import Tensor

from tensorstash.tiers._encoded import (
    METHODS,
    Buffer,
    Encoded,
    Stream,
    byte_view,
    check_blocks,
    check_payload,
    corrupted,
    stream_of,
)
from tensorstash.tiers._jobs import one_thread, ordered
from tensorstash.tiers._transforms import TRANSFORMS, UNDO, NotFlags, aligned, is_aligned

__all__ = ["decode", "encode"]

# Largest block accepted; lz4 handles at most about 2 GB in one call.
_MAX_CHUNK_BYTES = 1 << 30


def encode(
    payload: Tensor,
    dtype: torch.dtype,
    method: str,
    *,
    acceleration: int = 1,
    pool: Executor | None = None,
    chunk_bytes: int = 512 * 1024,
) -> Encoded:
    """Encode a tensor's bytes losslessly.

    Args:
        payload: 1-D contiguous uint8 CPU tensor, the bytes of a tensor. It is
            only read; the result shares no memory with it.
        dtype: the tensor's dtype (its itemsize drives "shuffle" and "zeros").
        method: one of :data:`METHODS`, e.g. from :func:`~tensorstash.tiers._codec.choose`.
        acceleration: lz4's speed/ratio trade-off; 1 compresses best.
        pool: threads for the segments; None encodes on this thread.
        chunk_bytes: payload bytes per block.

    Returns:
        The encoded payload. Its ``method`` is the one used: "bits" on bytes
        other than 0/1 and "shuffle" on one-byte elements are done as "lz4",
        and any result larger than the payload is stored "raw".

    Raises:
        ValueError: on an unknown method, a bad payload or bad settings.

    Example:
        >>> x = torch.randn(1000).relu()
        >>> encoded = encode(x.view(torch.uint8), x.dtype, "zeros")
        >>> encoded.stored_bytes < x.numel() * 4
        True
    """
    check_payload("encode", "payload", payload)
    _check_settings(method, acceleration, chunk_bytes)
    if method == "raw":
        return Encoded("raw", payload.numel(), (payload.clone(),))
    with one_thread():
        method, stream = _encode_stream(payload, dtype, method, acceleration, pool, chunk_bytes)
    if stream.stored_bytes > payload.numel():  # rule 3
        return Encoded("raw", payload.numel(), (payload.clone(),))
    return Encoded(method, payload.numel(), (stream,))


def decode(encoded: Encoded, out: Tensor, *, pool: Executor | None = None) -> None:
    """Write the bytes that ``encoded`` holds into ``out``.

    ``encoded`` is left as it was: it may be decoded again.

    Args:
        encoded: as returned by :func:`encode`.
        out: 1-D contiguous uint8 CPU tensor of ``encoded.nbytes`` bytes.
        pool: threads for the segments; None decodes on this thread.

    Raises:
        ValueError: when ``out`` does not fit, or ``encoded`` is corrupted.
    """
    check_payload("decode", "out", out)
    if out.numel() != encoded.nbytes:
        raise ValueError(
            f"tensorstash._codec.decode: out holds {out.numel()} bytes but the encoded "
            f"payload has {encoded.nbytes}; pass a buffer of exactly encoded.nbytes bytes"
        )
    if encoded.nbytes == 0:
        return
    part = encoded.parts[0]
    if encoded.method == "raw" and isinstance(part, Tensor):
        out.copy_(part)
        return
    stream = stream_of(encoded)
    target = out if is_aligned(out) else torch.empty_like(out)
    with one_thread():
        _decode_stream(stream, encoded.method, target, pool)
        if target is not out:
            out.copy_(target)


def _check_settings(method: str, acceleration: int, chunk_bytes: int) -> None:
    if method not in METHODS:
        raise ValueError(
            f"tensorstash._codec.encode: unknown method {method!r}; use one of {METHODS}"
        )
    if not isinstance(acceleration, int) or acceleration < 1:
        raise ValueError(
            f"tensorstash._codec.encode: acceleration must be an int >= 1, got {acceleration!r}"
        )
    if not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= _MAX_CHUNK_BYTES:
        raise ValueError(
            f"tensorstash._codec.encode: chunk_bytes must be an int in [1, {_MAX_CHUNK_BYTES}], "
            f"got {chunk_bytes!r}"
        )


# -- encoding ---------------------------------------------------------------------


def _encode_stream(
    payload: Tensor,
    dtype: torch.dtype,
    method: str,
    acceleration: int,
    pool: Executor | None,
    chunk_bytes: int,
) -> tuple[str, Stream]:
    """The method actually used, and the stream it produced (see :func:`encode`)."""
    if method == "shuffle" and dtype.itemsize == 1:
        method = "lz4"
    itemsize = dtype.itemsize if method in ("shuffle", "zeros") else 1
    if method != "lz4":
        payload = aligned(payload)
    segment = max(1, chunk_bytes // itemsize)
    if method in ("bits", "zeros"):
        # Whole int64 words of flags per segment: only the last one is padded,
        # and every segment starts aligned for the int64 view (rule 5).
        segment = -(-segment // 8) * 8
    body = payload.numel() // itemsize * itemsize
    jobs = _compress_jobs(payload[:body], segment * itemsize, method, itemsize, acceleration)
    try:
        blocks = list(ordered(jobs, pool))
    except NotFlags:
        return _encode_stream(payload, dtype, "lz4", acceleration, pool, chunk_bytes)
    sizes = tuple(size for size, _ in blocks)
    data = tuple(block for _, block in blocks)
    tail = bytes(byte_view(payload[body:]))
    return method, Stream(itemsize, segment, sizes, data, tail)


def _compress_jobs(
    body: Tensor, step: int, method: str, itemsize: int, acceleration: int
) -> Iterator[Callable[[], tuple[int, Buffer]]]:
    """For each segment of ``step`` bytes, the job that transforms and compresses it (rule 4)."""
    transform = TRANSFORMS[method]
    for start in range(0, body.numel(), step):
        segment = body[start : start + step]
        yield partial(_encode_segment, segment, transform, itemsize, acceleration)


def _encode_segment(
    segment: Tensor,
    transform: Callable[[Tensor, int], Tensor] | None,
    itemsize: int,
    acceleration: int,
) -> tuple[int, Buffer]:
    with one_thread():
        data = segment if transform is None else transform(segment, itemsize)
    return _compress(data, acceleration)


def _compress(data: Tensor, acceleration: int) -> tuple[int, Buffer]:
    """One block: the data's size, and lz4's output or, if not smaller, a copy (rule 3)."""
    view = byte_view(data)
    packed = lz4.block.compress(view, mode="fast", acceleration=acceleration, store_size=False)
    if len(packed) < len(view):
        return len(view), packed
    # A bytearray, so that decoding can wrap it in a tensor without copying.
    return len(view), bytearray(view)


# -- decoding ---------------------------------------------------------------------


def _decode_stream(stream: Stream, method: str, out: Tensor, pool: Executor | None) -> None:
    """Decode every block into its place in ``out``, one job per segment (rule 4)."""
    body = out[: out.numel() - len(stream.tail)]
    step = stream.segment * stream.itemsize
    check_blocks(stream, body.numel())
    targets = (body[start : start + step] for start in range(0, body.numel(), step))
    places = zip(stream.blocks, stream.sizes, targets, strict=True)
    undo = UNDO[method]
    jobs = (partial(_decode_segment, *place, undo, stream.itemsize) for place in places)
    for _ in ordered(jobs, pool):
        pass
    if stream.tail:
        tail = torch.tensor(list(stream.tail), dtype=torch.uint8)
        out[body.numel() :] = tail


def _decode_segment(
    block: Buffer,
    size: int,
    target: Tensor,
    undo: Callable[[Tensor, Tensor, int], None] | None,
    itemsize: int,
) -> None:
    """Decompress one block and undo its transform into ``target``."""
    if undo is None:
        _decompress_into(block, size, target)
        return
    data = _decompress(block, size)
    with one_thread():
        undo(torch.frombuffer(data, dtype=torch.uint8), target, itemsize)


def _decompress_into(block: Buffer, size: int, target: Tensor) -> None:
    """Decompress one block straight into ``target``."""
    if size != target.numel():
        raise corrupted(size, target.numel())
    data = _decompress(block, size)
    # ctypes releases the GIL around the copy, so workers copy in parallel.
    ctypes.memmove(target.data_ptr(), (ctypes.c_char * size).from_buffer(data), size)


def _decompress(block: Buffer, size: int) -> bytearray:
    """A block's decoded bytes, writable so that torch can wrap them without a copy."""
    if len(block) == size:
        return block if isinstance(block, bytearray) else bytearray(block)
    try:
        data = lz4.block.decompress(block, uncompressed_size=size, return_bytearray=True)
    except lz4.block.LZ4BlockError as error:
        raise corrupted(-1, size) from error
    if len(data) != size:
        raise corrupted(len(data), size)
    return data
