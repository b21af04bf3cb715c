"""Every zoo model under every policy: gradients bitwise equal to plain autograd."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checks import PolicySpec, assert_grads_equal, assert_went_to, leak_check, run_case
from zoo import ZOO

import tensorstash as ts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = [pytest.param(name, id=name) for name in ZOO]


@pytest.mark.parametrize("name", MODELS)
def test_zoo_grads_equal_plain(name: str, policy: Any) -> None:
    expected = run_case(ZOO[name]())
    session = ts.stash(policy, min_bytes=0)
    actual = run_case(ZOO[name](), session)
    assert_grads_equal(expected, actual)


@pytest.mark.parametrize("name", MODELS)
def test_zoo_tensors_reach_policy_tier(name: str, spec: PolicySpec, policy: Any) -> None:
    session = ts.stash(policy, min_bytes=0)
    run_case(ZOO[name](), session)
    assert_went_to(session, spec.tier)


@pytest.mark.parametrize("name", MODELS)
def test_zoo_step_releases_everything(name: str, policy: Any, spill_dirs: list[Path]) -> None:
    session = ts.stash(policy, min_bytes=0)
    run_case(ZOO[name](), session)
    leak_check(session, directories=spill_dirs)
