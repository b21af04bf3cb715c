"""Every zoo model under every policy: gradients bitwise equal to plain autograd."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    PolicySpec,
    Ticks,
    assert_grads_equal,
    assert_went_to,
    grads_of,
    leak_check,
    model_policy_params,
    run_case,
)
from zoo import ZOO

import tensorstash as ts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = [pytest.param(name, id=name) for name in ZOO]


@pytest.mark.parametrize(("name", "spec"), model_policy_params(list(ZOO)))
def test_zoo_grads_equal_plain(name: str, policy: Any) -> None:
    expected = run_case(ZOO[name]())
    session = ts.stash(policy, min_bytes=0)
    actual = run_case(ZOO[name](), session)
    assert_grads_equal(expected, actual)


@pytest.mark.parametrize(("name", "spec"), model_policy_params(list(ZOO)))
def test_zoo_tensors_reach_policy_tier(name: str, spec: PolicySpec, policy: Any) -> None:
    session = ts.stash(policy, min_bytes=0)
    run_case(ZOO[name](), session)
    assert_went_to(session, spec.tier)


@pytest.mark.parametrize(("name", "spec"), model_policy_params(list(ZOO)))
def test_zoo_step_releases_everything(name: str, policy: Any, spill_dirs: list[Path]) -> None:
    session = ts.stash(policy, min_bytes=0)
    run_case(ZOO[name](), session)
    leak_check(session, directories=spill_dirs)


STEPS = 9


def _train(
    case: Any, budgets: list[Any] | None, profile: ts.Profile | None
) -> tuple[list[Any], list[ts.Session]]:
    """SGD steps of a zoo case, each step's gradients; with ``Auto`` at ``budgets[step]``."""
    optimizer = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    grads, sessions = [], []
    for step in range(STEPS):
        session = None
        if budgets is not None:
            session = ts.stash(ts.Auto(device_budget=budgets[step]), profile=profile, min_bytes=0)
            sessions.append(session)
        grads.append(grads_of(case.model, case.inputs, case.loss, session, seed=100 + step))
        optimizer.step()
    return grads, sessions


@pytest.mark.filterwarnings("ignore:tensorstash.Auto. device_budget .* cannot be held")
@pytest.mark.parametrize("name", MODELS)
def test_zoo_auto_plan_trains_bitwise_while_the_plan_changes(name: str) -> None:
    expected, _ = _train(ZOO[name](), None, None)
    case = ZOO[name]()
    with ts.stash(ts.Keep(), min_bytes=0) as probe:
        case.step()
    half = max(probe.stats.to_dict()["tiers"]["kept"]["peak_bytes"] // 2, 1)
    # Learning at half the activation bytes, planned there, then at the default limit:
    # plans that recompute or move sites, then one that keeps everything, which takes its
    # real peak in its first steps under the limit and then runs quiet (sessions that
    # open quiet), on every model.
    budgets: list[Any] = [half] * 5 + [None] * 4
    actual, sessions = _train(case, budgets, ts.Profile(clock=Ticks()))
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        try:
            assert_grads_equal(want, got)
        except AssertionError as error:
            raise AssertionError(f"step {step}: {error}") from None
    assert [s.stats.quiet for s in sessions[-2:]] == [1, 1]
    planned = [s.plan for s in sessions[3:5]]
    assert all(p is not None and (p.recompute or p.tiers) for p in planned), planned
