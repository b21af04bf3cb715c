"""The codec's choice of a method: :func:`choose` tries the methods that suit a dtype on a
sample and picks the one that stores it in the fewest bytes, if any pays for its time.

# NOTE [ Codec choice ]
1. A trial, not a rule of thumb. Each candidate method encodes a sample of
   the payload (``_SAMPLE_WINDOWS`` windows of ``_SAMPLE_BYTES`` spread over
   it, or all of it when small) with :func:`encode` itself, so the sample is
   stored just as the payload would be.
2. Candidates by dtype (:func:`_candidates`), cheapest first: bools try
   "lz4" and "bits"; other dtypes "lz4", then "zeros" when the sample holds an
   element with all bits zero (without one "zeros" stores every element plus
   a bitmap and cannot win, and skipping its trial saves most of the time a
   choice takes), then "shuffle" for floats wider than a byte.
3. A method must pay for its time. It counts only from ``_MIN_RATIO`` on the
   sample. A byte shuffle spends most of its time in lz4 on the plane of
   high bytes (sign and exponent), 1/itemsize of the payload: it counts only
   when it saves at least ``_SHUFFLE_SAVING`` of that share, 1.11x on float32
   but 1.25x on bfloat16, whose activations it would store only a little
   smaller, and far more slowly than leaving them raw (all that lz4 alone
   does). Nor does a method that :func:`encode` carried out another way
   ("bits" on bytes other than 0/1, anything stored "raw"). None counts:
   "raw".
4. Near ties go to the cheaper method. A sample's estimate is good to only a
   few percent, so among the methods that count, the first in candidate
   order within ``_NEAR_TIE`` of the smallest wins.
5. The trial's ops run with one intra-op thread (rule 4 of NOTE [ Codec ], in
   _jobs.py), and the sample is copied without torch ops for the same reason.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from tensorstash.tiers._encoded import check_payload
from tensorstash.tiers._jobs import one_thread
from tensorstash.tiers._lz4stream import encode
from tensorstash.tiers._transforms import aligned, words

__all__ = ["choose"]

# Windows sampled and their size (rule 1), the gain below which data is stored
# raw, the share of a shuffle's high-byte plane it must save (rule 3), and the
# size margin within which the cheaper method wins (rule 4).
_SAMPLE_WINDOWS = 4
_SAMPLE_BYTES = 16 * 1024  # 64 KiB in all
_MIN_RATIO = 1.1
_SHUFFLE_SAVING = 0.4
_NEAR_TIE = 1.03


def choose(payload: Tensor, dtype: torch.dtype) -> str:
    """Pick the method expected to store ``payload`` in the fewest bytes (NOTE [ Codec choice ]).

    Args:
        payload: 1-D contiguous uint8 CPU tensor, the bytes of a tensor.
        dtype: the tensor's dtype.

    Returns:
        A method name; "raw" when no method pays.

    Raises:
        ValueError: on a bad payload.

    Example:
        >>> flags = torch.rand(1 << 20) > 0.5
        >>> choose(flags.view(torch.uint8), torch.bool)
        'bits'
    """
    check_payload("choose", "payload", payload)
    if payload.numel() == 0:
        return "raw"
    sample = _sample(payload, dtype.itemsize)
    sizes: dict[str, int] = {}
    with one_thread():
        for method in _candidates(dtype, _has_zero_element(sample, dtype.itemsize)):
            encoded = encode(sample, dtype, method)
            pays = sample.numel() >= _min_ratio(method, dtype.itemsize) * encoded.stored_bytes
            if encoded.method == method and pays:
                sizes[method] = encoded.stored_bytes
    if not sizes:
        return "raw"
    smallest = min(sizes.values())
    return next(method for method, size in sizes.items() if size <= _NEAR_TIE * smallest)


def _candidates(dtype: torch.dtype, zeros: bool) -> tuple[str, ...]:
    """Methods worth trying on a dtype, cheapest first; "zeros" only if there are any (rule 2)."""
    if dtype == torch.bool:
        return ("lz4", "bits")
    floats = dtype.itemsize > 1 and (dtype.is_floating_point or dtype.is_complex)
    return ("lz4", *(("zeros",) if zeros else ()), *(("shuffle",) if floats else ()))


def _min_ratio(method: str, itemsize: int) -> float:
    """The gain below which ``method`` is not worth its time (rule 3)."""
    if method == "shuffle":
        return max(_MIN_RATIO, 1 / (1 - _SHUFFLE_SAVING / itemsize))
    return _MIN_RATIO


def _has_zero_element(sample: Tensor, itemsize: int) -> bool:
    """Whether any whole element of the sample has all its bits zero (rule 2)."""
    if sample.numel() < itemsize:
        return False
    elements = words(aligned(sample[: sample.numel() // itemsize * itemsize]), itemsize)
    if elements.shape[1] == 1:
        return not bool(elements.view(-1).bool().all())
    return not bool(elements.bool().any(dim=1).all())


def _sample(payload: Tensor, itemsize: int) -> Tensor:
    """A few windows spread over the payload, cut on element boundaries (rule 1)."""
    window = max(itemsize, _SAMPLE_BYTES // itemsize * itemsize)
    if payload.numel() <= _SAMPLE_WINDOWS * window:
        return payload
    last = (payload.numel() - window) // itemsize
    sample = torch.empty(_SAMPLE_WINDOWS * window, dtype=torch.uint8)
    for index in range(_SAMPLE_WINDOWS):
        start = last * index // (_SAMPLE_WINDOWS - 1) * itemsize
        # Not torch.cat or copy_: at this size they start OpenMP threads (rule 5).
        target = sample.data_ptr() + index * window
        ctypes.memmove(target, payload.data_ptr() + start, window)
    return sample
