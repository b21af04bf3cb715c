"""``tensorstash plan``: Auto's plan for a model and a memory limit, without the whole bench.

It trains the model a few steps under ``Auto(limit=...)`` with a ``Profile`` (the
first step measures under a budget that surely fits, the next follow the plan), then
shows the plan the last step followed with its predictions, beside what that step
measured. The limit is spelled as the bench's ``auto:<limit>``: a share of no stash's
real peak growth (``50%``, ``0.5``) or a size (``64MiB``) over each step's base.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tensorstash.bench.measure import StepResult, StepRunner
from tensorstash.bench.variants import AUTO_PREFIX, limit_bytes
from tensorstash.bench.workloads import Workload
from tensorstash.core.stats import human_bytes
from tensorstash.planning.plan import Plan


@dataclass(frozen=True)
class PlanRun:
    """A plan and the steps that made and followed it.

    Attributes:
        budget: what the limit lets a step add to its base, in bytes.
        activation_bytes: the eligible bytes one step saves.
        plan: the plan of the last step (None if no step planned).
        steps: what each step measured, the first (measuring) one first.
    """

    budget: int
    activation_bytes: int
    plan: Plan | None
    steps: tuple[StepResult, ...]

    def report(self) -> str:
        """The plan's table, then the last step's measurement beside the prediction."""
        if self.plan is None:
            return (
                f"limit +{human_bytes(self.budget)} over the step's base: no plan yet, the "
                "first step measures (run --steps 2 or more)"
            )
        lines = [self.plan.table()]
        last = self.steps[-1]
        predicted = self.plan.predicted_peak_bytes
        peak = (
            ""
            if predicted is None
            else f" ({last.peak_bytes / max(predicted, 1):.2f}x of predicted)"
        )
        lines.append(
            f"measured, step {len(self.steps)}: {last.seconds:.3f} s "
            f"({last.seconds / max(self.plan.predicted_step_s, 1e-9):.2f}x of predicted), "
            f"real peak growth {human_bytes(last.peak_bytes)}{peak}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "limit_bytes": self.budget,
            "activation_bytes": self.activation_bytes,
            "recompute": list(plan.recompute) if plan else None,
            "tiers": {f"{m}:{op}#{n}": t for (m, op, n), t in plan.tiers.items()} if plan else None,
            "held_bytes": plan.held_bytes if plan else None,
            "reachable_bytes": plan.reachable_bytes if plan else None,
            "predicted_step_s": plan.predicted_step_s if plan else None,
            "predicted_peak_bytes": plan.predicted_peak_bytes if plan else None,
            "step_s": [step.seconds for step in self.steps],
            "real_peak_bytes": [step.peak_bytes for step in self.steps],
            "grads_equal": all(step.grads_equal for step in self.steps),
        }


def make_plan_run(
    workload: Workload,
    budget: str,
    *,
    steps: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> PlanRun:
    """Train ``workload`` for ``steps`` steps under ``Auto(limit=...)`` with a Profile.

    Args:
        budget: the limit over each step's base: a share of no stash's real peak
            growth (``50%``, ``0.5``) or a size (``64MiB``), as the bench's ``auto:<limit>``.

    Raises:
        ValueError: a limit that is neither.
    """
    name = AUTO_PREFIX + budget
    runner = StepRunner(workload, device, dtype, seed)
    runner.take_reference()  # plain autograd's gradients, its growth, the activation bytes
    activation = runner.activation_bytes or 0
    size = limit_bytes(name, runner.plain_growth)
    if size is None:
        raise ValueError(f"tensorstash plan: {budget!r} is not a limit")
    results = tuple(runner.step(name) for _ in range(steps))
    plan = getattr(runner.session, "plan", None)
    return PlanRun(size, activation, plan, results)
