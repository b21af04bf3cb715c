"""Lossless codecs for a tensor's bytes: lz4 in chunks, with dtype-aware transforms.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Codec ]
A payload is the 1-D uint8 view of a tensor's bytes (see NOTE [ Geometry ] in
_layout.py). :func:`encode` turns it into an :class:`Encoded` value and
:func:`decode` writes the same bytes, bit for bit, into a buffer.

1. Methods. "raw" keeps a copy. "lz4" compresses the bytes in blocks.
   "shuffle" first regroups byte j of every element into one plane (exponent
   bytes of floats sit together, and lz4 finds their repeats). "bits" packs
   0/1 bytes (bools) eight to a byte. "zeros" stores a bitmap of the elements
   whose bits are not all zero (-0.0 counts as nonzero) and those elements
   compacted: lz4 alone compresses ReLU outputs little, and slowly, because
   the zero runs there are too short for it.
2. Blocks. A method's output is cut into independent lz4 blocks, one for each
   segment of about ``chunk_bytes`` of the payload: lz4 is faster on blocks
   of a few hundred KiB than on one large buffer, the blocks are
   compressed and decompressed in parallel, and a transform working on one
   segment at a time stays in the CPU cache.
3. Never larger. A block that lz4 does not shrink is kept as is (a block whose
   length equals its decoded size is raw), and an encoding that ends up
   larger than the payload ("zeros" on dense data) is replaced by "raw". So
   ``stored_bytes`` never exceeds ``nbytes``.
4. Threads. Each segment is one job: its transform, then lz4 (or lz4, then
   the undo). Jobs run on the ``pool`` given, a few ahead of the one needed:
   lz4 releases the GIL and so do torch ops, and a job issues a handful of
   ops, each on at most ``_PIECE`` elements (fewer, larger ops hold the GIL
   for less Python work). Every codec op runs with one intra-op thread, on a
   worker and on the caller alike (``_one_thread``): the ops are small, and an
   OpenMP team for each spins against the training step's threads, and on a
   loaded machine decoding on the caller with two threads was many times
   slower. A job that no worker has started when it is needed is run by
   the caller, so ``pool`` may be the executor the caller itself runs on,
   even a busy one.
5. Element views. Transforms read elements as integers of the element's width
   (bit patterns, never float values, so NaN payloads survive). torch only
   views a uint8 tensor as wider integers when its storage offset is a
   multiple of the width, so a misaligned payload or output goes through an
   aligned copy.
6. Buffers. An encoded value is plain byte buffers and a few numbers:
   :meth:`Encoded.buffers` lists the buffers in order, :meth:`Encoded.hollow`
   keeps only the numbers, and ``hollow.with_buffers(pieces)`` puts copies of
   the buffers back (a later stage writes them to disk and reads them back,
   rule 2 of NOTE [ Tiers ] in policy.py). :class:`Lz4Codec` is this module
   behind the :class:`Codec` protocol (rule 1 of NOTE [ Tiers ]).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from functools import partial
from typing import Generic, Protocol, TypeVar

import lz4.block
import torch
from torch import Tensor

__all__ = ["METHODS", "Codec", "Encoded", "Lz4Codec", "Stream", "choose", "decode", "encode"]

METHODS: tuple[str, ...] = ("raw", "lz4", "shuffle", "bits", "zeros")

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

# Integer dtypes by width in bytes: how elements are read as bit patterns.
_WORDS: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
# Widest word used anywhere; payloads and outputs are aligned to it (rule 5).
_ALIGN = 8

# 0x8040201008040201 as a signed int64. Multiplying eight 0/1 bytes, read as
# one little-endian int64, by it moves byte i to bit 63 - i without carries
# (every partial product lands on its own bit); multiplying a byte by it puts
# a copy of the byte every 9 bits, which moves bit 7 - i to bit 8i + 7.
_SPREAD = 0x8040201008040201 - (1 << 64)
_LOW_BITS = 0x0101010101010101

# Blocks compressed or decompressed ahead of the one the caller waits for:
# enough to keep a few workers busy, few enough to bound the memory in flight.
_AHEAD = 8
# Elements a torch op works on at once (rule 4). A multiple of 64, so pieces
# of a "zeros" segment start on whole 8-byte words of its bitmap. Large, so a
# job issues few ops: each op holds the GIL for its Python work.
_PIECE = 1 << 20
# Largest block accepted; lz4 handles at most about 2 GB in one call.
_MAX_CHUNK_BYTES = 1 << 30

# choose(): windows sampled, their size, the gain below which data is stored
# raw, and the size margin within which the cheaper method wins (a sample's
# estimate is only good to a few percent). A byte shuffle spends most of its
# time in lz4 on the plane of high bytes (sign and exponent), 1/itemsize of
# the payload: it pays when it saves at least _SHUFFLE_SAVING of that share,
# 1.11x on float32 but 1.25x on bfloat16, whose activations it would store
# only a little smaller, and far more slowly than leaving them raw (all that
# lz4 alone does).
_SAMPLE_WINDOWS = 4
_SAMPLE_BYTES = 16 * 1024  # 64 KiB in all
_MIN_RATIO = 1.1
_SHUFFLE_SAVING = 0.4
_NEAR_TIE = 1.03


# -- encoded values ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stream:
    """A payload cut into segments, each transformed and stored as one block.

    Attributes:
        itemsize: bytes per element the segments were cut on.
        segment: elements of the payload in each segment (the last may hold fewer).
        sizes: bytes of each block once decompressed.
        blocks: each block, lz4-compressed, or raw when its length equals its size.
        tail: trailing payload bytes short of a whole element, kept as they are.
    """

    itemsize: int
    segment: int
    sizes: tuple[int, ...]
    blocks: tuple[Buffer, ...]
    tail: bytes = b""

    @property
    def stored_bytes(self) -> int:
        """Bytes held by the blocks and the tail."""
        return sum(len(block) for block in self.blocks) + len(self.tail)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A payload in encoded form; :func:`decode` restores it.

    Attributes:
        method: how it was encoded, one of :data:`METHODS`; may differ from the
            method asked for (see :func:`encode`).
        nbytes: size of the original payload.
        parts: ``(tensor,)`` holding a copy of the bytes for "raw",
            ``(stream,)`` (a :class:`Stream`) for the other methods.
    """

    method: str
    nbytes: int
    parts: tuple[Stream | Tensor, ...]
    owner: tuple[Tensor, ...] = ()

    @property
    def stored_bytes(self) -> int:
        """Bytes held in memory for the payload (at most ``nbytes``)."""
        return sum(_held(part) for part in self.parts)

    def buffers(self) -> list[memoryview]:
        """The bytes this value holds, as buffers in order (rule 6), valid while it lives.

        A stream's tail (less than one element) is not among them: the hollow value keeps it.
        """
        views: list[memoryview] = []
        for part in self.parts:
            if isinstance(part, Stream):
                views.extend(memoryview(block).cast("B") for block in part.blocks)
            else:
                views.append(_view(part) if part.numel() else memoryview(b""))
        return views

    def hollow(self) -> Encoded:
        """This value without its bytes: what :meth:`with_buffers` fills back (rule 6)."""
        parts = tuple(
            replace(part, blocks=())
            if isinstance(part, Stream)
            else torch.empty(0, dtype=torch.uint8)
            for part in self.parts
        )
        return Encoded(self.method, self.nbytes, parts)

    def with_buffers(self, pieces: list[Tensor]) -> Encoded:
        """A hollow value filled with ``pieces``: 1-D uint8 CPU tensors holding the bytes
        of :meth:`buffers`, in order. The result keeps views of them (rule 6).

        Raises:
            ValueError: the pieces do not fit this value's shape.
        """
        parts: list[Stream | Tensor] = []
        rest = list(pieces)
        for part in self.parts:
            if not isinstance(part, Stream):
                if not rest:
                    break
                parts.append(rest.pop(0))
                continue
            count = len(part.sizes)
            taken, rest = rest[:count], rest[count:]
            if len(taken) != count:
                break
            parts.append(replace(part, blocks=tuple(_view(piece) for piece in taken)))
        if rest or len(parts) != len(self.parts):
            raise ValueError(
                f"tensorstash._codec: {len(pieces)} buffers do not fit an encoded value of "
                f"{len(self.parts)} parts; the bytes read back are not the ones written"
            )
        return Encoded(self.method, self.nbytes, tuple(parts), owner=tuple(pieces))


def _held(part: Stream | Tensor) -> int:
    if isinstance(part, Stream):
        return part.stored_bytes
    return part.numel() * part.element_size()


# -- public functions -------------------------------------------------------------


def choose(payload: Tensor, dtype: torch.dtype) -> str:
    """Pick the method expected to store ``payload`` in the fewest bytes.

    Every method that suits the dtype is tried on a sample (four 16 KiB
    windows spread over the payload, or all of it when small); "zeros" only
    when the sample has an element that is zero. A method counts from 1.1x
    on the sample; "shuffle" on 2-byte elements from 1.25x, since it costs
    more there. Within 3% of the smallest that counts, the cheaper method
    wins (order of :data:`METHODS`).

    Args:
        payload: 1-D contiguous uint8 CPU tensor, the bytes of a tensor.
        dtype: the tensor's dtype.

    Returns:
        A method name; "raw" when no method pays.

    Example:
        >>> flags = torch.rand(1 << 20) > 0.5
        >>> choose(flags.view(torch.uint8), torch.bool)
        'bits'
    """
    _check_tensor("choose", "payload", payload)
    if payload.numel() == 0:
        return "raw"
    sample = _sample(payload, dtype.itemsize)
    sizes: dict[str, int] = {}
    with _one_thread():
        for method in _candidates(dtype, _has_zero_element(sample, dtype.itemsize)):
            encoded = encode(sample, dtype, method)
            pays = sample.numel() >= _min_ratio(method, dtype.itemsize) * encoded.stored_bytes
            if encoded.method == method and pays:
                sizes[method] = encoded.stored_bytes
    if not sizes:
        return "raw"
    smallest = min(sizes.values())
    return next(method for method, size in sizes.items() if size <= _NEAR_TIE * smallest)


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
        method: one of :data:`METHODS`, e.g. from :func:`choose`.
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
    _check_tensor("encode", "payload", payload)
    _check_settings(method, acceleration, chunk_bytes)
    if method == "raw":
        return Encoded("raw", payload.numel(), (payload.clone(),))
    with _one_thread():
        method, stream = _encode_stream(payload, dtype, method, acceleration, pool, chunk_bytes)
    if stream.stored_bytes > payload.numel():
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
    _check_tensor("decode", "out", out)
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
    if not isinstance(part, Stream) or encoded.method not in _UNDO:
        raise ValueError(
            f"tensorstash._codec.decode: cannot decode method {encoded.method!r} with "
            f"parts of type {type(part).__name__}; the encoded value is corrupted"
        )
    target = out if _is_aligned(out) else torch.empty_like(out)
    with _one_thread():
        _decode_stream(part, encoded.method, target, pool)
        if target is not out:
            out.copy_(target)


class Codec(Protocol):
    """A lossless encoding of a tensor's host bytes (rule 1 of NOTE [ Tiers ] in policy.py).

    ``choose`` picks a method for a payload (the compression stage calls it
    once per kind of tensor), ``encode`` turns the payload into an
    :class:`Encoded` value (its method "raw" when nothing paid), and
    ``decode`` writes the bytes back. ``pool`` runs pieces of work in
    parallel; None runs them on the caller's thread.
    """

    def choose(self, payload: Tensor, dtype: torch.dtype) -> str: ...

    def encode(
        self, payload: Tensor, dtype: torch.dtype, method: str, pool: Executor | None
    ) -> Encoded: ...

    def decode(self, encoded: Encoded, out: Tensor, pool: Executor | None) -> None: ...


@dataclass(frozen=True, slots=True)
class Lz4Codec:
    """This module's encodings as a :class:`Codec`; ``acceleration`` is lz4's."""

    acceleration: int = 1

    def choose(self, payload: Tensor, dtype: torch.dtype) -> str:
        return choose(payload, dtype)

    def encode(
        self, payload: Tensor, dtype: torch.dtype, method: str, pool: Executor | None
    ) -> Encoded:
        return encode(payload, dtype, method, acceleration=self.acceleration, pool=pool)

    def decode(self, encoded: Encoded, out: Tensor, pool: Executor | None) -> None:
        decode(encoded, out, pool=pool)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run this thread's torch ops without an intra-op thread team (rule 4).

    The setting is per thread and restored on exit.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- checks -----------------------------------------------------------------------


def _check_tensor(api: str, name: str, tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor):
        raise ValueError(
            f"tensorstash._codec.{api}: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    ok = tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.device.type == "cpu"
    if not ok or not tensor.is_contiguous():
        raise ValueError(
            f"tensorstash._codec.{api}: {name} must be a 1-D contiguous uint8 CPU tensor, got "
            f"dtype={tensor.dtype}, shape={tuple(tensor.shape)}, stride={tensor.stride()}, "
            f"device={tensor.device}; pass tensor.contiguous().view(-1).view(torch.uint8).cpu()"
        )


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


def _is_aligned(tensor: Tensor) -> bool:
    return tensor.storage_offset() % _ALIGN == 0


def _aligned(tensor: Tensor) -> Tensor:
    """The tensor, or an aligned copy where wider views of it would fail (rule 5)."""
    return tensor if _is_aligned(tensor) else tensor.clone()


# -- choose -----------------------------------------------------------------------


def _candidates(dtype: torch.dtype, zeros: bool) -> tuple[str, ...]:
    """Methods worth trying on a dtype, cheapest first; "zeros" only if there are any."""
    if dtype == torch.bool:
        return ("lz4", "bits")
    floats = dtype.itemsize > 1 and (dtype.is_floating_point or dtype.is_complex)
    return ("lz4", *(("zeros",) if zeros else ()), *(("shuffle",) if floats else ()))


def _min_ratio(method: str, itemsize: int) -> float:
    """The gain below which ``method`` is not worth its time."""
    if method == "shuffle":
        return max(_MIN_RATIO, 1 / (1 - _SHUFFLE_SAVING / itemsize))
    return _MIN_RATIO


def _has_zero_element(sample: Tensor, itemsize: int) -> bool:
    """Whether any whole element of the sample has all its bits zero.

    Without one, "zeros" stores every element plus a bitmap: it cannot win,
    and skipping its trial saves most of the time :func:`choose` takes.
    """
    if sample.numel() < itemsize:
        return False
    words = _words(_aligned(sample[: sample.numel() // itemsize * itemsize]), itemsize)
    if words.shape[1] == 1:
        return not bool(words.view(-1).bool().all())
    return not bool(words.bool().any(dim=1).all())


def _sample(payload: Tensor, itemsize: int) -> Tensor:
    """A few windows spread over the payload, cut on element boundaries."""
    window = max(itemsize, _SAMPLE_BYTES // itemsize * itemsize)
    if payload.numel() <= _SAMPLE_WINDOWS * window:
        return payload
    last = (payload.numel() - window) // itemsize
    sample = torch.empty(_SAMPLE_WINDOWS * window, dtype=torch.uint8)
    for index in range(_SAMPLE_WINDOWS):
        start = last * index // (_SAMPLE_WINDOWS - 1) * itemsize
        # Not torch.cat or copy_: at this size they start OpenMP threads (rule 4).
        target = sample.data_ptr() + index * window
        ctypes.memmove(target, payload.data_ptr() + start, window)
    return sample


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
        payload = _aligned(payload)
    segment = max(1, chunk_bytes // itemsize)
    if method in ("bits", "zeros"):
        # Whole int64 words of flags per segment: only the last one is padded,
        # and every segment starts aligned for the int64 view (rule 5).
        segment = -(-segment // 8) * 8
    body = payload.numel() // itemsize * itemsize
    jobs = _compress_jobs(payload[:body], segment * itemsize, method, itemsize, acceleration)
    try:
        blocks = list(_ordered(jobs, pool))
    except _NotFlags:
        return _encode_stream(payload, dtype, "lz4", acceleration, pool, chunk_bytes)
    sizes = tuple(size for size, _ in blocks)
    data = tuple(block for _, block in blocks)
    tail = bytes(_view(payload[body:]))
    return method, Stream(itemsize, segment, sizes, data, tail)


def _compress_jobs(
    body: Tensor, step: int, method: str, itemsize: int, acceleration: int
) -> Iterator[Callable[[], tuple[int, Buffer]]]:
    """For each segment of ``step`` bytes, the job that transforms and compresses it (rule 4)."""
    transform = _TRANSFORMS[method]
    for start in range(0, body.numel(), step):
        segment = body[start : start + step]
        yield partial(_encode_segment, segment, transform, itemsize, acceleration)


def _encode_segment(
    segment: Tensor,
    transform: Callable[[Tensor, int], Tensor] | None,
    itemsize: int,
    acceleration: int,
) -> tuple[int, Buffer]:
    with _one_thread():
        data = segment if transform is None else transform(segment, itemsize)
    return _compress(data, acceleration)


def _compress(data: Tensor, acceleration: int) -> tuple[int, Buffer]:
    """One block: the data's size, and lz4's output or, if not smaller, a copy."""
    view = _view(data)
    packed = lz4.block.compress(view, mode="fast", acceleration=acceleration, store_size=False)
    if len(packed) < len(view):
        return len(view), packed
    # A bytearray, so that decoding can wrap it in a tensor without copying.
    return len(view), bytearray(view)


def _shuffle(segment: Tensor, itemsize: int) -> Tensor:
    """Byte j of every element, for each j in turn (in a little-endian host's byte order).

    A plane is cut from the elements' integer view by a shift and a truncating
    cast: faster in torch than a strided copy of uint8 columns.
    """
    words = _words(segment, itemsize)
    count, columns = words.shape
    width = words.element_size()
    planes = torch.empty(segment.numel(), dtype=torch.uint8).view(itemsize, count)
    for rows in _pieces(count, columns):
        for column in range(columns):
            word = words[rows, column]
            for byte in range(width):
                planes[column * width + byte, rows].copy_(word >> (8 * byte) if byte else word)
    return planes.view(-1)


class _NotFlags(Exception):
    """Raised by :func:`_pack` on a byte other than 0 or 1: "bits" would lose it."""


def _pack(segment: Tensor, itemsize: int) -> Tensor:
    """The segment's bytes packed eight to a byte; raises _NotFlags unless all are 0/1."""
    whole = segment.numel() // 8
    words = segment[: whole * 8].view(torch.int64)
    for rows in _pieces(whole, 1):
        if bool((words[rows] & ~_LOW_BITS).any()):
            raise _NotFlags
    if any(flag > 1 for flag in segment[whole * 8 :].tolist()):
        raise _NotFlags
    packed = torch.empty(-(-segment.numel() // 8), dtype=torch.uint8)
    _pack_bits(segment, packed)
    return packed


def _gather(segment: Tensor, itemsize: int) -> Tensor:
    """The segment's bitmap of nonzero elements, a zero element, then the nonzero elements.

    The bitmap is padded to whole 8-byte words, so the elements after it stay
    aligned for the integer view that reads them back. Each element is
    scattered to its rank among the nonzero ones (a running sum of the flags);
    a zero element goes to the zero slot, which it leaves as it was. In torch
    this is a few times faster than ``nonzero`` and a gather.
    """
    words = _words(segment, itemsize)
    count, columns = words.shape
    bitmap = -(-count // 64) * 8
    block = torch.empty(bitmap + (count + 1) * itemsize, dtype=torch.uint8)
    block[(count + 7) // 8 : bitmap + itemsize] = 0
    values = _words(block[bitmap:], itemsize)
    used = 0
    for rows in _pieces(count, columns):
        part = words[rows]
        # bool() tests "not all bits zero", several times faster than != 0.
        nonzero = part.bool().any(dim=1) if columns > 1 else part.view(-1).bool()
        flags = nonzero.view(torch.uint8)
        _pack_bits(flags, block[rows.start // 8 : (rows.stop + 7) // 8])
        rank, used = _ranks(flags, used, torch.int64)
        if columns > 1:
            values.index_copy_(0, rank, part)
        else:
            values.view(-1).scatter_(0, rank, part.view(-1))
    return block[: bitmap + (used + 1) * itemsize]


def _ranks(flags: Tensor, before: int, dtype: torch.dtype) -> tuple[Tensor, int]:
    """Each flagged element's rank, counting ``before`` earlier ones, and 0 for the others.

    Returns the ranks (of ``dtype``: int64 for ``scatter_``, int32, half the
    memory traffic, for ``index_select``) and the count of flagged elements
    including ``before``. Two ops, each writing the ranks once: temporaries
    cost as much as the arithmetic here.
    """
    rank = flags.cumsum(0, dtype=dtype)
    total = before + int(rank[-1])
    if before:
        rank += before
    rank *= flags
    return rank, total


def _pack_bits(flags: Tensor, packed: Tensor) -> None:
    """Pack bytes of 0/1 (8-byte aligned) eight to a byte, the first in the high bit."""
    whole = flags.numel() // 8
    words = flags[: whole * 8].view(torch.int64)
    for rows in _pieces(whole, 1):
        # The cast to uint8 keeps the low byte: the eight flags.
        packed[rows].copy_((words[rows] * _SPREAD) >> 56)
    rest = flags[whole * 8 :].tolist()
    if rest:
        packed[whole] = sum(flag << (7 - bit) for bit, flag in enumerate(rest))


_TRANSFORMS: dict[str, Callable[[Tensor, int], Tensor] | None] = {
    "lz4": None,
    "shuffle": _shuffle,
    "bits": _pack,
    "zeros": _gather,
}


# -- decoding ---------------------------------------------------------------------


def _decode_stream(stream: Stream, method: str, out: Tensor, pool: Executor | None) -> None:
    """Decode every block into its place in ``out``, one job per segment (rule 4)."""
    body = out[: out.numel() - len(stream.tail)]
    step = stream.segment * stream.itemsize
    if len(stream.blocks) != len(stream.sizes) or len(stream.blocks) != -(-body.numel() // step):
        raise ValueError(
            f"tensorstash._codec.decode: {len(stream.blocks)} blocks of {step} bytes cannot "
            f"hold {body.numel()} bytes; the encoded value is corrupted"
        )
    targets = (body[start : start + step] for start in range(0, body.numel(), step))
    places = zip(stream.blocks, stream.sizes, targets, strict=True)
    undo = _UNDO[method]
    jobs = (partial(_decode_segment, *place, undo, stream.itemsize) for place in places)
    for _ in _ordered(jobs, pool):
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
    with _one_thread():
        undo(torch.frombuffer(data, dtype=torch.uint8), target, itemsize)


def _decompress_into(block: Buffer, size: int, target: Tensor) -> None:
    """Decompress one block straight into ``target``."""
    if size != target.numel():
        raise _corrupted(size, target.numel())
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
        raise _corrupted(-1, size) from error
    if len(data) != size:
        raise _corrupted(len(data), size)
    return data


def _unshuffle(source: Tensor, target: Tensor, itemsize: int) -> None:
    """Undo :func:`_shuffle`: rebuild each word from its planes, high byte first."""
    words = _words(target, itemsize)
    count, columns = words.shape
    width = words.element_size()
    planes = source.view(itemsize, count)
    for rows in _pieces(count, columns):
        # Widening each plane first: an OR of mixed dtypes is slower in torch.
        wide = torch.empty(rows.stop - rows.start, dtype=words.dtype)
        for column in range(columns):
            word = words[rows, column]
            word.copy_(planes[column * width + width - 1, rows])
            for byte in reversed(range(width - 1)):
                word <<= 8
                word |= wide.copy_(planes[column * width + byte, rows])


def _unpack(source: Tensor, target: Tensor, itemsize: int) -> None:
    _unpack_bits(source, target)


def _scatter(source: Tensor, target: Tensor, itemsize: int) -> None:
    """Undo :func:`_gather`: each element is gathered from the stored ones by its rank.

    A flagged element's rank among the flagged ones (a running sum of the
    flags) indexes the stored elements; an unflagged one reads the zero
    element. One gather is faster in torch than zero-fill plus masked scatter.
    """
    words = _words(target, itemsize)
    count, columns = words.shape
    bitmap = -(-count // 64) * 8
    values = _words(source[bitmap:], itemsize)
    used = 0
    for rows in _pieces(count, columns):
        flags = torch.empty(rows.stop - rows.start, dtype=torch.uint8)
        _unpack_bits(source[rows.start // 8 : (rows.stop + 7) // 8], flags)
        rank, used = _ranks(flags, used, torch.int32)
        if columns > 1:
            torch.index_select(values, 0, rank, out=words[rows])
        else:
            torch.index_select(values.view(-1), 0, rank, out=words[rows].view(-1))
    if used + 1 != values.shape[0]:
        raise _corrupted((used + 1) * itemsize, values.shape[0] * itemsize)


def _unpack_bits(packed: Tensor, flags: Tensor) -> None:
    """Undo :func:`_pack_bits` into ``flags`` (8-byte aligned), as 0/1 bytes."""
    whole = flags.numel() // 8
    words = flags[: whole * 8].view(torch.int64)
    for rows in _pieces(whole, 1):
        word = words[rows]
        word.copy_(packed[rows])
        word.mul_(_SPREAD)
        word >>= 7
        word &= _LOW_BITS
    if flags.numel() > whole * 8:
        last = int(packed[whole])
        rest = [(last >> (7 - bit)) & 1 for bit in range(flags.numel() - whole * 8)]
        flags[whole * 8 :] = torch.tensor(rest, dtype=torch.uint8)


_UNDO: dict[str, Callable[[Tensor, Tensor, int], None] | None] = {
    "lz4": None,
    "shuffle": _unshuffle,
    "bits": _unpack,
    "zeros": _scatter,
}


def _corrupted(got: int, expected: int) -> ValueError:
    return ValueError(
        f"tensorstash._codec.decode: a block decoded to {got} bytes instead of {expected}; "
        "the encoded value is corrupted"
    )


# -- helpers ----------------------------------------------------------------------


def _words(data: Tensor, itemsize: int) -> Tensor:
    """Whole elements of a uint8 tensor as (elements, words) of the widest integer that fits."""
    width = next(width for width in (8, 4, 2, 1) if itemsize % width == 0)
    return data.view(_WORDS[width]).view(-1, itemsize // width)


def _pieces(count: int, columns: int) -> Iterator[slice]:
    """Row ranges covering ``count`` rows, each at most ``_PIECE`` elements (rule 4)."""
    step = max(8, _PIECE // columns)
    return (slice(start, min(start + step, count)) for start in range(0, count, step))


def _view(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy.

    The tensor must outlive the view: the view does not keep it alive.
    """
    array = (ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


class _Job(Generic[T]):
    """A call that runs once, on a pool worker or on the first caller to need it.

    Whoever waits for the result runs the call if no worker has started it, so
    a job never waits for a pool whose workers are all busy (rule 4).
    Unlike ``Future.cancel`` and a fallback, claiming cannot race a worker.
    """

    __slots__ = ("_call", "_claimed", "_done", "_error", "_value")

    def __init__(self, call: Callable[[], T]) -> None:
        self._call: Callable[[], T] | None = call
        self._claimed = threading.Lock()
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the call, unless someone already has."""
        if not self._claimed.acquire(blocking=False):
            return
        call, self._call = self._call, None
        try:
            if call is not None:
                self._value = call()
        except BaseException as error:  # handed to the caller by result()
            self._error = error
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the call has finished."""
        return self._done.is_set()

    def result(self) -> T:
        """The call's value; runs it here when no worker has started it."""
        self.run()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _ordered(calls: Iterable[Callable[[], T]], pool: Executor | None) -> Iterator[T]:
    """Results of ``calls`` in order, running up to ``_AHEAD`` of them ahead on ``pool``.

    ``calls`` is consumed lazily, which bounds the blocks held in flight. While
    the oldest call is still running, this thread runs calls no worker has
    started rather than wait.
    """
    if pool is None:
        for call in calls:
            yield call()
        return
    pending: deque[_Job[T]] = deque()
    for call in calls:
        job = _Job(call)
        # A pool that was shut down refuses the job: result() then runs it here.
        with contextlib.suppress(RuntimeError):
            pool.submit(job.run)
        pending.append(job)
        if len(pending) > _AHEAD:
            yield _next(pending)
    while pending:
        yield _next(pending)


def _next(pending: deque[_Job[T]]) -> T:
    """The oldest job's result; runs pending jobs here until it is done."""
    for job in pending:
        if pending[0].done():
            break
        job.run()
    return pending.popleft().result()
