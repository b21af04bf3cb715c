"""Every example runs as a user would run it, and leaves nothing in the temp directory."""

from __future__ import annotations

import importlib.util
import os
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

TORCH_CACHE = "torchinductor_"
"""torch's own cache, ``torchinductor_<user>`` in the temp directory: one per user, made by
the first ``torch.utils.checkpoint`` or compile of any program and reused by the next; not
something an example leaves behind."""


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    for module in NEEDS.get(path.stem, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the optional dependency {module}")
    # Without its optional scratch directory, an example works in the temp directory.
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert result.returncode == 0, result.stderr
    assert "tier" in result.stdout
    left = [p for p in temp.rglob("*") if not p.relative_to(temp).parts[0].startswith(TORCH_CACHE)]
    assert left == [], f"{path.name} left these in the temp directory: {left}"
