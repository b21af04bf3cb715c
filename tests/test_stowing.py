"""The disk tier inside compiled graphs (rule 12 of NOTE [ Compiled code ] in
tensorstash/planning/compiler.py): stowed tensors come back bitwise, leave no file, and
the placement pass puts each stow and fetch next to its uses."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import leak_check
from torch import fx, nn

from tensorstash.core import _support
from tensorstash.core.policy import Context
from tensorstash.core.stats import StashStats
from tensorstash.planning import _stowing, compiler
from tensorstash.tiers.disk import DiskSpill

pytestmark = [
    pytest.mark.skipif(
        not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
        reason="torch.compile is not supported here",
    ),
    # two runs compared bit for bit: with two threads, eager matmuls differ by an ulp
    # now and then, with or without a stash
    pytest.mark.usefixtures("one_torch_thread"),
]
inlined = pytest.mark.skipif(
    _support.missing(_support.COMPILED) is not None,
    reason=str(_support.missing(_support.COMPILED)),  # what the plan table says there
)
"""Tests that compile under a pair, whose hooks AOTAutograd inlines from torch 2.10."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 256), nn.Tanh()
    ).eval()


def _grads(model: nn.Module, fn: Callable[..., torch.Tensor], *, retain: bool = False) -> list:
    model.zero_grad(set_to_none=True)
    x = torch.randn(16, 32, 64, generator=torch.Generator().manual_seed(2))
    loss = fn(x)
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _session_stows(policy: Any, ctx: Context) -> None:
    """What a session that pushes a moving pair hands down to its thread (rule 12): its
    eager tensors (none here: the whole step is compiled) and where its graphs stow."""
    compiler.handing(lambda tensor: tensor, lambda packed: packed, (policy, ctx))


def _stowing_step(
    model: nn.Module,
    fn: Callable[..., torch.Tensor],
    directory: Path,
    moving: int,
    ctx: Context | None = None,
    **kw: Any,
) -> tuple[list, int]:
    pair = compiler.hooks_for(1.0, moving)
    ctx = ctx if ctx is not None else Context(StashStats())
    _session_stows(DiskSpill(directory, background=False), ctx)
    count = compiler.thread_count()
    count.moved = 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack):
            grads = _grads(model, fn, **kw)
    finally:
        compiler.handed()
    return grads, count.moved


@inlined
@pytest.mark.parametrize(
    "backend",
    ["aot_eager_decomp_partition", pytest.param("inductor", marks=pytest.mark.slow)],
)
def test_stowed_tensors_come_back_bitwise_and_leave_no_file(
    fresh_dynamo: None, tmp_path: Path, backend: str
) -> None:
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend=backend)
    expected = _grads(model, fn)
    ctx = Context(StashStats())
    grads, moved = _stowing_step(model, fn, tmp_path, 1 << 20, ctx)
    assert moved >= 1 << 20  # at least what the pair was asked to stow
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    disk = ctx.stats.tiers["disk"]
    assert disk.tensors > 0 and disk.bytes == moved  # the session's stats count them
    gc.collect()
    assert len(_stowing._HELD) == 0, "a stowed value outlived its graph"
    assert ctx.stats.live_bytes == 0
    leak_check(directories=[tmp_path])


@inlined
def test_stowed_tensors_come_back_for_a_second_backward(fresh_dynamo: None, tmp_path: Path) -> None:
    """``retain_graph=True``: the fetch runs twice, and the value is still there."""
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend="aot_eager_decomp_partition")
    expected = _grads(model, fn, retain=True)
    grads, moved = _stowing_step(model, fn, tmp_path, 1 << 20, retain=True)
    assert moved > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    gc.collect()
    leak_check(directories=[tmp_path])


@inlined
def test_stowed_tensors_of_a_graph_freed_before_backward_leave_no_file(
    fresh_dynamo: None, tmp_path: Path
) -> None:
    """A forward whose loss is dropped with no backward: its stowed values go with it."""
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend="aot_eager_decomp_partition")
    pair = compiler.hooks_for(1.0, 1 << 20)
    ctx = Context(StashStats())
    _session_stows(DiskSpill(tmp_path, background=False), ctx)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack):
            loss = fn(torch.randn(16, 32, 64))
    finally:
        compiler.handed()
    assert ctx.stats.tiers["disk"].tensors > 0 and len(_stowing._HELD) > 0
    del loss
    gc.collect()
    assert len(_stowing._HELD) == 0 and ctx.stats.live_bytes == 0
    leak_check(directories=[tmp_path])


@inlined
def test_stowed_tensors_without_a_session_stay_in_memory(fresh_dynamo: None) -> None:
    """A compiled forward that runs under a moving pair with no session stowing on its
    thread keeps its own copy: right gradients, no file."""
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend="aot_eager_decomp_partition")
    expected = _grads(model, fn)
    pair = compiler.hooks_for(1.0, 1 << 20)
    with torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack):
        grads = _grads(model, fn)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_a_moving_pair_is_another_pair_whose_graphs_the_cache_keys_apart() -> None:
    """Rule 12: what a pair stows is in its pack graph, so another budget's graphs are
    never found for it (rule 4: one pair per setting and bytes)."""
    still, moving = compiler.hooks_for(0.5), compiler.hooks_for(0.5, 3 << 20)
    assert still is compiler.hooks_for(0.5) and moving is compiler.hooks_for(0.5, 3 << 20)
    assert moving is not still and moving is not compiler.hooks_for(0.5, 4 << 20)
    assert str(3 << 20) in moving.pack.code and str(3 << 20) not in still.pack.code


def _graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """A forward whose saved tensor is stowed at its end, and a backward that fetches it
    at its start, as AOTAutograd inlines them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    token_in = graph.placeholder("token_in")
    a = graph.call_function(torch.ops.aten.relu.default, (x,))
    b = graph.call_function(torch.ops.aten.mul.Tensor, (a, a))
    c = graph.call_function(torch.ops.aten.sin.default, (b,))
    d = graph.call_function(torch.ops.aten.cos.default, (c,))
    fetched = graph.call_function(
        torch.ops.tensorstash.fetch.default, (token_in, [4], [1], torch.float32)
    )
    stow = graph.call_function(torch.ops.tensorstash.stow.default, (a, "s"))
    e = graph.call_function(torch.ops.aten.add.Tensor, (d, fetched))
    graph.output((e, stow))
    return graph, {"a": a, "b": b, "stow": stow, "fetch": fetched, "e": e, "d": d}


def test_placement_puts_a_stow_after_the_last_use_and_a_fetch_before_the_first() -> None:
    graph, nodes = _graph()
    assert _stowing.place(graph) == 2
    order = list(graph.nodes)
    assert order.index(nodes["stow"]) == order.index(nodes["b"]) + 1  # a's last use
    assert order.index(nodes["fetch"]) == order.index(nodes["e"]) - 1  # its first use


def test_placement_comes_before_the_users_own_passes_and_keeps_the_cache_on() -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Theirs(CustomGraphPass):  # the user's own post-grad pass
        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "theirs"

    theirs = Theirs()
    for passes in (None, theirs, [theirs, theirs]):
        chosen = _stowing.with_placement(passes)
        assert chosen is not None
        placement, *rest = chosen
        assert rest == ([] if passes is None else [theirs] if passes is theirs else passes)
        # a CustomGraphPass with a uuid: inductor's compile cache stays on
        assert isinstance(placement, CustomGraphPass) and placement.uuid()
        assert _stowing.with_placement(chosen) is None  # not twice
    graph, nodes = _graph()
    placement(graph)
    order = list(graph.nodes)
    assert order.index(nodes["stow"]) == order.index(nodes["b"]) + 1
