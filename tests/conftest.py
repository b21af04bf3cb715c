"""Fixtures: the policy under test, where it may spill, and a clean hook stack."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import PolicySpec, policy_params, top_saved_tensors_hooks


@pytest.fixture(params=policy_params())
def spec(request: pytest.FixtureRequest) -> PolicySpec:
    """Every policy in turn (see ``checks.POLICY_SPECS``)."""
    return request.param


@pytest.fixture
def spill_dir(tmp_path: Path) -> Path:
    """The directory given to ``DiskSpill(directory=...)``."""
    path = tmp_path / "spill"
    path.mkdir()
    return path


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where ``tempfile`` makes directories during the test.

    ``DiskSpill(directory=None)`` (and the name "disk") spill to a private
    temporary directory; pointing ``tempfile`` here lets a test see its files.
    """
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


@pytest.fixture
def spill_dirs(spill_dir: Path, private_tmp: Path) -> list[Path]:
    """Every directory a policy of this test may write files to."""
    return [spill_dir, private_tmp]


@pytest.fixture
def policy(spec: PolicySpec, spill_dir: Path, private_tmp: Path) -> Any:
    """A fresh instance (or name) of the policy under test."""
    return spec.make(spill_dir)


@pytest.fixture(autouse=True)
def no_hooks_left() -> Iterator[None]:
    """Every test starts and ends with no saved-tensor hooks pushed."""
    assert top_saved_tensors_hooks() is None, "a previous test left saved-tensor hooks pushed"
    yield
    assert top_saved_tensors_hooks() is None, "the test left saved-tensor hooks pushed"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run torch's CPU kernels on one thread for a module's tests.

    The tests compare two runs in one process, so the thread count cannot
    change what they check. On a 2-core machine, torch's OpenMP threads spin
    while tensorstash's workers (or any other process) hold a core, which makes
    a 10 ms step take a second; one thread keeps the suite fast under load.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
