"""Every example runs as a user would run it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example is a new Python process

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
NEEDS = {
    "lightning_callback": ("lightning",),
    "hf_trainer": ("transformers", "accelerate"),
    "hf_lora_trainer": ("transformers", "accelerate", "peft"),
    "lora_model": ("transformers", "peft"),
}
"""The optional extras an example needs; without them it is skipped."""


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    for module in NEEDS.get(path.stem, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the optional dependency {module}")
    # Every example takes an optional scratch directory as its one argument.
    result = subprocess.run(
        [sys.executable, str(path), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "tier" in result.stdout
    if path.stem == "compress_then_spill":
        assert [p for d in tmp_path.iterdir() for p in d.iterdir()] == []  # files removed
