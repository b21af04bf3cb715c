"""The codec's dtype-aware transforms: what a method does to a segment before lz4, and its undo.

Rules 1 and 5 of NOTE [ Codec ] (in _codec.py) are stated here.

1. Methods. "raw" keeps a copy. "lz4" compresses the bytes in blocks.
   "shuffle" first regroups byte j of every element into one plane (exponent
   bytes of floats sit together, and lz4 finds their repeats). "bits" packs
   0/1 bytes (bools) eight to a byte. "zeros" stores a bitmap of the elements
   whose bits are not all zero (-0.0 counts as nonzero) and those elements
   compacted: lz4 alone compresses ReLU outputs little, and slowly, because
   the zero runs there are too short for it. :data:`TRANSFORMS` holds each
   method's transform and :data:`UNDO` its undo ("lz4" has none).
5. Element views. Transforms read elements as integers of the element's width
   (bit patterns, never float values, so NaN payloads survive). torch only
   views a uint8 tensor as wider integers when its storage offset is a
   multiple of the width, so a misaligned payload or output goes through an
   aligned copy (:func:`aligned`).

Each transform works on one segment, a piece of at most ``_PIECE`` elements at
a time (rule 4, in _jobs.py), with integer arithmetic on whole words. Where
several torch formulations give the same bytes, the faster one is used, and
the docstrings say which; the measurements are in
docs/figures/tiers-and-memory.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from tensorstash.tiers._encoded import corrupted

__all__ = ["TRANSFORMS", "UNDO", "NotFlags", "aligned", "is_aligned", "words"]

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

# Elements a torch op works on at once (rule 4). A multiple of 64, so pieces
# of a "zeros" segment start on whole 8-byte words of its bitmap. Large, so a
# job issues few ops: each op holds the GIL for its Python work.
_PIECE = 1 << 20


# -- element views ----------------------------------------------------------------


def words(data: Tensor, itemsize: int) -> Tensor:
    """Whole elements of a uint8 tensor as (elements, words) of the widest integer that fits."""
    width = next(width for width in (8, 4, 2, 1) if itemsize % width == 0)
    return data.view(_WORDS[width]).view(-1, itemsize // width)


def is_aligned(tensor: Tensor) -> bool:
    """Whether every integer view of ``tensor`` exists (rule 5)."""
    return tensor.storage_offset() % _ALIGN == 0


def aligned(tensor: Tensor) -> Tensor:
    """The tensor, or an aligned copy where wider views of it would fail (rule 5)."""
    return tensor if is_aligned(tensor) else tensor.clone()


def _pieces(count: int, columns: int) -> Iterator[slice]:
    """Row ranges covering ``count`` rows, each at most ``_PIECE`` elements (rule 4)."""
    step = max(8, _PIECE // columns)
    return (slice(start, min(start + step, count)) for start in range(0, count, step))


# -- transforms -------------------------------------------------------------------


def _shuffle(segment: Tensor, itemsize: int) -> Tensor:
    """Byte j of every element, for each j in turn (in a little-endian host's byte order).

    A plane is cut from the elements' integer view by a shift and a truncating
    cast: faster in torch than a strided copy of uint8 columns.
    """
    elements = words(segment, itemsize)
    count, columns = elements.shape
    width = elements.element_size()
    planes = torch.empty(segment.numel(), dtype=torch.uint8).view(itemsize, count)
    for rows in _pieces(count, columns):
        for column in range(columns):
            word = elements[rows, column]
            for byte in range(width):
                planes[column * width + byte, rows].copy_(word >> (8 * byte) if byte else word)
    return planes.view(-1)


class NotFlags(Exception):
    """Raised by :func:`_pack` on a byte other than 0 or 1: "bits" would lose it."""


def _pack(segment: Tensor, itemsize: int) -> Tensor:
    """The segment's bytes packed eight to a byte; raises NotFlags unless all are 0/1."""
    whole = segment.numel() // 8
    flags = segment[: whole * 8].view(torch.int64)
    for rows in _pieces(whole, 1):
        if bool((flags[rows] & ~_LOW_BITS).any()):
            raise NotFlags
    if any(flag > 1 for flag in segment[whole * 8 :].tolist()):
        raise NotFlags
    packed = torch.empty(-(-segment.numel() // 8), dtype=torch.uint8)
    _pack_bits(segment, packed)
    return packed


def _gather(segment: Tensor, itemsize: int) -> Tensor:
    """The segment's bitmap of nonzero elements, a zero element, then the nonzero elements.

    The bitmap is padded to whole 8-byte words, so the elements after it stay
    aligned for the integer view that reads them back. Each element is
    scattered to its rank among the nonzero ones (a running sum of the flags);
    a zero element goes to the zero slot, which it leaves as it was. In torch
    this is faster than ``nonzero`` and a gather.
    """
    elements = words(segment, itemsize)
    count, columns = elements.shape
    bitmap = -(-count // 64) * 8
    block = torch.empty(bitmap + (count + 1) * itemsize, dtype=torch.uint8)
    block[(count + 7) // 8 : bitmap + itemsize] = 0
    values = words(block[bitmap:], itemsize)
    used = 0
    for rows in _pieces(count, columns):
        part = elements[rows]
        # bool() tests "not all bits zero", faster than != 0.
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
    eights = flags[: whole * 8].view(torch.int64)
    for rows in _pieces(whole, 1):
        # The cast to uint8 keeps the low byte: the eight flags.
        packed[rows].copy_((eights[rows] * _SPREAD) >> 56)
    rest = flags[whole * 8 :].tolist()
    if rest:
        packed[whole] = sum(flag << (7 - bit) for bit, flag in enumerate(rest))


# -- undos ------------------------------------------------------------------------


def _unshuffle(source: Tensor, target: Tensor, itemsize: int) -> None:
    """Undo :func:`_shuffle`: rebuild each word from its planes, high byte first."""
    elements = words(target, itemsize)
    count, columns = elements.shape
    width = elements.element_size()
    planes = source.view(itemsize, count)
    for rows in _pieces(count, columns):
        # Widening each plane first: an OR of mixed dtypes is slower in torch.
        wide = torch.empty(rows.stop - rows.start, dtype=elements.dtype)
        for column in range(columns):
            word = elements[rows, column]
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
    elements = words(target, itemsize)
    count, columns = elements.shape
    bitmap = -(-count // 64) * 8
    values = words(source[bitmap:], itemsize)
    used = 0
    for rows in _pieces(count, columns):
        flags = torch.empty(rows.stop - rows.start, dtype=torch.uint8)
        _unpack_bits(source[rows.start // 8 : (rows.stop + 7) // 8], flags)
        rank, used = _ranks(flags, used, torch.int32)
        if columns > 1:
            torch.index_select(values, 0, rank, out=elements[rows])
        else:
            torch.index_select(values.view(-1), 0, rank, out=elements[rows].view(-1))
    if used + 1 != values.shape[0]:
        raise corrupted((used + 1) * itemsize, values.shape[0] * itemsize)


def _unpack_bits(packed: Tensor, flags: Tensor) -> None:
    """Undo :func:`_pack_bits` into ``flags`` (8-byte aligned), as 0/1 bytes."""
    whole = flags.numel() // 8
    eights = flags[: whole * 8].view(torch.int64)
    for rows in _pieces(whole, 1):
        word = eights[rows]
        word.copy_(packed[rows])
        word.mul_(_SPREAD)
        word >>= 7
        word &= _LOW_BITS
    if flags.numel() > whole * 8:
        last = int(packed[whole])
        rest = [(last >> (7 - bit)) & 1 for bit in range(flags.numel() - whole * 8)]
        flags[whole * 8 :] = torch.tensor(rest, dtype=torch.uint8)


TRANSFORMS: dict[str, Callable[[Tensor, int], Tensor] | None] = {
    "lz4": None,
    "shuffle": _shuffle,
    "bits": _pack,
    "zeros": _gather,
}
"""Each streamed method's transform of a segment (rule 1); lz4 compresses what it returns."""

UNDO: dict[str, Callable[[Tensor, Tensor, int], None] | None] = {
    "lz4": None,
    "shuffle": _unshuffle,
    "bits": _unpack,
    "zeros": _scatter,
}
"""Each streamed method's undo, from a decompressed block into its place in the output."""
