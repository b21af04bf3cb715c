"""Every zoo model compiled, under every lossless policy and Auto: gradients bitwise equal
to the compiled model alone, and no graph compiled once a policy's steps are warm.

The models compile with ``aot_eager_decomp_partition``: AOTAutograd and the min-cut
partitioner, as inductor runs them, without inductor's code generation (test_compile.py
runs inductor). The reference is the compiled model alone, not eager autograd: a compiled
graph decomposes ops and may round otherwise than eager code.

- Plain policies see each compiled graph as one ``autograd.Function``: its saved tensors go
  through the policy, and come back as they were.
- ``Auto`` with a budget under what the compiled graphs keep plans through the compiler
  (NOTE [ Compiled code ] in planning/compiler.py): its pair's graphs compile at the
  partitioner's settings it tries, with random ops saved, and train bitwise as the
  compiled model alone does (the recompute runs the same decomposed ops again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    assert_grads_equal,
    counting_stows,
    leak_check,
    model_policy_params,
    moved_by_eager_hooks,
    run_case,
)
from torch._dynamo.utils import counters
from zoo import ZOO, Case

import tensorstash as ts

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported(),
        reason="torch.compile is not supported here",
    ),
]

BACKEND = "aot_eager_decomp_partition"
WARM = 2
"""Steps a policy takes before the compiled graphs it runs must all be compiled."""


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def compiled() -> Iterator[Callable[[str], tuple[Case, Any]]]:
    """Each zoo model compiled once for the module: its case, and the compiled model
    alone's gradients."""
    torch._dynamo.reset()
    made: dict[str, tuple[Case, Any]] = {}

    def get(name: str) -> tuple[Case, Any]:
        if name not in made:
            case = ZOO[name]()
            fn = torch.compile(case.model, backend=BACKEND)
            compiled_case = Case(case.name, fn, case.inputs, case.loss)  # type: ignore[arg-type]
            made[name] = (compiled_case, run_case(compiled_case))
        return made[name]

    with torch._dynamo.config.patch(cache_size_limit=64):
        yield get
    torch._dynamo.reset()


@pytest.mark.parametrize(("name", "spec"), model_policy_params(list(ZOO)))
def test_compiled_zoo_grads_equal_the_compiled_model_alone(
    name: str, policy: Any, compiled: Callable[[str], tuple[Case, Any]], spill_dirs: list[Path]
) -> None:
    case, expected = compiled(name)
    for step in range(WARM + 2):
        if step == WARM:
            graphs = _graphs()
        session = ts.stash(policy, min_bytes=0)
        assert_grads_equal(expected, run_case(case, session))
    assert _graphs() == graphs, "a warm step compiled a graph (a recompile loop)"
    saved = sum(tier.tensors for tier in session.stats.tiers.values())
    assert saved > 0, "the compiled graphs' saved tensors did not reach the session"
    leak_check(session, directories=spill_dirs)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "transformer" else pytest.mark.slow) for n in ZOO]
)
def test_compiled_zoo_under_auto_plans_through_the_compiler_bitwise(
    name: str, compiled: Callable[[str], tuple[Case, Any]]
) -> None:
    """A budget of a quarter of what the compiled graphs keep: Auto searches the
    partitioner's settings (each compiled once), settles, then compiles nothing more;
    every step's gradients are the compiled model alone's."""
    from tensorstash.planning import compiler
    from tensorstash.planning.compiler import CompilerPlan

    case, expected = compiled(name)
    probe = ts.stash(ts.Keep(), min_bytes=0)
    run_case(case, probe)
    kept = probe.stats.tiers["kept"].peak_bytes
    auto, profile = ts.Auto(device_budget=max(kept // 4, 1)), ts.Profile()
    plans = []
    for _ in range(12):
        session = ts.stash(auto, profile=profile)
        assert_grads_equal(expected, run_case(case, session))
        plans.append(session.plan)
        if isinstance(session.plan, CompilerPlan) and session.plan.settled:
            break
    if name == "lstm":  # dynamo runs nn.LSTM eagerly (torch._dynamo.config.allow_rnn)
        assert compiler.known(profile).compiled is False  # so Auto planned it as eager code
        return
    plan = plans[-1]
    assert isinstance(plan, CompilerPlan) and plan.settled, [str(p) for p in plans]
    graphs = _graphs()
    for _ in range(2):
        session = ts.stash(auto, profile=profile)
        with counting_stows() as stows:
            assert_grads_equal(expected, run_case(case, session))
        assert session.plan is not None and session.plan.setting == plan.setting
        # No eager hook moved a compiled graph's tensors (eager code's stay, counted); a
        # carry's graphs write to disk themselves (rule 12), and only a carry's do.
        assert (stows.of(session) > 0) == (plan.moving > 0), (stows.of(session), plan.table())
        assert moved_by_eager_hooks(session, "host", stows) == 0, session.stats.table()
        assert moved_by_eager_hooks(session, "disk", stows) == 0, session.stats.table()
    assert _graphs() == graphs, "the settled plan compiled a graph (a recompile loop)"
