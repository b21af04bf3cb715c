"""What the training callbacks say of ``Auto``'s plan: its table, logged when it changes.

A plan changes when what it recomputes or where it moves a call site changes, or the
limit or budget it holds; a plan made again with the same choices (its predictions
moved a little) is not news. A plan that does not fit what it was made for (a budget
no plan holds, or a limit whose least real peak is over it) is logged as a warning.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("tensorstash")
"""The logger the callbacks write the plan tables to (``logging.getLogger("tensorstash")``)."""


def _key(plan: Any) -> Any:
    tiers = getattr(plan, "tiers", None)
    if tiers is None:  # a plan for compiled code: its table says what it asked of the compiler
        return plan.table().splitlines()[0]
    return (
        plan.recompute,
        frozenset(tiers.items()),
        getattr(plan, "limit_bytes", None),
        plan.budget,
        _over(plan),
    )


def _over(plan: Any) -> bool:
    """Whether the plan does not hold what it was made for."""
    limit, base, peak = (
        getattr(plan, "limit_bytes", None),
        getattr(plan, "base_bytes", None),
        getattr(plan, "predicted_peak_bytes", None),
    )
    if limit is not None and base is not None and peak is not None:
        return base + peak > limit
    return not getattr(plan, "fits", True)


class PlanLog:
    """The plans a callback's sessions followed: each new one logged with its table.

    Attributes:
        plan: the last step's plan, or None.
        changes: ``(step, table)`` of each plan that differed from the one before.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.plan: Any = None
        self.changes: list[tuple[int, str]] = []
        self._last: Any = None

    def saw(self, plan: Any, step: int) -> bool:
        """A session followed ``plan`` at ``step``: log it if it differs from the last
        one (True then)."""
        if plan is None:
            return False
        self.plan = plan
        key = _key(plan)
        if key == self._last:
            return False
        self._last = key
        table = plan.table()
        self.changes.append((step, table))
        level = logging.WARNING if _over(plan) else logging.INFO
        logger.log(level, "%s: the plan from step %d on:\n%s", self.who, step, table)
        return True
