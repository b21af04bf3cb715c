"""torch.compile: tensors saved by compiled graphs go through the session.

One compiled model serves every case (the hooks do not recompile it), so the
inductor compile is paid once per backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checks import leak_check
from torch import nn

import tensorstash as ts

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
    reason="torch.compile is not supported here",
)


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


@pytest.fixture(scope="module", params=["inductor", "aot_eager"])
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
    assert all(row["tier"] == "kept" for row in rows if tuple(row["shape"]) in weights)
    assert {row["module"] for row in rows} == {"Sequential"}


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
    # The plan keeps everything: from the fourth step on, quiet, and from the fifth the
    # sessions open quiet; none of them compiles the model again.
    assert [s.stats.quiet for s in sessions] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert frames[3:] == [frames[3]] * 5, frames


def test_auto_plans_around_a_compiled_function_whose_forward_runs_with_grad_off() -> None:
    """A plan is made while the compiled graph's forward saves its tensors, with grad off
    there: the probe of a recomputed region's cost must not inherit that (it raised
    "element 0 of tensors does not require grad")."""
    from tensorstash import _rates

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
