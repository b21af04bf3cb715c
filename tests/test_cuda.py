"""On a CUDA device: every zoo model under every policy, the streams, the budget, verify.

Skipped where there is no CUDA device. The oracle is plain autograd on the same
device, with deterministic algorithms so that two runs of the same model give the
same bits without tensorstash.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    PolicySpec,
    assert_grads_equal,
    assert_went_to,
    leak_check,
    run_case,
    tier_counts,
)
from torch import nn
from zoo import ZOO, Case

import tensorstash as ts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODELS = [pytest.param(name, id=name) for name in ZOO]


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def on_cuda(case: Case) -> Case:
    """The same case with its model and inputs on the CUDA device."""
    inputs = tuple(x.detach().cuda().requires_grad_(x.requires_grad) for x in case.inputs)
    return Case(case.name, case.model.cuda(), inputs, case.loss)


def device_tier(spec: PolicySpec) -> str:
    """Where a CUDA tensor ends: CpuOffload moves it to the host, the rest as on the CPU."""
    return "host" if spec.tier == "kept" and "cpu" in spec.id else spec.tier


@pytest.mark.parametrize("name", MODELS)
def test_cuda_zoo_grads_equal_plain(name: str, spec: PolicySpec, policy: Any) -> None:
    expected = run_case(on_cuda(ZOO[name]()))
    session = ts.stash(policy, min_bytes=0)
    actual = run_case(on_cuda(ZOO[name]()), session)
    assert_grads_equal(expected, actual)
    if spec.id.startswith("auto"):
        # Auto copies a CUDA tensor past its budget to host RAM (its rule 5); a CPU
        # tensor the model saves (SDPA's RNG state) goes to disk, as on the CPU.
        assert tier_counts(session)["host"] > 0, session.stats.table()
    else:
        assert_went_to(session, device_tier(spec))


@pytest.mark.parametrize("name", MODELS)
def test_cuda_zoo_releases_everything(name: str, policy: Any, spill_dirs: list[Path]) -> None:
    session = ts.stash(policy, min_bytes=0, verify=True)
    for _ in range(3):
        run_case(on_cuda(ZOO[name]()), session)
    torch.cuda.synchronize()
    leak_check(session, directories=spill_dirs)


@pytest.mark.parametrize("name", MODELS)
def test_cuda_zoo_auto_with_a_small_budget(name: str) -> None:
    expected = run_case(on_cuda(ZOO[name]()))
    session = ts.stash(ts.Auto(device_budget=64 << 10), min_bytes=0, record=True)
    actual = run_case(on_cuda(ZOO[name]()), session)
    assert_grads_equal(expected, actual)
    largest = max(row["bytes"] for row in session.decisions)
    kept = session.stats.to_dict()["tiers"]["kept"]
    assert kept["peak_bytes"] <= (64 << 10) + largest


class Wide(nn.Module):
    """Activations dominate memory: wide layers on a large batch, small weights."""

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def peak_of_step(model: nn.Module, x: torch.Tensor, ctx: Any = None) -> tuple[int, list[Any]]:
    """Peak CUDA bytes above the start of a step, and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    if ctx is None:
        loss = model(x).square().mean()
    else:
        with ctx:
            loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    return torch.cuda.max_memory_allocated() - start, grads


def test_cuda_cpu_offload_halves_peak_memory_with_equal_gradients() -> None:
    torch.manual_seed(0)
    model = Wide(depth=16).cuda()
    x = torch.randn(8192, 1024, device="cuda")
    peak_of_step(model, x)  # warm the allocator and cuBLAS
    plain, expected = peak_of_step(model, x)
    session = ts.stash(ts.CpuOffload())
    offloaded, actual = peak_of_step(model, x, session)
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a)
    assert tier_counts(session)["host"] >= 8
    assert offloaded <= plain * 0.5, f"peak {offloaded} bytes under cpu vs {plain} plain"


def test_cuda_auto_predicts_the_real_peak_of_a_plan_that_copies_to_the_host() -> None:
    # The bytes copied to the host are not on the device: counted as held there,
    # they made the predicted real peak too low by the bytes copied.
    torch.manual_seed(0)
    model = Wide(depth=16).cuda()
    x = torch.randn(8192, 1024, device="cuda")
    peak_of_step(model, x)
    with ts.stash(ts.Keep()) as probe:
        loss = model(x).square().mean()
    loss.backward()
    activation = probe.stats.to_dict()["tiers"]["kept"]["peak_bytes"]
    profile, auto = ts.Profile(), ts.Auto(device_budget=activation // 2, recompute=False)
    for _ in range(6):
        session = ts.stash(auto, profile=profile)
        peak, _ = peak_of_step(model, x, session)
    plan = session.plan
    assert plan is not None and "host" in plan.tiers.values(), plan
    assert plan.predicted_peak_bytes is not None
    assert abs(plan.predicted_peak_bytes / peak - 1) <= 0.15, (plan.predicted_peak_bytes, peak)


def test_cuda_auto_holds_its_budget_with_the_copies_still_running() -> None:
    # A device tensor copied to the host stays on the device until its copy ends: with
    # CpuOffload's fixed 1 GiB of copies in flight, a plan that kept its budget's worth
    # held up to 1 GiB more when forward ended.
    torch.manual_seed(0)
    model = Wide(depth=16).cuda()
    x = torch.randn(8192, 1024, device="cuda")
    largest = x.numel() * x.element_size()
    peak_of_step(model, x)
    with ts.stash(ts.Keep()) as probe:
        loss = model(x).square().mean()
    loss.backward()
    budget = probe.stats.to_dict()["tiers"]["kept"]["peak_bytes"] // 4
    profile, auto = ts.Profile(), ts.Auto(device_budget=budget, recompute=False)
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        with ts.stash(auto, profile=profile) as session:
            loss = model(x).square().mean()
            held = torch.cuda.memory_allocated() - start  # no synchronize: copies may run
            loss.backward()
        torch.cuda.synchronize()
    plan = session.plan
    assert plan is not None and "host" in plan.tiers.values() and plan.fits, plan
    assert held <= budget + 2 * largest, (held, budget)


def test_cuda_a_tensor_whose_copy_still_runs_comes_back_as_itself() -> None:
    # Backward begins while exp's 256 MiB output is still being copied out: it comes
    # back as that tensor, not as a second one copied back beside it. The device sleeps
    # before exp, so the copy cannot have ended when backward unpacks.
    x = torch.randn(8192, 8192, device="cuda", requires_grad=True)
    size = x.numel() * x.element_size()
    x.exp().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    with ts.stash(ts.CpuOffload(), min_bytes=0) as session:
        y = x.exp()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert y.grad_fn._saved_result.data_ptr() == y.data_ptr()  # the source itself
    y.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start  # before torch.equal's own 64 MiB
    assert tier_counts(session)["host"] == 1
    assert torch.equal(x.grad, expected)
    assert peak <= size * 1.25, f"backward held {peak} bytes beyond its start; x.grad is {size}"


def test_cuda_auto_times_what_backward_spends_recomputing_the_plan() -> None:
    # NOTE [ Recompute ] rule 7: on CUDA too, with events around each recompute.
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(4))
    ).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    peak_of_step(model, x)
    profile, auto = ts.Profile(), ts.Auto(always_recompute=["1", "2"])
    for _ in range(5):
        peak_of_step(model, x, ts.stash(auto, profile=profile))
    steps = [s for s in (*profile.history, *profile.quiet_history) if s.recomputed]
    assert steps, list(profile.history)
    for step in steps:
        assert step.recompute_s is not None and 0 < step.recompute_s < step.backward_s, step


def test_cuda_verify_catches_a_corrupted_host_copy() -> None:
    from tensorstash.tiers.cpu import OnHost

    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    gc.collect()
    with ts.stash(ts.CpuOffload(), min_bytes=0, verify=True):
        y = x.exp()
    torch.cuda.synchronize()
    packed = [obj for obj in gc.get_objects() if isinstance(obj, OnHost)]
    assert len(packed) == 1, f"expected one tensor on the host, found {len(packed)}"
    packed[0].ready()[123] ^= 0xFF  # the pinned copy of exp's output, between forward and backward
    with pytest.raises(ts.VerifyError):
        y.sum().backward()


def test_cuda_recompute_with_dropout_matches_plain() -> None:
    torch.manual_seed(0)
    blocks = nn.Sequential(*(ZOO["transformer"]().model for _ in range(3))).cuda()
    x = torch.randn(4, 64, 128, device="cuda", requires_grad=True)

    def step(model: nn.Module, ctx: Any = None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        if ctx is None:
            loss = model(x).square().sum()
        else:
            with ctx:
                loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = step(blocks)
    mixed = nn.Sequential(ts.recompute(blocks[0]), blocks[1], ts.recompute(blocks[2]))
    actual = step(mixed, ts.stash(ts.CpuOffload(), min_bytes=0))
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a)


def test_cuda_bench_rows_on_the_device(tmp_path: Path) -> None:
    from tensorstash.cli import main

    argv = ["bench", "--model", "tiny", "--steps", "2", "--warmup", "1", "--device", "cuda"]
    policies = "keep,cpu,lz4,disk,auto,recompute,save_on_cpu,checkpoint"
    assert main([*argv, "--policies", policies, "--json", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    assert rows[0]["policy"] == "none"
    ours = [row for row in rows if row["policy"] not in ("save_on_cpu", "checkpoint")]
    assert all(row["grads_equal"] for row in ours), ours
