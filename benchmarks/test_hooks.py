"""What the hooks cost per saved tensor, whatever the policy does with it.

A forward of ``N`` cheap ops (``y = y.sin()``, each saving its input) and its
backward run without a stash and under one:

- ``small``: 64-byte tensors, under ``min_bytes``: the session keeps them
  untouched (the eligibility check and the version stamp);
- ``eligible``: 64 KiB tensors (``min_bytes``), packed by ``Keep`` (the whole
  session path: eligibility, dedupe, accounting) or by ``Auto`` (plus one
  decision each, on cached memory probes).

``extra_info["overhead_us_per_tensor"]`` is the median with the stash minus
the median without hooks, the two run alternately after the benchmark, over
``N``: pack and unpack of one tensor, in microseconds (about 0 for "none").
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from conftest import Size, interleaved, record_ratio, run

import tensorstash as ts
from tensorstash.session.stash import DEFAULT_MIN_BYTES

ELEMENTS = {"small": 16, "eligible": DEFAULT_MIN_BYTES // 4}  # float32
CASES = [("small", "none"), ("small", "keep"), ("eligible", "none"), ("eligible", "keep")]
CASES.append(("eligible", "auto"))


def stash_for(policy: str) -> contextlib.AbstractContextManager[Any]:
    if policy == "none":
        return contextlib.nullcontext()
    return ts.stash(ts.Keep() if policy == "keep" else ts.Auto())


def chain(x: torch.Tensor, n: int, policy: str) -> torch.Tensor:
    """``n`` saved tensors in forward, then backward; the input's gradient."""
    x.grad = None
    with stash_for(policy):
        y = x * 1.0  # not a leaf: a leaf that requires grad is kept as a parameter
        for _ in range(n):
            y = y.sin()
        loss = y.sum()
    loss.backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize(("tensor", "policy"), CASES, ids=[f"{t}-{p}" for t, p in CASES])
def test_hooks(benchmark: Any, size: Size, tensor: str, policy: str) -> None:
    benchmark.group = f"hooks {tensor} tensors"
    x = torch.randn(ELEMENTS[tensor], generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    n = size.chain
    grad, median = run(benchmark, lambda: chain(x, n, policy), size)
    plain_s, stash_s = interleaved(
        lambda: chain(x, n, "none"), lambda: chain(x, n, policy), size.rounds
    )
    overhead_us = (stash_s - plain_s) / n * 1e6
    benchmark.extra_info.update(
        tensors=n,
        tensor_bytes=ELEMENTS[tensor] * 4,
        us_per_tensor=median / n * 1e6,
        overhead_us_per_tensor=overhead_us,
    )
    if policy != "none":
        record_ratio(f"hooks {tensor} {policy}: µs per tensor over no hooks", overhead_us)
    expected = chain(x, n, "none").clone()
    assert torch.equal(grad, expected), f"{policy}: gradient differs from plain autograd"
