"""Lossless codecs for a tensor's bytes: lz4 in chunks, with dtype-aware transforms.

# NOTE [ Codec ]
A payload is the 1-D uint8 view of a tensor's bytes (see NOTE [ Geometry ] in
_layout.py). :func:`encode` turns it into an :class:`Encoded` value and
:func:`decode` writes the same bytes, bit for bit, into a buffer;
:func:`choose` picks the method (NOTE [ Codec choice ] in _choice.py).
:class:`Lz4Codec` is all of it behind the :class:`Codec` protocol (rule 1 of
NOTE [ Tiers ] in policy.py). Each rule is stated, with its reasons, in the
module that follows it; the numbers are the ones the code and
docs/figures/tiers-and-memory.md cite.

1. Methods ("raw", "lz4", "shuffle", "bits", "zeros"): what each does to the
   bytes. _transforms.py.
2. Blocks: a method's output is cut into independent lz4 blocks, one per
   segment of about ``chunk_bytes``. _lz4stream.py.
3. Never larger: ``stored_bytes`` never exceeds ``nbytes``. _lz4stream.py.
4. Threads: segments are jobs run ahead on a pool, or by the caller when no
   worker has started them; codec ops use one intra-op thread. _jobs.py.
5. Element views: elements are read as integer bit patterns, through an
   aligned copy where needed. _transforms.py.
6. Buffers: an encoded value is plain byte buffers and a few numbers, and
   what is read back is checked before it is decoded. _encoded.py.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tensorstash.tiers._choice import choose
from tensorstash.tiers._encoded import METHODS, Encoded, Stream
from tensorstash.tiers._lz4stream import decode, encode

__all__ = ["METHODS", "Codec", "Encoded", "Lz4Codec", "Stream", "choose", "decode", "encode"]


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
    """This module's encodings as a :class:`Codec`; ``acceleration`` is lz4's.

    Its methods call this module's :func:`choose`, :func:`encode` and
    :func:`decode`, looked up when called.
    """

    acceleration: int = 1

    def choose(self, payload: Tensor, dtype: torch.dtype) -> str:
        return choose(payload, dtype)

    def encode(
        self, payload: Tensor, dtype: torch.dtype, method: str, pool: Executor | None
    ) -> Encoded:
        return encode(payload, dtype, method, acceleration=self.acceleration, pool=pool)

    def decode(self, encoded: Encoded, out: Tensor, pool: Executor | None) -> None:
        decode(encoded, out, pool=pool)
