"""Every zoo model under every policy: gradients bitwise equal to plain autograd."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checks import PolicySpec, assert_grads_equal, assert_went_to, grads_of, leak_check
from zoo import ZOO, Case

import tensorstash as ts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = [pytest.param(name, id=name) for name in ZOO]


def run(case: Case, ctx: Any = None) -> dict[str, Any]:
    return grads_of(case.model, case.inputs, case.loss, ctx)


@pytest.mark.parametrize("name", MODELS)
def test_zoo_grads_equal_plain(name: str, policy: Any) -> None:
    expected = run(ZOO[name]())
    session = ts.stash(policy, min_bytes=0)
    actual = run(ZOO[name](), session)
    assert_grads_equal(expected, actual)


@pytest.mark.parametrize("name", MODELS)
def test_zoo_tensors_reach_policy_tier(name: str, spec: PolicySpec, policy: Any) -> None:
    session = ts.stash(policy, min_bytes=0)
    run(ZOO[name](), session)
    assert_went_to(session, spec.tier)


@pytest.mark.parametrize("name", MODELS)
def test_zoo_step_releases_everything(name: str, policy: Any, spill_dirs: list[Path]) -> None:
    session = ts.stash(policy, min_bytes=0)
    run(ZOO[name](), session)
    leak_check(session, directories=spill_dirs)
