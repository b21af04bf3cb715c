"""The HF GPT-2 step the memory benchmarks share (needs transformers).

A 4-layer GPT-2 (d=256, batch 4x128, the bench's ``gpt2-hf``) in training mode on
the CPU with 2 threads: its forward, the same under Hugging Face's gradient
checkpointing of every block, and the eligible bytes one step saves (what a
``Keep`` session counts), against which Auto's budgets are shares.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import tensorstash as ts
from tensorstash.bench import HF_GPT2, builtin_workload
from tensorstash.bench.variants import checkpointed_copy


@dataclass(frozen=True)
class Gpt2Step:
    model: nn.Module
    forward: Callable[[], Tensor]
    checkpointed: Callable[[], Tensor]
    activation_bytes: int


def gpt2_step() -> Gpt2Step:
    torch.set_num_threads(2)
    workload = builtin_workload(HF_GPT2, seed=0)
    model, batch = workload.model.train(), workload.batch
    assert workload.checkpointing is not None  # HF's own

    def forward() -> Tensor:
        loss: Tensor = model(*batch)
        return loss

    copied = checkpointed_copy(workload).model

    def checkpointed() -> Tensor:
        copied.zero_grad(set_to_none=True)
        loss: Tensor = copied(*batch)
        return loss

    with ts.stash(ts.Keep()) as probe:
        loss = forward()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return Gpt2Step(model, forward, checkpointed, probe.stats.tiers["kept"].peak_bytes)


def median_ratio(values: Mapping[str, Sequence[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s figure over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(values[a], values[b], strict=True))
