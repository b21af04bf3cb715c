"""``stash(verify=True)``: a checksum of each tensor at pack, checked at unpack.

# NOTE [ Verify ]
A checksum of the tensor's bits (not its values: -0.0 and NaN payloads
count), taken at pack and compared at unpack, before backward uses the
tensor:

1. CPU tensors: CRC-32 (zlib, which releases the GIL) over the elements in
   logical order, with no copy for a contiguous tensor.
2. CUDA tensors: three int64 sums on the device, so that pack neither copies
   to the host nor waits: all words (the bits read as integers of the same
   width); the sums over the last dimension weighted by their position; the
   sums over the other dimensions weighted by position along the last. Integer
   sums wrap and do not depend on the order they are added in, so the result
   is exact. A changed value, a stale or zeroed buffer, moved rows or columns:
   each changes at least one sum.
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

from tensorstash.core._layout import memory

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class VerifyError(RuntimeError):
    """A tensor came back from its policy different from what was saved."""


def checksum(tensor: Tensor) -> int | Tensor:
    """A checksum of ``tensor``'s bits (NOTE [ Verify ]), compared with :func:`check`."""
    if tensor.device.type == "cpu":
        data = tensor.detach()
        data = data if data.is_contiguous() else data.contiguous()
        if data.is_complex():
            data = torch.view_as_real(data)
        return zlib.crc32(memory(data))
    return _sums(tensor)


def _sums(tensor: Tensor) -> Tensor:
    """Rule 2 of NOTE [ Verify ]: three int64 sums over the bits, on the tensor's device."""
    words = tensor.detach()
    if words.is_complex():
        words = torch.view_as_real(words)
    if words.dtype == torch.bool:
        words = words.view(torch.uint8)
    elif words.is_floating_point() or words.dtype not in _WORDS.values():
        words = words.view(_WORDS[words.element_size()])
    if words.dim() < 2:  # rows of 1024 words where they divide evenly
        words = words.reshape(-1, 1024 if words.numel() % 1024 == 0 else 1)
    if words.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=words.device)
    rows = words.sum(dim=-1, dtype=torch.int64).reshape(-1)
    cols = words.sum(dim=tuple(range(words.dim() - 1)), dtype=torch.int64)
    weights = torch.arange(1, max(rows.numel(), cols.numel()) + 1, device=words.device)
    return torch.stack(
        (rows.sum(), (rows * weights[: rows.numel()]).sum(), (cols * weights[: cols.numel()]).sum())
    )


def check(expected: int | Tensor, tensor: Tensor, what: str) -> None:
    """Raise :class:`VerifyError` naming ``what`` if ``tensor``'s checksum differs."""
    found = checksum(tensor)
    if isinstance(found, Tensor) and isinstance(expected, Tensor):
        same = torch.equal(found, expected)
    else:
        same = bool(found == expected)
    if not same:
        raise VerifyError(
            f"tensorstash: {what} came back different from what was saved (verify=True found a "
            "checksum mismatch). Backward was stopped before using it, so no gradient is wrong. "
            "This is memory or storage corruption, or a bug in tensorstash: run again with "
            "policy 'keep' to confirm, and report it with the policy and the tensor's shape."
        )
