"""The plan (NOTE [ Plan ]): the solver on measured profiles, and Auto following it."""

from __future__ import annotations

import copy
import dataclasses
import gc
import mmap
import sys
import threading
import time
import types
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from checks import Ticks, top_saved_tensors_hooks
from torch import nn
from torch.nn.modules import module as module_hooks
from zoo import Block

import tensorstash as ts
from tensorstash.memory import _pool
from tensorstash.planning.auto import TRIM_LEAST
from tensorstash.planning.plan import HOOK_S, Rates, make_plan, weighted_median
from tensorstash.planning.profile import ALREADY_RECOMPUTED, ModuleRecord, SiteRecord, StepRecord

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MiB = 1 << 20


# -- the solver, on profiles written by hand -------------------------------------------


def profile_of(
    modules: dict[str, tuple[float, int]],
    sites: dict[str, list[int]],
    *,
    seconds: float = 1.0,
    unsafe: dict[str, str] | None = None,
) -> ts.Profile:
    """A profile that measured one step: ``modules`` maps a path to (forward seconds,
    input bytes); ``sites`` maps a module path to the bytes of the tensors saved in it."""
    profile = ts.Profile()
    order = 0
    for path, sizes in sites.items():
        for occurrence, nbytes in enumerate(sizes, 1):
            profile.last[(path, "MulBackward0", occurrence)] = SiteRecord(order, nbytes)
            order += 1
    firsts = {
        path: min((r.order for s, r in profile.last.items() if s[0].startswith(path)), default=0)
        for path in modules
    }
    profile.modules = {  # each its own kind: twins would share their median time
        path: ModuleRecord(1, forward_s, inputs, firsts[path], (unsafe or {}).get(path), path)
        for path, (forward_s, inputs) in modules.items()
    }
    total = sum(r.nbytes for r in profile.last.values())
    first = StepRecord(seconds / 3, 2 * seconds / 3, total, 4 * total, cold=True)
    profile.history.append(first)
    profile.peak = first  # a profile's first step takes the real peak
    profile._root_name = "Net"
    return profile


def two_blocks(cheap_s: float = 0.002, dear_s: float = 0.008) -> ts.Profile:
    return profile_of(
        {"a": (cheap_s, MiB), "b": (dear_s, MiB)},
        {"a": [4 * MiB, 4 * MiB], "b": [4 * MiB, 4 * MiB]},
    )


def three_blocks(a_s: float, b_s: float, c_s: float = 0.008) -> ts.Profile:
    """Blocks a, b, c of 8 MiB each: recomputing a or b lowers the peak held, c (the last)
    cannot, for backward reaches it while everything before it is still held."""
    return profile_of(
        {"a": (a_s, MiB), "b": (b_s, MiB), "c": (c_s, MiB)},
        {name: [4 * MiB, 4 * MiB] for name in "abc"},
    )


def test_plan_keeps_everything_when_the_activations_fit() -> None:
    plan = make_plan(two_blocks(), 64 * MiB)
    assert plan is not None
    assert plan.recompute == () and plan.tiers == {} and plan.choices == ()
    assert plan.held_bytes == 16 * MiB and plan.fits
    assert plan.predicted_step_s == pytest.approx(plan.base_step_s)


def test_plan_takes_the_cheapest_saving_per_byte_first() -> None:
    plan = make_plan(two_blocks(cheap_s=0.002, dear_s=0.008), 9 * MiB)
    assert plan is not None and plan.recompute == ("a",)
    assert plan.held_bytes == 9 * MiB  # 16 MiB less "a"'s 8 MiB, plus its 1 MiB input
    plan = make_plan(three_blocks(0.008, 0.002), 17 * MiB)
    assert plan is not None and plan.recompute == ("b",)


def test_plan_never_recomputes_what_backward_would_hold_again() -> None:
    # "b" is cheap, but backward recomputes it while "a"'s 8 MiB are still held:
    # 17 MiB, more than nothing recomputed holds. Only "a" lowers the peak.
    plan = make_plan(two_blocks(cheap_s=0.008, dear_s=0.002), 9 * MiB)
    assert plan is not None and plan.recompute == ("a",)
    # A whole model's body is cheap per byte and holds everything again in backward.
    profile = profile_of(
        {"t": (0.010, MiB), "t.0": (0.006, MiB), "t.1": (0.006, MiB), "t.2": (0.006, MiB)},
        {"t.0": [8 * MiB], "t.1": [8 * MiB], "t.2": [8 * MiB]},
    )
    plan = make_plan(profile, 10 * MiB)
    assert plan is not None and plan.recompute == ("t.0", "t.1")
    assert plan.held_bytes == 10 * MiB  # 24 MiB less 7 MiB twice


def test_plan_never_recomputes_a_module_whose_forward_was_not_timed() -> None:
    plan = make_plan(three_blocks(0.0, 0.008), 17 * MiB)
    assert plan is not None and plan.recompute == ("b",)  # "a" looks free: its cost is unknown


def test_plan_prefers_the_earlier_of_equal_modules() -> None:
    plan = make_plan(two_blocks(cheap_s=0.004, dear_s=0.0041), 9 * MiB)
    assert plan is not None and plan.recompute == ("a",)  # equal within noise: the earlier


def test_plan_recomputing_a_module_replaces_the_choices_inside_it() -> None:
    profile = profile_of(
        {"a": (0.0015, MiB), "a.x": (0.0005, MiB), "a.y": (0.001, MiB)},
        {"a.x": [4 * MiB], "a.y": [4 * MiB]},
    )
    # "a.x" is the cheapest per byte; then "a", which adds what "a.y" would for less.
    plan = make_plan(profile, 2 * MiB)
    assert plan is not None and plan.recompute == ("a",)
    assert [choice.target for choice in plan.choices] == ["a"]
    assert plan.held_bytes == MiB
    # "a" costs its whole forward and saves all it holds (8 MiB less its 1 MiB input),
    # not what it added to "a.x", which it replaced and which is no longer paid for.
    (choice,) = plan.choices
    assert choice.cost_s == pytest.approx(0.0015) and choice.saved_bytes == 7 * MiB
    assert plan.predicted_step_s - plan.base_step_s >= 0.0015


def test_plan_predicts_the_recompute_of_modules_the_user_checkpoints() -> None:
    already = {"a": ALREADY_RECOMPUTED}
    profile = profile_of(
        {"a": (0.1, MiB), "b": (0.05, MiB), "c": (0.05, MiB)},
        {"b": [8 * MiB], "c": [8 * MiB]},
        unsafe=already,
    )
    # Every step recomputes "a" (the user's): out of the plain step, into the prediction.
    plan = make_plan(profile, 64 * MiB)
    assert plan is not None and plan.recompute == ()
    assert plan.checkpointed_s == pytest.approx(0.1)
    assert plan.predicted_step_s - plan.base_step_s == pytest.approx(0.1)
    assert "recomputes what you checkpoint, 100.0 ms" in plan.table()
    plan = make_plan(profile, 9 * MiB)
    assert plan is not None and plan.recompute == ("b",)
    assert plan.predicted_step_s - plan.base_step_s == pytest.approx(0.15)


def test_plan_takes_one_saving_that_covers_what_is_left() -> None:
    profile = profile_of(
        {"a": (0.002, MiB), "b": (0.002, MiB), "c": (0.0005, 0)},
        {"a": [8 * MiB], "c": [MiB], "b": [8 * MiB]},
    )
    # 17 MiB held, 16.5 allowed: "c" covers the half MiB left, cheaper than a block.
    plan = make_plan(profile, 16 * MiB + MiB // 2)
    assert plan is not None and plan.recompute == ("c",)


def test_plan_never_recomputes_unsafe_modules_nor_modules_around_them() -> None:
    profile = profile_of(
        {"a": (0.002, MiB), "a.bn": (0.0002, 0), "b": (0.008, MiB), "c": (0.008, MiB)},
        {"a.bn": [8 * MiB], "b": [8 * MiB], "c": [8 * MiB]},
        unsafe={"a.bn": "changes its buffers in forward"},
    )
    plan = make_plan(profile, 17 * MiB)
    assert plan is not None and plan.recompute == ("b",)


def test_plan_follows_never_and_always() -> None:
    plan = make_plan(three_blocks(0.002, 0.008), 17 * MiB, never=lambda path: path == "a")
    assert plan is not None and plan.recompute == ("b",)
    plan = make_plan(two_blocks(), 64 * MiB, always=["b"])
    assert plan is not None and plan.recompute == ("b",)


def test_plan_without_recompute_moves_sites_on_the_cpu() -> None:
    plan = make_plan(two_blocks(), 9 * MiB, recompute=False, rates=Rates(ratio=1.0))
    assert plan is not None and plan.recompute == ()
    assert set(plan.tiers.values()) == {"disk"} and plan.fits
    assert len(plan.tiers) == 2  # two 4 MiB sites bring 16 MiB under 9


def test_plan_copies_the_earliest_sites_to_host_free_on_cuda() -> None:
    profile = two_blocks()
    link = Rates(link=6 * MiB / (1 / 3))  # the link moves 6 MiB during forward
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=link, recompute=False)
    assert plan is not None
    free = [c for c in plan.choices if c.kind == "host" and c.cost_s == 0]
    assert [c.target for c in free] == ["a:MulBackward0#1"]  # the earliest; 4 MiB fits 6
    assert plan.fits


def test_plan_on_cuda_leaves_the_copies_still_running_room_in_the_budget() -> None:
    # A copied tensor stays on the device until its copy ends, and Auto lets the copies
    # hold only the budget less what the plan keeps: a plan that kept its whole budget
    # left them none, and each save waited for the copy before it.
    link = Rates(link=1e12)
    plan = make_plan(two_blocks(), 12 * MiB, device="cuda", rates=link, recompute=False)
    assert plan is not None and plan.fits and set(plan.tiers.values()) == {"host"}
    assert plan.held_bytes <= 9 * MiB  # a quarter of the budget left to the copies
    assert len(plan.tiers) == 2  # one 4 MiB site would bring 16 MiB under 12
    # On the CPU nothing is copied to a host: the plan holds up to its budget.
    plan = make_plan(two_blocks(), 12 * MiB, recompute=False, rates=Rates(ratio=1.0))
    assert plan is not None and len(plan.tiers) == 1 and plan.held_bytes == 12 * MiB


def test_plan_names_the_least_budget_it_can_reach() -> None:
    plan = make_plan(two_blocks(), MiB // 2, recompute=True, rates=Rates(ratio=1.0))
    assert plan is not None and not plan.fits
    assert plan.held_bytes == 2 * MiB  # both recomputed: their inputs stay
    assert plan.reachable_bytes == 4 * MiB  # and the largest tensor, while it is packed
    assert "the least reachable" in plan.table()


def test_plan_predicts_the_base_plus_what_it_costs() -> None:
    profile = two_blocks()
    plan = make_plan(profile, 9 * MiB)
    assert plan is not None
    # A step that moved nothing took 1 s with the hooks; before a quiet step was
    # timed, the hooks cost HOOK_S per site, and a plan that only recomputes has none.
    assert plan.hooks_s == pytest.approx(HOOK_S * 4)
    assert plan.base_step_s == pytest.approx(1.0 - plan.hooks_s)
    assert plan.quiet and plan.predicted_step_s == pytest.approx(plan.base_step_s + 0.002)
    # The real peak: the measured one less what the step held, plus the plan's,
    # or more while backward recomputes "a" with nothing saved before it.
    measured = profile.history[-1]
    assert measured.peak_bytes is not None
    other = measured.peak_bytes - measured.held_bytes
    assert plan.predicted_peak_bytes == other + max(plan.held_bytes, MiB + 8 * MiB)


def test_plan_learns_what_a_spill_cost_from_a_step_that_spilled() -> None:
    profile = two_blocks()
    # A second step spilled 8 MiB and took 0.4 s more than the first.
    profile.history.append(StepRecord(0.5, 0.9, 8 * MiB, None, (), 0.0, {"disk": 8 * MiB}))
    plan = make_plan(profile, 9 * MiB, recompute=False, rates=Rates(ratio=1.0))
    assert plan is not None
    assert plan.predicted_step_s == pytest.approx(1.0 + 0.4, rel=1e-6)


def test_plan_prices_a_spill_by_its_bytes_not_by_its_steps() -> None:
    profile = two_blocks()
    # A step spilled 16 MiB and took 0.8 s more; it has left the history since.
    spilled = StepRecord(0.6, 1.2, 8 * MiB, None, (), 0.0, {"disk": 16 * MiB})
    profile.aside[frozenset({"disk"})] = deque([spilled])
    # Three later steps spilled 256 KiB each, their cost lost in their noise.
    for _ in range(3):
        profile.history.append(
            StepRecord(1 / 3, 2 / 3, 8 * MiB, None, (), 0.0, {"disk": 256 * 1024})
        )
    plan = make_plan(profile, 9 * MiB, recompute=False, rates=Rates(ratio=1.0))
    assert plan is not None
    # 8 MiB spilled at what the 16 MiB cost a byte: 0.4 s, not next to nothing.
    assert plan.predicted_step_s == pytest.approx(1.0 + 0.4, rel=1e-6)


def test_weighted_median_counts_each_value_by_its_weight() -> None:
    assert weighted_median([(0.0, 1), (5.0, 10), (1.0, 2)]) == 5.0
    assert weighted_median([(2.0, 1)]) == 2.0
    assert weighted_median([(1.0, 1), (3.0, 1)]) == 1.0


def test_plan_costs_recompute_at_what_backward_took_to_recompute() -> None:
    profile = two_blocks(cheap_s=0.002, dear_s=0.008)
    # A warm step recomputed "a" (0.002 s of forward) and backward took 0.001 s to do it.
    profile.history.append(StepRecord(0.4, 0.601, 9 * MiB, None, ("a",), recompute_s=0.001))
    plan = make_plan(profile, 9 * MiB)
    assert plan is not None and plan.recompute == ("a",)
    # 1.001 s less the recompute it timed, less the hooks (a quiet plan runs none)
    assert plan.base_step_s == pytest.approx(1.0 - plan.hooks_s)
    assert plan.choices[0].cost_s == pytest.approx(0.001)  # half its forward time
    assert plan.predicted_step_s == pytest.approx(1.001 - plan.hooks_s)
    # Without the timing, recompute costs its forward time.
    untimed = two_blocks(cheap_s=0.002, dear_s=0.008)
    untimed.history.append(StepRecord(0.4, 0.601, 9 * MiB, None, ("a",)))
    plan = make_plan(untimed, 9 * MiB)
    assert plan is not None and plan.choices[0].cost_s == pytest.approx(0.002)


def test_plan_prices_what_each_recomputed_region_costs_beyond_its_recompute() -> None:
    profile = profile_of(
        {"a": (0.005, MiB), "a.x": (0.002, MiB), "a.y": (0.002, MiB), "b": (0.004, MiB)},
        {"a.x": [4 * MiB], "a.y": [4 * MiB], "b": [4 * MiB, 4 * MiB]},
    )
    # Without what a region costs beyond its recompute, "a.x" and "a.y" save 6 MiB for
    # less forward time than "a"; with it, one region costs less than two.
    plan = make_plan(profile, 10 * MiB)
    assert plan is not None and plan.recompute == ("a.x", "a.y")
    rates = Rates(region_s=0.002, saved_s=0.0005)
    plan = make_plan(profile, 10 * MiB, rates=rates)
    assert plan is not None and plan.recompute == ("a",)
    (choice,) = plan.choices
    assert choice.cost_s == pytest.approx(0.005 + 0.002 + 2 * 0.0005)  # its two sites
    assert plan.predicted_step_s - plan.base_step_s == pytest.approx(choice.cost_s)
    # A step that recomputed "a" took its recompute (timed) and its region's own cost:
    # neither is in the plain step's base, and the plan is predicted as it ran.
    profile.history.append(StepRecord(0.4, 0.605, 9 * MiB, None, ("a",), recompute_s=0.003))
    plan = make_plan(profile, 10 * MiB, rates=rates)
    assert plan is not None and plan.recompute == ("a",)
    assert plan.base_step_s == pytest.approx(1.005 - 0.003 - 0.003 - plan.hooks_s)
    assert plan.predicted_step_s == pytest.approx(1.005 - plan.hooks_s)


def test_region_cost_is_probed_once_per_device() -> None:
    from tensorstash.planning import _rates

    device = torch.device("cpu")
    _rates._regions.pop(str(device), None)
    region_s, saved_s = _rates.region_cost(device)
    assert 0.0 <= region_s < 0.05 and 0.0 < saved_s < 0.005, (region_s, saved_s)
    assert _rates.region_cost(device) == (region_s, saved_s)


# -- Auto following the plan ----------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, depth: int = 4, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x), torch.arange(x.shape[0]) % 16)


def ticking() -> ts.Profile:
    return ts.Profile(clock=Ticks())


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def data(rows: int = 512) -> torch.Tensor:
    return torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    with ts.stash(ts.Keep()) as probe:
        loss = model(x)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return int(probe.stats.to_dict()["tiers"]["kept"]["peak_bytes"])


def train(
    model: nn.Module, steps: int, policy: Any = None, profile: Any = None, **kw: Any
) -> list[ts.Session]:
    """SGD steps with dropout; a stash around each forward when ``policy`` is given."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sessions = []
    for index in range(steps):
        torch.manual_seed(100 + index)
        x = data()
        optimizer.zero_grad(set_to_none=True)
        chosen = policy(index) if callable(policy) else policy
        if chosen is None:
            loss = model(x)
        else:
            with ts.stash(chosen, profile=profile, **kw) as session:
                loss = model(x)
            sessions.append(session)
        loss.backward()
        optimizer.step()
    return sessions


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs from plain training"


def test_auto_recomputes_from_step_two_and_gives_every_module_back() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    keys = list(model.state_dict())
    calls: list[int] = []
    model.blocks[1].register_forward_hook(lambda m, i, o: calls.append(1))
    profile = ticking()
    first, second = train(model, 2, ts.Auto(device_budget=budget), profile)
    assert first.plan is None  # the first step measures
    assert second.plan is not None and second.plan.recompute
    assert all("forward" not in vars(m) for m in model.modules())  # restored at exit
    assert list(model.state_dict()) == keys and len(calls) == 2  # hooks still run


def test_auto_sets_up_checkpointing_only_for_a_plan_that_recomputes_outside_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first checkpoint of a process imports torch._dynamo (a second, 70 MiB).
    clock = Ticks()
    set_ups: list[int] = []

    def warm_up() -> float:
        if set_ups:
            return 0.0
        set_ups.append(1)
        clock.now += 10.0  # a slow set-up
        sys.modules["tensorstash_test_set_up"] = types.ModuleType("tensorstash_test_set_up")
        return 10.0

    monkeypatch.setattr("tensorstash.planning._auto_step.warm_up", warm_up)
    monkeypatch.delitem(sys.modules, "tensorstash_test_set_up", raising=False)
    model = fresh()
    profile = ts.Profile(clock=clock)
    train(model, 3, ts.Auto(), profile)
    assert not set_ups  # a run that fits never recomputes: it sets nothing up
    budget = activation_bytes(model, data()) // 2
    profile = ts.Profile(clock=clock)
    sessions = train(model, 3, ts.Auto(device_budget=budget), profile)
    assert sessions[1].plan is not None and sessions[1].plan.recompute
    assert set_ups == [1]
    planned = list(profile.history)[1]  # the step that set up, timed from after it
    assert planned.recomputed and planned.forward_s + planned.backward_s < 1.0
    assert planned.peak_bytes is not None  # its import is not the step's memory


@pytest.mark.parametrize("clocked", [False, True], ids=["perf_counter", "ticks"])
def test_auto_probes_the_region_cost_only_where_a_plan_may_recompute_on_its_clock(
    monkeypatch: pytest.MonkeyPatch, clocked: bool
) -> None:
    from tensorstash.planning import _rates

    probed: list[torch.device] = []
    monkeypatch.setattr(_rates, "region_cost", lambda device: probed.append(device) or (0, 0))
    model, x = fresh(), data()
    budget = activation_bytes(model, x)
    profile = ticking() if clocked else ts.Profile()
    train(model, 2, ts.Auto(device_budget=2 * budget), profile)
    assert probed == []  # it fits: no plan recomputes
    train(model, 2, ts.Auto(device_budget=budget // 2), profile)
    # A test's ticks are not the probe's seconds: nothing is probed on them.
    assert set(probed) == (set() if clocked else {torch.device("cpu")})  # (cached there)


def test_auto_times_what_backward_spends_recomputing_the_plan() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    profile = ticking()
    first, second, _ = train(model, 3, ts.Auto(device_budget=budget), profile)
    assert first.plan is None and profile.history[0].recompute_s is None  # nothing recomputed
    assert second.plan is not None and second.plan.recompute
    for record in list(profile.history)[1:]:
        assert record.recomputed and record.recompute_s is not None
        assert 0 < record.recompute_s < record.backward_s  # the profile's clock, in backward


def test_auto_plan_trains_bitwise_with_dropout_while_the_plan_changes() -> None:
    plain, stashed = fresh(), fresh()
    train(plain, 6)
    budget = activation_bytes(fresh(), data())
    autos = [ts.Auto(device_budget=budget // 2), ts.Auto(device_budget=budget // 4)]
    sessions = train(stashed, 6, lambda i: autos[i % 2], ticking())
    plans = {s.plan.recompute for s in sessions if s.plan is not None}
    assert len(plans) == 2  # two budgets, two plans, alternating
    assert_same_weights(plain, stashed)


@pytest.mark.slow  # bf16 on CPU; autocast per policy and plans bitwise are checked fast elsewhere
def test_auto_plan_trains_bitwise_under_bf16_autocast() -> None:
    plain, stashed = fresh(), fresh()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train(plain, 4)
        budget = activation_bytes(fresh(), data())
        sessions = train(stashed, 4, ts.Auto(device_budget=budget // 3), ticking())
    assert any(s.plan is not None and s.plan.recompute for s in sessions)
    assert_same_weights(plain, stashed)


def test_auto_holds_its_budget_after_the_first_step() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 3
    sessions = train(model, 4, ts.Auto(device_budget=budget), ticking(), record=True)
    for session in sessions[1:]:
        tiers = session.stats.to_dict()["tiers"]
        largest = max(row["bytes"] for row in session.decisions)
        assert tiers["kept"]["peak_bytes"] + tiers["host"]["peak_bytes"] <= budget + largest


@pytest.mark.slow  # test_auto_holds_its_budget_after_the_first_step checks it on a small model
@pytest.mark.parametrize("name", ["small", "gpt2-hf"])
def test_auto_holds_its_budget_on_the_bench_models(name: str) -> None:
    """At 25, 50 and 75% of a bench model's activation bytes, with the measured times
    (whatever plan they give), every step after the first holds at most the budget
    plus the tensor it packs: kept bytes and host RAM's, writes in flight included."""
    if name == "gpt2-hf":
        pytest.importorskip("transformers")
    from tensorstash.bench.workloads import builtin_workload

    workload = builtin_workload(name, 0)
    model = workload.model.train()

    def step(policy: Any, profile: ts.Profile | None = None) -> ts.Session:
        model.zero_grad(set_to_none=True)
        with ts.stash(policy, profile=profile, record=True) as session:
            loss = model(*workload.batch)
        loss.backward()
        return session

    activation = step(ts.Keep()).stats.to_dict()["tiers"]["kept"]["peak_bytes"]
    for share in (4, 2, 4 / 3):
        budget, profile = int(activation / share), ts.Profile()
        counted = 0
        for index in range(4):
            session = step(ts.Auto(device_budget=budget), profile)
            if index == 0 or session.stats.quiet:  # the first measures; a quiet step counts nothing
                continue
            tiers = session.stats.to_dict()["tiers"]
            largest = max(row["bytes"] for row in session.decisions)
            held = tiers["kept"]["peak_bytes"] + tiers["host"]["peak_bytes"]
            assert held <= budget + largest, (share, index, held, budget, session.plan)
            counted += 1
        assert counted >= 2  # the plan's steps that take its real peak run with hooks


def test_auto_counts_the_writes_waiting_for_the_disk_toward_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU the bytes waiting for the disk writer are in host RAM, the device: with a
    writer that lags, a planned step that spills holds the budget plus the tensor it packs,
    not the budget plus DiskSpill's default backlog."""
    from tensorstash.tiers import disk

    monkeypatch.setattr(disk, "usable_cores", lambda: torch.get_num_threads() + 1)
    run = disk._Job.run

    def lagging(job: Any) -> Any:
        time.sleep(0.005)
        return run(job)

    monkeypatch.setattr(disk._Job, "run", lagging)
    model = fresh()
    budget = activation_bytes(model, data()) // 4
    auto = ts.Auto(device_budget=budget, recompute=False)
    sessions = train(model, 4, auto, ticking(), record=True)
    for session in sessions[1:]:
        tiers = session.stats.to_dict()["tiers"]
        assert tiers["disk"]["tensors"] > 0
        largest = max(row["bytes"] for row in session.decisions)
        held = tiers["kept"]["peak_bytes"] + tiers["host"]["peak_bytes"]
        assert held <= budget + largest, (held, budget, session.plan)


def test_auto_warns_once_naming_the_least_budget_it_can_hold() -> None:
    model = fresh()
    largest = 512 * 1024 * 4  # a session holds the tensor it packs: this one at least
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, 4, ts.Auto(device_budget=1024), ticking())
    found = [w for w in caught if "cannot be held" in str(w.message)]
    assert len(found) == 1 and f"device_budget >= {largest}" in str(found[0].message)


def test_auto_without_recompute_only_moves_tensors() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    sessions = train(model, 3, ts.Auto(device_budget=budget, recompute=False), ticking())
    assert all(s.plan is None or not s.plan.recompute for s in sessions)
    assert sessions[-1].stats.to_dict()["tiers"]["disk"]["tensors"] > 0


def test_auto_never_recomputes_the_modules_named() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    sessions = train(model, 3, ts.Auto(device_budget=budget, never_recompute="blocks.0"), ticking())
    plan = sessions[-1].plan
    assert plan is not None and plan.recompute
    assert not any(path.startswith("blocks.0") for path in plan.recompute)
    # By class: no Block (what is inside one may be).
    sessions = train(model, 3, ts.Auto(device_budget=budget, never_recompute=("Block",)), ticking())
    plan = sessions[-1].plan
    assert plan is not None and plan.fits
    assert not any(path.count(".") == 1 for path in plan.recompute)


def test_auto_leaves_modules_already_checkpointed_alone() -> None:
    model = fresh()
    ts.recompute(model.blocks[0])
    model.blocks[1].gradient_checkpointing = True
    budget = activation_bytes(model, data()) // 3
    sessions = train(model, 3, ts.Auto(device_budget=budget), ticking())
    plan = sessions[-1].plan
    assert plan is not None
    assert not any(p.startswith(("blocks.0", "blocks.1")) for p in plan.recompute)
    ts.unrecompute(model)
    assert "forward" not in vars(model.blocks[0])


def test_auto_plan_stays_out_of_evaluation_and_no_grad() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    auto, profile = ts.Auto(device_budget=budget), ticking()
    train(model, 2, auto, profile)
    steps, state = profile.steps, profile.state_dict()
    wrapped: list[bool] = []
    hook = model.blocks[0].register_forward_pre_hook(
        lambda m, a: wrapped.append("forward" in vars(m))
    )
    with torch.no_grad(), ts.stash(auto, profile=profile):
        model(data())
    model.eval()
    with ts.stash(auto, profile=profile):
        model(data()).backward()
    model.train()
    hook.remove()
    assert wrapped == [False, False]
    after = profile.state_dict()
    del state["codec_methods"], after["codec_methods"]  # lz4's encodings, still true
    assert profile.steps == steps and after == state


def test_auto_plan_keeps_its_choice_when_timings_wobble() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    sessions = train(
        model, 8, ts.Auto(device_budget=budget), ts.Profile(clock=Ticks(), measure_steps=8)
    )
    plans = [s.plan.recompute for s in sessions if s.plan is not None]
    assert len(set(plans[1:])) == 1, plans


def test_unrecompute_undoes_recompute_modules() -> None:
    model = fresh()
    assert len(ts.recompute_modules(model, Block)) == 4
    ts.unrecompute(model)
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.fixture
def gpt2() -> Iterator[Any]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    yield transformers.GPT2LMHeadModel(config)


class _UsersModel(nn.Module):
    """A model of the user's own around a Hugging Face one: no ``config`` at its root."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.inner(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize("wrapped", [False, True], ids=["hf-model", "wrapped"])
def test_auto_runs_a_hugging_face_model_without_its_kv_cache_while_recomputing(
    gpt2: Any, wrapped: bool
) -> None:
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(gpt2)
    plain(input_ids=ids, labels=ids).loss.backward()
    model = _UsersModel(gpt2) if wrapped else gpt2
    with ts.stash(ts.Keep()) as probe:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    gpt2.zero_grad(set_to_none=True)
    budget = probe.stats.to_dict()["tiers"]["kept"]["peak_bytes"] // 3
    profile, seen = ticking(), []
    gpt2.transformer.h[0].register_forward_pre_hook(lambda m, a: seen.append(gpt2.config.use_cache))
    for _ in range(3):
        gpt2.zero_grad(set_to_none=True)
        with ts.stash(ts.Auto(device_budget=budget), profile=profile) as session:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert session.plan is not None and session.plan.recompute
    assert seen == [False, False, False] and gpt2.config.use_cache is True
    for (name, p), q in zip(plain.named_parameters(), gpt2.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_auto_plan_does_not_recompile_compiled_blocks_every_step() -> None:
    from torch._dynamo.testing import CompileCounter

    plain, model = fresh(), fresh()
    budget = activation_bytes(model, data()) // 2
    counter = CompileCounter()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=counter)
    auto, profile = ts.Auto(device_budget=budget), ticking()
    try:
        train(model, 3, auto, profile)  # measures, then plans
        frames = counter.frame_count
        sessions = train(model, 4, auto, profile)
    finally:
        torch._dynamo.reset()
    plans = {s.plan.recompute if s.plan else None for s in sessions}
    assert len(plans) == 1 and next(iter(plans))  # one plan, recomputing blocks
    assert all(path.startswith("blocks.") for path in next(iter(plans)))  # type: ignore[union-attr]
    assert counter.frame_count == frames  # the same plan: nothing compiled again
    train(plain, 3)
    train(plain, 4)  # the same seeds as the two runs above
    assert_same_weights(plain, model)


def _trim_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tensorstash-trim"]


def _no_trim_thread_within(timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _trim_threads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.fixture
def no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the session pool, as where it is not built (NOTE [ Session pool ] rule 4)."""
    monkeypatch.setattr(_pool, "compiled", None)


@pytest.mark.usefixtures("no_pool")
def test_auto_trims_in_a_planned_cpu_step_until_its_tensors_are_freed() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    profile = ticking()
    auto = ts.Auto(device_budget=budget, trim_every=1)
    train(model, 1, auto, profile)  # the first step measures: no plan, no thread
    assert _no_trim_thread_within()
    with ts.stash(auto, profile=profile) as session:
        loss = model(data())
    assert session.plan is not None and session.plan.choices
    assert _trim_threads()  # alive while the graph holds saved tensors
    grown = torch.ones(4 << 20)  # 16 MiB touched: the resident set grows, the thread trims
    deadline = time.monotonic() + 5
    while session.stats.returns == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert session.stats.returns >= 1  # each hand-back is counted
    del grown
    loss.backward()
    assert _no_trim_thread_within()
    with ts.stash(auto, profile=profile):  # a graph dropped without backward
        loss = model(data())
    del loss
    gc.collect()
    assert _no_trim_thread_within()
    with pytest.raises(RuntimeError, match="boom"), ts.stash(auto, profile=profile):
        model(data())
        raise RuntimeError("boom")
    gc.collect()
    assert _no_trim_thread_within()
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.skipif(_pool.compiled is None, reason="the session pool is not built")
def test_auto_holds_the_session_pool_in_a_planned_cpu_step_until_its_tensors_are_freed() -> None:
    plain, model = fresh(), fresh()
    budget = activation_bytes(model, data()) // 2
    profile = ticking()
    auto = ts.Auto(device_budget=budget, trim_every=1 << 20)
    before = _pool.counts()
    train(plain, 4)
    sessions = train(model, 4, auto, profile)  # the first step measures: no plan, no pool
    assert all(s.plan is not None and s.plan.choices for s in sessions[1:])
    assert _pool.counts().misses > before.misses  # type: ignore[union-attr]
    assert sum(s.stats.returns for s in sessions) == 0  # the pool returned it: no trims
    assert_same_weights(plain, model)
    assert _no_trim_thread_within() and not _pool.installed()
    with ts.stash(auto, profile=profile) as session:
        loss = model(data())
    assert session.plan is not None and session.plan.choices
    assert _pool.installed()  # while the graph holds saved tensors
    loss.backward()
    assert session.stats.quiet == 1  # plain autograd: the pool goes as its backward ends
    assert not _pool.installed()
    assert _no_trim_thread_within()
    with ts.stash(auto, profile=profile):  # a graph dropped without backward
        loss = model(data())
    del loss
    gc.collect()
    assert _no_trim_thread_within() and not _pool.installed()
    with pytest.raises(RuntimeError, match="boom"), ts.stash(auto, profile=profile):
        model(data())
        raise RuntimeError("boom")
    gc.collect()
    assert _no_trim_thread_within() and not _pool.installed()


@pytest.mark.filterwarnings("ignore:tensorstash.Auto. device_budget")
def test_auto_does_not_trim_when_told_not_to_or_when_nothing_moves() -> None:
    model = fresh()
    profile = ticking()
    big = activation_bytes(model, data()) * 4
    autos = (ts.Auto(device_budget=big, trim_every=1), ts.Auto(device_budget=1, trim_every=None))
    for auto in autos:
        sessions = train(model, 2, auto, profile)
        assert sessions[-1].plan is not None
        assert not _trim_threads()
    with pytest.raises(ValueError, match="trim_every must be a positive size"):
        ts.Auto(trim_every=0)


# -- quiet steps (NOTE [ Quiet steps ] in auto.py) --------------------------------------------


def _hooks_seen_by(module: nn.Module) -> list[Any]:
    """The saved-tensor hooks pushed while ``module`` runs, one entry per call."""
    seen: list[Any] = []
    module.register_forward_pre_hook(lambda m, a: seen.append(top_saved_tensors_hooks()))
    return seen


def test_auto_runs_a_step_that_keeps_everything_without_hooks_bitwise() -> None:
    plain, stashed = fresh(), fresh()
    train(plain, 6)
    seen = _hooks_seen_by(stashed.blocks[0])
    sessions = train(stashed, 6, ts.Auto(), ticking())
    quiet = [s.stats.quiet for s in sessions]
    assert quiet == [0, 0, 0, 1, 1, 1]  # three steps measure (Profile.measure_steps)
    assert all(hooks is not None for hooks in seen[:3])
    assert all(hooks is None for hooks in seen[3:])  # plain autograd
    for session in sessions[3:]:
        assert session.plan is not None and session.plan.quiet
        assert all(tier["tensors"] == 0 for tier in session.stats.to_dict()["tiers"].values())
        assert "quiet 1 time(s)" in session.stats.table()
    assert_same_weights(plain, stashed)
    assert top_saved_tensors_hooks() is None and not _trim_threads()


def test_auto_runs_a_model_that_saves_only_small_tensors_without_hooks_bitwise() -> None:
    # Every tensor this model saves is under min_bytes: its steps have no site to
    # plan, and still count, so they go quiet as a plan that keeps everything does.
    plain, stashed = fresh(), fresh()
    train(plain, 6)
    seen = _hooks_seen_by(stashed.blocks[0])
    profile = ticking()
    sessions = train(stashed, 6, ts.Auto(), profile, min_bytes=1 << 30)
    assert profile.steps == 6 and profile.last == {}
    assert [s.stats.quiet for s in sessions] == [0, 0, 0, 1, 1, 1]
    assert all(hooks is None for hooks in seen[3:])
    assert all(s.plan is not None and s.plan.quiet for s in sessions[3:])
    assert_same_weights(plain, stashed)
    assert top_saved_tensors_hooks() is None


def test_auto_step_that_saves_nothing_eligible_keeps_the_plan_of_the_steps_around_it() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    profile, auto = ticking(), ts.Auto(device_budget=budget)
    held, sites = [], [dict(profile.last)]
    for rows in (512, 512, 512, 4, 512, 512):  # a 4-row batch saves nothing eligible
        with ts.stash(auto, profile=profile) as session:
            loss = model(data(rows))
        loss.backward()
        if rows == 4:
            assert profile.last == sites[-1]  # what the plan knows stays
        sites.append(dict(profile.last))
        held.append(session.stats.to_dict()["tiers"]["kept"]["peak_bytes"])
    assert profile.steps == 6
    assert all(nbytes <= budget for nbytes in held[1:])


def test_auto_quiet_step_recomputes_what_its_plan_says_bitwise() -> None:
    plain, stashed = fresh(), fresh()
    train(plain, 6)
    budget = activation_bytes(fresh(), data()) // 2
    calls: list[int] = []  # fc1 runs again inside the block when backward recomputes it
    stashed.blocks[0].fc1.register_forward_hook(lambda m, i, o: calls.append(1))
    sessions = train(stashed, 6, ts.Auto(device_budget=budget), ticking())
    last = sessions[-1]
    assert last.stats.quiet == 1 and last.plan is not None
    assert "blocks.0" in last.plan.recompute and not last.plan.tiers
    assert len(calls) == 6 + 5  # once a step, and again in each planned step's backward
    assert_same_weights(plain, stashed)
    assert _no_trim_thread_within()  # the quiet step's trim ends with its backward


def test_auto_quiet_step_needs_the_inputs_its_sites_were_recorded_with() -> None:
    model, profile = fresh(), ticking()
    auto = ts.Auto()
    rows = [512, 512, 512, 512, 256, 256, 256, 256]
    quiet = []
    for count in rows:
        with ts.stash(auto, profile=profile) as session:
            loss = model(data(count))
        loss.backward()
        quiet.append(session.stats.quiet)
    # Another batch shape runs with hooks and records its bytes, the two steps after it
    # time the modules again (NOTE [ Profile ] rule 6), then the steps go quiet again.
    assert quiet == [0, 0, 0, 1, 0, 0, 0, 1]
    assert profile.inputs == (((256, 256), "float32"),)


def test_auto_step_is_not_quiet_with_another_hook_pair_or_a_decision_log() -> None:
    model, profile = fresh(), ticking()
    train(model, 3, ts.Auto(), profile)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        outer = train(model, 1, ts.Auto(), profile)[0]
    logged = train(model, 1, ts.Auto(), profile, record=True)[0]
    assert outer.stats.quiet == 0 and logged.stats.quiet == 0
    assert logged.decisions  # every tensor went through the hooks
    assert train(model, 1, ts.Auto(), profile)[0].stats.quiet == 1


def test_auto_quiet_step_lets_pause_and_inner_sessions_work() -> None:
    model, profile = fresh(), ticking()
    train(model, 3, ts.Auto(), profile)
    x = data()
    with ts.stash(ts.Auto(), profile=profile) as session:
        loss = model(x)
        with ts.pause():
            grad = torch.func.grad(lambda w: (w * x).sum())(torch.ones(256))
        with ts.stash("lz4", min_bytes=0) as inner:
            extra = (x.requires_grad_() * 2).sigmoid().sum()
    (loss + extra).backward()
    assert session.stats.quiet == 1 and torch.equal(grad, x.sum(0))
    assert inner.stats.to_dict()["tiers"]["host"]["tensors"] >= 1
    assert top_saved_tensors_hooks() is None


def _module_hooks() -> int:
    """How many global module hooks are registered now (tensorstash's or anyone's)."""
    tables = (module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks)
    return sum(len(table) for table in tables)


def test_auto_session_after_a_quiet_step_opens_with_nothing_pushed_bitwise() -> None:
    plain, stashed = fresh(), fresh()
    train(plain, 8)
    profile, auto = ticking(), ts.Auto()
    at_open: list[tuple[Any, int]] = []

    def chosen(index: int) -> ts.Auto:
        at_open.append((top_saved_tensors_hooks(), _module_hooks()))  # before the session opens
        return auto

    inside = _hooks_seen_by(stashed.blocks[0])
    optimizer = torch.optim.SGD(stashed.parameters(), lr=0.1)
    sessions, opened = [], []
    for index in range(8):
        torch.manual_seed(100 + index)
        optimizer.zero_grad(set_to_none=True)
        with ts.stash(chosen(index), profile=profile) as session:
            opened.append((top_saved_tensors_hooks(), _module_hooks()))
            loss = stashed(data())
        loss.backward()
        optimizer.step()
        sessions.append(session)
    assert [s.stats.quiet for s in sessions] == [0, 0, 0, 1, 1, 1, 1, 1]
    # After the first quiet step a session pushes no hook pair, and follows no module
    # but the next call: one global pre-hook, gone once the model is called.
    assert all(hooks is not None for hooks, _ in opened[:4])
    assert all(hooks is None and count == 1 for hooks, count in opened[4:])
    assert all(hooks is None for hooks in inside[3:])
    assert _module_hooks() == 0 and top_saved_tensors_hooks() is None
    assert all(s.plan is not None and s.plan.quiet for s in sessions[3:])
    # The quiet steps are timed as before: the last one's time is taken at the next open.
    assert len(profile.quiet_history) == 4
    assert_same_weights(plain, stashed)


def _same_grads(plain: nn.Module, model: nn.Module) -> None:
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


def test_auto_session_that_opened_quiet_follows_a_first_call_that_is_not_the_model() -> None:
    model, profile, auto = fresh(), ticking(), ts.Auto()
    train(model, 4, auto, profile)
    plain, x = copy.deepcopy(model), data()
    torch.manual_seed(7)
    plain.head(plain.blocks[0](x)).square().mean().backward()
    inside = _hooks_seen_by(model.blocks[0].fc1)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with ts.stash(auto, profile=profile) as session:
        loss = model.head(model.blocks[0](x)).square().mean()
    loss.backward()
    assert session.stats.quiet == 0 and inside[-1] is not None  # hooked from the block's call
    assert session.stats.to_dict()["tiers"]["kept"]["tensors"] > 0
    _same_grads(plain, model)
    assert _module_hooks() == 0 and top_saved_tensors_hooks() is None


def test_auto_session_that_opened_quiet_pushes_its_hooks_below_inner_ones() -> None:
    model, profile, auto = fresh(), ticking(), ts.Auto()
    train(model, 4, auto, profile)
    x = data()
    for region in ("inner", "pause"):
        with ts.stash(auto, profile=profile) as session:
            if region == "inner":
                with ts.stash("lz4", min_bytes=0) as inner:
                    extra = (x.clone().requires_grad_() * 2).sigmoid().sum()
            else:
                with ts.pause():
                    grad = torch.func.grad(lambda w: (w * x).sum())(torch.ones(256))
                extra = torch.zeros(())
            loss = model(x)  # the session, hooked now, still goes quiet at the model's call
        (loss + extra).backward()
        assert session.stats.quiet == 1
        assert top_saved_tensors_hooks() is None and _module_hooks() == 0
    assert inner.stats.to_dict()["tiers"]["host"]["tensors"] >= 1
    assert torch.equal(grad, x.sum(0))


def _assert_next_session_opens_hooked_and_goes_quiet(
    model: nn.Module, profile: ts.Profile, auto: ts.Auto
) -> None:
    with ts.stash(auto, profile=profile) as after:
        assert top_saved_tensors_hooks() is not None  # it opened with its hooks
        loss = model(data())
    loss.backward()
    assert after.stats.quiet == 1
    assert top_saved_tensors_hooks() is None and _module_hooks() == 0


def test_auto_session_that_opened_quiet_leaves_other_hooks_alone_and_opens_hooked_next() -> None:
    model, profile, auto = fresh(), ticking(), ts.Auto()
    train(model, 4, auto, profile)
    plain, x = copy.deepcopy(model), data()
    torch.manual_seed(7)
    plain(x).backward()
    model.zero_grad(set_to_none=True)
    packed: list[int] = []
    torch.manual_seed(7)
    # Pushed inside a session that opened quiet: the model's call can neither hand the
    # step to plain autograd nor push the session's hooks above these.
    others = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)
    with ts.stash(auto, profile=profile) as session, others:
        loss = model(x)
    loss.backward()
    assert session.stats.quiet == 0 and packed
    _same_grads(plain, model)
    _assert_next_session_opens_hooked_and_goes_quiet(model, profile, auto)


def test_auto_session_that_opened_quiet_and_called_no_module_opens_hooked_next() -> None:
    model, profile, auto = fresh(), ticking(), ts.Auto()
    train(model, 4, auto, profile)
    x = data().requires_grad_()
    with ts.stash(auto, profile=profile) as session:
        y = (x * 2).sigmoid().sum()  # no module: the session stays as it opened
    y.backward()
    assert session.stats.quiet == 0 and _module_hooks() == 0
    _assert_next_session_opens_hooked_and_goes_quiet(model, profile, auto)


def test_auto_evaluation_under_no_grad_leaves_the_next_session_opening_quiet() -> None:
    model, profile, auto = fresh(), ticking(), ts.Auto()
    train(model, 4, auto, profile)
    with torch.no_grad(), ts.stash(auto, profile=profile):
        model(data())
    with ts.stash(auto, profile=profile) as session:
        assert top_saved_tensors_hooks() is None and _module_hooks() == 1  # opened quiet
        loss = model(data())
    loss.backward()
    assert session.stats.quiet == 1 and _module_hooks() == 0


def test_plan_prices_the_hooks_from_quiet_steps() -> None:
    profile = two_blocks()
    profile.quiet_history.append(StepRecord(0.3, 0.6, 0, None))  # 0.9 s without hooks
    plan = make_plan(profile, 64 * MiB)
    assert plan is not None and plan.quiet
    assert plan.hooks_s == pytest.approx(0.1)
    assert plan.base_step_s == pytest.approx(0.9) and plan.predicted_step_s == pytest.approx(0.9)


def test_plan_recomputes_instead_of_copying_where_the_hooks_cost_more() -> None:
    profile = two_blocks(cheap_s=0.002, dear_s=0.008)
    profile.quiet_history.append(StepRecord(0.3, 0.6, 0, None))  # the hooks cost 0.1 s
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=Rates(link=1e12))
    assert plan is not None and plan.quiet and plan.recompute == ("a",)
    # Hooks that cost next to nothing: the copies the link hides are cheaper.
    profile.quiet_history.clear()
    profile.quiet_history.append(StepRecord(1 / 3, 2 / 3 - 1e-6, 0, None))
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=Rates(link=1e12))
    assert plan is not None and not plan.quiet and plan.tiers and not plan.recompute


def copied_only(seconds: float = 1.0) -> ts.Profile:
    """Two blocks on CUDA whose every measured step copied 8 MiB to host (the first step
    moves what does not fit): no step says what a step that moves nothing takes."""
    profile = two_blocks(cheap_s=0.002, dear_s=0.008)
    profile.history.clear()
    for _ in range(2):
        moved = StepRecord(seconds / 3, 2 * seconds / 3, 8 * MiB, None, (), 0.05, {"host": 8 * MiB})
        profile.history.append(moved)
    return profile


def test_plan_on_cuda_runs_the_recompute_only_plan_before_it_trusts_copies() -> None:
    # Rule 9: the base would be 1 s less 0.05 s of policies, and copies the link
    # hides would look free; the plan that only recomputes fits, and measures the base.
    link = Rates(link=1e12)
    plan = make_plan(copied_only(), 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.quiet and plan.recompute == ("a",)


def test_plan_on_cuda_prices_copies_at_what_they_cost_the_steps() -> None:
    link = Rates(link=1e12)
    # A step that recomputed "a" took 0.302 s: the base is 0.3 s, and copying
    # 8 MiB cost 0.7 s. Recomputing (2 ms) is cheaper.
    dear = copied_only(1.0)
    dear.history.append(StepRecord(0.1, 0.202, 9 * MiB, None, ("a",), recompute_s=0.002))
    plan = make_plan(dear, 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers
    # Copies that took nothing over the base (their kernels hid them): copies win.
    cheap = copied_only(0.3)
    cheap.history.append(StepRecord(0.1, 0.202, 9 * MiB, None, ("a",), recompute_s=0.002))
    cheap.quiet_history.append(StepRecord(0.1, 0.2, 0, None))  # hooks: next to nothing
    plan = make_plan(cheap, 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.tiers and not plan.recompute
    assert all(c.cost_s == pytest.approx(0.0, abs=1e-9) for c in plan.choices)


def test_plan_on_cuda_prices_no_copy_at_the_step_that_first_copied() -> None:
    # The first step to copy so many bytes allocates the pinned buffers (on the bench's
    # large model on an H200, 3.6 s against a 0.5 s step). Priced at it, copies never won
    # again and the plan recomputed every block; until another step copied, the copies
    # the link hides are free.
    link = Rates(link=1e12)
    profile = copied_only(1.0)
    profile.history.pop()
    profile.history[0].first_move = True
    profile.history.append(StepRecord(0.1, 0.202, 9 * MiB, None, ("a",), recompute_s=0.002))
    for record in profile.history:
        record.cold = True  # each took the real peak of its plan: no warm step yet
    profile.quiet_history.append(StepRecord(0.1, 0.2, 0, None))  # hooks: next to nothing
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.tiers and not plan.recompute
    # A later step that copied at that cost, cold or not, prices it: recomputing wins.
    again = StepRecord(1 / 3, 2 / 3, 8 * MiB, None, (), 0.05, {"host": 8 * MiB}, cold=True)
    profile.history.append(again)
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers


def test_plan_on_the_cpu_prices_no_spill_at_the_step_that_first_spilled() -> None:
    # Rule 9 on the CPU: the first step to spill so many bytes made the spill directory,
    # its file and the page cache's pages, and every measured step is cold. Priced at it,
    # the spill lost to recomputing for good, though a step that spills runs as fast as
    # recomputing every block and holds less (the bench's small model at 25%).
    disk = Rates(disk=1e9)
    profile = two_blocks(cheap_s=0.02, dear_s=0.02)
    profile.history[0].cold = True
    profile.history.append(
        StepRecord(0.34, 0.68, 9 * MiB, None, ("a",), recompute_s=0.02, cold=True)
    )
    plan = make_plan(profile, 9 * MiB, rates=disk)
    assert plan is not None and set(plan.tiers.values()) == {"disk"} and not plan.recompute
    first = StepRecord(
        0.5, 1.0, 8 * MiB, None, (), 0.01, {"disk": 8 * MiB}, cold=True, first_move=True
    )
    profile.history.append(first)
    plan = make_plan(profile, 9 * MiB, rates=disk)
    assert plan is not None and set(plan.tiers.values()) == {"disk"} and not plan.recompute
    # A later step that spilled at that cost, cold or not, prices it: recomputing wins.
    again = StepRecord(0.5, 1.0, 8 * MiB, None, (), 0.01, {"disk": 8 * MiB}, cold=True)
    profile.history.append(again)
    plan = make_plan(profile, 9 * MiB, rates=disk)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers


def test_profile_marks_the_steps_that_move_more_than_any_before() -> None:
    model, profile = fresh(), ts.Profile()
    steps = (("keep", 512), ("lz4", 512), ("lz4", 128), ("disk", 128), ("disk", 128))
    for policy, rows in steps:
        model.zero_grad(set_to_none=True)
        with ts.stash(policy, profile=profile):
            loss = model(torch.zeros(rows, 256))  # zeros: lz4 keeps them compressed
        loss.backward()
    assert [r.first_move for r in profile.history] == [False, True, False, True, False]
    assert profile.history[1].moved["host"] > profile.history[2].moved["host"] > 0
    restored = ts.Profile()
    restored.load_state_dict(profile.state_dict())
    assert [r.first_move for r in restored.history] == [False, True, False, True, False]


def test_plan_on_cuda_takes_a_copying_step_as_its_base_and_prices_no_faults() -> None:
    # A budget no plan reaches: every step copies. The policies' 0.05 s overlap the
    # kernels, and the pages faulted in are host memory (new pinned buffers).
    profile = copied_only(1.0)
    for record in profile.history:
        record.faulted_bytes = 4 << 30
    plan = make_plan(profile, MiB // 2, device="cuda", rates=Rates(link=1e12, refault=1e9))
    assert plan is not None and not plan.fits
    assert plan.faults_s == 0 and plan.faulted_bytes == 0
    assert plan.base_step_s == pytest.approx(1.0 - plan.hooks_s)
    assert plan.predicted_step_s == pytest.approx(1.0, rel=0.02)


def test_plan_remembers_what_copies_cost_once_they_left_the_history() -> None:
    link = Rates(link=1e12)
    profile = copied_only(1.0)
    # Five steps of the recompute-only plan push the copying steps out of the history.
    for _ in range(5):
        record = StepRecord(0.1, 0.202, 9 * MiB, None, ("a",), recompute_s=0.002)
        profile.history.append(record)
    assert all(not s.moved for s in profile.history)
    profile.aside[frozenset({"host"})] = deque(copied_only(1.0).history)
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers
    # Without them the copies would look free again, and the plan would flip back.
    profile.aside.clear()
    plan = make_plan(profile, 9 * MiB, device="cuda", rates=link)
    assert plan is not None and plan.tiers


def test_profile_keeps_the_steps_that_leave_its_history_by_what_they_moved() -> None:
    model, profile = Net(), ts.Profile()
    x = torch.randn(1024, 256)
    for policy in ["lz4"] * 4 + ["keep"] * 6:
        with ts.stash(policy, profile=profile):
            loss = model(x)
        loss.backward()
    assert all(not s.moved for s in profile.history)
    moved = profile.aside[frozenset({"host"})]
    assert len(moved) == 4 and all(s.moved for s in moved)
    assert profile.calibration_steps() == [*moved, *profile.history]
    restored = ts.Profile()
    restored.load_state_dict(profile.state_dict())
    assert restored.calibration_steps() == profile.calibration_steps()


# -- the pages a step faults in (NOTE [ Plan ] rule 8) ---------------------------------------


def test_plan_prices_the_pages_its_steps_fault_in() -> None:
    profile = two_blocks(cheap_s=0.002, dear_s=0.008)
    rates = Rates(refault=8 * MiB / 0.01)  # 10 ms per 8 MiB faulted in
    # Before a step ran the plan, the steps that hand memory back fault in at least a
    # step's activation bytes; the measured step faulted in nothing.
    plan = make_plan(profile, 9 * MiB, rates=rates, trims=True)
    assert plan is not None and plan.recompute == ("a",)
    assert plan.faulted_bytes == 16 * MiB and plan.faults_s == pytest.approx(0.02)
    assert plan.predicted_step_s == pytest.approx(plan.base_step_s + 0.002 + 0.02)
    assert "faults in 16.0 MiB, 20.0 ms" in plan.table()
    # Warm steps that recomputed "a" faulted in 8 MiB (median), each 10 ms more for it:
    # their time less those 10 ms, and the recompute, is the base.
    for faulted in (4 * MiB, 8 * MiB, 12 * MiB):
        seconds = 1.0 + 0.002 + faulted / rates.refault
        profile.quiet_history.append(
            StepRecord(seconds / 3, 2 * seconds / 3, 0, None, ("a",), faulted_bytes=faulted)
        )
    plan = make_plan(profile, 9 * MiB, rates=rates, trims=True)
    assert plan is not None and plan.quiet and plan.recompute == ("a",)
    assert plan.faulted_bytes == 8 * MiB and plan.faults_s == pytest.approx(0.01)
    assert plan.hooks_s == pytest.approx(0.0, abs=1e-9)  # the quiet steps cost 1 s too
    assert plan.predicted_step_s == pytest.approx(1.0 + 0.002 + 0.01)
    # A plan that keeps everything faults in what the steps that kept everything did.
    kept = make_plan(profile, 64 * MiB, rates=rates, trims=True)
    assert kept is not None and kept.faulted_bytes == 0 and kept.faults_s == 0.0


def test_plan_tries_the_plan_that_only_recomputes_before_one_that_moves() -> None:
    profile = two_blocks(cheap_s=0.05, dear_s=0.4)
    # A warm step spilled 8 MiB for next to nothing: spilling looks cheaper than
    # recomputing "a", whose steps (their faults, the hooks they spare) nothing measured.
    profile.history.append(StepRecord(1 / 3, 2 / 3, 8 * MiB, None, (), 0.0, {"disk": 8 * MiB}))
    moving = make_plan(profile, 9 * MiB, trims=True, recompute=False)
    alone = make_plan(profile, 9 * MiB, trims=True, always=("a",))
    assert moving is not None and moving.tiers and alone is not None and alone.fits
    assert moving.predicted_step_s < alone.predicted_step_s
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers
    # Once a step recomputed "a" and moved nothing, the two are weighed: the spill wins.
    seconds = 1.0 + 0.05
    profile.quiet_history.append(StepRecord(seconds / 3, 2 * seconds / 3, 0, None, ("a",)))
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None and plan.tiers and not plan.recompute


def test_plan_prices_the_calls_that_hand_memory_back() -> None:
    profile = two_blocks(cheap_s=0.002, dear_s=0.008)
    rates = Rates(refault=1e18)  # faults cost nothing here: only the calls count
    # A step that recomputed "a" spent 30 ms of its 1.032 s handing memory back.
    profile.quiet_history.append(StepRecord(0.3, 0.732, 0, None, ("a",), trim_s=0.03))
    plan = make_plan(profile, 9 * MiB, rates=rates, trims=True)
    assert plan is not None and plan.quiet and plan.recompute == ("a",)
    assert plan.trim_s == pytest.approx(0.03)
    assert plan.predicted_step_s == pytest.approx(1.032)  # its base, recompute and trims
    assert plan.hooks_s == pytest.approx(0.0, abs=1e-9)  # the calls are not the hooks'
    assert "hands memory back, 30.0 ms" in plan.table()
    # Another plan whose steps hand memory back, before one ran: as the steps that did.
    other = make_plan(profile, 9 * MiB, rates=rates, trims=True, always=("b",))
    assert other is not None and other.recompute == ("b",)
    assert other.trim_s == pytest.approx(0.03)
    # A plan that keeps everything hands nothing back.
    kept = make_plan(profile, 64 * MiB, rates=rates, trims=True)
    assert kept is not None and kept.trim_s == 0.0


@pytest.mark.usefixtures("no_pool")
def test_profile_times_what_a_planned_cpu_step_spends_handing_memory_back() -> None:
    model = fresh()
    budget = activation_bytes(model, data()) // 2
    profile = ticking()
    sessions = train(model, 4, ts.Auto(device_budget=budget, trim_every=1), profile)
    trimmed = [s.trim_s for s in [*profile.history, *profile.quiet_history] if s.recomputed]
    calls = sum(session.stats.returns for session in sessions)
    assert calls > 0 and trimmed and all(t >= 0 for t in trimmed) and max(trimmed) > 0
    assert sum(s.stats.returned_seconds for s in sessions) > 0


def test_plan_expects_fewer_faults_from_a_plan_that_holds_less() -> None:
    # A step begun from a heap handed back to the OS faults in what it touches: the
    # measured step held 16 MiB and faulted in 40; a plan holding 9 MiB less touches less.
    profile = two_blocks(cheap_s=0.002, dear_s=0.008)
    first = profile.history[0]
    profile.history[0] = dataclasses.replace(first, faulted_bytes=40 * MiB)
    plan = make_plan(profile, 9 * MiB, rates=Rates(refault=MiB / 0.001))
    assert plan is not None and plan.recompute == ("a",)
    assert plan.faulted_bytes == 40 * MiB - 16 * MiB + 9 * MiB
    assert plan.faults_s == pytest.approx(0.033)
    # The measured step's faults are taken off its time, and a plain step's put back.
    assert plan.predicted_step_s == pytest.approx(1.0 - 0.040 - plan.hooks_s + 0.002 + 0.033)
    assert plan.base_step_s == pytest.approx(1.0 - plan.hooks_s)


def test_profile_records_what_each_step_faulted_in() -> None:
    model = fresh()
    profile = ticking()
    for _ in range(2):  # hooked steps: the first measures
        with ts.stash("auto", profile=profile):
            loss = model(data())
        pages = mmap.mmap(-1, 8 * MiB)  # 8 MiB of fresh pages, touched in the step
        torch.frombuffer(pages, dtype=torch.uint8)[::4096].fill_(1)
        loss.backward()
        pages.close()
        assert profile.history[-1].faulted_bytes >= 8 * MiB
    profile.measure_steps = 0
    train(model, 2, "auto", profile)  # the sites of these inputs are recorded
    with ts.stash("auto", profile=profile) as session:  # a quiet step
        loss = model(data())
    pages = mmap.mmap(-1, 16 * MiB)
    torch.frombuffer(pages, dtype=torch.uint8)[::4096].fill_(1)
    loss.backward()
    pages.close()
    assert session.stats.quiet == 1
    with ts.stash("auto", profile=profile):
        pass  # the next step reads the quiet one's times
    assert profile.quiet_history[-1].faulted_bytes >= 16 * MiB
    state = profile.state_dict()
    assert state["history"][-1]["faulted_bytes"] == profile.history[-1].faulted_bytes
    del state["history"][-1]["faulted_bytes"]  # a state saved before it was recorded
    restored = ts.Profile()
    restored.load_state_dict(state)
    assert restored.history[-1].faulted_bytes == 0
    assert restored.quiet_history[-1].faulted_bytes >= 16 * MiB


def test_disk_probe_spills_as_diskspill_does_and_leaves_nothing(tmp_path: Any) -> None:
    from tensorstash.planning import _rates

    assert _rates._probe_disk(str(tmp_path)) > 0
    assert list(tmp_path.iterdir()) == []  # a file with no name, closed
    assert _rates._probe_disk("/proc") == 0.0  # a parent that takes no file: no rate


@pytest.mark.parametrize("spare", [False, True])
def test_disk_rate_counts_contention_only_where_the_writer_has_a_core(
    monkeypatch: pytest.MonkeyPatch, spare: bool
) -> None:
    # NOTE [ Spill files ] rule 3: with every core torch's, the training thread spills
    # as it packs, as the probe does; a writer thread of its own takes the interpreter.
    from tensorstash.planning import _auto_plan, _rates

    monkeypatch.setattr(_rates, "disk_rate", lambda directory: 1e9)
    monkeypatch.setattr(_rates, "compress_rate", lambda: 6e8)
    cores = torch.get_num_threads() + (1 if spare else 0)
    monkeypatch.setattr(_auto_plan, "usable_cores", lambda: cores)
    auto, model = ts.Auto(recompute=False), fresh()
    rates = _auto_plan.rates(auto, ts.Profile(), 0, "cpu", model)
    assert rates.disk == pytest.approx(1e9 / _auto_plan.CPU_CONTENTION if spare else 1e9)
    assert rates.compress == pytest.approx(6e8 / _auto_plan.CPU_CONTENTION)
    # A directory that stopped taking files: no rate, and no plan divides by it.
    monkeypatch.setattr(_rates, "disk_rate", lambda directory: 0.0)
    rates = _auto_plan.rates(auto, ts.Profile(), 0, "cpu", model)
    assert rates.disk == _auto_plan.NO_DISK
    plan = make_plan(two_blocks(), 9 * MiB, rates=rates)
    assert plan is not None and "disk" not in plan.tiers.values()


def test_rates_are_not_probed_against_a_test_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # A profile's ticks are not the probes' seconds: the defaults stand, the same every run.
    from tensorstash.planning import _auto_plan, _rates

    def probed(*args: Any) -> float:
        raise AssertionError("probed")

    for name in ("disk_rate", "compress_rate", "refault_rate"):
        monkeypatch.setattr(_rates, name, probed)
    rates = _auto_plan.rates(ts.Auto(recompute=False), ticking(), 0, "cpu", fresh())
    assert (rates.disk, rates.compress, rates.refault) == (
        Rates.disk,
        Rates.compress,
        Rates.refault,
    )


def test_refault_probe_measures_a_rate() -> None:
    from tensorstash.planning import _rates

    assert _rates.refault_rate() > 0


def test_plan_predicts_the_real_peak_from_the_median_of_the_steps_that_took_it() -> None:
    """One step's real peak moves by up to a tenth from the next one's (the allocator
    walks other free pages each step): the plan takes the median of what the steps of
    its own kind (what it recomputes, where it moves) held besides their saved bytes,
    and a step of another kind moves nothing."""
    first = two_blocks().history[-1]
    assert first.peak_bytes is not None

    def predicted(*extra: ts.profile.StepRecord) -> int:
        profile = two_blocks()
        for record in extra:
            profile.history.append(record)
            profile.peaks.append(record)
        profile.peak = extra[-1] if extra else profile.peak
        plan = make_plan(profile, 9 * MiB)
        assert plan is not None and plan.recompute == ("a",)
        assert plan.predicted_peak_bytes is not None
        return plan.predicted_peak_bytes

    def kind_a(more: int) -> ts.profile.StepRecord:
        return dataclasses.replace(first, recomputed=("a",), peak_bytes=first.peak_bytes + more)

    low, middle, high = kind_a(-6 * MiB), kind_a(-MiB), kind_a(4 * MiB)
    other = dataclasses.replace(first, peak_bytes=first.peak_bytes * 9)  # keeps all
    # The median of the three of its kind: the middle one, whatever the others held.
    assert predicted(low, high, middle) == predicted(middle, middle, middle)
    assert predicted(other, low, high, middle) == predicted(middle, middle, middle)
    assert predicted(low, middle) < predicted(middle, middle) < predicted(middle, high)


def test_plan_hands_memory_back_only_where_it_frees_enough() -> None:
    """``trim_every="auto"``: a plan holding more than RETURNS_BELOW of the activation bytes
    hands nothing back (the pages faulted in again cost more than it frees); one holding
    less does, and is priced for it; ``trims=True`` (a size the user gave) always does."""
    from tensorstash.planning.plan import RETURNS_BELOW

    profile = two_blocks(cheap_s=0.002, dear_s=0.008)  # 16 MiB of activations
    rates = Rates(refault=8 * MiB / 0.01)
    low = make_plan(profile, 9 * MiB, rates=rates, trims="auto")
    assert low is not None and low.recompute == ("a",) and low.choices
    assert low.held_bytes <= RETURNS_BELOW * low.activation_bytes and low.returns_memory
    assert low.faulted_bytes == 16 * MiB  # at least a step's activation bytes, handed back
    # A small block first: recomputing it saves a little, and the plan holds most bytes.
    profile = profile_of(
        {"a": (0.001, 0), "b": (0.008, MiB)}, {"a": [2 * MiB], "b": [7 * MiB, 7 * MiB]}
    )
    high = make_plan(profile, 15 * MiB, rates=rates, trims="auto")
    assert high is not None and high.recompute == ("a",)
    assert high.held_bytes > RETURNS_BELOW * high.activation_bytes and not high.returns_memory
    assert high.faulted_bytes < 16 * MiB  # what the measured step touched, less what it saves
    always = make_plan(profile, 15 * MiB, rates=rates, trims=True)
    assert always is not None and always.returns_memory
    assert always.predicted_step_s > high.predicted_step_s
    kept = make_plan(profile, 64 * MiB, rates=rates, trims=True)
    assert kept is not None and not kept.choices and not kept.returns_memory


@pytest.mark.parametrize("pool", ["leased", "not built", "refused"])
def test_auto_watches_a_planned_cpu_step_where_its_plan_hands_memory_back(
    monkeypatch: pytest.MonkeyPatch, pool: str
) -> None:
    """With the session pool every plan that saves bytes hands them back; trimming (where
    the pool is not built, or another allocator holds the CPU), only a plan that holds
    at most ``RETURNS_BELOW`` of the activation bytes, every three quarters of them."""
    import tensorstash.planning._auto_step as auto_step

    pooled = pool == "leased"
    if pool == "not built":
        monkeypatch.setattr(_pool, "compiled", None)
    elif _pool.compiled is None:
        pytest.skip("the session pool is not built")
    if pool == "refused":
        monkeypatch.setattr(_pool, "lease", lambda cap: None)

    made: list[int] = []
    watch = auto_step.Watch
    monkeypatch.setattr(
        auto_step, "Watch", lambda every, *a, **k: made.append(every) or watch(every, *a, **k)
    )
    model = fresh()
    activation = activation_bytes(model, data())
    for share, watched in ((0.4, True), (0.9, pooled)):
        made.clear()
        sessions = train(model, 3, ts.Auto(device_budget=int(activation * share)), ticking())
        plan = sessions[-1].plan
        assert plan is not None and plan.choices
        assert plan.returns_memory is (watched or pool == "refused")
        assert bool(made) is watched, (share, made)
        if watched and not pooled:
            assert made[-1] == max(TRIM_LEAST, activation * 3 // 4)


def test_autos_that_trim_differently_share_a_profile_without_sharing_a_plan() -> None:
    """The plan cached in a profile is made for an ``Auto``'s options, ``trim_every``
    among them: one that hands no memory back never runs the plan of one that does."""
    model = fresh()
    budget = int(activation_bytes(model, data()) * 0.4)
    profile = ticking()
    sessions = train(model, 5, ts.Auto(device_budget=budget), profile)
    assert sessions[-1].plan is not None and sessions[-1].plan.returns_memory
    (session,) = train(model, 1, ts.Auto(device_budget=budget, trim_every=None), profile)
    assert session.plan is not None and not session.plan.returns_memory


@pytest.mark.parametrize("spilled_peak_mib", [30, 50, None], ids=["less", "more", "untried"])
def test_plan_spills_every_site_where_that_is_as_fast_and_its_steps_held_less(
    spilled_peak_mib: int | None,
) -> None:
    # Rule 11 (the bench's small model at 25%): recomputing and spilling tie within the
    # steps' noise, and rule 7 takes the plan that only recomputes; the steps that
    # spilled held less at the real peak, so spilling every site is the better plan.
    # Where no step took the real peak under it, it runs, so that one does.
    profile = two_blocks(cheap_s=0.05, dear_s=0.4)
    peak = None if spilled_peak_mib is None else spilled_peak_mib * MiB
    spilled = StepRecord(1 / 3, 2 / 3, 8 * MiB, peak, (), 0.0, {"disk": 8 * MiB})
    profile.history.append(spilled)
    if peak is not None:
        profile.peaks.append(spilled)
    recomputed = StepRecord(1.05 / 3, 2.1 / 3, 9 * MiB, 40 * MiB, ("a",), recompute_s=0.05)
    profile.history.append(recomputed)
    profile.peaks.append(recomputed)
    profile.peak = recomputed
    for seconds in (1.05, 1.15, 0.95):  # quiet steps that recomputed "a", and their noise
        profile.quiet_history.append(StepRecord(seconds / 3, 2 * seconds / 3, 0, None, ("a",)))
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None
    if spilled_peak_mib is None or spilled_peak_mib < 40:
        assert not plan.recompute and len(plan.tiers) == len(profile.last)  # every site
        assert set(plan.tiers.values()) == {"disk"} and plan.held_bytes == 0
    else:  # the spills held more: the plan that only recomputes stays
        assert plan.recompute == ("a",) and not plan.tiers
    if spilled_peak_mib is None:  # a profile that takes no real peak never tries it
        unmeasured = copy.copy(profile)  # what it measured, with no real peak taken
        unmeasured.measure_memory = False
        plan = make_plan(unmeasured, 9 * MiB, trims=True)
        assert plan is not None and plan.recompute == ("a",) and not plan.tiers


def test_plan_takes_the_plan_that_only_recomputes_within_the_noise_of_quiet_steps() -> None:
    profile = two_blocks(cheap_s=0.05, dear_s=0.4)
    profile.history.append(StepRecord(1 / 3, 2 / 3, 8 * MiB, None, (), 0.0, {"disk": 8 * MiB}))
    # A step that spilled every site took its real peak (rule 11 has run the plan that
    # moves every site once): the rules below decide.
    profile.peaks.append(StepRecord(1 / 3, 2 / 3, 8 * MiB, 40 * MiB, (), 0.0, {"disk": 16 * MiB}))
    steady = 1.0 + 0.05
    for _ in range(3):  # three quiet steps that recomputed "a", all alike: no noise
        profile.quiet_history.append(StepRecord(steady / 3, 2 * steady / 3, 0, None, ("a",)))
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None and plan.tiers and not plan.recompute  # the spill is cheaper
    moving_s, alone = plan.predicted_step_s, make_plan(profile, 9 * MiB, trims=True, always=("a",))
    assert alone is not None and alone.predicted_step_s > moving_s
    gap = alone.predicted_step_s - moving_s
    # Quiet steps that stray by more than that gap: the quiet plan is taken.
    profile.quiet_history.clear()
    for seconds in (steady, steady + 3 * gap, steady - 3 * gap):
        profile.quiet_history.append(StepRecord(seconds / 3, 2 * seconds / 3, 0, None, ("a",)))
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers
    # A plan that moves runs no quiet step: the hooked steps' noise counts as well.
    profile.quiet_history.clear()
    profile.quiet_history.append(StepRecord(steady / 3, 2 * steady / 3, 0, None, ("a",)))
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None and plan.tiers  # one quiet step, steady hooked ones: the spill
    spilled = {"disk": 8 * MiB}
    for seconds in (1.0 + 3 * gap, 1.0 - 3 * gap, 1.0 + 6 * gap, 1.0 - 6 * gap):
        profile.history.append(
            StepRecord(seconds / 3, 2 * seconds / 3, 8 * MiB, None, (), 0.0, spilled)
        )
    plan = make_plan(profile, 9 * MiB, trims=True)
    assert plan is not None and plan.recompute == ("a",) and not plan.tiers
