"""The package's layout: old import paths name the same modules, and imports run one way."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tensorstash as ts
from tensorstash._aliases import OLD_PATHS

PACKAGE = Path(ts.__file__).parent
LAYERS = ["core", "memory", "tiers", "session", "planning", "integrations", "bench"]
"""Subpackages in import order: each imports only from those before it."""


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_import_path_names_the_module_at_its_new_path(old: str) -> None:
    assert importlib.import_module(f"tensorstash.{old}") is importlib.import_module(
        f"tensorstash.{OLD_PATHS[old]}"
    )


@pytest.mark.slow  # a new Python process
def test_old_from_imports_of_public_names_work_in_a_fresh_process() -> None:
    script = (
        "from tensorstash.disk import DiskSpill\n"
        "from tensorstash.stash import stash, Session\n"
        "from tensorstash.lightning import StashCallback\n"
        "from tensorstash.hf import StashTrainerCallback\n"
        "from tensorstash.distributed import gather_stats\n"
        "import tensorstash as ts, tensorstash.recompute, tensorstash.stash\n"
        "assert ts.DiskSpill is DiskSpill and ts.Session is Session\n"
        "assert callable(ts.stash) and ts.stash is stash and callable(ts.recompute)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


NO_NUMPY = """
import importlib.machinery

_find = importlib.machinery.PathFinder.find_spec.__func__

def _find_spec(cls, name, path=None, target=None):
    if name == "numpy" or name.startswith("numpy."):
        return None  # as where numpy is not installed
    return _find(cls, name, path, target)

importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)
"""
"""A sitecustomize.py that hides numpy from a new process, as the base install has none."""

STOW_AND_FETCH = """
from tensorstash.planning import _stowing
import torch
x = torch.randn(256, 256)
token, fetched = _stowing.stow(x, "disk"), []
w = torch.ones(1, requires_grad=True)
w.register_hook(lambda grad: fetched.append(_stowing.fetch(token)))  # in a backward
(w * 2).sum().backward()
assert torch.equal(fetched[0], x)
"""


@pytest.mark.slow  # new Python processes
def test_tensorstash_without_numpy_prints_no_numpy_warning_and_needs_none(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_NUMPY)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONWARNINGS": "default"}

    def run(script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )

    def stderr_of(script: str) -> str:
        done = run(script)
        assert done.returncode == 0, done.stderr
        return done.stderr

    # The checks can fail: numpy is hidden, and torch alone warns without it.
    assert "No module named 'numpy'" in run("import numpy").stderr
    assert "Failed to initialize NumPy" in stderr_of("import torch")
    quiet = stderr_of("import tensorstash as ts, torch; assert ts.stash; torch.zeros(2).sum()")
    assert "NumPy" not in quiet, quiet
    assert "NumPy" not in stderr_of("import tensorstash.cli")  # the command's first import
    # A compiled plan's stowed values come back without numpy (its token's bytes).
    assert "NumPy" not in stderr_of(STOW_AND_FETCH)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _imports() -> list[tuple[str, str, str]]:
    """(importing module, its layer, imported module) for every import inside a layer."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        layer = _layer(module)
        if layer is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
                if node.module == "tensorstash":
                    names = [f"tensorstash.{alias.name}" for alias in node.names]
                found += [(module, layer, name) for name in names]
            elif isinstance(node, ast.Import):
                found += [(module, layer, alias.name) for alias in node.names]
    return [row for row in found if row[2].startswith("tensorstash")]


def test_subpackages_import_only_the_ones_before_them() -> None:
    allowed = {layer: {*LAYERS[: LAYERS.index(layer) + 1]} for layer in LAYERS}
    allowed["bench"].add("top")  # the bench is an application of the package
    upward = [
        f"{module} imports {name}"
        for module, layer, name in _imports()
        if (_layer(name) or "top") not in allowed[layer]
    ]
    assert not upward, "imports against the layer order: " + "; ".join(upward)


def test_the_session_imports_no_policy_planner_or_profiler() -> None:
    """The session knows policies through their protocol and a selector's planning through
    session/quiet.py: from the tiers it takes only recompute's region flag."""
    found = {
        name
        for module, layer, name in _imports()
        if layer == "session" and _layer(name) not in ("core", "session")
    }
    assert found == {"tensorstash.tiers.recompute"}, found
