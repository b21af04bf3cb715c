"""PEFT LoRA adapters on HF language models (GPT-2, Llama, built from configs in zoo.py).

Fine-tuning with adapters trains a few small matrices beside a frozen base: the oracle is
the same model trained by plain autograd in lockstep (the same SGD update applied to both
after every step), its gradients compared bitwise at every step, LoRA dropout on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from checks import (
    POLICY_SPECS,
    SEED,
    PolicySpec,
    assert_grads_equal,
    assert_went_to,
    grads_of,
    leak_check,
    tier_counts,
)
from torch import nn

import tensorstash as ts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 3
LEARNING_RATE = 0.5
"""Large enough that every step's adapters differ visibly from the last step's."""

FAST_POLICIES = ("cpu+lz4+disk", "name-disk", "auto-tight")
"""The policies ``make test`` runs on both models; ``make test-all`` runs every one."""


def sgd(model: nn.Module) -> None:
    """One plain SGD update of the trainable parameters (the adapters)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.sub_(LEARNING_RATE * parameter.grad)


def lockstep(
    name: str,
    context: Callable[[int], contextlib.AbstractContextManager[Any]],
    *,
    steps: int = STEPS,
    prepare: Callable[[nn.Module], None] | None = None,
) -> list[Any]:
    """Train the LoRA model ``name`` for ``steps`` steps under plain autograd and, beside
    it, under ``context(step)``; assert every step's gradients equal. Returns the contexts'
    values (the sessions)."""
    plain, stashed = zoo.lora(name), zoo.lora(name)
    if prepare is not None:
        prepare(plain.model)
        prepare(stashed.model)
    sessions = []
    for step in range(steps):
        want = grads_of(plain.model, plain.inputs, plain.loss, seed=SEED + step)
        manager = context(step)
        got = grads_of(stashed.model, stashed.inputs, stashed.loss, manager, seed=SEED + step)
        assert_grads_equal(want, got)
        sessions.append(manager)
        sgd(plain.model)
        sgd(stashed.model)
    return sessions


def lora_policy_params() -> list[Any]:
    """Every lossless policy on both models, those beside ``FAST_POLICIES`` slow."""
    return [
        pytest.param(
            name,
            spec,
            id=f"{spec.id}-{name}",
            marks=() if spec.id in FAST_POLICIES else pytest.mark.slow,
        )
        for spec in POLICY_SPECS
        for name in zoo.HF_MODELS
    ]


# -- every policy, step after step ----------------------------------------------------------


@pytest.mark.parametrize(("name", "spec"), lora_policy_params())
def test_lora_grads_equal_plain_autograd_every_step(
    name: str, spec: PolicySpec, spill_dir: Path, private_tmp: Path
) -> None:
    sessions = lockstep(name, lambda step: ts.stash(spec.make(spill_dir), min_bytes=0))
    for session in sessions:
        assert_went_to(session, spec.tier)
    del sessions
    leak_check(directories=[spill_dir, private_tmp])


@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_default_auto_grads_equal_every_step(name: str) -> None:
    lockstep(name, lambda step: ts.stash("auto", min_bytes=0))


@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_auto_with_a_profile_plans_and_keeps_grads_equal(name: str, spill_dir: Path) -> None:
    """Auto under a budget of a quarter of the activations, one Profile over six steps: it
    learns in the first, plans from the second (recomputing blocks whose LoRA dropout must
    draw the same masks again, or spilling), and every step stays bitwise."""
    kept = lockstep(name, lambda step: ts.stash(ts.Keep(), min_bytes=0), steps=1)[0]
    activations = int(kept.stats.to_dict()["tiers"]["kept"]["peak_bytes"])
    profile = ts.Profile()
    budget = activations // 4

    def planned(step: int) -> Any:
        return ts.stash(ts.Auto(device_budget=budget, directory=spill_dir), profile=profile)

    sessions = lockstep(name, planned, steps=6)
    plans = [session.plan for session in sessions[1:]]
    assert all(plan is not None for plan in plans), "Auto made no plan after its first step"
    counts = tier_counts(sessions[-1])
    moved = counts["host"] + counts["disk"]
    assert plans[-1].recompute or moved, "the plan under a quarter of the activations moved nothing"
    del sessions
    leak_check(directories=[spill_dir])


# -- HF's own gradient checkpointing ------------------------------------------------------


def hf_checkpointing(reentrant: bool) -> Callable[[nn.Module], None]:
    """Turn on HF's checkpointing of every decoder layer, as a user (or the Trainer) does."""

    def on(model: nn.Module) -> None:
        library = model.model  # LanguageModelLoss -> PeftModel; PEFT forwards the call
        library.activation_checkpointing_enable({"use_reentrant": reentrant})

    return on


@pytest.mark.parametrize(
    "reentrant",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["non-reentrant", "reentrant"],
)
@pytest.mark.parametrize(
    "spec",
    [
        PolicySpec("lz4+disk", lambda d: ts.Chain(ts.Lz4(), ts.DiskSpill(directory=d)), "disk"),
        # Tighter than checks' auto-tight: the checkpointed layers keep only their inputs.
        PolicySpec("auto-tighter", lambda d: ts.Auto(device_budget=16 << 10, directory=d), "disk"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_under_hf_checkpointing_grads_equal(
    name: str, spec: PolicySpec, reentrant: bool, spill_dir: Path
) -> None:
    """The checkpointed layers keep only their inputs, through the stash; backward
    recomputes them (their dropout included) with the stash closed."""
    sessions = lockstep(
        name,
        lambda step: ts.stash(spec.make(spill_dir), min_bytes=0),
        prepare=hf_checkpointing(reentrant),
    )
    for session in sessions:
        assert_went_to(session, spec.tier)
    del sessions
    leak_check(directories=[spill_dir])


# -- merged and unmerged adapters ------------------------------------------------------------


def merged_then_unmerged(model: nn.Module) -> None:
    """Merge the adapters into the base weights and take them out again, in place (what
    PEFT does around evaluation): the base weights' contents and versions move."""
    model.model.merge_adapter()
    model.model.unmerge_adapter()


@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_after_merge_and_unmerge_grads_equal(name: str, spill_dir: Path) -> None:
    lockstep(
        name,
        lambda step: ts.stash(ts.Chain(ts.Lz4(), ts.DiskSpill(directory=spill_dir)), min_bytes=0),
        prepare=merged_then_unmerged,
    )
    leak_check(directories=[spill_dir])


def merged_with_new_adapters(name: str) -> Callable[[nn.Module], None]:
    """Merge the first adapters into the base for good (``merge_and_unload``) and put new
    ones on the merged model: adapters trained on top of merged ones."""

    def prepare(model: nn.Module) -> None:
        base = model.model.merge_and_unload()
        model.model = zoo.with_lora(base, name, seed=1)
        model.train()

    return prepare


@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_new_adapters_on_merged_weights_grads_equal(name: str, spill_dir: Path) -> None:
    lockstep(
        name,
        lambda step: ts.stash(ts.DiskSpill(directory=spill_dir), min_bytes=0),
        prepare=merged_with_new_adapters(name),
    )
    leak_check(directories=[spill_dir])


# -- the frozen base is never moved ------------------------------------------------------


@contextlib.contextmanager
def counting_parameter_saves(model: nn.Module) -> Iterator[list[int]]:
    """Identity hooks (plain autograd's saves, unchanged) that count the saved tensors
    sharing a parameter's storage: the weights and their views (``weight.t()``)."""
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() in storages:
            found[0] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield found


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-checkpointing"])
@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_frozen_weights_and_their_views_never_move(
    name: str, checkpointing: bool, spill_dir: Path
) -> None:
    """Under a selector that would spill everything it is offered: every save of a
    parameter or a view of one (counted by identity hooks under plain autograd) is
    kept, counted as "parameter" in the stats and the decision log, and none reaches the
    selector; the frozen weights end as they began, without gradients."""
    case = zoo.lora(name)
    if checkpointing:
        hf_checkpointing(False)(case.model)
    frozen = {n: p for n, p in case.model.named_parameters() if not p.requires_grad}
    assert len(frozen) > len(dict(case.model.named_parameters())) / 2  # the base is most of it
    before = {n: p.detach().clone() for n, p in frozen.items()}
    storages = {p.untyped_storage().data_ptr() for p in case.model.parameters()}
    with counting_parameter_saves(case.model) as found:
        torch.manual_seed(SEED)
        case.step().backward()
    expected = found[0]
    # Without checkpointing, at least the base weights the adapters sit on; with it, the
    # layers keep only their inputs, and what runs outside them (embeddings, the head).
    assert expected >= (1 if checkpointing else 2 * len(zoo.LORA_TARGETS[name]))

    offered: list[int] = []

    def spill_all(tensor: torch.Tensor, memory: Any) -> ts.Policy:
        offered.append(tensor.untyped_storage().data_ptr())
        return ts.DiskSpill(directory=spill_dir)

    case.model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    with ts.stash(ts.Select(spill_all), min_bytes=0, record=True) as session:
        loss = case.step()
    loss.backward()
    stats = session.stats
    assert stats.skipped["parameter"] == expected, stats.table()
    rows = [row for row in stats.decisions if row["reason"] == "parameter"]
    assert len(rows) == expected and {row["tier"] for row in rows} == {"kept"}
    assert offered and not storages.intersection(offered), "a parameter reached the selector"
    assert stats.to_dict()["tiers"]["disk"]["tensors"] == len(offered)
    for parameter_name, parameter in frozen.items():
        assert parameter.grad is None and not parameter.requires_grad, parameter_name
        assert torch.equal(parameter, before[parameter_name]), parameter_name
    del session, stats, loss
    leak_check(directories=[spill_dir])


@pytest.mark.parametrize("name", list(zoo.HF_MODELS))
def test_lora_under_autocast_keeps_weights_and_moves_only_their_copies(
    name: str, spill_dir: Path
) -> None:
    """Under bfloat16 autocast the frozen weights reach backward as bf16 copies made for
    each op (autocast caches casts of trainable leaves only): new tensors that plain
    autograd holds until backward, which a policy may move. The weights themselves and
    their views still never reach it, and the gradients stay bitwise."""
    storages: set[int] = set()
    offered: list[int] = []

    def spill_all(tensor: torch.Tensor, memory: Any) -> ts.Policy:
        offered.append(tensor.untyped_storage().data_ptr())
        return ts.DiskSpill(directory=spill_dir)

    @contextlib.contextmanager
    def autocast_stash(step: int) -> Iterator[Any]:
        with (
            ts.stash(ts.Select(spill_all), min_bytes=0) as session,
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            yield session

    def plain_autocast(model: nn.Module) -> None:
        storages.update(p.untyped_storage().data_ptr() for p in model.parameters())
        forward = model.forward

        def under_autocast(*args: Any) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return forward(*args)

        model.forward = under_autocast  # type: ignore[method-assign]

    lockstep(name, autocast_stash, prepare=plain_autocast)
    assert offered and not storages.intersection(offered), "a parameter reached the selector"
    leak_check(directories=[spill_dir])
