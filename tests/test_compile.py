"""torch.compile: tensors saved by compiled graphs go through the session.

One compiled model serves every case (the hooks do not recompile it), so the
inductor compile is paid once per backend.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import counting_stows, leak_check, moved_by_eager_hooks
from torch import nn

import tensorstash as ts
from tensorstash.core import _support

TIERS = ("kept", "host", "disk")

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
    reason="torch.compile is not supported here",
)
planned = pytest.mark.skipif(
    _support.missing(_support.COMPILED) is not None,
    reason=str(_support.missing(_support.COMPILED)),  # what the plan table says there
)
"""Tests of Auto's plans through the compiler (NOTE [ Support range ] rule 2)."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _step(model: nn.Module, compiled: Callable[..., torch.Tensor], session: object) -> list:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    x = torch.randn(16, 32, 64, requires_grad=True)
    if session is None:
        out = compiled(x)
    else:
        with session:  # type: ignore[attr-defined]
            out = compiled(x)
    out.square().mean().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.fixture(
    scope="module", params=[pytest.param("inductor", marks=pytest.mark.slow), "aot_eager"]
)
def compiled(request: pytest.FixtureRequest) -> tuple[nn.Module, Callable[..., torch.Tensor], list]:
    model = _model()
    fn = torch.compile(model, backend=request.param)
    # Compiled for the first time inside a session: the module hooks must stay out of tracing.
    with ts.stash("keep", min_bytes=0):
        first = fn(torch.randn(16, 32, 64))
    del first
    return model, fn, _step(model, fn, None)


POLICIES: dict[str, Callable[[Path], object]] = {
    "keep": lambda d: ts.Keep(),
    "cpu": lambda d: ts.CpuOffload(),
    "lz4": lambda d: ts.Lz4(),
    "disk": lambda d: ts.DiskSpill(d),
    "lz4+disk": lambda d: ts.Chain(ts.Lz4(), ts.DiskSpill(d)),
    "auto": lambda d: ts.Auto(device_budget=0, directory=str(d)),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_compiled_grads_bitwise(
    name: str, compiled: tuple[nn.Module, Callable[..., torch.Tensor], list], tmp_path: Path
) -> None:
    model, fn, reference = compiled
    session = ts.stash(POLICIES[name](tmp_path), min_bytes=0, record=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning from torch about our module hooks
        grads = _step(model, fn, session)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    stats = session.stats
    saved = sum(tier.tensors for tier in stats.tiers.values())
    assert saved > 0, "the compiled graph's saved tensors did not reach the session"
    if name in ("disk", "lz4+disk", "auto"):
        assert stats.tiers["disk"].tensors > 0
    leak_check(session, directories=[tmp_path])  # files go as the writer drops its last use
    # Parameters are leaves that require grad: never moved, even from a compiled graph.
    rows = session.decisions
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    saved_weights = [row for row in rows if tuple(row["shape"]) in weights]
    assert len(saved_weights) >= len(weights), "the graph saved weights the session never saw"
    assert all(row["tier"] == "kept" and row["reason"] == "parameter" for row in saved_weights)
    assert {row["module"] for row in rows} == {"Sequential"}


@planned
def test_auto_quiet_steps_run_a_compiled_model_without_compiling_it_again() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _model()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(model, backend=counter)
    reference = _step(model, fn, None)
    profile, auto = ts.Profile(), ts.Auto()
    sessions, frames = [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning from torch about our module hooks
            for _ in range(8):
                session = ts.stash(auto, profile=profile)
                grads = _step(model, fn, session)
                assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
                sessions.append(session)
                frames.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    # NOTE [ Compiled code ] rule 5: the first step runs under the default partitioner's
    # pair (one compile) and learns that what the graph keeps fits; every later step
    # pushes nothing and runs the model's own graph, compiling nothing.
    assert [s.stats.quiet for s in sessions] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert frames[1:] == [frames[1]] * 7, frames


@planned
def test_auto_plans_around_a_compiled_function_whose_forward_runs_with_grad_off() -> None:
    """A plan is made while the compiled graph's forward saves its tensors, with grad off
    there: the probe of a recomputed region's cost must not inherit that (it raised
    "element 0 of tensors does not require grad")."""
    from tensorstash.planning import _rates

    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), backend="aot_eager")
    x = torch.randn(16, 32, 64)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = fn(x)
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    _rates._regions.clear()  # probe again, from inside the compiled forward
    try:
        reference = grads()
        profile = ts.Profile()
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            with ts.stash(ts.Auto(device_budget=64 << 10), profile=profile) as session:
                loss = fn(x)
            loss.backward()
            got = [p.grad for p in model.parameters() if p.grad is not None]
            assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
        assert session.plan is not None
    finally:
        torch._dynamo.reset()


# -- Auto plans compiled code through the compiler (NOTE [ Compiled code ] in compiler.py) --

PARTITIONED = "aot_eager_decomp_partition"  # the min-cut partitioner, without inductor's compile


def _compiled_fn(model: nn.Module, backend: Any = PARTITIONED) -> Callable[..., torch.Tensor]:
    return torch.compile(lambda x: model(x).square().mean(), backend=backend)


def _train(
    model: nn.Module, fn: Callable[..., torch.Tensor], policy: Any, steps: int, profile: Any
) -> tuple[list[Any], list[list[torch.Tensor]]]:
    sessions, grads = [], []
    x = torch.randn(16, 32, 64, generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if policy is None:
            loss = fn(x)
            session = None
        else:
            with ts.stash(policy, profile=profile) as session:
                loss = fn(x)
        loss.backward()
        sessions.append(session)
        grads.append([p.grad.clone() for p in model.parameters()])
    return sessions, grads


@pytest.fixture
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_auto_plans_compiled_code_as_eager_code_on_a_torch_that_cannot_inline_hooks(
    fresh_dynamo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Support range ] rule 2 (torch 2.8 and 2.9, as this torch is made to say):
    planning through the compiler steps aside; the steps are planned as eager code, with
    the gradients of the compiled model alone; a warning says so once, and so does the
    plan's table."""
    from tensorstash.planning import _opening

    said = "planning compiled code through the compiler needs torch 2.10 or newer (...)"
    monkeypatch.setattr(
        _support, "missing", lambda feature: said if feature == _support.COMPILED else None
    )
    monkeypatch.setattr(_opening, "_warned", [])
    model = _model().eval()
    fn = _compiled_fn(model)
    _, reference = _train(model, fn, None, 1, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sessions, grads = _train(model, fn, ts.Auto(device_budget=256 << 10), 4, ts.Profile())
    for got in grads:
        assert all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True))
    assert [str(w.message) for w in caught if said in str(w.message)] == [
        f"tensorstash.Auto: {said}; steps that run compiled code are planned as eager code, "
        "the session's hooks around the compiled graphs. pip install 'torch>=2.10' to plan "
        "them through the compiler"
    ]
    plans = [s.plan for s in sessions if s.plan is not None]
    assert all(isinstance(plan, ts.Plan) for plan in plans)  # eager plans, not the compiler's
    assert all(f"compiled code: {said}; planned as eager code" in p.table() for p in plans)
    plan = ts.Plan(256 << 10, activation_bytes=1 << 20, held_bytes=1 << 18, reachable_bytes=0)
    assert f"compiled code: {said}; planned as eager code" in plan.table()


@planned
def test_auto_leaves_compiled_code_that_fits_untouched(fresh_dynamo: Any) -> None:
    """The default budget: one step under the default partitioner's pair learns what the
    compiled graph keeps; every later step pushes nothing and runs the user's graphs."""
    model = _model().eval()  # no dropout: every step's gradients alike
    fn = _compiled_fn(model)
    _, reference = _train(model, fn, None, 1, None)
    profile = ts.Profile()
    sessions, grads = _train(model, fn, ts.Auto(), 2, profile)
    graphs = _graphs()
    later, more = _train(model, fn, ts.Auto(), 4, profile)
    assert _graphs() == graphs, "a step after the first compiled a graph"
    for got in grads + more:
        assert all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True))
    assert [s.stats.quiet for s in sessions + later] == [0, 1, 1, 1, 1, 1]
    plan = later[-1].plan
    assert plan.quiet and plan.settled and plan.kept_bytes > 0
    assert "the compiled graphs keep what fits, and run untouched" in plan.table()
    assert all(tier.tensors == 0 for tier in later[-1].stats.tiers.values())


@planned
def test_auto_plans_compiled_code_with_the_partitioners_budget(fresh_dynamo: Any) -> None:
    """A budget under what the compiled forward keeps: Auto asks the partitioner for the
    setting that fits, moves nothing with eager hooks, and trains as the compiler at that
    setting does, bitwise."""
    import torch._functorch.config as functorch_config

    model = _model().eval()
    fn = _compiled_fn(model)
    profile, auto = ts.Profile(), ts.Auto(device_budget=256 << 10)
    # the search's steps: 1.0, each setting compiled once, their peaks, rule 11's steps,
    # and rule 12's carry where rule 11 names a setting
    sessions, _ = _train(model, fn, auto, 14, profile)
    plan = sessions[-1].plan
    assert plan.settled and plan.setting is not None and plan.setting < 1.0
    assert plan.kept_bytes is not None and plan.kept_bytes <= 256 << 10
    assert f"activation_memory_budget={plan.setting}" in plan.table()
    first = plan.trials[0]
    assert first.setting == 1.0 and first.kept_bytes is not None and first.kept_bytes > 256 << 10
    graphs = _graphs()
    with counting_stows() as stows:
        more, tail = _train(model, fn, auto, 2, profile)
    assert _graphs() == graphs and all(s.plan.setting == plan.setting for s in more)
    # No eager hook saw a compiled graph's tensors: nothing was moved or counted, but
    # what a carry (rule 12) writes to disk inside the graphs.
    assert (stows.of(more[-1]) > 0) == (plan.moving > 0), (stows.of(more[-1]), plan.table())
    assert sum(moved_by_eager_hooks(more[-1], tier, stows) for tier in TIERS) == 0
    assert functorch_config.activation_memory_budget == 1.0  # the user's value is back

    def at_setting(graph: Any, inputs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        with functorch_config.patch(activation_memory_budget=plan.setting):
            return lookup_backend(PARTITIONED)(graph, inputs)

    peer = _compiled_fn(model, at_setting)
    _, expected = _train(model, peer, None, 1, None)
    for got in tail:
        assert all(torch.equal(a, b) for a, b in zip(got, expected[0], strict=True))


@planned
@pytest.mark.slow
def test_compiled_search_keeps_the_users_partitioner_budget(fresh_dynamo: Any) -> None:
    import torch._functorch.config as functorch_config

    model = _model().eval()
    fn = _compiled_fn(model)
    with functorch_config.patch(activation_memory_budget=0.7):
        _train(model, fn, ts.Auto(device_budget=64 << 10), 3, ts.Profile())
        assert functorch_config.activation_memory_budget == 0.7


@planned
def test_auto_plans_an_eager_model_as_before_in_a_process_that_compiled(
    fresh_dynamo: Any,
) -> None:
    """Dynamo compiled something else: the first step learns that this model's code is
    eager (no compiled graph kept anything), and the steps after plan it as eager code."""
    other = _model()
    _train(other, _compiled_fn(other), None, 1, None)
    model = _model()  # training: Auto plans a model in training (dropout seeded alike)

    def eager(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    _, reference = _train(model, eager, None, 1, None)
    profile = ts.Profile()
    sessions, grads = _train(model, eager, ts.Auto(device_budget=256 << 10), 5, profile)
    for got in grads:
        assert all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True))
    from tensorstash.planning import compiler

    assert compiler.known(profile).compiled is False
    plan = sessions[-1].plan
    assert plan is not None and not isinstance(plan, compiler.CompilerPlan)
    moved = sessions[-1].stats.tiers
    assert moved["host"].tensors + moved["disk"].tensors > 0 or plan.recompute


@planned
def test_auto_plans_compiled_graphs_that_draw_random_numbers_with_their_draws_saved(
    fresh_dynamo: Any,
) -> None:
    """Rule 7: under a memory budget the partitioner recomputes dropout with other random
    values (same loss, other gradients); Auto's budget keeps what the random ops drew, and
    trains bitwise as the compiled model alone does. The compiler's own budget at the same
    setting, without the pass, gives other gradients: the pass is what makes them equal."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.registry import lookup_backend

    model = _model()  # training: dropout draws random numbers
    fn = _compiled_fn(model)
    _, reference = _train(model, fn, None, 1, None)
    profile = ts.Profile()
    with counting_stows() as stows:
        sessions, grads = _train(model, fn, ts.Auto(device_budget=64 << 10), 12, profile)
    for got in grads:
        assert all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True))
    plan = sessions[-1].plan
    assert plan.random and plan.settled and plan.setting is not None and plan.setting < 1.0
    assert 0.0 not in [t.setting for t in plan.trials]  # 0 recomputes random ops too
    assert "random ops saved (dropout's draws kept" in plan.table()
    assert (stows.of(sessions[-1]) > 0) == (plan.moving > 0), plan.table()
    assert sum(moved_by_eager_hooks(sessions[-1], tier, stows) for tier in TIERS) == 0

    def compilers_own(graph: Any, inputs: Any) -> Any:
        with functorch_config.patch(activation_memory_budget=plan.setting):
            return lookup_backend(PARTITIONED)(graph, inputs)

    _, peer = _train(model, _compiled_fn(model, compilers_own), None, 1, None)
    assert not all(torch.equal(a, b) for a, b in zip(peer[0], reference[0], strict=True))


def test_the_random_ops_pass_marks_the_forwards_draws_and_runs_the_users_pass() -> None:
    """Rule 7: only the forward's random ops, and not those the user's checkpointing
    marked; the user's own joint pass runs after."""
    from torch.utils.checkpoint import CheckpointPolicy

    from tensorstash.planning.compiler import _SaveRandom

    graph = torch.fx.Graph()
    x = graph.placeholder("primals_1")
    tangent = graph.placeholder("tangents_1")
    drawn = graph.call_function(torch.ops.aten.rand_like.default, (x,))
    theirs = graph.call_function(torch.ops.aten.bernoulli.default, (x,))
    theirs.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    late = graph.call_function(torch.ops.aten.rand_like.default, (tangent,))
    graph.output((drawn, theirs, late))
    joint = torch.fx.GraphModule(torch.nn.Module(), graph)
    ran: list[Any] = []
    assert _SaveRandom(lambda g, i: ran.append(g) or g)(joint, ()) is joint
    assert ran == [joint]
    assert drawn.meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert theirs.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert "recompute" not in late.meta


@planned
def test_auto_sees_the_draws_of_graphs_from_the_compile_cache(
    fresh_dynamo: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Rule 7: graphs that inductor finds in its caches (AOTAutograd's, the FX graph
    cache) are not compiled again, so nothing at compile time sees their dropout; the
    forward that runs tells. A second profile, after a reset, must still leave out the
    setting that recomputes random ops, and train bitwise."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=True))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=True))
        stack.callback(
            torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled()
        )
        torch.use_deterministic_algorithms(True)
        model = _model()  # training: dropout draws random numbers
        fn = _compiled_fn(model, "inductor")
        _, reference = _train(model, fn, None, 1, None)
        _train(model, fn, ts.Auto(device_budget=64 << 10), 1, ts.Profile())  # fills the cache
        torch._dynamo.reset()
        fn = _compiled_fn(model, "inductor")
        sessions, grads = _train(model, fn, ts.Auto(device_budget=64 << 10), 6, ts.Profile())
    for got in grads:
        assert all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True))
    plan = sessions[-1].plan
    assert plan.random and plan.settled and plan.setting is not None
    assert 0.0 not in [t.setting for t in plan.trials]


@planned
@pytest.mark.slow
def test_graphs_cached_under_another_scheme_are_not_found(
    fresh_dynamo: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Rule 7: AOTAutograd's cache leaves the joint pass out of its key; the scheme named
    in the pack graph keeps graphs compiled without the pass (or with another) apart."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from tensorstash.planning import compiler

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = _model()
    x = torch.randn(16, 32, 64)
    ours = compiler.SCHEME

    def hits(scheme: str) -> int:
        monkeypatch.setattr(compiler, "SCHEME", scheme)
        monkeypatch.setattr(compiler, "_PAIRS", {})
        torch._dynamo.reset()
        before = counters["aot_autograd"]["autograd_cache_hit"]
        fn = torch.compile(lambda x: model(x).sum())
        pair = compiler.hooks_for(0.5)
        with torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack):
            loss = fn(x)
        loss.backward()
        return int(counters["aot_autograd"]["autograd_cache_hit"] - before)

    with (
        inductor_config.patch(fx_graph_cache=True),
        functorch_config.patch(enable_autograd_cache=True),
    ):
        assert hits("before") == 0
        assert hits("before") == 1  # the cache is at work
        assert hits(ours) == 0


class _Embedded(nn.Module):
    """Tokens through an embedding and two blocks, to a loss: one compiled forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize(
    "hooks",
    [
        "python",
        pytest.param("c-chosen", marks=pytest.mark.slow),
        pytest.param("c-auto", marks=pytest.mark.slow),
    ],
)
def test_session_hooks_are_not_traced_by_dynamo_in_recompute_regions(
    fresh_dynamo: Any, hooks: str
) -> None:
    """Rule 12 of NOTE [ Session ]: recompute regions inside a compiled model push hooks
    that dynamo traces; the session's own hooks, pushed around the compiled model, must
    run with dynamo off, or dynamo compiles them with fake tensors and fails. The Python
    hooks (a profile's), and the C hooks that call back into Python for a policy's pack
    (lz4) or for Auto's choice."""
    model = _Embedded().eval()
    compiled = torch.compile(model, backend="aot_eager")
    tokens = torch.randint(0, 100, (8, 128), generator=torch.Generator().manual_seed(3))
    compiled(tokens).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    profile = ts.Profile() if hooks == "python" else None
    policy: Any = {"python": "auto", "c-chosen": "lz4", "c-auto": ts.Auto(device_budget=0)}[hooks]
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        names = ts.recompute_modules(model, Block)
        try:
            with ts.stash(policy, profile=profile, min_bytes=0):
                compiled(tokens).backward()
        finally:
            for name in names:
                ts.unrecompute(model.get_submodule(name))
        grads = [p.grad for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))


# -- torch.compile's own options: fullgraph, mode, dynamic shapes --


@planned
def test_auto_plans_a_fullgraph_compile(fresh_dynamo: Any) -> None:
    """fullgraph=True: neither the pair nor the first step's eager hooks break the graph."""
    model = _model().eval()
    fn = torch.compile(lambda x: model(x).square().mean(), backend=PARTITIONED, fullgraph=True)
    _, reference = _train(model, fn, None, 1, None)
    sessions, grads = _train(model, fn, ts.Auto(device_budget=256 << 10), 14, ts.Profile())
    plan = sessions[-1].plan
    assert plan.settled and plan.setting is not None and plan.setting < 1.0
    for got in grads:
        assert all(torch.allclose(a, b) for a, b in zip(got, reference[0], strict=True))


@planned
@pytest.mark.slow
def test_auto_plans_dynamic_shapes_by_the_most_a_step_kept(fresh_dynamo: Any) -> None:
    """Rule 9 of NOTE [ Compiled code ]: steps of two lengths share one graph per setting;
    the plan fits the longer one, and no step after the plan compiles."""
    model = _model().eval()
    fn = torch.compile(lambda x: model(x).square().mean(), backend=PARTITIONED, dynamic=True)
    lengths = [8, 32] * 6
    budget = 256 << 10
    profile = ts.Profile()
    plans, graphs = [], []
    for length in lengths:
        x = torch.randn(16, length, 64)
        with ts.stash(ts.Auto(device_budget=budget), profile=profile) as session:
            loss = fn(x)
        loss.backward()
        plans.append(session.plan)
        graphs.append(_graphs())
    plan = plans[-1]
    assert plan.settled and plan.setting is not None and plan.setting < 1.0
    assert plan.kept_bytes is not None and plan.kept_bytes <= budget
    settled = next(i for i, p in enumerate(plans) if p.settled)
    assert graphs[settled:] == [graphs[settled]] * (len(lengths) - settled)


@planned
@pytest.mark.slow
def test_auto_plans_reduce_overhead_on_the_cpu_as_the_default_mode(fresh_dynamo: Any) -> None:
    """mode="reduce-overhead" asks for CUDA graphs; on the CPU inductor skips them (and says
    so in its counters), and Auto plans the graphs it compiles as any others."""
    from torch._dynamo.utils import counters

    model = _model().eval()
    fn = torch.compile(lambda x: model(x).square().mean(), mode="reduce-overhead")
    _, reference = _train(model, fn, None, 1, None)
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips > 0
    sessions, grads = _train(model, fn, ts.Auto(device_budget=256 << 10), 14, ts.Profile())
    plan = sessions[-1].plan
    assert plan.settled and plan.setting is not None and plan.setting < 1.0
    assert counters["inductor"]["cudagraph_skips"] > skips  # each setting's graphs too
    for got in grads:
        assert all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6)
            for a, b in zip(got, reference[0], strict=True)
        )


@planned
@pytest.mark.slow
def test_auto_pair_is_not_traced_by_dynamo_in_eager_code_of_a_compiled_function(
    fresh_dynamo: Any,
) -> None:
    """Rule 2 of NOTE [ Compiled code ]: code that dynamo leaves eager inside a compiled
    function still runs under its frame callback; the pair autograd calls from there runs
    with dynamo off, and so do the session's hooks it hands tensors to."""
    model = _model().eval()

    def eager_part(x: torch.Tensor) -> torch.Tensor:
        return x.tanh() * x  # saves tensors outside any graph

    eager = torch._dynamo.disable(eager_part, recursive=False)
    fn = torch.compile(lambda x: eager(model(x)).square().mean(), backend=PARTITIONED, dynamic=True)
    _, reference = _train(model, fn, None, 1, None)
    sessions, grads = _train(model, fn, ts.Auto(device_budget=256 << 10), 6, ts.Profile())
    for got in grads:
        assert all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True))
    assert sessions[-1].plan.setting < 1.0  # planned through the compiler, eager part and all
