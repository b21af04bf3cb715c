"""The pytest-benchmark suites in benchmarks/ run and pass, at their smallest size.

``make test`` does not collect benchmarks/ (``testpaths = ["tests"]``); this
runs them once each (``--benchmark-disable``) in a subprocess, with
``TENSORSTASH_BENCH_SIZE=tiny``. Their own checks (bitwise round trips,
gradients equal to plain autograd, figures present) run there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each suite and benchmark is a new Python process

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["benchmarks/test_step.py", "benchmarks/test_throughput.py", "benchmarks/test_hooks.py"]


def test_benchmark_suites_pass_at_tiny_size(tmp_path: Path) -> None:
    # One torch thread: on a loaded 2-core machine, idle OpenMP threads spin against busy ones.
    env = {**os.environ, "TENSORSTASH_BENCH_SIZE": "tiny", "TMPDIR": str(tmp_path)}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "pytest", *SUITES, "--benchmark-disable", "-q"]
    command += ["-p", "no:cacheprovider", f"--basetemp={tmp_path / 'pytest'}"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed is not None and int(passed.group(1)) >= 40, result.stdout[-2000:]
    assert "skipped" not in result.stdout
    # The figures against the raw limits and the no-hook baselines were computed.
    assert "raw lz4 (MB/s)" in result.stdout
    assert "raw file (MB/s)" in result.stdout
    assert "µs per tensor over no hooks" in result.stdout
    assert list((tmp_path / "pytest").glob("**/tensorstash-*")) == []  # spill files removed


def test_training_loop_benchmark_trains_each_variant_alone(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/training_loop.py", "--model", "tiny", "--rounds", "1"]
    # A limit of 16 MiB over each step's base: half of tiny's growth (5 MiB) is less than
    # what a fresh process's first Auto session holds as it opens, and is refused.
    command += ["--steps", "7", "--policies", "disk,disk-untrimmed,auto:16MiB"]
    command += ["--directory", str(tmp_path), "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    rows = [line.split() for line in lines[start:] if line.strip()][:4]
    assert [row[0] for row in rows] == ["none", "disk", "disk-untrimmed", "auto:16MiB"]
    assert all(row[-1].endswith("x") and float(row[-1][:-1]) > 0 for row in rows)  # overheads
    assert list(tmp_path.iterdir()) == []  # the spill directory went with its processes


def test_quiet_loop_benchmark_runs_auto_without_hooks_after_it_learned() -> None:
    command = [sys.executable, "benchmarks/quiet_loop.py", "--model", "tiny", "--steps", "30"]
    command += ["--skip", "4", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    hooked = next(line for line in result.stdout.splitlines() if line.startswith("steps with"))
    # It learns in its first steps; past them (steps 25 and 26 included) it runs quiet.
    assert max(int(step) for step in hooked.split("[")[1].rstrip("]").split(",")) < 8
    assert "median" in result.stdout and "mean" in result.stdout
