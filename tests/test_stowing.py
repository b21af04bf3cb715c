"""The disk tier inside compiled graphs (rule 12 of NOTE [ Compiled code ] in
tensorstash/planning/compiler.py): stowed tensors come back bitwise, leave no file, and
the placement pass puts each stow and fetch next to its uses."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from checks import counting_stows, leak_check, moved_by_eager_hooks
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
def test_eager_hooks_disk_count_leaves_out_exactly_what_the_graphs_stowed(
    fresh_dynamo: None, tmp_path: Path
) -> None:
    """The tests' check of what eager hooks moved (``checks.moved_by_eager_hooks``) takes
    off a session's disk count the tensors its graphs stowed, and nothing more: a tensor an
    eager hook spilled beside them still counts."""
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend="aot_eager_decomp_partition")
    session = SimpleNamespace(_ctx=Context(StashStats()))
    session.stats = session._ctx.stats
    with counting_stows() as stows:
        _, moved = _stowing_step(model, fn, tmp_path, 1 << 20, session._ctx)
    assert moved > 0 and stows.of(session) == session.stats.tiers["disk"].tensors > 0
    assert moved_by_eager_hooks(session, "disk", stows) == 0
    spill = DiskSpill(tmp_path, background=False)
    packed = spill.pack(torch.randn(256, 256), session._ctx)  # as an eager hook spills
    session._ctx.account(packed)
    assert moved_by_eager_hooks(session, "disk", stows) == 1
    del packed
    gc.collect()
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


def _theirs() -> Any:
    """The user's own post-grad pass: an inductor ``CustomGraphPass`` with a uuid, which
    counts its runs."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Theirs(CustomGraphPass):
        def __init__(self) -> None:
            self.ran = 0

        def __call__(self, graph: fx.Graph) -> None:
            self.ran += 1

        def uuid(self) -> str:
            return "theirs"

    return Theirs()


def _one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor as before torch 2.13: one post-grad pass, no list (NOTE [ Support range ]
    rule 3)."""
    from torch._inductor import custom_graph_pass

    monkeypatch.delattr(custom_graph_pass, "get_custom_graph_passes", raising=False)


def test_placement_comes_before_the_users_own_passes_and_keeps_the_cache_on() -> None:
    from torch._inductor import custom_graph_pass

    if not hasattr(custom_graph_pass, "get_custom_graph_passes"):
        pytest.skip("inductor takes one post-grad pass before torch 2.13 (tested below)")
    theirs = _theirs()
    for passes in (None, theirs, [theirs, theirs]):
        chosen = _stowing.with_placement(passes)
        assert chosen is not None
        placement, *rest = chosen
        assert rest == ([] if passes is None else [theirs] if passes is theirs else passes)
        # a CustomGraphPass with a uuid: inductor's compile cache stays on
        assert isinstance(placement, custom_graph_pass.CustomGraphPass) and placement.uuid()
        assert _stowing.with_placement(chosen) is None  # not twice
    graph, nodes = _graph()
    placement(graph)
    order = list(graph.nodes)
    assert order.index(nodes["stow"]) == order.index(nodes["b"]) + 1


def test_placement_runs_the_users_own_pass_after_it_where_inductor_takes_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before torch 2.13 (2.11 raised ImportError here): one pass that places, then runs
    the user's, keyed by both for inductor's cache, and by none where theirs has none."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    _one_pass(monkeypatch)
    theirs = _theirs()
    alone = _stowing.with_placement(None)
    chained = _stowing.with_placement(theirs)
    assert isinstance(alone, CustomGraphPass) and isinstance(chained, CustomGraphPass)
    assert alone.uuid() and chained.uuid() and alone.uuid() != chained.uuid()
    assert _stowing.with_placement(chained) is None  # not twice
    graph, nodes = _graph()
    chained(graph)
    order = list(graph.nodes)
    assert order.index(nodes["stow"]) == order.index(nodes["b"]) + 1
    assert theirs.ran == 1
    assert _stowing.with_placement(lambda graph: None).uuid() is None  # theirs: no cache


@inlined
@pytest.mark.slow
def test_stowed_tensors_come_back_bitwise_where_inductor_takes_one_pass(
    fresh_dynamo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    _one_pass(monkeypatch)
    placed: list[int] = []
    place = _stowing.place
    monkeypatch.setattr(_stowing, "place", lambda graph: placed.append(place(graph)) or 0)
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend="inductor")
    expected = _grads(model, fn)
    with (  # compiled here, not found in the caches (where the pass already ran)
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        grads, moved = _stowing_step(model, fn, tmp_path, 1 << 20)
    assert moved >= 1 << 20 and len(placed) == 2 and all(placed)  # forward and backward
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    gc.collect()
    leak_check(directories=[tmp_path])


# -- rule 12: the placement is in force only while a pair that moves can compile --


def _args(trigger: str, compile_id: str) -> Any:
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    return CallbackArgs(CallbackTrigger[trigger], compile_id)


def _post_grad_passes_in(trigger: str, compile_id: str, pair: Any = None) -> Any:
    """The post-grad passes inductor compiles with while dynamo's callbacks bracket a
    compile (``pair`` pushed, if any)."""
    import torch._inductor.config as inductor_config

    hooks = (
        torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack)
        if pair is not None
        else contextlib.nullcontext()
    )
    with hooks:
        compiler._compile_starts(_args(trigger, compile_id))
        try:
            return inductor_config.post_grad_custom_post_pass
        finally:
            compiler._compile_ends(_args(trigger, compile_id))


def _placed(passes: Any) -> bool:
    listed = passes if isinstance(passes, list) else [passes]
    return any(getattr(each, "tensorstash_placement", False) is True for each in listed)


@inlined
def test_placement_is_in_force_for_a_moving_pairs_graphs_and_their_lazy_backward() -> None:
    moving = compiler.hooks_for(0.5, 3 << 20)
    assert _placed(_post_grad_passes_in("DYNAMO", "901/0", moving))
    assert not _placed(_post_grad_passes_in("DYNAMO", "902/0", compiler.hooks_for(0.5)))
    assert not _placed(_post_grad_passes_in("DYNAMO", "903/0"))  # the user's own compile
    assert not _placed(_post_grad_passes_in("LAZY_BACKWARD", "902/0"))
    assert _placed(_post_grad_passes_in("LAZY_BACKWARD", "901/0"))  # its pair is gone by now
    assert not _placed(_post_grad_passes_in("LAZY_BACKWARD", "901/0"))  # compiled once
    import torch._inductor.config as inductor_config

    assert inductor_config.post_grad_custom_post_pass is None  # the user's, back


def test_compiles_after_a_moving_pair_was_made_are_the_users_own(
    fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a pair that moved was made, every later compile in the process ran the
    placement pass (and under torch 2.11 failed): a compile of the user's own, with no pair
    pushed, compiles as it would without tensorstash."""
    import torch._inductor.config as inductor_config

    _one_pass(monkeypatch)  # as 2.11: the compile failed with an ImportError
    compiler.hooks_for(0.5, 3 << 20)
    seen: list[Any] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        seen.append(inductor_config.post_grad_custom_post_pass)
        return graph.forward

    fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend=backend)
    x = torch.randn(8, requires_grad=True)
    fn(x).backward()
    assert seen == [None] and torch.equal(x.grad, 2 * x.cos().detach())
