"""Select and Auto with injected probes: each rule fires, the budget holds, reasons logged."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorstash as ts
from tensorstash.session.rules import LEAF

MiB = 1 << 20
SKIPPED = ("parameter", "deduplicated", LEAF)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fixed(free: int, total: int = 64 << 30) -> ts.auto.Probe:
    return lambda device: (free, total)


def mlp(depth: int = 1) -> nn.Module:
    """Linear(256, 1024), ReLU, ``depth`` x (Linear(1024, 1024), ReLU), Linear(1024, 256)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, 1024), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 256))


def run(model: nn.Module, policy: object) -> tuple[ts.Session, list[torch.Tensor]]:
    torch.manual_seed(1)
    x = torch.randn(512, 256, requires_grad=True)
    model.zero_grad()
    with ts.stash(policy, min_bytes=0, record=True) as session:  # type: ignore[arg-type]
        loss = model(x).square().mean()
    loss.backward()
    return session, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def plain(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(512, 256, requires_grad=True)
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def reasons(session: ts.Session) -> set[str]:
    """The selector's reasons (what background work added after "; " left out)."""
    return {row["reason"].split("; ")[0] for row in session.decisions}


def test_auto_keeps_everything_under_a_large_budget() -> None:
    model = mlp()
    session, grads = run(model, ts.Auto(device_budget="1GiB", host_probe=fixed(64 << 30)))
    tiers = session.stats.to_dict()["tiers"]
    assert tiers["host"]["tensors"] == tiers["disk"]["tensors"] == 0
    assert "under device budget" in reasons(session)
    assert all(torch.equal(a, b) for a, b in zip(plain(model), grads, strict=True))


def test_auto_budget_holds_within_one_tensor() -> None:
    model = mlp(depth=4)
    budget = 5 * MiB
    session, grads = run(model, ts.Auto(device_budget=budget, host_probe=fixed(64 << 30)))
    kept = session.stats.to_dict()["tiers"]["kept"]
    largest = max(row["bytes"] for row in session.decisions)
    assert kept["peak_bytes"] <= budget + largest
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] >= 1  # CPU: spilled
    assert "device budget reached" in reasons(session)
    assert all(torch.equal(a, b) for a, b in zip(plain(model), grads, strict=True))


def test_auto_keeps_the_tensors_saved_last_for_backward() -> None:
    model = mlp(depth=4)  # saves 512x1024 float32 (2 MiB) per ReLU, then 0.5 MiB for the loss
    budget = 8 * MiB  # 6 MiB kept from the start, a window of 2 MiB for the end
    session, grads = run(model, ts.Auto(device_budget=budget, host_probe=fixed(64 << 30)))
    rows = [row for row in session.decisions if row["reason"] not in SKIPPED]
    tiers = [row["tier"] for row in rows]
    # Three ReLU outputs fit under 3/4 of the budget; the next two wait in the window and
    # the older goes to disk once 2 MiB were saved after it; the last two stay.
    assert tiers == ["kept", "kept", "kept", "disk", "kept", "kept"], rows
    assert rows[3]["reason"].startswith("device budget reached; the device is host RAM: to disk; s")
    assert "saved last" not in rows[3]["reason"]
    assert all("saved last" in row["reason"] for row in rows[4:])
    stats = session.stats.to_dict()["tiers"]
    assert stats["disk"]["tensors"] == 1 and stats["host"]["tensors"] == 0
    # Written as it is: lz4 before the disk cost the step more than it saved.
    assert stats["disk"]["stored_bytes"] == stats["disk"]["bytes"] == 2 * MiB
    assert stats["kept"]["peak_bytes"] <= budget + 2 * MiB
    assert all(torch.equal(a, b) for a, b in zip(plain(model), grads, strict=True))


def test_deferred_tensor_changed_in_place_raises_at_backward(tmp_path: object) -> None:
    select = ts.Select(lambda t, m: ts.Defer(ts.DiskSpill(str(tmp_path)), window=0))
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(select, min_bytes=0) as session:
        y = x.exp()  # saves its output
        y.add_(1)  # changed while it waits in the window
        z = (x * 3).sin().cos()  # pushes y out: not packed, it changed; then x * 3 out
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y + z).sum().backward()
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] == 1  # x * 3, not y


def test_select_rule_may_defer_with_its_own_window() -> None:
    model = mlp(depth=2)
    select = ts.Select(lambda t, m: ts.Defer(ts.Lz4(), window=3 * MiB))
    session, grads = run(model, select)
    rows = [row for row in session.decisions if row["reason"] not in SKIPPED]
    # Three 2 MiB ReLU outputs, then 0.5 MiB: only the first has 3 MiB saved after it.
    assert [row["tier"] for row in rows] == ["host", "kept", "kept", "kept"]
    assert all(torch.equal(a, b) for a, b in zip(plain(model), grads, strict=True))


def test_auto_spills_to_disk_when_host_memory_is_low() -> None:
    model = mlp()
    policy = ts.Auto(device_budget=0, host_reserve="1GiB", host_probe=fixed(512 * MiB))
    session, grads = run(model, policy)
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] >= 1
    assert "host memory low" in reasons(session)
    assert all(torch.equal(a, b) for a, b in zip(plain(model), grads, strict=True))
    del session
    gc.collect()


def test_select_probes_are_cached_for_refresh_s() -> None:
    calls: list[int] = []

    def probe(device: torch.device) -> tuple[int, int]:
        calls.append(1)
        return 1 << 30, 2 << 30

    clock = Clock()
    select = ts.Select(lambda t, m: ts.Keep(), device_probe=probe, host_probe=probe, clock=clock)
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(select, min_bytes=0):
        for _ in range(5):
            (x * 2).sin()
        first = len(calls)
        clock.now += 1.0
        (x * 2).sin()
    assert first == 2  # one device and one host reading for five decisions
    assert len(calls) == 4


def test_select_sees_memory_and_held_bytes() -> None:
    seen: list[ts.Memory] = []

    def rule(tensor: torch.Tensor, memory: ts.Memory) -> object:
        seen.append(memory)
        return "keep"

    x = torch.randn(256, 256, requires_grad=True)
    select = ts.Select(rule, device_probe=fixed(123), host_probe=fixed(456))
    with ts.stash(select, min_bytes=0):
        (x * 2).sin().exp()
    assert seen[0].device_free == 123 and seen[0].host_available == 456
    assert seen[1].held["kept"] == 256 * 256 * 4  # the first tensor, kept


def test_decision_log_names_module_shape_tier_and_reason() -> None:
    model = mlp()
    session, _ = run(model, ts.Chain(ts.Lz4(), ts.DiskSpill()))
    rows = session.decisions
    assert rows == session.stats.to_dict()["decisions"]
    relu = [row for row in rows if row["module"] == "1"]
    assert relu and relu[0]["shape"] == [512, 1024] and relu[0]["dtype"] == "float32"
    assert relu[0]["tier"] == "disk"
    assert relu[0]["reason"] == "policy Chain; spilled, compressible 1.9x"
    assert relu[0]["stored_bytes"] < relu[0]["bytes"]
    params = [row for row in rows if row["reason"] == "parameter"]
    assert params and all(row["tier"] == "kept" for row in params)
    for row in rows:
        assert set(row) >= {"module", "shape", "dtype", "bytes", "tier", "stored_bytes", "reason"}
    table = session.stats.table(by="module")
    assert "module" in table.splitlines()[0] and "\n1 " in table


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_budget": "lots"}, "device_budget must be bytes"),
        ({"device_budget": 1.5}, "as a share must be in"),
        ({"host_reserve": -1}, "host_reserve must be at least 0"),
    ],
)
def test_auto_rejects_bad_sizes(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ts.Auto(**kwargs)  # type: ignore[arg-type]


def test_select_rejects_a_rule_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match="rule must be callable"):
        ts.Select(3)  # type: ignore[arg-type]


def test_select_cannot_be_a_chain_stage() -> None:
    with pytest.raises(TypeError, match="cannot be a stage"):
        ts.Chain(ts.Select(lambda t, m: "keep"), ts.DiskSpill())


@pytest.mark.parametrize(
    "chosen",
    [
        lambda: ts.Auto(),
        lambda: "auto",
        lambda: ts.Select(lambda t, m: "keep"),
        lambda: ts.Defer(ts.Auto(), window=0),
    ],
    ids=["Auto", "auto-name", "Select", "Defer-Auto"],
)
def test_select_rule_returning_a_selector_says_what_to_return(chosen: Callable[[], Any]) -> None:
    x = torch.randn(128, 128, requires_grad=True)
    select = ts.Select(lambda t, m: chosen())
    with pytest.raises(TypeError) as raised, ts.stash(select, min_bytes=0):
        (x * 2).sin()
    message = str(raised.value)
    assert message.startswith("tensorstash.Select: the rule returned"), message
    assert "a selector" in message and "return a policy" in message, message
    assert "Chain" not in message.split(";")[0], message  # not about a stage of a Chain


def test_stash_defaults_to_auto() -> None:
    assert isinstance(ts.stash().policy, ts.Auto)


def test_decision_log_names_modules_after_an_interrupted_forward() -> None:
    class Interrupts(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), ts.stash("keep", min_bytes=0, record=True):
        nn.Sequential(nn.Linear(8, 8), Interrupts())(torch.randn(2, 8))
    session, _ = run(mlp(), "keep")
    assert {row["module"] for row in session.decisions} >= {"0", "1", "2"}


@pytest.mark.parametrize(
    ("available", "expected", "reason"),
    [
        (64 << 30, ts.CpuOffload(), "device budget reached"),
        (3 << 30, ts.Chain(ts.CpuOffload(), ts.Lz4()), "host memory tight"),
        (1 << 30, ts.Chain(ts.CpuOffload(), ts.DiskSpill()), "host memory low"),
    ],
    ids=["plain-copy", "compressed", "spilled"],
)
def test_auto_moves_device_tensors_by_host_memory_left(
    available: int, expected: object, reason: str
) -> None:
    # A device tensor past the budget goes to the host as it is (the link is faster
    # than lz4), compressed under twice host_reserve, spilled under host_reserve.
    from tensorstash.core.policy import Context
    from tensorstash.core.stats import StashStats

    auto = ts.Auto(
        device_budget=MiB,
        host_reserve=2 << 30,
        host_probe=fixed(available),
        device_probe=fixed(8 << 30, 16 << 30),
    )
    ctx = Context(StashStats())
    ctx.stats.tiers["kept"].live_bytes = 2 * MiB  # held already: past the budget
    tensor = torch.empty(1 << 20, device="meta")  # 4 MiB "on a device", never allocated
    policy, why = auto.choose(tensor, ctx)
    policy = policy.policy if isinstance(policy, ts.Defer) else policy
    text = why.text()
    assert text.startswith("device budget reached" if reason != "host memory low" else reason)
    assert reason in text
    assert type(policy) is type(expected)
    if isinstance(expected, ts.Chain):
        assert [type(s) for s in policy.stages] == [type(s) for s in expected.stages]


def test_auto_host_tier_takes_its_room_for_copies_from_the_plan_in_force() -> None:
    """A session may run several steps: a copy tier made in a step without a plan (room
    0: every copy to the host waited on) must not stay so once a plan that fits leaves
    room, nor keep a room that a later plan no longer leaves."""
    from tensorstash.core.policy import Context
    from tensorstash.core.stats import StashStats

    auto = ts.Auto(
        device_budget=8 * MiB, host_probe=fixed(64 << 30), device_probe=fixed(8 << 30, 16 << 30)
    )
    ctx = Context(StashStats())
    ctx.stats.tiers["kept"].live_bytes = 16 * MiB  # held already: past the budget
    tensor = torch.empty(1 << 20, device="meta")  # 4 MiB "on a device", never allocated
    choice = auto.state(ctx).choice

    def room() -> int:
        policy, _ = auto.choose(tensor, ctx)
        policy = policy.policy if isinstance(policy, ts.Defer) else policy
        assert isinstance(policy, ts.CpuOffload)
        return policy.max_inflight_bytes

    def plan(held: int) -> ts.Plan:
        return ts.Plan(8 * MiB, activation_bytes=32 * MiB, held_bytes=held, reachable_bytes=held)

    assert room() == 0  # no plan: every copy waited on
    choice.follow(plan(3 * MiB))
    assert room() == 5 * MiB  # the budget less what the plan holds
    choice.follow(plan(7 * MiB))
    assert room() == 1 * MiB
    choice.follow(None)
    assert room() == 0


def test_auto_makes_no_tier_in_a_step_that_keeps_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DiskSpill checks its directory when made (a probe file, the mount table): a step
    that keeps every tensor must not pay for that."""
    made: list[object] = []
    from tensorstash.planning import _auto_choice

    real = _auto_choice.DiskSpill

    def counting(*args: object, **kwargs: object) -> object:
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(_auto_choice, "DiskSpill", counting)
    model = mlp()
    run(model, ts.Auto(device_budget="1GiB", host_probe=fixed(64 << 30)))
    assert made == []
    session, grads = run(model, ts.Auto(device_budget=0, host_probe=fixed(64 << 30)))
    assert len(made) == 1  # made once, when a tensor first went to disk
    assert session.stats.to_dict()["tiers"]["disk"]["tensors"] >= 1
    assert all(torch.equal(a, b) for a, b in zip(plain(model), grads, strict=True))


def test_host_memory_reads_what_psutil_reads() -> None:
    psutil = pytest.importorskip("psutil")
    from tensorstash.planning.auto import host_memory

    available, total = host_memory()
    info = psutil.virtual_memory()
    assert total == info.total
    assert abs(available - info.available) < max(info.total // 50, 64 << 20)


def test_device_memory_on_cuda_counts_what_the_caching_allocator_holds_unused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The driver sees the allocator's cached blocks as taken; they serve the next tensors.
    from tensorstash.planning.auto import device_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 << 30, 140 << 30))
    stats = {
        "reserved_bytes": {"all": {"current": 120 << 30, "peak": 130 << 30}},
        "allocated_bytes": {"all": {"current": 4 << 30, "peak": 100 << 30}},
    }
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    assert device_memory(torch.device("cuda", 0)) == (122 << 30, 140 << 30)
    # Before the allocator is initialised its statistics are empty: nothing cached.
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})
    assert device_memory(torch.device("cuda", 0)) == (6 << 30, 140 << 30)
