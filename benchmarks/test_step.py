"""One training step (forward and backward) of the bench model under each policy.

The variants are those of ``tensorstash bench`` (``tensorstash.bench.ALL_POLICIES``
and ``auto:8MiB``, Auto under a budget), run on its embedded model through its
:func:`~tensorstash.bench.variant_context`. Each benchmark's
``extra_info`` holds what the step kept where: the peak stored bytes of each
tier, the bytes saved per tier, the compression ratio, the growth of resident
memory over one step, whether the gradients equal plain autograd's, and the
overhead: the step's median over plain autograd's, the two run alternately
after the benchmark.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Size, interleaved, record_ratio, run

import tensorstash as ts
from tensorstash.bench import (
    ALL_POLICIES,
    BASELINE,
    PeakRss,
    builtin_workload,
    return_free_memory,
    variant_context,
)

SEED = 0
POLICIES = [*ALL_POLICIES, "auto:8MiB"]


class Stepper:
    """The bench model, its batch, and plain autograd's gradients, shared by the variants."""

    def __init__(self, size: Size) -> None:
        self.workload = builtin_workload(size.model, SEED)
        self.model = self.workload.model.train()
        self.device = torch.device("cpu")
        self.profiles: dict[str, ts.Profile] = {}  # an Auto variant learns across its steps
        self.reference = [None if g is None else g.clone() for g in self._grads(BASELINE)[1]]

    def step(self, name: str) -> dict[str, Any] | None:
        """One forward and backward under ``name``; the session's stats (None without one)."""
        return self._grads(name)[0]

    def _grads(self, name: str) -> tuple[dict[str, Any] | None, list[torch.Tensor | None]]:
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(SEED)  # the same dropout masks in every step
        with variant_context(name, self.workload, self.device, self.profiles) as session:
            loss = self.model(*self.workload.batch)
            loss.backward()
        del loss
        stats = None if session is None else session.stats.to_dict()
        return stats, [p.grad for p in self.model.parameters()]

    def grads_equal(self) -> bool:
        grads = [p.grad for p in self.model.parameters()]
        return all(
            (g is None and r is None) or (g is not None and r is not None and torch.equal(g, r))
            for g, r in zip(grads, self.reference, strict=True)
        )


@pytest.fixture(scope="module")
def stepper(size: Size) -> Stepper:
    return Stepper(size)


def memory_info(stats: dict[str, Any] | None) -> dict[str, Any]:
    """The step's memory figures for ``extra_info``."""
    if stats is None:
        return {"peak_activation_bytes": None, "compression_ratio": None, "tiers": None}
    tiers = stats["tiers"]
    return {
        # What the stash counted (kept + host tier peaks), beside the real peak below.
        "peak_activation_bytes": tiers["kept"]["peak_bytes"] + tiers["host"]["peak_bytes"],
        "compression_ratio": stats["compression_ratio"],
        "tiers": {
            tier: {key: counters[key] for key in ("tensors", "bytes", "stored_bytes", "peak_bytes")}
            for tier, counters in tiers.items()
        },
    }


@pytest.mark.benchmark(group="step")
@pytest.mark.parametrize("policy", POLICIES)
def test_step(benchmark: Any, stepper: Stepper, size: Size, policy: str) -> None:
    stats, median = run(benchmark, lambda: stepper.step(policy), size)
    overhead = 1.0
    if policy != BASELINE:
        plain_s, policy_s = interleaved(
            lambda: stepper.step(BASELINE), lambda: stepper.step(policy), size.rounds
        )
        overhead = policy_s / plain_s
    # One more step, measured apart from the timed ones: resident memory after a heap trim.
    return_free_memory()
    with PeakRss() as meter:
        stepper.step(policy)
    info = memory_info(stats)
    info.update(
        model=size.model,
        step_s=median,
        overhead=overhead,
        peak_rss_delta_bytes=meter.delta_bytes,
        grads_equal=stepper.grads_equal(),
    )
    benchmark.extra_info.update(info)
    if policy != BASELINE:
        record_ratio(f"step {policy} / none", info["overhead"])

    # Recomputed regions restore the RNG state, so every variant is bitwise lossless.
    assert info["grads_equal"], f"{policy}: gradients differ from plain autograd"
    if stats is not None:
        assert info["peak_activation_bytes"] + info["tiers"]["disk"]["peak_bytes"] > 0
        assert info["compression_ratio"] >= 1.0
