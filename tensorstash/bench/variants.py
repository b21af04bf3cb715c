"""The bench's variants: no stash, each policy, Auto under a budget, and the peers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import tensorstash as ts
from tensorstash.bench.model import BenchGPT
from tensorstash.bench.workloads import Workload

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
ALL_POLICIES: tuple[str, ...] = (BASELINE, *STASH_POLICIES, *PEERS)
AUTO_PREFIX = "auto:"
"""``auto:<budget>`` (e.g. ``auto:8MiB``) runs ``Auto(device_budget=<budget>)``."""
NO_PLAN = " without a plan"
"""The suffix of an ``auto:<budget>`` variant's twin that never plans (rule 6 of the NOTE)."""
DEFAULT_POLICIES: tuple[str, ...] = (*ALL_POLICIES[:7], "auto:8MiB", *ALL_POLICIES[7:])
"""Every policy, and Auto under an 8 MiB budget: it offloads on the CPU, where the
default budget (half of free RAM) keeps everything."""
NEEDS_BLOCKS = ("recompute", "checkpoint")
"""Policies that wrap the model's blocks (see ``Workload.blocks``)."""


def _auto_policy(name: str) -> Any:
    return ts.Auto(device_budget=name.removeprefix(AUTO_PREFIX))


def _is_policy(name: str) -> bool:
    if name.startswith(AUTO_PREFIX):
        try:
            _auto_policy(name)
        except ValueError:
            return False
        return True
    return name in ALL_POLICIES


def _learns(name: str) -> bool:
    """Whether the variant runs Auto with a Profile (rule 6 of NOTE [ Fair comparison ])."""
    return name == "auto" or name == "recompute" or name.startswith(AUTO_PREFIX)


def resolve_policies(names: Sequence[str]) -> list[str]:
    """Validate bench policy names, drop repeats and put the baseline "none" first.

    Args:
        names: names from :data:`ALL_POLICIES` or ``auto:<budget>``, in the order to run them.

    Returns:
        The names to run, starting with "none" (overhead is measured against it).

    Raises:
        ValueError: a name is not a bench policy.
    """
    unknown = [name for name in names if not _is_policy(name)]
    if unknown:
        raise ValueError(
            f"tensorstash bench: unknown policy {unknown[0]!r}; valid policies are "
            f"{', '.join(ALL_POLICIES)} and auto:<budget> (e.g. auto:8MiB); pass several "
            "comma-separated, e.g. --policies none,lz4"
        )
    resolved = [BASELINE]
    resolved.extend(name for name in dict.fromkeys(names) if name != BASELINE)
    return resolved


@contextlib.contextmanager
def _blocks_recomputed(workload: Workload) -> Iterator[None]:
    """The workload's blocks run under non-reentrant checkpointing inside the region."""
    names = ts.recompute_modules(workload.model, workload.blocks)
    try:
        yield
    finally:
        for name in names:
            ts.unrecompute(workload.model.get_submodule(name))


@contextlib.contextmanager
def variant_context(
    name: str,
    workload: Workload,
    device: torch.device,
    profiles: dict[str, ts.Profile] | None = None,
) -> Iterator[Any]:
    """Run a region under one bench variant.

    Args:
        name: a bench policy name (see :func:`resolve_policies`).
        workload: the model ("checkpoint" and "recompute" wrap its blocks).
        device: where the model runs (``save_on_cpu`` pins memory on CUDA).
        profiles: the Profile of each Auto variant, kept across its steps
            (one is added on first use); None: a fresh Profile each time, as
            for a twin that never plans (``NO_PLAN``, rule 6 of the NOTE).

    Returns:
        A context manager whose value is the stash session, or None for
        variants that are not a stash.
    """
    planless = name.endswith(NO_PLAN)
    name = name.removesuffix(NO_PLAN)
    profile = None
    if _learns(name):
        if profiles is None or planless:
            profile = ts.Profile()
        else:
            profile = profiles.setdefault(name, ts.Profile())
    model = workload.model
    if name == BASELINE:
        yield None
    elif name == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            yield None
    elif name == "checkpoint" and isinstance(model, BenchGPT):
        model.checkpoint = True  # torch's own checkpoint, as a peer that owes nothing to us
        try:
            yield None
        finally:
            model.checkpoint = False
    elif name == "checkpoint":
        with _blocks_recomputed(workload):
            yield None
    elif name == "recompute":
        with _blocks_recomputed(workload), ts.stash("auto", profile=profile) as session:
            yield session
    else:
        policy = _auto_policy(name) if name.startswith(AUTO_PREFIX) else STASH_POLICIES[name]()
        with ts.stash(policy, profile=profile) as session:
            yield session


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
