"""Profile: call sites recorded per step; Auto plans from the last step (NOTE [ Profile ])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tensorstash as ts
from tensorstash.profile import SiteRecord
from tensorstash.stash import LEAF

MiB = 1 << 20
SKIPPED = ("parameter", "deduplicated", LEAF)


class Clock:
    """A clock that moves one second each time it is read: every unpack 'stalls'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(6)))


def plain(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad()
    net(x).square().mean().backward()
    return [p.grad.clone() for p in net.parameters()]


def step(net: nn.Module, x: torch.Tensor, policy: object, profile: ts.Profile) -> ts.Session:
    net.zero_grad()
    with ts.stash(policy, min_bytes=0, record=True, profile=profile) as session:  # type: ignore[arg-type]
        loss = net(x).square().mean()
    loss.backward()
    return session


def offloaded(session: ts.Session) -> list[int]:
    """Positions (in pack order) of the eligible tensors that were moved off the device."""
    rows = [r for r in session.decisions if r["reason"] not in SKIPPED]
    return [i for i, row in enumerate(rows) if row["tier"] != "kept"]


def test_profile_records_the_same_sites_each_step() -> None:
    net, x = model(), torch.randn(256, 512)
    profile = ts.Profile()
    step(net, x, "keep", profile)
    first = list(profile.current)
    step(net, x, "keep", profile)
    assert profile.steps == 1
    assert list(profile.last) == first == list(profile.current)
    assert [site[0] for site in first][:2] == ["0.0", "0.1"]  # module paths


def test_auto_with_a_profile_offloads_the_earliest_tensors_from_step_two() -> None:
    net, x = model(), torch.randn(256, 512)
    expected = plain(net, x)
    budget = 3 * 256 * 512 * 4  # three of the twelve saved activations
    auto = ts.Auto(device_budget=budget, host_probe=lambda d: (64 << 30, 128 << 30))
    profile = ts.Profile(clock=Clock())
    first = step(net, x, auto, profile)
    grads_first = [p.grad.clone() for p in net.parameters()]
    second = step(net, x, auto, profile)
    # Step one keeps the first tensors until 3/4 of the budget is spent and the last
    # ones in its recent window, and offloads those between: each reload "stalled".
    early, late = offloaded(first), offloaded(second)
    eligible = len(profile.last)
    assert early == list(range(early[0], early[-1] + 1)) and early[0] > 0
    assert early[-1] < eligible - 1  # the last ones stayed
    # Step two offloads the tensors saved earliest; it keeps the last ones and the
    # latest that stalled.
    assert late == list(range(len(late)))
    third = step(net, x, auto, profile)
    assert offloaded(third) == late  # the plan is stable
    reasons = {row["reason"].split(";")[0] for row in second.decisions}
    assert "offload: saved early, time to bring it back" in reasons
    assert "keep: backward needs it first (saved last)" in reasons
    for stats in (first.stats, second.stats):
        kept = stats.to_dict()["tiers"]["kept"]["peak_bytes"]
        assert kept <= budget + 256 * 512 * 4
    for e, a, b in zip(expected, grads_first, [p.grad for p in net.parameters()], strict=True):
        assert torch.equal(e, a) and torch.equal(e, b)


def test_plan_keeps_a_site_whose_reload_stalled_and_offloads_another_instead() -> None:
    profile = ts.Profile(stall_s=0.01)
    sites = [("m", "op", (1,), "float32", i) for i in range(4)]
    profile.current = {
        sites[0]: SiteRecord(0, 100, unpack_s=0.5, offloaded=True),  # stalled backward
        sites[1]: SiteRecord(1, 100),
        sites[2]: SiteRecord(2, 100),
        sites[3]: SiteRecord(3, 100),
    }
    profile.start_step()  # the step ends: its records become profile.last
    plan = profile.plan(budget=200, recent=50)
    assert plan[sites[0]] == (True, "keep: its reload stalled backward last step")
    assert plan[sites[3]] == (True, "keep: backward needs it first (saved last)")
    assert not plan[sites[1]][0] and not plan[sites[2]][0]


def test_plan_never_keeps_more_than_the_budget() -> None:
    profile = ts.Profile()
    profile.last = {("m", None, (1,), "f", i): SiteRecord(i, 100) for i in range(10)}
    plan = profile.plan(budget=350)
    assert sum(1 for keep, _ in plan.values() if keep) == 3


def test_lz4_reuses_the_encoding_a_profile_carries_from_the_last_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorstash import _codec

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
    restored = ts.Profile()
    restored.load_state_dict(profile.state_dict())
    assert restored.codec_methods == profile.codec_methods


def test_stash_rejects_a_profile_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"profile must be a tensorstash\.Profile"):
        ts.stash("keep", profile={})  # type: ignore[arg-type]
