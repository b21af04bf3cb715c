"""recompute(): activations dropped and recomputed, mixed with offloaded blocks, bitwise."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from torch import nn

import tensorstash as ts


class Block(nn.Module):
    """A residual block with dropout, keyword arguments and a tuple output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc2(self.drop(torch.relu(self.fc1(self.norm(x)))))
        return x + scale * h, h.detach().norm()


class Net(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _ = block(x, scale=0.5)
        return x.square().mean()


def grads(model: nn.Module, context: object | None = None) -> list[torch.Tensor]:
    torch.manual_seed(7)
    x = torch.randn(64, 128, requires_grad=True)
    model.zero_grad()
    if context is None:
        loss = model(x)
    else:
        with context:  # type: ignore[attr-defined]
            loss = model(x)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def assert_equal(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(e, a), f"gradient {i} differs"


def fresh() -> Net:
    torch.manual_seed(0)
    return Net()


def test_recompute_every_block_gives_bitwise_gradients() -> None:
    expected = grads(fresh())
    model = fresh()
    assert ts.recompute_modules(model, Block) == [f"blocks.{i}" for i in range(4)]
    assert_equal(expected, grads(model))


def test_recompute_keeps_the_module_and_its_state_dict() -> None:
    model = fresh()
    keys = list(model.state_dict())
    block = model.blocks[0]
    assert ts.recompute(block) is block
    assert list(model.state_dict()) == keys
    ts.unrecompute(block)
    assert "forward" not in vars(block)


def test_recompute_mixed_with_offload_gives_bitwise_gradients() -> None:
    expected = grads(fresh())
    model = fresh()
    ts.recompute_modules(model, ["blocks.0", "blocks.2"])
    session = ts.stash(ts.DiskSpill(), min_bytes=0)
    assert_equal(expected, grads(model, session))
    tiers = session.stats.to_dict()["tiers"]
    assert tiers["disk"]["tensors"] > 0  # blocks 1 and 3, and the recomputed blocks' inputs


def test_recompute_saves_less_than_plain_blocks() -> None:
    plain = ts.stash(ts.DiskSpill(), min_bytes=0)
    grads(fresh(), plain)
    model = fresh()
    ts.recompute_modules(model, Block)
    recomputed = ts.stash(ts.DiskSpill(), min_bytes=0)
    grads(model, recomputed)
    spilled = [s.stats.to_dict()["tiers"]["disk"]["bytes"] for s in (plain, recomputed)]
    assert spilled[1] * 4 < spilled[0]


def test_recompute_wraps_a_function() -> None:
    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x.sin(), 0.2).exp()

    torch.manual_seed(1)
    x = torch.randn(256, 256, requires_grad=True)
    torch.manual_seed(2)
    region(x).sum().backward()
    expected, x.grad = x.grad, None
    torch.manual_seed(2)
    ts.recompute(region)(x).sum().backward()
    assert torch.equal(expected, x.grad)


class Stashing(nn.Module):
    """A block that stashes its own forward, as a library model might."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.block = Block(width)
        self.sessions: list[ts.Session] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with ts.stash(ts.DiskSpill(), min_bytes=0) as session:
            self.sessions.append(session)  # before a recomputation stops early in it
            y, _ = self.block(x, scale=0.5)
        return y


class StashingNet(nn.Module):
    def __init__(self, depth: int = 2, wrap: object = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Stashing() for _ in range(depth))
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.wrap(layer, x) if self.wrap is not None else layer(x)  # type: ignore[operator]
        return x.square().mean()


def stashing(wrap: object = None) -> StashingNet:
    torch.manual_seed(0)
    return StashingNet(wrap=wrap)


def _non_reentrant(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)  # type: ignore[no-any-return]


def _reentrant(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)  # type: ignore[no-any-return]


def _sessions(model: StashingNet) -> list[ts.Session]:
    return [session for layer in model.layers for session in layer.sessions]  # type: ignore[union-attr]


def test_stash_inside_ts_recompute_passes_through_in_forward_and_recompute() -> None:
    expected = grads(stashing())
    model = stashing()
    for layer in model.layers:
        ts.recompute(layer)
    assert_equal(expected, grads(model))
    sessions = _sessions(model)
    assert len(sessions) == 4  # each layer: once in forward, once while backward recomputes it
    for session in sessions:
        stats = session.stats.to_dict()
        assert stats["inside_recompute"] == 1
        assert all(tier["tensors"] == 0 for tier in stats["tiers"].values())  # nothing pushed


def test_stash_inside_non_reentrant_checkpoint_passes_through() -> None:
    expected = grads(stashing())
    model = stashing(_non_reentrant)
    assert_equal(expected, grads(model))
    sessions = _sessions(model)
    assert len(sessions) == 4
    assert all(session.stats.inside_recompute == 1 for session in sessions)
    assert "opened inside a recomputed region" in sessions[0].stats.table()


def test_stash_inside_reentrant_checkpoint_packs_the_recomputation() -> None:
    # Reentrant checkpointing runs the region under no_grad in forward (nothing is
    # saved) and again with grad in backward, where the stash works as anywhere.
    expected = grads(stashing())
    model = stashing(_reentrant)
    assert_equal(expected, grads(model))
    for layer in model.layers:
        forward, recomputed = layer.sessions  # type: ignore[union-attr]
        assert forward.stats.inside_recompute == recomputed.stats.inside_recompute == 0
        assert sum(tier.tensors for tier in forward.stats.tiers.values()) == 0
        assert recomputed.stats.to_dict()["tiers"]["disk"]["tensors"] > 0


def test_stash_inside_recompute_inside_an_outer_stash_passes_through() -> None:
    expected = grads(stashing())
    model = stashing()
    for layer in model.layers:
        ts.recompute(layer)
    outer = ts.stash(ts.DiskSpill(), min_bytes=0)
    assert_equal(expected, grads(model, outer))
    assert outer.stats.inside_recompute == 0
    assert outer.stats.to_dict()["tiers"]["disk"]["tensors"] > 0  # the layers' inputs
    assert all(session.stats.inside_recompute == 1 for session in _sessions(model))


def test_recompute_rejects_what_is_not_callable() -> None:
    with pytest.raises(TypeError, match=r"expected an nn\.Module or a function"):
        ts.recompute(3)  # type: ignore[type-var]


def test_recompute_modules_names_missing_submodules() -> None:
    with pytest.raises(ValueError, match=r"\['blocks.9'\] name no submodule.*Block"):
        ts.recompute_modules(fresh(), ["blocks.9"])


def test_recompute_modules_takes_a_string_as_one_path() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(12)))
    x = torch.randn(4, 32, requires_grad=True)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert ts.recompute_modules(model, "10") == ["10"]
    assert [i for i, layer in enumerate(model) if "forward" in vars(layer)] == [10]
    model(x).sum().backward()
    assert_equal(expected, [p.grad for p in model.parameters()])


@pytest.mark.parametrize("which", ["Block", ("Block",), ["blocks.0", "Block"], {Block}])
def test_recompute_modules_takes_class_names_as_never_recompute_does(which: object) -> None:
    expected = grads(fresh())
    model = fresh()
    assert ts.recompute_modules(model, which) == [f"blocks.{i}" for i in range(4)]  # type: ignore[arg-type]
    assert_equal(expected, grads(model))


def test_recompute_modules_path_covers_the_modules_inside_it() -> None:
    model = fresh()
    assert ts.recompute_modules(model, ["blocks.1", "blocks.1.fc1", "LayerNorm"]) == [
        "blocks.0.norm",
        "blocks.1",
        "blocks.2.norm",
        "blocks.3.norm",
    ]


@pytest.mark.parametrize(
    ("which", "message"),
    [
        (10, r"which must be a submodule path or class name.*got int 10"),
        (b"blocks.0", r"which must be a submodule path.*got bytes"),
        ([1, 2], r"1 is not a submodule path, a class name or an nn.Module class"),
        ([torch.Tensor], r"is not a submodule path"),
        (nn.Linear(2, 2), r"module instance \(Linear\).*tensorstash.recompute\(module\)"),
    ],
)
def test_recompute_modules_refuses_what_names_no_module(which: object, message: str) -> None:
    model = fresh()
    with pytest.raises(TypeError, match=message):
        ts.recompute_modules(model, which)  # type: ignore[arg-type]
    assert not any("forward" in vars(module) for module in model.modules())


class FakeEvent:
    """A CUDA timing event stand-in: recorded at a tick, elapsed in milliseconds."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True

    def query(self) -> bool:
        return self.synchronized

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0

    def record(self, stream: object) -> None:
        pass


def fake_cuda(monkeypatch: pytest.MonkeyPatch, make: Callable[[], FakeEvent]) -> ModuleType:
    """The recompute module, its arguments taken as CUDA tensors and its timer's events
    made by ``make`` (this test has no CUDA)."""
    module = importlib.import_module("tensorstash.recompute")  # ts.recompute is the function
    module.drop_user_recompute_seconds()  # left by the tests before
    monkeypatch.setattr(module, "_cuda_device", lambda args, kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: make())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    return module


def test_recompute_on_cuda_is_timed_by_events_read_only_when_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE [ Recompute ] rule 7: untimed on CUDA, a launch-bound step's recompute was
    # priced at forward times the profile's own timing had inflated.
    ticks, events = iter(range(0, 100, 2)), []

    def event() -> FakeEvent:
        events.append(FakeEvent(next(ticks)))
        return events[-1]

    module = fake_cuda(monkeypatch, event)
    block = ts.recompute(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    x = torch.randn(4, 8, requires_grad=True)
    try:
        block(x).sum().backward()  # the forward is not timed; backward's recompute is
        assert len(events) == 2 and not any(e.synchronized for e in events)
        assert module.take_user_recompute_seconds() == pytest.approx(2.0)
        assert events[1].synchronized
        block(x).sum().backward()
        module.drop_user_recompute_seconds()  # a step that does not time it reads nothing
        assert len(events) == 4 and not events[3].synchronized
        assert module.take_user_recompute_seconds() is None
    finally:
        ts.unrecompute(block)


def test_recompute_on_cuda_counts_the_hosts_time_where_the_events_see_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NOTE [ Recompute ] rule 7: on a step bound by launching kernels the device reaches
    # the first event late, and the pair spans less than the host spent recomputing.
    ticks = iter(range(100))

    def event() -> FakeEvent:
        return FakeEvent(next(ticks) / 1000.0)  # a millisecond apart

    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch._C._current_graph_task_id() != -1:
                time.sleep(0.05)  # the host's time in backward's recompute
            return x.tanh()

    module = fake_cuda(monkeypatch, event)
    block = ts.recompute(Slow())
    x = torch.randn(4, 8, requires_grad=True)
    try:
        block(x).sum().backward()
        assert module.take_user_recompute_seconds() >= 0.05
    finally:
        ts.unrecompute(block)


def test_recompute_on_cuda_keeps_no_event_pair_once_it_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A module recomputed by steps no profile times must not hold a pair per step.
    ticks = iter(range(0, 100, 2))

    def completed() -> FakeEvent:
        event = FakeEvent(next(ticks))
        event.synchronized = True
        return event

    module = fake_cuda(monkeypatch, completed)
    block = ts.recompute(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    x = torch.randn(4, 8, requires_grad=True)
    try:
        for _ in range(3):
            block(x).sum().backward()
        readings = module._recompute_s[block]
        assert len(readings.pending) == 1 and readings.seconds == pytest.approx(4.0)
        assert module.take_user_recompute_seconds() == pytest.approx(6.0)
    finally:
        ts.unrecompute(block)
