"""The bench's variants: no stash, each policy, Auto under a budget, and the peers.

A variant is a name; :func:`variant_context` runs a region under it. Names:

- "none": plain autograd, the baseline every ratio is taken against;
- a stash policy: "keep", "cpu", "lz4", "disk", "lz4+disk", "auto";
- "recompute": ``ts.recompute`` on every block, their inputs through Auto;
- ``auto:<limit>``: ``Auto(limit=...)``, a memory limit each step's real peak
  must keep: the step's base (what the process or device holds as it begins)
  plus a share of no stash's real peak growth (``auto:50%``, ``auto:0.5``) or
  a size (``auto:64MiB``), so each row reads against its own limit (see
  :func:`limit_bytes`);
- the peers: "save_on_cpu" and "checkpoint" (torch's, or the model's own), and
  on a GPU the hook-based offloaders of torchtune and TRL, optional rows that
  are skipped, with the reason, where they cannot run (:func:`skip_reason`);
- on a Hugging Face model, HF's own means (NOTE [ HF peers ] in hf.py):
  ``hf-every:<k>``, its checkpointing of one decoder layer in ``k``, and
  "hf-offload", its checkpointing with the layers' inputs in pinned host memory
  (on a GPU); on another model their rows are skipped, with the reason;
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
from tensorstash.bench.hf import (
    HF_PEERS,
    every_n_layers,
    hf_model,
    hf_peer_on,
    hf_skip_reason,
    is_hf_peer,
)
from tensorstash.bench.workloads import Workload
from tensorstash.core import _support
from tensorstash.core._sizes import Share, parse_size
from tensorstash.memory._memory import real_memory_now
from tensorstash.planning.auto import LIMIT_LEAST

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
"""``auto:<limit>`` (``auto:50%``, ``auto:64MiB``) runs ``Auto(limit=...)`` at the step's base
plus that share of no stash's real peak growth, or that size (:func:`limit_bytes`)."""
NO_PLAN = " without a plan"
"""The suffix of an ``auto:<budget>`` variant's twin that never plans (rule 6 of the NOTE)."""
DEFAULT_POLICIES: tuple[str, ...] = (*ALL_POLICIES[:7], "auto:50%", *ALL_POLICIES[7:])
"""Every policy, and Auto under a limit at half no stash's real peak growth (the default
limit, a share of the machine's memory, keeps everything of these models)."""
SWEEP_POLICIES: tuple[str, ...] = (
    BASELINE, "checkpoint", "recompute", "save_on_cpu", "cpu", "lz4", "disk",
    "auto", "auto:25%", "auto:50%", "auto:75%", *OPTIONAL_PEERS,
)  # fmt: skip
"""What ``--sweep`` runs, in float32 and under bf16 autocast (and, on an HF model,
:data:`~tensorstash.bench.hf.HF_PEERS`: :func:`default_policies`)."""
NEEDS_BLOCKS = ("recompute", "checkpoint")
"""Policies that wrap the model's blocks (see ``Workload.blocks``); "checkpoint" not on a
model with checkpointing of its own (``Workload.checkpointing``)."""
_INSTALL = {"torchtune": "pip install torchtune torchao", "trl": "pip install trl"}


def budget_spec(name: str) -> str | None:
    """The ``<limit>`` of an ``auto:<limit>`` name (None for other names)."""
    return name.removeprefix(AUTO_PREFIX) if name.startswith(AUTO_PREFIX) else None


def is_relative(name: str) -> bool:
    """Whether ``name`` is an Auto limit given as a share of no stash's real peak growth
    (``auto:50%``, ``auto:0.5``)."""
    spec = budget_spec(name)
    if spec is None:
        return False
    try:
        return isinstance(parse_size(spec, "tensorstash bench", name), Share)
    except (TypeError, ValueError):
        return False


def limit_bytes(name: str, plain_growth: int | None) -> int | None:
    """What an ``auto:<limit>`` variant's step may add to its base, in bytes (None for
    other variants): a share of ``plain_growth`` or a size (NOTE [ Sizes ]).

    Args:
        name: the variant.
        plain_growth: no stash's real peak growth over a step, the base of a share.

    Raises:
        ValueError: not a size or a share, or a share without ``plain_growth``.
    """
    spec = budget_spec(name)
    if spec is None:
        return None
    api = "tensorstash bench"
    try:
        size = parse_size(spec, api, f"the limit of {name!r}")
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{api}: {name!r}: a limit is a share of no stash's real peak growth "
            f"(auto:50%, auto:0.5) or a size over each step's base (auto:64MiB); {error}"
        ) from None
    if not isinstance(size, Share):
        return int(size)
    if plain_growth is None:
        raise ValueError(
            f"{api}: {name!r} is a share of no stash's real peak growth; pass plain_growth "
            "(run_bench measures it with a plain step)"
        )
    return size.of(plain_growth)


budget_bytes = limit_bytes  # the name of older releases


def limit_slack(limit: int) -> int:
    """How far past its limit a step's measured real peak may read and still be within it:
    what sampling the resident set misses or adds (2 MiB, or 3% of the limit)."""
    return max(2 << 20, int(0.03 * limit))


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
    if is_hf_peer(name):
        try:
            every_n_layers(name)
        except ValueError:
            return False
        return True
    return name in ALL_POLICIES or name in OPTIONAL_PEERS


def default_policies(workload: Workload, *, sweep: bool = False) -> list[str]:
    """What the bench runs when ``--policies`` is not given: :data:`DEFAULT_POLICIES` (or
    :data:`SWEEP_POLICIES`), and HF's own peers on a model that holds an HF model."""
    names = list(SWEEP_POLICIES if sweep else DEFAULT_POLICIES)
    if hf_model(workload.model) is not None:
        names.extend(HF_PEERS)
    return names


def runs_on_copy(name: str) -> bool:
    """Whether the variant turns something on in the model for good, and so runs on a copy
    of it made for it alone: "checkpoint" and HF's peers (rule 3 of NOTE [ HF peers ])."""
    return name == "checkpoint" or is_hf_peer(name)


def learns(name: str) -> bool:
    """Whether the variant runs Auto with a Profile (rule 6 of NOTE [ Fair comparison ])."""
    return name == "auto" or name == "recompute" or name.startswith(AUTO_PREFIX)


def resolve_policies(names: Sequence[str]) -> list[str]:
    """Validate bench policy names, drop repeats and put the baseline "none" first.

    Args:
        names: names from :data:`ALL_POLICIES`, :data:`OPTIONAL_PEERS`,
            ``auto:<budget>``, "hf-offload" or ``hf-every:<k>``, in the order to run them.

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
            "as auto:8MiB, or a share of the activation bytes such as auto:50%), "
            "compile:<b> (the model compiled with the partitioner's memory budget b, from 0 "
            "to 1, such as compile:0.5), and on a Hugging Face model hf-offload and "
            "hf-every:<k> (HF's checkpointing of one decoder layer in k, k >= 1, such as "
            "hf-every:2); pass several comma-separated, e.g. --policies none,lz4"
        )
    resolved = [BASELINE]
    resolved.extend(name for name in dict.fromkeys(names) if name != BASELINE)
    return resolved


def skip_reason(
    name: str,
    device: torch.device,
    *,
    compiled: bool = False,
    workload: Workload | None = None,
) -> str | None:
    """Why a variant cannot run here (None: it runs): an optional peer without CUDA or its
    library, "recompute" on a compiled model, or an HF peer on ``workload`` where it has no
    HF model or its transformers lacks the peer (NOTE [ HF peers ]; without a workload, an
    HF peer is taken to run)."""
    if is_hf_peer(name):
        return None if workload is None else hf_skip_reason(name, workload.model, device)
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
    blockless = [name for name in names if needs_blocks(name, workload)]
    if blockless:
        raise ValueError(
            f"tensorstash bench: policy {blockless[0]!r} wraps the model's blocks, and "
            f"{workload.description} names none; return (model, batch, blocks) from the "
            "model script (blocks: a module class or submodule names), or leave "
            f"{' and '.join(NEEDS_BLOCKS)} out of --policies"
        )


def needs_blocks(name: str, workload: Workload) -> bool:
    """Whether variant ``name`` wraps blocks that ``workload`` does not name: "recompute",
    and "checkpoint" on a model without checkpointing of its own."""
    if workload.blocks is not None or name not in NEEDS_BLOCKS:
        return False
    return name == "recompute" or workload.checkpointing is None


def checkpointing_on(workload: Workload) -> Callable[[], None]:
    """Turn on the "checkpoint" peer: the workload's model checkpoints every block, its
    own way where it has one, else with torch's checkpoint. Returns what turns it off."""
    if workload.checkpointing is not None:
        return workload.checkpointing(workload.model)
    return _recompute_blocks(workload)


def checkpointed_copy(workload: Workload) -> Workload:
    """The workload on a copy of its model whose "checkpoint" peer is on for good, as a
    user turns it on (HF's enable adds a hook that no disable takes off)."""
    return variant_copy("checkpoint", workload)


def variant_copy(name: str, workload: Workload) -> Workload:
    """The workload on a copy of its model with variant ``name`` (:func:`runs_on_copy`) on
    for good, as a user turns it on (rule 3 of NOTE [ HF peers ])."""
    model = copy.deepcopy(workload.model)
    copied = dataclasses.replace(workload, model=model, library_model=hf_model(model))
    if name == "checkpoint":
        checkpointing_on(copied)
    else:
        hf_peer_on(name, model)
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
    plain_growth: int | None = None,
    base: int | None = None,
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
        activation_bytes: the eligible bytes one step saves.
        plain_growth: no stash's real peak growth over a step, the base of a limit
            given as a share (see :func:`limit_bytes`).
        base: what the process or device holds as the step begins, which an
            ``auto:<limit>`` step's limit is over; None: read now.

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
    elif runs_on_copy(name):  # the bench runs these on a copy (StepRunner.model_for)
        off = (
            checkpointing_on(workload) if name == "checkpoint" else hf_peer_on(name, workload.model)
        )
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
        over = limit_bytes(name, plain_growth)
        if over is None:
            policy = STASH_POLICIES[name]()
        else:
            held = real_memory_now(device) if base is None else base
            policy = ts.Auto(limit=max(held + over, LIMIT_LEAST))
        with ts.stash(policy, profile=profile) as session:
            yield session
