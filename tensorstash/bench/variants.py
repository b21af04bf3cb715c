"""The bench's variants: no stash, each policy, Auto under a budget, and the peers.

A variant is a name; :func:`variant_context` runs a region under it. Names:

- "none": plain autograd, the baseline every ratio is taken against;
- a stash policy: "keep", "cpu", "lz4", "disk", "lz4+disk", "auto";
- "recompute": ``ts.recompute`` on every block, their inputs through Auto;
- ``auto:<budget>``: ``Auto(device_budget=...)``, the budget in bytes
  (``auto:8MiB``) or in percent of the model's activation bytes (``auto:50%``),
  the eligible bytes one step saves (see :func:`budget_bytes`);
- the peers: "save_on_cpu" and "checkpoint" (torch's, or the model's own), and
  on a GPU the hook-based offloaders of torchtune and TRL, optional rows that
  are skipped, with the reason, where they cannot run (:func:`skip_reason`);
- ``compile:<b>``: the model compiled with the partitioner's activation memory
  budget ``b``, no stash (NOTE [ Compiled runs ] in compiled.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import tensorstash as ts
from tensorstash.bench.compiled import COMPILE_OFFLOAD, COMPILE_PREFIX, compile_budget
from tensorstash.bench.workloads import Workload
from tensorstash.core import _support
from tensorstash.planning.auto import parse_bytes

# Policies handed to ts.stash, by bench name; factories so each step gets a fresh value.
STASH_POLICIES: dict[str, Callable[[], Any]] = {
    "keep": lambda: "keep",
    "cpu": lambda: "cpu",
    "lz4": lambda: "lz4",
    "disk": lambda: "disk",
    "lz4+disk": lambda: ts.Chain(ts.Lz4(), ts.DiskSpill()),
    "auto": lambda: "auto",
    "recompute": lambda: "auto",  # every block recomputed; their inputs go through Auto
}
BASELINE = "none"
PEERS = ("save_on_cpu", "checkpoint")
OPTIONAL_PEERS = ("torchtune", "trl")
"""Hook-based offloaders of other libraries: CUDA only, and only where installed."""
ALL_POLICIES: tuple[str, ...] = (BASELINE, *STASH_POLICIES, *PEERS)
"""Every variant that runs anywhere (``auto:<budget>`` and the optional peers aside)."""
AUTO_PREFIX = "auto:"
"""``auto:<budget>`` (``auto:8MiB``, ``auto:50%``) runs ``Auto(device_budget=<budget>)``."""
NO_PLAN = " without a plan"
"""The suffix of an ``auto:<budget>`` variant's twin that never plans (rule 6 of the NOTE)."""
DEFAULT_POLICIES: tuple[str, ...] = (*ALL_POLICIES[:7], "auto:50%", *ALL_POLICIES[7:])
"""Every policy, and Auto with half the model's activation bytes as its budget (the
default budget, half of free memory, keeps everything of these models)."""
SWEEP_POLICIES: tuple[str, ...] = (
    BASELINE, "checkpoint", "recompute", "save_on_cpu", "cpu", "lz4", "disk",
    "auto", "auto:25%", "auto:50%", "auto:75%", *OPTIONAL_PEERS,
)  # fmt: skip
"""What ``--sweep`` runs, in float32 and under bf16 autocast."""
NEEDS_BLOCKS = ("recompute", "checkpoint")
"""Policies that wrap the model's blocks (see ``Workload.blocks``)."""
_INSTALL = {"torchtune": "pip install torchtune torchao", "trl": "pip install trl"}


def budget_spec(name: str) -> str | None:
    """The ``<budget>`` of an ``auto:<budget>`` name (None for other names)."""
    return name.removeprefix(AUTO_PREFIX) if name.startswith(AUTO_PREFIX) else None


def is_relative(name: str) -> bool:
    """Whether ``name`` is an Auto budget in percent of the activation bytes (``auto:50%``)."""
    spec = budget_spec(name)
    return spec is not None and spec.endswith("%")


def budget_bytes(name: str, activation_bytes: int | None) -> int | None:
    """The budget of an ``auto:<budget>`` variant in bytes (None for other variants).

    Args:
        name: the variant.
        activation_bytes: the eligible bytes one step saves (what a ``Keep``
            session counts as its kept tier's ``peak_bytes``); needed for a
            budget in percent.

    Raises:
        ValueError: not a budget, or a percentage without ``activation_bytes``.
    """
    spec = budget_spec(name)
    if spec is None:
        return None
    if not spec.endswith("%"):
        size = parse_bytes(spec, "tensorstash bench", f"the budget of {name!r}")
        if not isinstance(size, int):
            raise ValueError(
                f"tensorstash bench: {name!r}: a budget is bytes (auto:8MiB) or a percentage "
                f"of the model's activation bytes (auto:50%); got {spec!r}"
            )
        return size
    try:
        percent = float(spec[:-1])
    except ValueError:
        percent = -1.0
    if not 0 < percent <= 1000:
        raise ValueError(
            f"tensorstash bench: {name!r}: a percentage budget must be a number in (0, 1000], "
            "e.g. auto:50%"
        )
    if activation_bytes is None:
        raise ValueError(
            f"tensorstash bench: {name!r} is a share of the model's activation bytes; pass "
            "activation_bytes (run_bench measures them with a Keep session)"
        )
    return int(activation_bytes * percent / 100)


def _is_policy(name: str) -> bool:
    if name.startswith(COMPILE_PREFIX):
        try:
            compile_budget(name)
        except ValueError:
            return False
        return True
    if name.startswith(AUTO_PREFIX):
        try:
            budget_bytes(name, 0)
        except (ValueError, TypeError):
            return False
        return True
    return name in ALL_POLICIES or name in OPTIONAL_PEERS


def learns(name: str) -> bool:
    """Whether the variant runs Auto with a Profile (rule 6 of NOTE [ Fair comparison ])."""
    return name == "auto" or name == "recompute" or name.startswith(AUTO_PREFIX)


def resolve_policies(names: Sequence[str]) -> list[str]:
    """Validate bench policy names, drop repeats and put the baseline "none" first.

    Args:
        names: names from :data:`ALL_POLICIES`, :data:`OPTIONAL_PEERS` or
            ``auto:<budget>``, in the order to run them.

    Returns:
        The names to run, starting with "none" (overhead is measured against it).

    Raises:
        ValueError: a name is not a bench policy.
    """
    unknown = [name for name in names if not _is_policy(name)]
    if unknown:
        raise ValueError(
            f"tensorstash bench: unknown policy {unknown[0]!r}; valid policies are "
            f"{', '.join((*ALL_POLICIES, *OPTIONAL_PEERS))}, auto:<budget> (bytes such "
            "as auto:8MiB, or a share of the activation bytes such as auto:50%) and "
            "compile:<b> (the model compiled with the partitioner's memory budget b, from 0 "
            "to 1, such as compile:0.5); pass several comma-separated, e.g. --policies none,lz4"
        )
    resolved = [BASELINE]
    resolved.extend(name for name in dict.fromkeys(names) if name != BASELINE)
    return resolved


def skip_reason(name: str, device: torch.device, *, compiled: bool = False) -> str | None:
    """Why a variant cannot run here (None: it runs): an optional peer without CUDA or its
    library, or "recompute" on a compiled model."""
    if name == COMPILE_OFFLOAD and device.type != "cuda":
        return (
            "the compiler's offload copies device tensors to the host; on the "
            f"{device.type} the host is the device"
        )
    if name == COMPILE_OFFLOAD:
        return _support.missing(_support.OFFLOAD)  # NOTE [ Support range ] rule 2
    if name == "recompute" and compiled:
        return (
            "its regions wrap the model's blocks, which the compiled graphs run inside; "
            "the compile:<b> rows recompute compiled code"
        )
    if name not in OPTIONAL_PEERS:
        return None
    if device.type != "cuda":
        return "needs CUDA streams (a GPU run)"
    module = "torchtune.training" if name == "torchtune" else "trl.models"
    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed ({_INSTALL[name]})"
    try:
        importlib.import_module(module)
    except Exception as error:  # an install that cannot import is a skip, not a crash
        return f"{module} cannot be imported: {type(error).__name__}: {error}"
    return None


def check_blocks(names: Sequence[str], workload: Workload) -> None:
    """Raise ValueError if a policy in ``names`` wraps blocks the workload does not name."""
    blockless = [name for name in names if name in NEEDS_BLOCKS and workload.blocks is None]
    if blockless:
        raise ValueError(
            f"tensorstash bench: policy {blockless[0]!r} wraps the model's blocks, and "
            f"{workload.description} names none; return (model, batch, blocks) from the "
            "model script (blocks: a module class or submodule names), or leave "
            f"{' and '.join(NEEDS_BLOCKS)} out of --policies"
        )


def checkpointing_on(workload: Workload) -> Callable[[], None]:
    """Turn on the "checkpoint" peer: the workload's model checkpoints every block, its
    own way where it has one, else with torch's checkpoint. Returns what turns it off."""
    if workload.checkpointing is not None:
        return workload.checkpointing(workload.model)
    return _recompute_blocks(workload)


def checkpointed_copy(workload: Workload) -> Workload:
    """The workload on a copy of its model whose "checkpoint" peer is on for good, as a
    user turns it on (HF's enable adds a hook that no disable takes off)."""
    model = copy.deepcopy(workload.model)
    copied = dataclasses.replace(workload, model=model, library_model=None)
    checkpointing_on(copied)
    return copied


def _recompute_blocks(workload: Workload) -> Callable[[], None]:
    """Put the workload's blocks under non-reentrant checkpointing: what takes it off."""
    model = workload.model
    names = ts.recompute_modules(model, workload.blocks)

    def off() -> None:
        for name in names:
            ts.unrecompute(model.get_submodule(name))

    return off


@contextlib.contextmanager
def _blocks_recomputed(workload: Workload) -> Iterator[None]:
    """The workload's blocks run under non-reentrant checkpointing inside the region."""
    off = _recompute_blocks(workload)
    try:
        yield
    finally:
        off()


_PEER_CONTEXTS: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def _peer_context(name: str, workload: Workload) -> Any:
    """The peer's context manager, made once per model and entered every step.

    Both peers are made once and reused, as their libraries' recipes do; TRL's
    also puts hooks on the model's output head for good, so a second one would
    stack them.
    """
    made = _PEER_CONTEXTS.setdefault(workload.model, {})
    if name not in made:
        if name == "torchtune":
            from torchtune.training import OffloadActivations

            made[name] = OffloadActivations()
        else:
            from accelerate import PartialState
            from trl.models import get_act_offloading_ctx_manager

            PartialState()  # as TRL's trainers do first: its logger asks for this state
            made[name] = get_act_offloading_ctx_manager(workload.library_model or workload.model)
    return made[name]


@contextlib.contextmanager
def variant_context(
    name: str,
    workload: Workload,
    device: torch.device,
    profiles: dict[str, ts.Profile] | None = None,
    *,
    activation_bytes: int | None = None,
) -> Iterator[Any]:
    """Run a region under one bench variant.

    Args:
        name: a bench policy name (see :func:`resolve_policies`), or one with
            the ``NO_PLAN`` suffix (rule 6 of the NOTE).
        workload: the model ("checkpoint" and "recompute" wrap its blocks).
        device: where the model runs (``save_on_cpu`` pins memory on CUDA).
        profiles: the Profile of each Auto variant, kept across its steps
            (one is added on first use); None: a fresh Profile each time, as
            for a twin that never plans.
        activation_bytes: the eligible bytes one step saves, the base of a
            budget in percent (see :func:`budget_bytes`).

    Returns:
        A context manager whose value is the stash session, or None for
        variants that are not a stash.
    """
    planless = name.endswith(NO_PLAN)
    name = name.removesuffix(NO_PLAN)
    profile = None
    if learns(name):
        if profiles is None or planless:
            profile = ts.Profile()
        else:
            profile = profiles.setdefault(name, ts.Profile())
    if name == BASELINE or name.startswith(COMPILE_PREFIX):
        yield None
    elif name == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            yield None
    elif name == "checkpoint":
        off = checkpointing_on(workload)
        try:
            yield None
        finally:
            off()
    elif name in OPTIONAL_PEERS:
        with _peer_context(name, workload):
            yield None
    elif name == "recompute":
        with _blocks_recomputed(workload), ts.stash("auto", profile=profile) as session:
            yield session
    else:
        budget = budget_bytes(name, activation_bytes)
        policy = STASH_POLICIES[name]() if budget is None else ts.Auto(device_budget=budget)
        with ts.stash(policy, profile=profile) as session:
            yield session
