"""Profile: what a session measures per step (NOTE [ Profile ]), and its checkpoints."""

from __future__ import annotations

import io
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from checks import Ticks
from torch import nn
from zoo import Block

import tensorstash as ts
from tensorstash.planning.profile import HISTORY, PEAK_SAMPLES, QUIET_TIMED_EVERY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MiB = 1 << 20


class Net(nn.Module):
    def __init__(self, depth: int = 3, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).square().mean()


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def step(
    model: nn.Module, x: torch.Tensor, profile: ts.Profile, policy: Any = "keep"
) -> ts.Session:
    model.zero_grad(set_to_none=True)
    with ts.stash(policy, profile=profile) as session:
        loss = model(x.detach().requires_grad_())
    loss.backward()
    return session


def batch(rows: int = 128) -> torch.Tensor:
    return torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))


def test_profile_counts_a_step_once_its_backward_ends() -> None:
    model, profile = net(), ts.Profile()
    with ts.stash("keep", profile=profile):
        loss = model(batch())
    assert profile.steps == 0 and profile.current  # forward done, backward not yet
    loss.backward()
    assert profile.steps == 1 and not profile.current
    record = profile.history[-1]
    assert record.forward_s > 0 and record.backward_s > 0
    assert record.held_bytes > 0 and record.moved == {}


def test_profile_counts_a_step_whose_backward_runs_inside_the_session() -> None:
    model, profile = net(), ts.Profile()
    with ts.stash("keep", profile=profile) as session:
        model(batch()).backward()
        assert profile.steps == 1  # counted when backward ended, inside the session
    record = profile.history[-1]
    held = record.held_bytes  # what forward left held when backward began, not after it
    assert held > 0 and session.stats.to_dict()["tiers"]["kept"]["peak_bytes"] >= held


@pytest.mark.parametrize("policy", ["keep", "auto"])
def test_profile_step_whose_backward_runs_on_another_thread_stops_observing_modules(
    policy: str,
) -> None:
    """On CUDA the first unpack, where a step stops observing modules, runs on the
    autograd engine's device thread: the step must leave the training thread's observers."""
    from tensorstash.session import _modules

    model, profile = net(), ts.Profile()
    for _ in range(3):
        with ts.stash(ts.Auto() if policy == "auto" else policy, profile=profile):
            loss = model(batch())
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
            assert _modules._thread().observers == []
    assert profile.steps == 3


def test_profile_sites_are_module_op_and_occurrence() -> None:
    model, profile = net(), ts.Profile()
    step(model, batch(), profile)
    first = dict(profile.last)
    step(model, batch(), profile)
    assert list(profile.last) == list(first)
    assert all(len(site) == 3 for site in first)
    assert {site[0] for site in first} >= {"blocks.0.fc1", "blocks.2.fc2"}


def test_profile_sites_carry_across_batch_sizes_with_their_bytes() -> None:
    model, profile = net(), ts.Profile(measure_steps=1)
    step(model, batch(128), profile)
    big = dict(profile.last)
    step(model, batch(64), profile)
    assert set(profile.last) == set(big)
    assert all(profile.last[site].nbytes * 2 == big[site].nbytes for site in big)
    assert profile._measures()  # another shape: the modules are timed again


def test_profile_times_modules_and_their_inputs() -> None:
    model, profile = net(), ts.Profile()
    step(model, batch(), profile)
    block = profile.modules["blocks.1"]
    inner = profile.modules["blocks.1.fc1"]
    assert block.calls == 1 and block.kind == "Block"
    assert block.forward_s >= inner.forward_s > 0
    assert block.input_bytes == 128 * 256 * 4  # the block's input, what recompute keeps
    assert profile.modules["blocks.1.fc2"].input_bytes == 128 * 1024 * 4
    assert all(record.unsafe is None for record in profile.modules.values())


class Normed(nn.Module):
    """BatchNorm in training updates its running statistics in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(256, 256), nn.BatchNorm1d(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).relu()


class InPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2).sin()


def test_profile_marks_modules_that_change_state_in_forward_unsafe() -> None:
    model = nn.Sequential(nn.Linear(256, 256), Normed(), nn.Linear(256, 256), InPlace())
    profile = ts.Profile()
    with ts.stash("keep", profile=profile):
        loss = model(batch()).sum()
    loss.backward()
    assert "BatchNorm" in str(profile.modules["1.bn"].unsafe)
    assert profile.modules["3"].unsafe == "changes its input in place"
    assert profile.modules["0"].unsafe is None and profile.modules["2"].unsafe is None


def test_profile_times_the_recompute_of_modules_the_user_wraps() -> None:
    model, ticks = net(), Ticks()
    profile = ts.Profile(clock=ticks)
    step(model, batch(), profile)
    assert profile.history[-1].checkpointed_s is None  # nothing of the user's recomputed
    ts.recompute_modules(model, ["blocks.0", "blocks.2"])
    forward = model.blocks[0].forward
    model.blocks[0](batch().requires_grad_()).sum().backward()  # no profile's step: not counted
    for _ in range(2):
        before = ticks.now
        step(model, batch(), profile)
        taken = profile.history[-1].checkpointed_s
        # Timed with the profile's clock, in backward only: a part of the step's ticks.
        assert taken is not None and 0 < taken < ticks.now - before
    fresh = ts.Profile()
    fresh.load_state_dict(profile.state_dict())
    assert fresh.history[-1].checkpointed_s == taken
    plan = ts.plan.make_plan(profile, 1 << 40, rates=ts.plan.Rates(refault=0))  # ticks only
    assert plan is not None and plan.checkpointed_s > 0  # in the prediction, not the base
    assert plan.predicted_step_s == pytest.approx(plan.base_step_s + plan.checkpointed_s)
    assert model.blocks[0].forward is forward
    ts.unrecompute(model)


def test_profile_marks_modules_already_checkpointed_unsafe() -> None:
    model = net()
    ts.recompute(model.blocks[0])
    model.blocks[2].gradient_checkpointing = True  # as Hugging Face marks its layers

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.utils.checkpoint.checkpoint(self.net.blocks[1], x, use_reentrant=False)
            return self.net.head(self.net.blocks[2](self.net.blocks[0](h))).square().mean()

    profile = ts.Profile()
    step(Outer(), batch(), profile)
    modules = profile.modules
    assert "already recomputed" in str(modules["net.blocks.0"].unsafe)
    assert "already recomputed" in str(modules["net.blocks.2"].unsafe)
    assert "already checkpointed" in str(modules["net.blocks.1"].unsafe)


def test_no_grad_and_evaluation_forwards_are_not_steps() -> None:
    model, profile = net(), ts.Profile()
    step(model, batch(), profile)
    state = profile.state_dict()
    with torch.no_grad(), ts.stash("keep", profile=profile):
        model(batch())
    model.eval()
    with ts.stash("keep", profile=profile):
        model(batch()).backward()
    model.train()
    assert profile.steps == 1
    assert profile.state_dict() == state


def test_profile_measures_the_real_peak_of_a_step_on_a_warm_heap() -> None:
    model, profile = net(), ts.Profile(measure_steps=1, remeasure_every=0)
    for _ in range(2):  # a warm heap: the next step could reuse these pages
        model(batch(512)).sum().backward()
    for _ in range(PEAK_SAMPLES):  # the first steps of a plan take its real peak
        step(model, batch(512), profile)
        peak = profile.history[-1].peak_bytes
        assert peak is not None and peak > MiB  # the step's activations, at least
    step(model, batch(512), profile)
    assert profile.history[-1].peak_bytes is None  # no module timings, no memory taken


def test_profile_takes_the_peak_in_the_first_step_of_a_run_and_times_the_warm_ones() -> None:
    model, profile = net(), ts.Profile(measure_steps=3, remeasure_every=5)
    colds = []
    for _ in range(7):
        step(model, batch(), profile)
        last = profile.history[-1]
        colds.append(last.cold)
        assert (last.peak_bytes is not None) == last.cold
    # Steps 0-2 time modules, 3-4 do not, 5-6 do again: the first of each run is cold,
    # and so are the second and third steps, the plan's other samples of the real peak.
    assert PEAK_SAMPLES == 3
    assert colds == [True, True, True, False, False, True, False]
    assert profile.peak is profile.history[-2]  # the last step that took the peak
    assert len(profile.module_history) == 5
    assert [cold for cold, _ in profile.module_history] == [True, True, True, True, False]


def test_profile_takes_no_peak_in_a_step_that_imports_and_takes_it_in_the_next() -> None:
    """What an import allocates stays for good (the first torch checkpoint of a process
    imports torch._dynamo): a step that imported a module takes no real peak, the next
    one does, and the plan predicts from that one."""
    import sys
    import types

    class Importing(Net):
        imports = 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.imports:
                self.imports -= 1
                name = "tensorstash_test_imported_in_a_step"
                sys.modules[name] = types.ModuleType(name)
            return super().forward(x)

    torch.manual_seed(0)
    model, profile = Importing(), ts.Profile(measure_steps=3, remeasure_every=0)
    try:
        step(model, batch(512), profile)
        first = profile.history[-1]
        assert first.cold and first.peak_bytes is None and profile.peak is None
        for _ in range(PEAK_SAMPLES):
            step(model, batch(512), profile)
            taken = profile.history[-1]
            assert taken.cold and taken.peak_bytes is not None and profile.peak is taken
        step(model, batch(512), profile)
        assert not profile.history[-1].cold  # the peak was taken: the run goes on warm
    finally:
        sys.modules.pop("tensorstash_test_imported_in_a_step", None)


def test_profile_module_times_from_a_cold_step_count_only_until_a_warm_one() -> None:
    from collections import deque

    from tensorstash.planning._records import ModuleRecord, median_modules

    def timed(seconds: float) -> dict[str, ModuleRecord]:
        return {"a": ModuleRecord(calls=1, forward_s=seconds)}

    history: deque[tuple[bool, dict[str, ModuleRecord]]] = deque([(True, timed(0.03))])
    assert median_modules(history)["a"].forward_s == 0.03  # nothing better yet
    history.append((False, timed(0.01)))
    assert median_modules(history)["a"].forward_s == 0.01  # faulted pages left out
    history.append((True, timed(0.05)))
    history.append((False, timed(0.02)))
    assert median_modules(history)["a"].forward_s == pytest.approx(0.015)


def test_profile_makes_the_plan_again_after_the_warm_step_that_follows_a_cold_one() -> None:
    model, profile = net(), ts.Profile(measure_steps=1, remeasure_every=0)
    revisions, colds = [], []
    for _ in range(5):
        step(model, batch(), profile)
        revisions.append(profile._schedule.revision)
        colds.append(profile.history[-1].cold)
    # The first three steps measure, cold (three samples of the real peak); the fourth
    # is warm and measures nothing, yet its times are the first warm ones: the plan is
    # made again after it, then not.
    assert PEAK_SAMPLES == 3
    assert colds == [True, True, True, False, False]
    assert revisions == [1, 2, 3, 4, 4]


def test_profile_step_that_saves_nothing_eligible_between_others_records_nothing() -> None:
    model, profile = net(), ts.Profile(measure_steps=1, remeasure_every=0)
    step(model, batch(), profile)  # the first sample of the real peak: more are due
    state = profile.state_dict()
    # Four rows save nothing over min_bytes: no sites, times or peak sample to keep.
    with ts.stash("keep", profile=profile):
        loss = model(batch(4).requires_grad_())
    loss.backward()
    assert profile.steps == 2
    assert profile.state_dict() == {**state, "steps": 2}
    assert profile.peak_due  # the next step of 128 rows takes the sample


def test_profile_measures_both_steps_after_a_batch_of_another_shape() -> None:
    model, profile = net(), ts.Profile(measure_steps=1, remeasure_every=0)
    for _ in range(PEAK_SAMPLES):
        step(model, batch(128), profile)
    assert not profile._measures()
    step(model, batch(64), profile)  # another shape: two steps measure again
    colds = []
    for _ in range(3):
        step(model, batch(64), profile)
        colds.append((profile.history[-1].cold, profile.history[-1].peak_bytes is not None))
    assert colds == [(True, True), (False, False), (False, False)]
    # The first steps (the samples of the real peak), then the two after the change.
    assert len(profile.module_history) == PEAK_SAMPLES + 2


def test_lz4_reuses_the_encoding_a_profile_carries_from_the_last_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorstash.tiers import _codec

    trials: list[str] = []
    choose = _codec.choose
    monkeypatch.setattr(_codec, "choose", lambda *a: trials.append(choose(*a)) or trials[-1])
    torch.manual_seed(0)
    x = torch.randn(512, 1024, requires_grad=True)
    profile = ts.Profile()
    for _ in range(2):
        with ts.stash("lz4", min_bytes=0, profile=profile):
            y = torch.relu(x * 2)
        y.sum().backward()
    assert trials == ["zeros"]  # the second step ran no trial
    assert set(profile.codec_methods.values()) == {"zeros"}


def test_profile_state_dict_round_trips_and_plans_alike() -> None:
    model, profile = net(), ts.Profile()
    for _ in range(PEAK_SAMPLES):
        step(model, batch(), profile)
    state = profile.state_dict()
    torch.save(state, io.BytesIO())  # plain data: safe with weights_only loads
    fresh = ts.Profile()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert fresh.peak == profile.peak and fresh.peak is not None and fresh.peak.cold
    assert list(fresh.peaks) == list(profile.peaks) and len(fresh.peaks) >= PEAK_SAMPLES
    budget = profile.history[-1].held_bytes // 2
    before = ts.plan.make_plan(profile, budget)
    after = ts.plan.make_plan(fresh, budget)
    assert before is not None and after is not None
    assert after.recompute == before.recompute and after.tiers == before.tiers
    assert after.predicted_step_s == pytest.approx(before.predicted_step_s)


def test_profile_times_quiet_steps_from_the_call_to_the_end_of_backward() -> None:
    model, profile = net(), ts.Profile(clock=Ticks())
    for _ in range(6):
        session = step(model, batch(), profile, ts.Auto())
    assert session.stats.quiet == 1 and profile.steps == 6
    assert len(profile.history) == 3  # the steps that recorded their sites
    step(model, batch(), profile, ts.Auto())  # begins by reading the last quiet step
    assert len(profile.quiet_history) == 3
    for record in profile.quiet_history:
        assert record.forward_s > 0 and record.backward_s > 0 and record.moved == {}
    assert profile.inputs == (((128, 256), "float32"),)


def test_profile_times_one_quiet_step_in_four_once_it_has_enough() -> None:
    model, profile = net(), ts.Profile(clock=Ticks(), remeasure_every=0)
    timed: list[bool] = []
    went_quiet = profile.went_quiet

    def spy(*args: Any, **kwargs: Any) -> Any:
        quiet = went_quiet(*args, **kwargs)
        timed.append(quiet is not None)
        return quiet

    profile.went_quiet = spy  # type: ignore[method-assign]
    while len(profile.quiet_history) < HISTORY:
        step(model, batch(), profile, ts.Auto())
    assert all(timed[:HISTORY])  # until the history is full, every quiet step
    timed.clear()
    for _ in range(3 * QUIET_TIMED_EVERY):
        session = step(model, batch(), profile, ts.Auto())
        assert session.stats.quiet == 1
    assert timed.count(True) == 3
    assert profile.steps == len(profile.history) + HISTORY + len(timed) + 1


@pytest.mark.parametrize(("recompute", "hooked_later"), [((), False), (("blocks.0",), True)])
def test_profile_times_modules_again_only_where_the_plan_recomputes(
    recompute: tuple[str, ...], hooked_later: bool
) -> None:
    """Rule 6: a plan that keeps every site and recomputes nothing is the same plan
    whatever its modules cost, so its quiet steps are not interrupted every
    ``remeasure_every`` steps by steps that time them (with hooks); a plan that
    recomputes is priced by those times, and its modules are timed again."""
    model, profile = net(), ts.Profile(remeasure_every=5)
    auto = ts.Auto(always_recompute=recompute)
    quiet = [step(model, batch(), profile, auto).stats.quiet for _ in range(16)]
    settled = quiet.index(1)
    assert settled <= 5
    assert (0 in quiet[settled:]) == hooked_later


def test_profile_quiet_step_without_a_backward_records_nothing() -> None:
    model, profile = net(), ts.Profile(clock=Ticks())
    for _ in range(3):
        step(model, batch(), profile, ts.Auto())
    with ts.stash(ts.Auto(), profile=profile) as session:
        loss = model(batch())
    assert session.stats.quiet == 1
    del loss  # the graph is freed without a backward
    step(model, batch(), profile, ts.Auto())
    assert not profile.quiet_history and profile.steps == 5


def test_profile_quiet_step_whose_forward_raises_leaves_no_hook_on_the_model() -> None:
    model, profile = net(), ts.Profile(clock=Ticks())
    for _ in range(3):
        step(model, batch(), profile, ts.Auto())
    boom = model.blocks[1].register_forward_hook(lambda m, i, o: 1 / 0)
    with pytest.raises(ZeroDivisionError), ts.stash(ts.Auto(), profile=profile) as session:
        model(batch())
    boom.remove()
    assert session.stats.quiet == 1 and model._forward_hooks  # the quiet step's timing hook
    session = step(model, batch(), profile, ts.Auto())
    assert session.stats.quiet == 1
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert len(profile.quiet_history) == 0  # neither step's times were taken yet


def test_profile_state_dict_keeps_the_quiet_steps_and_the_inputs() -> None:
    model, profile = net(), ts.Profile(clock=Ticks())
    for _ in range(5):
        step(model, batch(), profile, ts.Auto())
    state = profile.state_dict()  # reads the last quiet step
    assert len(state["quiet_history"]) == 2 and state["inputs"] == [[[128, 256], "float32"]]
    fresh = ts.Profile()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    older = {key: value for key, value in state.items() if key not in ("quiet_history", "inputs")}
    fresh.load_state_dict(older)  # a state saved before quiet steps existed
    assert not fresh.quiet_history and fresh.inputs is None
    older = {key: value for key, value in state.items() if key != "peaks"}
    fresh.load_state_dict(older)  # before the peaks of several steps were kept: the last one
    assert list(fresh.peaks) == [fresh.peak] and fresh.peak is not None
    assert not fresh.peak_due  # what was learnt counts: no more cold steps for it


def test_profile_load_state_dict_rejects_another_version() -> None:
    with pytest.raises(ValueError, match="version 99"):
        ts.Profile().load_state_dict({"version": 99, "steps": 0, "sites": []})


def test_stash_rejects_a_profile_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"profile must be a tensorstash\.Profile"):
        ts.stash("keep", profile={})  # type: ignore[arg-type]


def test_profile_takes_the_peak_once_in_a_step_under_a_new_plan() -> None:
    """A plan's real peak is predicted from steps that ran under it (backward's peak moves
    with what the plan recomputes and moves): a measured step under a plan whose peak was
    taken fewer than PEAK_SAMPLES times takes it, and so does the step after one."""
    model, profile = net(), ts.Profile(measure_steps=3, remeasure_every=0)  # in a run, too
    auto = ts.Auto(device_budget="4MiB", host_probe=lambda device: (64 << 30, 64 << 30))
    plans, peaks = [], []
    for _ in range(8):
        session = step(model, batch(512), profile, auto)
        if session.stats.quiet:
            continue  # a quiet step records no step (rule 8)
        last = profile.history[-1]
        plans.append((last.recomputed, frozenset(last.moved)))
        peaks.append(last.peak_bytes is not None)
    # The plain first step, then the new plan's first step and the one after it.
    assert plans[1] != plans[0] and peaks[:3] == [True, True, True]
    for i in range(1, len(plans)):
        samples = Counter(plans[j] for j in range(i) if peaks[j])
        if peaks[i]:
            assert min(samples[plans[i - 1]], samples[plans[i]]) < PEAK_SAMPLES, (plans, peaks)
        else:
            assert samples[plans[i - 1]] >= PEAK_SAMPLES, (plans, peaks)
    taken = Counter(plan for plan, took in zip(plans, peaks, strict=True) if took)
    assert all(n <= PEAK_SAMPLES for n in taken.values())
    assert session.plan is not None and session.plan.predicted_peak_bytes is not None


def test_profile_without_memory_measures_no_step_for_a_new_plans_peak() -> None:
    """With ``measure_memory=False`` no step takes the real peak: a new plan must not make
    every step time its modules again."""
    model, profile = net(), ts.Profile(measure_steps=3, remeasure_every=0, measure_memory=False)
    auto = ts.Auto(device_budget="4MiB", host_probe=lambda device: (64 << 30, 64 << 30))
    for _ in range(6):
        step(model, batch(512), profile, auto)
    assert profile.history[-1].recomputed or profile.history[-1].moved  # a plan ran
    assert len(profile.module_history) == 3  # the first three steps only
    assert all(rec.peak_bytes is None and not rec.cold for rec in profile.history)


def test_held_bytes_count_the_host_tier_only_where_the_host_is_the_device() -> None:
    # A step's real peak on CUDA holds what stayed on the device; on the CPU the
    # host tier's bytes (compressed, or waiting for the disk writer) are in its RAM too.
    from tensorstash.core.stats import StashStats
    from tensorstash.planning.profile import device_held

    stats = StashStats()
    stats.tiers["kept"].live_bytes = 3 << 20
    stats.tiers["host"].live_bytes = 5 << 20
    stats.tiers["disk"].live_bytes = 7 << 20
    stats.hot.live = 1 << 20
    assert device_held(stats, torch.device("cpu")) == 9 << 20
    assert device_held(stats, torch.device("cuda", 0)) == 4 << 20
