"""The codec's encoded form: the methods, :class:`Encoded` and its :class:`Stream`, and the
checks on bytes read back.

Rule 6 of NOTE [ Codec ] (in _codec.py) is stated here; the other rules say how
the bytes of a stream are made (_transforms.py, _lz4stream.py, _jobs.py).

6. Buffers. An encoded value is plain byte buffers and a few numbers:
   :meth:`Encoded.buffers` lists the buffers in order, :meth:`Encoded.hollow`
   keeps only the numbers, and ``hollow.with_buffers(pieces)`` puts copies of
   the buffers back (a later stage writes them to disk and reads them back,
   rule 2 of NOTE [ Tiers ] in policy.py). Bytes read back may not be the
   ones written, so what they must agree with is checked as they are put
   back and decoded: the number of buffers (:meth:`Encoded.with_buffers`),
   a method that makes a stream and a stream to decode (:func:`stream_of`),
   one block per segment (:func:`check_blocks`) and each block's decoded
   size (:func:`corrupted`), each failing with a ``ValueError`` that says
   the bytes are not the ones written.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch
from torch import Tensor

__all__ = [
    "METHODS",
    "Buffer",
    "Encoded",
    "Stream",
    "byte_view",
    "check_blocks",
    "check_payload",
    "corrupted",
    "stream_of",
]

METHODS: tuple[str, ...] = ("raw", "lz4", "shuffle", "bits", "zeros")
"""Every encoding: "raw" keeps a copy of the bytes, the others make a :class:`Stream`."""

Buffer = bytes | bytearray | memoryview


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
    """A payload in encoded form; :func:`~tensorstash.tiers._codec.decode` restores it.

    Attributes:
        method: how it was encoded, one of :data:`METHODS`; may differ from the
            method asked for (see :func:`~tensorstash.tiers._codec.encode`).
        nbytes: size of the original payload.
        parts: ``(tensor,)`` holding a copy of the bytes for "raw",
            ``(stream,)`` (a :class:`Stream`) for the other methods.
        owner: the tensors whose memory the parts view (from :meth:`with_buffers`).
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
                views.append(byte_view(part) if part.numel() else memoryview(b""))
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
            parts.append(replace(part, blocks=tuple(byte_view(piece) for piece in taken)))
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


def byte_view(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy.

    The tensor must outlive the view: the view does not keep it alive.
    """
    array = (ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


# -- checks -----------------------------------------------------------------------


def check_payload(api: str, name: str, tensor: Tensor) -> None:
    """Raise unless ``tensor`` is a payload: a 1-D contiguous uint8 CPU tensor."""
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


def stream_of(encoded: Encoded) -> Stream:
    """The stream of a value encoded by a method other than "raw" (rule 6).

    Raises:
        ValueError: the method is not one that makes a stream, or its part is not one.
    """
    part = encoded.parts[0]
    if not isinstance(part, Stream) or encoded.method not in METHODS[1:]:
        raise ValueError(
            f"tensorstash._codec.decode: cannot decode method {encoded.method!r} with "
            f"parts of type {type(part).__name__}; the encoded value is corrupted"
        )
    return part


def check_blocks(stream: Stream, body: int) -> None:
    """Raise unless the stream has one block, and one size, per segment of ``body`` bytes."""
    step = stream.segment * stream.itemsize
    if len(stream.blocks) != len(stream.sizes) or len(stream.blocks) != -(-body // step):
        raise ValueError(
            f"tensorstash._codec.decode: {len(stream.blocks)} blocks of {step} bytes cannot "
            f"hold {body} bytes; the encoded value is corrupted"
        )


def corrupted(got: int, expected: int) -> ValueError:
    """The error for a block that decodes to ``got`` bytes where ``expected`` were written."""
    return ValueError(
        f"tensorstash._codec.decode: a block decoded to {got} bytes instead of {expected}; "
        "the encoded value is corrupted"
    )
