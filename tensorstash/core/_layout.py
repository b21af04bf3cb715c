"""How a strided tensor becomes a flat run of bytes and back, with its exact geometry.

The measurement behind rule 4 is in docs/figures/tiers-and-memory.md.

# NOTE [ Geometry ]
Gradient kernels can depend on strides (a channels_last convolution picks other
kernels than a contiguous one, with other rounding), so a tensor brought back
must have the size and stride it was saved with, not only the same values.

1. The bytes saved are the storage *span* the tensor touches, from its first
   element to its last, when that span is at most twice its element count
   (dense tensors, channels_last, transposes, stride-0 broadcasts).
2. Otherwise (a narrow slice of a wide tensor) the elements are saved compactly
   in row-major order and scattered back into a span-sized buffer on restore.
3. Only size, stride, dtype and values are promised, as autograd requires:
   a restored tensor may start anywhere in a fresh storage or alias the
   bytes it was given.
4. A buffer that a copy or a decoder fills whole is allocated with
   :func:`unfilled`. Under ``torch.use_deterministic_algorithms(True)`` torch
   fills every ``torch.empty`` with NaN (or the largest integer) so that a read
   of uninitialized memory gives the same bits each run. The stash never reads
   such bytes, and the fill costs a pass over the buffer: a large share of a
   step that copies every saved byte (``CpuOffload`` on a GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# Above this ratio of span to elements, the compact copy of rule 2 is cheaper.
_MAX_SPAN_RATIO = 2


@dataclass(frozen=True, slots=True)
class Layout:
    """What is needed to rebuild a tensor from its saved bytes.

    Attributes:
        dtype: element type.
        shape: the tensor's size.
        stride: the tensor's stride, in elements.
        device: where the tensor lived when it was saved.
        span: elements of the storage region the restored tensor needs.
        compact: True when the bytes hold the elements in row-major order
            (rule 2 of NOTE [ Geometry ]), False when they hold the span.
        nbytes: bytes of the payload: the span, or the elements when compact
            (worked out from the fields above, once).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device
    span: int
    compact: bool
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        # Read on every pack and unpack: worked out once.
        count = self.numel if self.compact else self.span
        object.__setattr__(self, "nbytes", count * self.itemsize)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def span_of(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements between a tensor's first and last element, both included."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def describe(tensor: Tensor) -> tuple[Layout, Tensor]:
    """Split a tensor into its layout and a 1-D byte payload (a view where possible).

    Args:
        tensor: a strided tensor without conjugate or negative bits.

    Returns:
        The layout, and a 1-D uint8 tensor on the tensor's device whose bytes,
        given to :func:`rebuild` with that layout, restore the tensor. When the
        span is dense enough the payload is a view of the tensor's storage, so
        the caller must copy it before the tensor may change.
    """
    data = tensor.detach()
    shape = tuple(data.shape)
    stride = tuple(data.stride())
    numel = data.numel()
    # Most saved tensors are contiguous: their span is their elements.
    span = numel if data.is_contiguous() else span_of(shape, stride)
    compact = span > _MAX_SPAN_RATIO * max(numel, 1)
    if compact:
        flat = data.contiguous().reshape(-1)
    else:
        flat = data.as_strided((span,), (1,), data.storage_offset())
    layout = Layout(data.dtype, shape, stride, data.device, span, compact)
    return layout, _as_bytes(flat)


def unfilled(
    numel: int, dtype: torch.dtype, device: torch.device | str = "cpu", *, pinned: bool = False
) -> Tensor:
    """``torch.empty`` for a buffer that is written whole before it is read (rule 4).

    On every unpack that copies back: without the fill on, a plain ``torch.empty``.
    """
    if _DETERMINISTIC is None or not _DETERMINISTIC.fill_uninitialized_memory:
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=pinned)
    with without_fill():
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=pinned)


_DETERMINISTIC: Any = getattr(torch.utils, "deterministic", None)  # torch 2.1 and later


@contextlib.contextmanager
def without_fill() -> Iterator[None]:
    """Deterministic mode's fill of new tensors, off for a region (rule 4).

    The setting is the process's: another thread allocating in the region
    skips the fill too (a fill only ever hides reads of uninitialized memory).
    """
    settings = _DETERMINISTIC
    if settings is None or not settings.fill_uninitialized_memory:
        yield
        return
    settings.fill_uninitialized_memory = False
    try:
        yield
    finally:
        settings.fill_uninitialized_memory = True


def _as_bytes(flat: Tensor) -> Tensor:
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def rebuild(layout: Layout, payload: Tensor) -> Tensor:
    """Restore a tensor from its layout and payload bytes.

    Args:
        layout: as returned by :func:`describe`.
        payload: 1-D uint8 tensor of ``layout.nbytes`` bytes, on any device;
            the result is on the payload's device and may alias it.

    Returns:
        A tensor with the layout's dtype, size and stride.
    """
    if payload.numel() != layout.nbytes:
        raise AssertionError(
            f"tensorstash: payload of {payload.numel()} bytes for a layout of "
            f"{layout.nbytes} bytes; this is a bug in tensorstash"
        )
    values = (
        payload.view(layout.dtype)
        if layout.nbytes
        else torch.empty(layout.span, dtype=layout.dtype, device=payload.device)
    )
    if not layout.compact:
        # as_strided's offset is absolute in the storage: the payload may be a
        # view into a larger one (bytes left in place by Lz4's raw path).
        return values.as_strided(layout.shape, layout.stride, values.storage_offset())
    out = unfilled(layout.span, layout.dtype, payload.device)
    out = out.as_strided(layout.shape, layout.stride, 0)
    out.copy_(values.view(layout.shape))
    return out


def memory(tensor: Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's elements, without a copy.

    The view does not keep the tensor alive: the caller must hold the tensor for
    as long as the view is used.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise AssertionError(
            "tensorstash: memory() needs a contiguous CPU tensor; this is a bug in tensorstash"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
