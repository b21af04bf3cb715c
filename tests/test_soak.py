"""A short soak: descriptors, threads, spill files and live bytes stay flat over many steps.

The long version is ``python benchmarks/soak.py`` (2000 steps per policy).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS, EVERY, WARMUP = 40, 5, 10
RSS_TOLERANCE = 24 << 20


def load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


soak = load_soak()


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(soak.POLICIES))
def test_soak_nothing_grows_after_warmup(spill_dir: Path, policy: str) -> None:
    samples = soak.soak(policy, STEPS, EVERY, spill_dir)
    assert len(samples) == STEPS // EVERY
    after = [s for s in samples if s.step > WARMUP]
    first = after[0]
    for field in soak.EXACT:
        values = [getattr(s, field) for s in after]
        assert values == [getattr(first, field)] * len(after), f"{field} moved: {values}"
    assert first.live_bytes == 0 and first.spill_bytes == 0
    assert max(s.rss for s in after) - first.rss <= RSS_TOLERANCE
    assert soak.growth(samples, WARMUP, RSS_TOLERANCE) == []


def test_soak_growth_reports_what_grew() -> None:
    grows = [soak.Sample(step, 100, 5 + step, 1, 0, 0) for step in range(10, 60, 10)]
    problems = soak.growth(grows, 10, RSS_TOLERANCE)
    assert len(problems) == 1 and problems[0].startswith("fds changed")
    fat = [soak.Sample(step, step << 20, 5, 1, 0, 0) for step in range(10, 100, 10)]
    assert soak.growth(fat, 0, 16 << 20) == ["rss grew 80.0 MiB after warm-up"]


@pytest.mark.slow
def test_soak_main_exits_zero_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert (
        soak.main(["--steps", "10", "--every", "2", "--policies", "disk", "--json", str(out)]) == 0
    )
    assert '"problems"' in out.read_text()
