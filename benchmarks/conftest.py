"""Shared pieces of the pytest-benchmark suites: sizes, a timer, references, a spill directory.

Run the suites with ``python -m pytest benchmarks/ --benchmark-json out.json``.
``TENSORSTASH_BENCH_SIZE`` picks how much work each benchmark does:

- ``small`` (the default): the "small" bench model, 16 MiB of data per
  pack+unpack, 200 saved tensors per hook chain, 5 timed rounds;
- ``tiny``: the "tiny" bench model, 1 MiB, 20 tensors, 1 round, for a check
  that the suites run (``tests/test_benchmark_suites.py``);
- ``medium``: the "medium" bench model, 64 MiB, 500 tensors, 5 rounds.

Every benchmark times its own calls as well (:class:`Timer`), so figures
derived from medians (MB/s, step overhead) are stored in
``benchmark.extra_info`` even under ``--benchmark-disable``, where
pytest-benchmark keeps no statistics. Comparisons against a reference (raw
lz4 or file I/O, no hooks) are measured again with the two interleaved
(:func:`interleaved`), so load from other processes hits both alike.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SIZE_VARIABLE = "TENSORSTASH_BENCH_SIZE"


@dataclass(frozen=True)
class Size:
    """How much work each benchmark does.

    Attributes:
        name: the value of ``TENSORSTASH_BENCH_SIZE``.
        model: a key of ``tensorstash.bench.CONFIGS``.
        data_bytes: bytes of each tensor packed and unpacked by the throughput suite.
        chain: saved tensors per forward in the hook-overhead suite.
        rounds: timed rounds of each benchmark (one warm-up round comes first).
    """

    name: str
    model: str
    data_bytes: int
    chain: int
    rounds: int


SIZES = {
    "tiny": Size("tiny", "tiny", 1 << 20, 20, 1),
    "small": Size("small", "small", 16 << 20, 200, 5),
    "medium": Size("medium", "medium", 64 << 20, 500, 5),
}


def bench_size() -> Size:
    """The :class:`Size` named by ``TENSORSTASH_BENCH_SIZE`` (default "small")."""
    name = os.environ.get(SIZE_VARIABLE, "small")
    if name not in SIZES:
        raise pytest.UsageError(
            f"benchmarks: {SIZE_VARIABLE}={name!r} is not a size; use one of "
            f"{', '.join(SIZES)} (e.g. {SIZE_VARIABLE}=tiny for a quick check)"
        )
    return SIZES[name]


@pytest.fixture(scope="session")
def size() -> Size:
    return bench_size()


class Timer:
    """Wraps a benchmark's target and records how long each call took.

    Example:
        >>> timer = Timer(step)
        >>> benchmark.pedantic(timer, rounds=5, warmup_rounds=1)
        >>> timer.median(last=5)
    """

    def __init__(self, target: Callable[[], Any]) -> None:
        self.target = target
        self.seconds: list[float] = []

    def __call__(self) -> Any:
        start = time.perf_counter()
        result = self.target()
        self.seconds.append(time.perf_counter() - start)
        return result

    def median(self, last: int) -> float:
        """Median seconds of the last ``last`` calls (the timed rounds, not the warm-up)."""
        if not self.seconds:
            raise RuntimeError("benchmarks.Timer: no call was timed; run the benchmark first")
        return statistics.median(self.seconds[-last:])


def run(benchmark: Any, target: Callable[[], Any], size: Size) -> tuple[Any, float]:
    """Benchmark ``target`` for ``size.rounds`` rounds after one warm-up round.

    Returns:
        The last call's result and the median seconds of the timed rounds
        (under ``--benchmark-disable``, the one call made).
    """
    timer = Timer(target)
    result = benchmark.pedantic(timer, rounds=size.rounds, warmup_rounds=1)
    return result, timer.median(last=size.rounds)


def interleaved(
    first: Callable[[], Any], second: Callable[[], Any], rounds: int
) -> tuple[float, float]:
    """Median seconds of ``first`` and of ``second``, called alternately ``rounds`` times each.

    A burst of load from other processes then slows both alike, so their
    ratio holds on a shared machine where two separate benchmarks' do not.
    One untimed call of each comes first.
    """
    a, b = Timer(first), Timer(second)
    for _ in range(rounds + 1):
        a()
        b()
    return a.median(last=rounds), b.median(last=rounds)


@pytest.fixture(scope="session")
def spill_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for spill files and raw file I/O (private directories are made inside)."""
    return tmp_path_factory.mktemp("spill")


_RATIOS: list[tuple[str, float]] = []


def record_ratio(test: str, ratio: float) -> None:
    """Remember a ratio against a reference, printed at the end of the run."""
    _RATIOS.append((test, ratio))


@pytest.fixture(autouse=True)
def _no_hooks_left() -> Iterator[None]:
    """Every benchmark starts and ends with no saved-tensor hooks pushed."""
    import torch

    def top() -> Any:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)

    assert top() is None, "a previous benchmark left saved-tensor hooks pushed"
    yield
    assert top() is None, "the benchmark left saved-tensor hooks pushed"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RATIOS:
        return
    terminalreporter.section("tensorstash: figures against the references of this run")
    width = max(len(test) for test, _ in _RATIOS)
    for test, ratio in _RATIOS:
        terminalreporter.write_line(f"{test:<{width}}  {ratio:8.3f}")
