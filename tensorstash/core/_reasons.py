"""Why a saved tensor went where it went: structured values, rendered only for people.

Code decides on :class:`Why` members and never on text; the decision log and
``stats.skipped`` show :meth:`Reason.text`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Why(enum.Enum):
    """A kind of decision or outcome; its value is the text people see ("{}": the detail)."""

    # Kept untouched by the session (rule 1 of NOTE [ Session ]).
    SUBCLASS = "tensor subclass"
    LAYOUT = "{} layout"
    NESTED = "nested tensor"
    UNDER_MIN_BYTES = "under min_bytes"
    FUNCTORCH = "functorch wrapper"
    DEVICE = "{} device"
    QUANTIZED = "quantized"
    CONJUGATE = "conjugate or negative view"
    PARAMETER = "parameter"
    LEAF = "leaf that requires grad"
    BUFFER = "buffer"
    DEDUPLICATED = "deduplicated"
    PLACEMENT = "DTensor placement {}"
    # Chosen by a policy or a selector.
    POLICY = "policy {}"
    RULE = "{}"
    UNDER_BUDGET = "under device budget"
    BUDGET_REACHED = "device budget reached"
    TO_DISK = "device budget reached; the device is host RAM: to disk"
    HOST_TIGHT = "device budget reached; host memory tight: compressed"
    HOST_LOW = "host memory low"
    LEARNING = "a profile's first step: kept, to time the model with nothing moved"
    PLANNED = "{}"
    PLANNED_HOST_LOW = "{}; host memory low"
    OVER_PLAN = "{}, but the budget is full"
    # While it waits in the recent window (NOTE [ Recent window ] in stash.py).
    RECENT = "saved last: kept for backward to start with"
    # What background work did with it.
    SPILLED = "spilled"
    SPILLED_COMPRESSIBLE = "spilled, compressible {}"
    COMPRESSED = "compressible {}"
    INCOMPRESSIBLE = "incompressible: left as it was"
    DISK_FULL = "disk full: kept in memory"
    DISK_CAP = "disk cap reached: kept in memory"


@dataclass(frozen=True, slots=True)
class Reason:
    """A :class:`Why` and the details its text takes (a device name, a ratio, ...)."""

    why: Why
    details: tuple[str, ...] = ()

    def text(self) -> str:
        """The reason as the decision log shows it."""
        return self.why.value.format(*self.details) if self.details else self.why.value

    def __str__(self) -> str:
        return self.text()


def reason(why: Why, *details: object) -> Reason:
    """``Reason(why, details)`` with each detail as text."""
    return Reason(why, tuple(str(d) for d in details))


UNDER_MIN_BYTES = Reason(Why.UNDER_MIN_BYTES)
PARAMETER = Reason(Why.PARAMETER)
LEAF = Reason(Why.LEAF)
BUFFER = Reason(Why.BUFFER)
SUBCLASS = Reason(Why.SUBCLASS)
DEDUPLICATED = Reason(Why.DEDUPLICATED)
UNDER_BUDGET = Reason(Why.UNDER_BUDGET)
