"""On a CUDA device: Auto's plans for compiled code (NOTE [ Compiled code ] in
tensorstash/planning/compiler.py), the counting ops under CUDA graphs, and the
compiler's own offload in the bench.

Skipped where there is no CUDA device. Compiled code is compared under deterministic
algorithms, against the compiled model alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from zoo import TransformerBlock

import tensorstash as ts
from tensorstash import bench
from tensorstash.core import _support
from tensorstash.planning import compiler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
SMALL = (8, 128, 128)  # batch, sequence, width of the zoo's TransformerBlock
BOUND = (16, 512, 1024)  # a step whose kernels take longer than the host takes to queue them
PARTITIONED = "aot_eager_decomp_partition"  # the partitioner, without inductor's compile time


@pytest.fixture(autouse=True)
def planned_here() -> None:
    """What these tests check needs AOTAutograd's inlined hooks (NOTE [ Support range ])."""
    missing = _support.missing(_support.COMPILED)
    if missing is not None:
        pytest.skip(missing)


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(shape: tuple[int, int, int] = SMALL, training: bool = False) -> nn.Module:
    torch.manual_seed(0)
    width = shape[-1]
    blocks = [TransformerBlock(width, heads=width // 32) for _ in range(2)]
    return nn.Sequential(*blocks).to(CUDA).train(training)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _train(
    model: nn.Module,
    fn: Callable[[torch.Tensor], torch.Tensor],
    steps: int,
    auto: Any = None,
    profile: Any = None,
    shape: tuple[int, int, int] = SMALL,
    **stash: Any,
) -> tuple[list[Any], list[list[torch.Tensor]]]:
    """``steps`` steps of ``fn`` on one batch, under ``auto`` with ``profile`` (None: the
    compiled model alone): each step's session and gradients."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(CUDA)
    sessions, grads = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if auto is None:
            loss, session = fn(x), None
        else:
            with ts.stash(auto, profile=profile, **stash) as session:
                loss = fn(x)
        loss.backward()
        sessions.append(session)
        grads.append([p.grad.clone() for p in model.parameters()])
    return sessions, grads


def test_cuda_compiled_search_plans_on_the_device_and_compiles_nothing_after(
    fresh_dynamo: None,
) -> None:
    """The search end to end on CUDA: a budget under what the compiled forward keeps is
    met by a setting of the partitioner; the steps are timed on the device (rule 13: the
    host only queues the kernels of this step, so a host clock would read a fraction of
    it); the gradients are the compiler's own at that setting, bitwise; and no step after
    the plan compiles."""
    import time

    from torch._dynamo.backends.registry import lookup_backend

    model = _model(BOUND)
    fn = torch.compile(lambda x: model(x).square().mean(), backend=PARTITIONED)
    sessions, _ = _train(model, fn, 1, ts.Auto(), ts.Profile(), BOUND)
    budget = int(sessions[0].plan.trials[0].kept_bytes) // 3  # what 1.0 keeps, a third
    profile, auto = ts.Profile(), ts.Auto(device_budget=budget)
    for _ in range(16):
        sessions, _ = _train(model, fn, 1, auto, profile, BOUND)
        if sessions[0].plan.settled:
            break
    plan = sessions[0].plan
    assert plan.settled and plan.setting is not None and plan.setting < 1.0
    assert plan.kept_bytes is not None and plan.kept_bytes <= budget
    search = compiler.known(profile).searches[budget]
    assert search.device is not None and search.device.type == "cuda"
    graphs = _graphs()
    torch.cuda.synchronize()
    start = time.perf_counter()
    sessions, grads = _train(model, fn, 3, auto, profile, BOUND)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 3
    assert _graphs() == graphs, "a step after the plan compiled a graph"
    assert all(s.plan.setting == plan.setting for s in sessions)
    search.setting_for_step()  # takes the device's figures of the steps that ended
    timed = search.trials[plan.setting].seconds[-3:]
    assert len(timed) == 3 and all(0.7 * wall < seconds <= 1.2 * wall for seconds in timed)

    def at_setting(graph: Any, inputs: Any) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=plan.setting):
            return lookup_backend(PARTITIONED)(graph, inputs)

    peer = torch.compile(lambda x: model(x).square().mean(), backend=at_setting)
    _, expected = _train(model, peer, 1, shape=BOUND)
    for got in grads:
        assert all(torch.equal(a, b) for a, b in zip(got, expected[0], strict=True))


def test_cuda_counting_ops_count_every_step_under_cuda_graphs(fresh_dynamo: None) -> None:
    """Rule 8: under ``mode="reduce-overhead"`` the counting ops stay out of the CUDA
    graphs inductor records, so every step counts what the graphs keep, replays
    included; the step that records is kept out of the setting's figures as a compile
    is."""
    model = _model()
    fn = torch.compile(lambda x: model(x).square().mean(), mode="reduce-overhead")
    search = compiler.CompiledSearch(budget=1 << 40)
    search.device = CUDA
    pair = compiler.hooks_for(0.5)
    x = torch.randn(SMALL, generator=torch.Generator().manual_seed(2)).to(CUDA)
    counted = []
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        step = compiler.CompiledStep(search, 0.5, 0, CUDA, known=True)
        with torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack):
            loss = fn(x)
        step.exited()
        loss.backward()
        counted.append((step.count.bytes, step.count.device))
    torch.cuda.synchronize()
    search._take_times()
    kept = search.trials[0.5].kept_bytes
    assert kept and counted == [(kept, torch.device("cuda", 0))] * 6
    trial = search.trials[0.5]
    assert trial.timings == 6 and len(trial.seconds) >= 3  # the replays: steps of their own


def test_cuda_model_whose_attention_saves_cpu_scalars_plans_on_the_device(
    fresh_dynamo: None,
) -> None:
    """Rule 13: SDPA's memory-efficient kernel (dropout in training) saves its RNG seed
    and offset as CPU scalars; with ``min_bytes=0`` they are counted, yet the step runs
    on CUDA: its budget is the device's, not host RAM's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(training=True)
    fn = torch.compile(lambda x: model(x).square().mean(), backend=PARTITIONED)
    profile, auto = ts.Profile(), ts.Auto(device_budget=0.5)  # half the device's memory
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # compiled with it, too
        _train(model, fn, 1, auto, profile, min_bytes=0)
        count = compiler.thread_count()
        assert torch.device("cpu") in count.devices, "no CPU scalar was saved: nothing checked"
        assert count.device is not None and count.device.type == "cuda"
        known = compiler.known(profile)
        assert known.compiled and known.device is not None and known.device.type == "cuda"
        (search,) = known.searches.values()
        total = torch.cuda.mem_get_info()[1]
        assert search.device is not None and search.device.type == "cuda"
        assert abs(search.budget - total // 2) <= total // 100  # the device's half, not RAM's
        _, grads = _train(model, fn, 2, auto, profile, min_bytes=0)
        _, expected = _train(model, fn, 1)
    assert all(torch.equal(a, b) for a, b in zip(grads[-1], expected[0], strict=True))


def test_cuda_bench_runs_the_compilers_offload_or_says_why_not() -> None:
    """Rule 8 of NOTE [ Compiled runs ]: ``compile:offload`` runs beside the compiled
    model, bit for bit, or its row is skipped with its error; the bench goes on."""
    rows = bench.run_bench(
        "tiny",
        ["none", "compile:1.0", bench.COMPILE_OFFLOAD],
        steps=2,
        warmup=1,
        device="cuda",
        compile=True,
    )
    by_name = {row.policy: row for row in rows}
    assert by_name["none"].grads_equal and by_name["compile:1.0"].grads_equal
    offload = by_name[bench.COMPILE_OFFLOAD]
    if offload.skipped is None:
        assert offload.grads_equal
    else:
        assert offload.skipped.startswith("failed: "), offload.skipped
