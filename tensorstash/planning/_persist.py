"""A profile's checkpoint: what it learned as lists, strings and numbers
(:meth:`Profile.state_dict <tensorstash.planning.profile.Profile.state_dict>`), and back.

The format is :data:`STATE_VERSION`; a state of another version is refused with
the fix. Keys this version gained later (``quiet_history``, ``aside``, ``inputs``,
``peaks``, and a step's ``faulted_bytes``, ``trim_s``, ``checkpointed_s``,
``first_move``, once ``first_copy``) may be absent: a state saved before them loads
with their defaults.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from tensorstash.planning._records import HISTORY, ModuleRecord, Site, SiteRecord, StepRecord

if TYPE_CHECKING:
    from tensorstash.planning.profile import Profile

STATE_VERSION = 3
"""The format of :meth:`Profile.state_dict`."""


def state_of(profile: Profile) -> dict[str, Any]:
    """What ``profile`` learned (its quiet steps already read), in the current format."""
    sites = [
        {
            "module": module,
            "op": op,
            "occurrence": occurrence,
            "order": record.order,
            "nbytes": record.nbytes,
            "unpack_s": record.unpack_s,
            "offloaded": record.offloaded,
            "stalled": (module, op, occurrence) in profile.stalls,
        }
        for (module, op, occurrence), record in profile.last.items()
    ]
    methods = [
        [op, str(dtype).removeprefix("torch."), list(shape), list(stride), method]
        for (op, dtype, shape, stride), method in profile.codec_methods.items()
    ]
    return {
        "version": STATE_VERSION,
        "steps": profile.steps,
        "sites": sites,
        "modules": [{"path": path, **_module_row(rec)} for path, rec in profile.modules.items()],
        "history": [_step_row(rec) for rec in profile.history],
        "quiet_history": [_step_row(rec) for rec in profile.quiet_history],
        "aside": [_step_row(rec) for kept in profile.aside.values() for rec in kept],
        "inputs": None if profile.inputs is None else _inputs_row(profile.inputs),
        "peak": None if profile.peak is None else _step_row(profile.peak),
        "peaks": [_step_row(rec) for rec in profile.peaks],
        "codec_methods": methods,
    }


def load_into(profile: Profile, state: dict[str, Any]) -> None:
    """Make ``state`` what ``profile`` measured: its sites, modules, steps and peaks.

    Raises:
        ValueError: the state is not one :func:`state_of` of this version wrote.
    """
    version = state.get("version") if isinstance(state, dict) else None
    if version != STATE_VERSION:
        raise ValueError(
            f"tensorstash.Profile: a saved state of version {version!r} cannot be loaded: "
            f"this tensorstash reads version {STATE_VERSION}. Start from a new Profile "
            "(it learns again from the next step)"
        )
    last: dict[Site, SiteRecord] = {}
    stalls: set[Site] = set()
    for row in state["sites"]:
        site = (row["module"], row["op"], int(row["occurrence"]))
        last[site] = SiteRecord(
            int(row["order"]), int(row["nbytes"]), row["unpack_s"], row["offloaded"]
        )
        if row["stalled"]:
            stalls.add(site)
    profile.steps, profile.last, profile.current, profile.stalls = (
        int(state["steps"]),
        last,
        {},
        stalls,
    )
    profile.modules = {row["path"]: _module_record(row) for row in state["modules"]}
    profile.module_history = deque([(False, dict(profile.modules))], maxlen=HISTORY)
    profile.history = deque((_step_record(row) for row in state["history"]), maxlen=HISTORY)
    profile.quiet_history = deque(
        (_step_record(row) for row in state.get("quiet_history", ())), maxlen=HISTORY
    )
    profile.aside = {}
    for row in state.get("aside", ()):  # absent in older states
        record = _step_record(row)
        profile.aside.setdefault(frozenset(record.moved), deque(maxlen=HISTORY)).append(record)
    inputs = state.get("inputs")
    profile.inputs = None if inputs is None else _inputs_record(inputs)
    profile.peak = None if state["peak"] is None else _step_record(state["peak"])
    peaks = [_step_record(row) for row in state.get("peaks", ())]  # absent in older states
    if not peaks and profile.peak is not None:
        peaks = [profile.peak]
    profile.peaks = deque(peaks, maxlen=HISTORY)
    profile.codec_methods = {
        (op, getattr(torch, dtype), tuple(shape), tuple(stride)): method
        for op, dtype, shape, stride, method in state["codec_methods"]
    }


def _module_row(record: ModuleRecord) -> dict[str, Any]:
    return {
        "calls": record.calls,
        "forward_s": record.forward_s,
        "input_bytes": record.input_bytes,
        "first_order": record.first_order,
        "unsafe": record.unsafe,
        "kind": record.kind,
    }


def _module_record(row: dict[str, Any]) -> ModuleRecord:
    return ModuleRecord(
        int(row["calls"]),
        float(row["forward_s"]),
        int(row["input_bytes"]),
        int(row["first_order"]),
        row["unsafe"],
        str(row["kind"]),
    )


def _step_row(record: StepRecord) -> dict[str, Any]:
    return {
        "forward_s": record.forward_s,
        "backward_s": record.backward_s,
        "held_bytes": record.held_bytes,
        "peak_bytes": record.peak_bytes,
        "recomputed": list(record.recomputed),
        "policy_s": record.policy_s,
        "moved": dict(record.moved),
        "cold": record.cold,
        "recompute_s": record.recompute_s,
        "faulted_bytes": record.faulted_bytes,
        "trim_s": record.trim_s,
        "checkpointed_s": record.checkpointed_s,
        "first_move": record.first_move,
        "room_bytes": record.room_bytes,
    }


def _step_record(row: dict[str, Any]) -> StepRecord:
    return StepRecord(
        float(row["forward_s"]),
        float(row["backward_s"]),
        int(row["held_bytes"]),
        None if row["peak_bytes"] is None else int(row["peak_bytes"]),
        tuple(row["recomputed"]),
        float(row["policy_s"]),
        {str(tier): int(n) for tier, n in row["moved"].items()},
        bool(row["cold"]),
        None if row["recompute_s"] is None else float(row["recompute_s"]),
        faulted_bytes=int(row.get("faulted_bytes", 0)),  # absent in older states
        trim_s=float(row.get("trim_s", 0.0)),
        checkpointed_s=None if row.get("checkpointed_s") is None else float(row["checkpointed_s"]),
        first_move=bool(row.get("first_move", row.get("first_copy", False))),
        room_bytes=None if row.get("room_bytes") is None else int(row["room_bytes"]),
    )


def _inputs_row(inputs: tuple[Any, ...]) -> list[Any]:
    return [[list(shape), dtype] for shape, dtype in inputs]


def _inputs_record(row: list[Any]) -> tuple[Any, ...]:
    return tuple((tuple(shape), str(dtype)) for shape, dtype in row)
