"""What a profile records: call sites, modules and steps (NOTE [ Profile ] in profile.py),
and the medians a plan is made from (rule 5)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_leaves

HISTORY = 5
"""Steps whose measurements a plan is made from (their medians)."""

Site = tuple[str, str | None, int]
"""``(module, op, occurrence)``: rule 1 of NOTE [ Profile ]."""

ORDER = 1 << 16
"""Sites a module call may save before the next call's orders begin (see SiteRecord.order)."""

ALREADY_RECOMPUTED = (
    "already recomputed (tensorstash.recompute or Hugging Face gradient checkpointing)"
)
"""``ModuleRecord.unsafe`` of a module the user checkpoints itself (its backward recomputes it)."""


@dataclass(slots=True)
class SiteRecord:
    """One call site in one step.

    Attributes:
        order: where it is saved in the step: the module calls before it, then
            the packs in its module call (``ORDER`` of them per call); it does
            not change when other sites are recomputed and not saved.
        nbytes: the tensor's size.
        unpack_s: seconds backward spent in its unpacks (waiting included).
        offloaded: whether its bytes left the device.
    """

    order: int
    nbytes: int
    unpack_s: float = 0.0
    offloaded: bool = False


@dataclass(slots=True)
class ModuleRecord:
    """One module in one step (rule 2).

    Attributes:
        calls: how many times it ran.
        forward_s: seconds its calls took, submodules included.
        input_bytes: bytes of the tensors given to it that recompute would keep.
        first_order: the order a tensor saved first inside it would have.
        unsafe: why it must not be recomputed, or None.
        kind: its class name.
    """

    calls: int = 0
    forward_s: float = 0.0
    input_bytes: int = 0
    first_order: int = 0
    unsafe: str | None = None
    kind: str = ""


@dataclass(slots=True)
class StepRecord:
    """One step (rule 2).

    Attributes:
        forward_s, backward_s: seconds of forward and of backward.
        held_bytes: eligible bytes the device held when forward ended
            (:func:`~tensorstash.planning._measure.device_held`).
        peak_bytes: real peak memory growth over the step, or None.
        recomputed: the modules the plan recomputed in it.
        policy_s: seconds the step spent in policies and waiting for them.
        moved: original bytes moved off the device, per tier ("host", "disk").
        cold: it began from a heap handed back to the OS, to take the real
            peak; its times are not those of training (rule 6).
        recompute_s: seconds backward spent recomputing the plan's modules,
            or None where they were not timed (NOTE [ Recompute ] rule 7).
        faulted_bytes: the pages the process faulted in over the step (minor
            faults times the page size; 0 where there is no ``getrusage``):
            fresh memory the step touched, memory a trim handed back to the OS
            included (NOTE [ Plan ] rule 8).
        trim_s: seconds the step's calls that handed memory back to the OS took
            (``StashStats.returned_seconds``, and the session pool's mapping and
            unmapping, ``PoolCounts.mapping_s``; NOTE [ Plan ] rule 8).
        checkpointed_s: seconds backward spent recomputing the modules the
            user wraps with ``recompute`` (NOTE [ Recompute ] rule 7), or None
            where none was timed.
        first_move: it moved more bytes to a tier than any step of its
            profile before it: it made what moving there uses (on CUDA the
            pinned buffers its copies use, on the CPU the spill directory,
            its file and the pages they take), and its time does not say
            what a moved byte costs (NOTE [ Plan ] rule 9).
        room_bytes: under a memory limit, what the limit left the step over its base
            (NOTE [ Memory limit ] rule 2), or None.
    """

    forward_s: float
    backward_s: float
    held_bytes: int
    peak_bytes: int | None
    recomputed: tuple[str, ...] = ()
    policy_s: float = 0.0
    moved: dict[str, int] = field(default_factory=dict)
    cold: bool = False
    recompute_s: float | None = None
    faulted_bytes: int = 0
    trim_s: float = 0.0
    checkpointed_s: float | None = None
    first_move: bool = False
    room_bytes: int | None = None

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The shapes and dtypes of the tensors a model is called with (rule 8)."""
    plain = not kwargs and all(type(a) is Tensor for a in args)  # the common call: no pytree
    leaves = args if plain else tree_leaves((args, kwargs))
    return tuple(
        (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for t in leaves
        if isinstance(t, Tensor)
    )


def inside(path: str, modules: tuple[str, ...]) -> bool:
    """Whether the module at ``path`` is one of ``modules`` or inside one."""
    return any(path == m or path.startswith(m + ".") for m in modules)


def plan_of(record: StepRecord) -> tuple[Any, ...]:
    """What a step's plan did, for rule 6: the modules it recomputed and the tiers it moved to
    (not their bytes, which change with the batch's shape)."""
    return (record.recomputed, frozenset(record.moved))


def median_modules(
    steps: deque[tuple[bool, dict[str, ModuleRecord]]],
) -> dict[str, ModuleRecord]:
    """Each module's median over the steps that measured it (rule 5), warm ones once
    there are (rule 6); unsafe once, unsafe."""
    paths = {path for _, step in steps for path in step}
    merged: dict[str, ModuleRecord] = {}
    for path in paths:
        records = [step[path] for _, step in steps if path in step]
        warm = [step[path] for cold, step in steps if path in step and not cold]
        latest = records[-1]
        merged[path] = ModuleRecord(
            calls=latest.calls,
            forward_s=statistics.median(rec.forward_s for rec in warm or records),
            input_bytes=latest.input_bytes,
            first_order=latest.first_order,
            unsafe=next((rec.unsafe for rec in records if rec.unsafe), None),
            kind=latest.kind,
        )
    return merged


def median_step(history: Sequence[StepRecord]) -> StepRecord | None:
    """The medians of the last steps with the plan of the last step (rule 5), warm
    steps only once there is one (rule 6); no real peak (it is not a median's)."""
    if not history:
        return None
    recomputed = history[-1].recomputed
    same = [rec for rec in history if rec.recomputed == recomputed]
    same = [rec for rec in same if not rec.cold] or same
    return StepRecord(
        forward_s=statistics.median(rec.forward_s for rec in same),
        backward_s=statistics.median(rec.backward_s for rec in same),
        held_bytes=int(statistics.median(rec.held_bytes for rec in same)),
        peak_bytes=None,
        recomputed=recomputed,
        policy_s=statistics.median(rec.policy_s for rec in same),
        moved=same[-1].moved,
        faulted_bytes=int(statistics.median(rec.faulted_bytes for rec in same)),
        trim_s=statistics.median(rec.trim_s for rec in same),
    )
