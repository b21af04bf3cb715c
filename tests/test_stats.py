"""StashStats across sessions (merge, combined, metrics) and Profile checkpoints."""

from __future__ import annotations

import pytest
import torch

import tensorstash as ts


def _two() -> tuple[ts.StashStats, ts.StashStats]:
    first, second = ts.StashStats(), ts.StashStats()
    first.add("host", 1000, 250)
    first.skip("parameter", 64)
    first.log({"module": "a", "tier": "host"})
    second.add("host", 3000, 750)
    second.add("disk", 500, 500)
    second.fallback("incompressible")
    second.timed("wait", 0.5)
    return first, second


def test_combined_adds_counters_and_keeps_the_largest_peak_of_sessions_in_turn() -> None:
    first, second = _two()
    total = ts.StashStats.combined([first, second])
    assert total.tiers["host"].bytes == 4000 and total.tiers["host"].stored_bytes == 1000
    assert total.tiers["host"].peak_bytes == 750  # the larger of 250 and 750
    assert total.tiers["disk"].tensors == 1 and total.tiers["kept"].bytes == 64
    assert total.compression_ratio == (4000 + 500) / (1000 + 500)
    assert total.skipped == {"parameter": 1} and total.fallbacks == {"incompressible": 1}
    assert total.wait_seconds == 0.5 and total.decisions == [{"module": "a", "tier": "host"}]


def test_peaks_of_concurrent_sessions_add_up() -> None:
    first, second = _two()
    first.release("host", 250)
    second.release("host", 750)
    in_turn = ts.StashStats.combined([first, second])
    at_once = ts.StashStats.combined([first.to_dict(), second.to_dict()], concurrent=True)
    assert in_turn.tiers["host"].peak_bytes == 750
    assert at_once.tiers["host"].peak_bytes == 1000
    assert ts.StashStats.combined([first], decisions=False).decisions == []


def test_metrics_are_flat_numbers_per_step() -> None:
    first, second = _two()
    values = ts.StashStats.combined([first, second]).metrics(per=2)
    assert values["tensorstash/host_bytes"] == 2000 and values["tensorstash/host_tensors"] == 1
    assert values["tensorstash/wait_seconds"] == 0.25
    assert values["tensorstash/compression_ratio"] == 4500 / 1500
    assert all(isinstance(v, float) for v in values.values())
    assert set(first.metrics("x.")) == {key.replace("tensorstash/", "x.") for key in values}


def _trained_profile() -> ts.Profile:
    profile = ts.Profile(clock=iter(range(10_000)).__next__)  # every unpack takes a "second"
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):
        with ts.stash(ts.Auto(device_budget=0), min_bytes=0, profile=profile):
            loss = (x.sin() * 2).cos().sum()
        loss.backward()
    return profile


def test_profile_state_dict_round_trips() -> None:
    profile = _trained_profile()
    state = profile.state_dict()
    assert state["steps"] == 2 and state["sites"]
    assert any(row["stalled"] for row in state["sites"])
    fresh = ts.Profile()
    fresh.load_state_dict(state)
    assert fresh.steps == 2 and fresh.last == profile.current
    assert fresh.stalls and fresh.plan(budget=1 << 20) == _next_plan(profile)
    assert fresh.state_dict() == state
    torch.save(state, __import__("io").BytesIO())  # plain data: safe with weights_only loads


def _next_plan(profile: ts.Profile) -> dict:
    profile.start_step()
    return profile.plan(budget=1 << 20)


def test_profile_load_state_dict_rejects_another_version() -> None:
    with pytest.raises(ValueError, match="version 99"):
        ts.Profile().load_state_dict({"version": 99, "steps": 0, "sites": []})
