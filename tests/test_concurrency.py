"""Sessions on several threads at once, and one session whose workers serve many tensors.

Saved-tensor hooks are thread-local: each thread's stash sees only its own
thread's tensors. The spill directory and module tracking are shared by the
process, so sessions running side by side must not see each other's files,
counters or modules. Every gradient is compared with plain autograd computed
before the threads start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    assert_grads_equal,
    leak_check,
    run_case,
    tier_counts,
    top_saved_tensors_hooks,
)
from torch import Tensor, nn
from zoo import Case, cnn, lstm, mlp, views

import tensorstash as ts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPEATS = 3


def in_threads(jobs: dict[str, Callable[[], None]], timeout: float = 120) -> None:
    """Run each job on its own thread, started together; re-raise the first failure."""
    barrier = threading.Barrier(len(jobs), timeout=timeout)
    errors: dict[str, BaseException] = {}

    def body(name: str, job: Callable[[], None]) -> None:
        try:
            barrier.wait()
            job()
        except BaseException as error:  # reported on the main thread
            errors[name] = error
            barrier.abort()

    threads = [
        threading.Thread(target=body, args=(name, job), name=f"test-{name}")
        for name, job in jobs.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"{thread.name} did not finish in {timeout} s"
    for name, error in errors.items():
        if not isinstance(error, threading.BrokenBarrierError):
            raise AssertionError(f"thread {name} failed: {error!r}") from error
    assert not errors, f"threads failed: {errors}"


# Models without dropout: torch's global RNG is shared by the threads.
FACTORIES: dict[str, Callable[[], Case]] = {"mlp": mlp, "views": views, "cnn": cnn, "lstm": lstm}


def policies(directory: Path) -> dict[str, Any]:
    """Two DiskSpill sessions in one directory, an Lz4 session and an lz4+disk chain."""
    return {
        "mlp": ts.DiskSpill(directory),
        "views": ts.DiskSpill(directory),
        "cnn": ts.Lz4(),
        "lstm": ts.Chain(ts.Lz4(), ts.DiskSpill(directory)),
    }


def solo_counts(directory: Path) -> dict[str, int]:
    """Tensors each case's session packs or skips when it runs alone."""
    counts = {}
    for name, factory in FACTORIES.items():
        session = ts.stash(policies(directory)[name], min_bytes=0)
        run_case(factory(), session)
        counts[name] = sum(tier_counts(session).values())
    return counts


def test_sessions_on_four_threads_equal_plain_without_cross_talk(spill_dir: Path) -> None:
    expected = {name: run_case(factory()) for name, factory in FACTORIES.items()}
    alone = solo_counts(spill_dir)
    # Cases are built here: their factories seed and draw from the global RNG.
    cases = {name: factory() for name, factory in FACTORIES.items()}
    sessions: dict[str, list[ts.Session]] = {name: [] for name in FACTORIES}

    def job(name: str) -> Callable[[], None]:
        def steps() -> None:
            for _ in range(REPEATS):
                session = ts.stash(policies(spill_dir)[name], min_bytes=0)
                assert_grads_equal(expected[name], run_case(cases[name], session))
                sessions[name].append(session)

        return steps

    in_threads({name: job(name) for name in FACTORIES})
    for name, done in sessions.items():
        assert len(done) == REPEATS
        for session in done:
            assert sum(tier_counts(session).values()) == alone[name], (
                f"{name}: a session counted tensors of another thread:\n{session.stats.table()}"
            )
    leak_check(*(s for done in sessions.values() for s in done), directories=[spill_dir])


def test_hooks_stay_on_the_thread_that_opened_the_session(spill_dir: Path) -> None:
    expected = run_case(mlp())
    case = mlp()
    opened, finished = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other() -> None:
        opened.wait(30)
        seen["hooks"] = top_saved_tensors_hooks()
        seen["grads"] = run_case(case)
        finished.set()

    thread = threading.Thread(target=other)
    thread.start()
    x = torch.randn(256, 256, requires_grad=True)
    with ts.stash(ts.DiskSpill(spill_dir), min_bytes=0) as session:
        opened.set()
        y = (x * 2).sin()
        assert finished.wait(60), "the other thread did not finish"
    y.sum().backward()
    thread.join()
    assert seen["hooks"] is None, "the session's hooks leaked to another thread"
    assert_grads_equal(expected, seen["grads"])
    assert tier_counts(session)["disk"] == 1, session.stats.table()
    del y
    leak_check(session, directories=[spill_dir])


class Wide(nn.Module):
    """Many parallel branches: dozens of tensors in flight on the workers at once."""

    def __init__(self, branches: int = 24, width: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branches = nn.ModuleList(nn.Linear(width, width) for _ in range(branches))

    def forward(self, x: Tensor) -> Tensor:
        outs = [torch.tanh(branch(x)) * torch.relu(branch(x)) for branch in self.branches]
        return torch.stack(outs).sum(0)


def wide_case() -> Case:
    torch.manual_seed(1)
    x = torch.randn(512, 128, requires_grad=True)
    w = torch.randn(512, 128)
    return Case("wide", Wide(), (x,), lambda out: (out * w).sum())  # type: ignore[operator]


WIDE_POLICIES = {
    "lz4": lambda d: ts.Lz4(),
    "lz4-backpressure": lambda d: ts.Lz4(max_pending_bytes=256 << 10),
    "disk": lambda d: ts.DiskSpill(d),
    "disk-backpressure": lambda d: ts.DiskSpill(d, max_pending_bytes=256 << 10),
    "lz4+disk": lambda d: ts.Chain(ts.Lz4(), ts.DiskSpill(d)),
}


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("name", list(WIDE_POLICIES))
def test_wide_model_shares_one_sessions_workers(spill_dir: Path, name: str, workers: int) -> None:
    expected = run_case(wide_case())
    case = wide_case()
    session = ts.stash(WIDE_POLICIES[name](spill_dir), min_bytes=0, workers=workers)
    assert_grads_equal(expected, run_case(case, session))
    packed = sum(tier_counts(session).values()) - sum(session.stats.skipped.values())
    assert packed >= 48, f"the wide model should pack many tensors:\n{session.stats.table()}"
    leak_check(session, directories=[spill_dir])


def test_wide_model_sessions_on_two_threads_equal_plain(spill_dir: Path) -> None:
    expected = run_case(wide_case())
    cases = {"a": wide_case(), "b": wide_case()}
    chosen = {"a": ts.Chain(ts.Lz4(), ts.DiskSpill(spill_dir)), "b": ts.DiskSpill(spill_dir)}
    sessions: list[ts.Session] = []

    def job(name: str) -> Callable[[], None]:
        def steps() -> None:
            for _ in range(REPEATS):
                session = ts.stash(chosen[name], min_bytes=0, workers=3)
                assert_grads_equal(expected, run_case(cases[name], session))
                sessions.append(session)

        return steps

    in_threads({"a": job("a"), "b": job("b")})
    leak_check(*sessions, directories=[spill_dir])
