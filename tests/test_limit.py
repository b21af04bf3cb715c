"""Auto(limit=...): every step's real peak under the memory a user names (NOTE [ Memory limit ]).

Real memory here is the process's resident set, sampled by tensorstash's own meter from a
heap handed back to the OS (as ../shared/checks/limit.py measures it), against plain
autograd's step on the same model in the same process.
"""

from __future__ import annotations

import gc
import os
import resource
import warnings

import pytest
import torch
from checks import assert_grads_equal
from torch import nn

import tensorstash as ts
from tensorstash.core._sizes import Share
from tensorstash.memory._memory import PeakRss, return_free_memory

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="the resident set of Linux's /proc"
)


class Blocks(nn.Module):
    """Six blocks whose activations (8 MiB each) are most of a step's memory."""

    def __init__(self, width: int = 512, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).square().mean()


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # plain autograd's matmuls are bitwise run to run
    yield
    torch.set_num_threads(threads)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Blocks(), torch.randn(4096, 512)


def _step(model: nn.Module, x: torch.Tensor, session: object = None) -> PeakRss:
    """One step from a heap handed back to the OS; its meter (peak and start)."""
    model.zero_grad(set_to_none=True)
    return_free_memory()
    with PeakRss() as meter:
        if session is None:
            model(x).backward()
        else:
            with session:  # type: ignore[attr-defined]
                loss = model(x)
            loss.backward()
    return meter


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _plain(model: nn.Module, x: torch.Tensor) -> tuple[int, int, dict[str, torch.Tensor]]:
    """The base and what a plain step adds (the last of three), and its gradients."""
    for _ in range(3):
        meter = _step(model, x)
    return meter.start_bytes, meter.delta_bytes, _grads(model)


def _tolerance(room: int) -> int:
    return max(2 * MIB, int(0.04 * room))


# -- the argument --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("12GiB", 12 << 30),
        ("12GB", 12_000_000_000),
        (3 << 30, 3 << 30),
        ("512 MiB", 512 << 20),
        ("90%", Share(0.9)),
        (0.9, Share(0.9)),
    ],
)
def test_auto_limit_takes_sizes_and_shares(given: object, expected: object) -> None:
    assert ts.Auto(limit=given)._parsed[2] == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "match"),
    [
        (50, "under the 1048576 bytes it can mean; pass a size such as '50MiB' or a share"),
        (0, "more than 0 bytes"),
        (-1, "at least 0 bytes"),
        (1.5, "as a share must be in"),
        ("150%", "as a share must be in"),
        ("lots", "must be bytes"),
    ],
)
def test_auto_limit_refuses_what_cannot_be_meant(given: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ts.Auto(limit=given)  # type: ignore[arg-type]


def test_auto_limit_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="limit must be bytes"):
        ts.Auto(limit=True)


def test_auto_without_a_limit_or_a_budget_takes_the_machines_share() -> None:
    assert ts.Auto()._parsed[2] == ts.planning.auto.DEFAULT_LIMIT
    assert ts.Auto(device_budget="1GiB")._parsed[2] is None  # a saved-bytes budget alone


def test_one_grammar_for_every_size() -> None:
    assert ts.Auto(device_budget="50%")._parsed[0] == Share(0.5)
    assert ts.DiskSpill(max_disk_bytes="1GiB").max_disk_bytes == 1 << 30
    assert ts.CpuOffload(max_inflight_bytes="64MiB").max_inflight_bytes == 64 << 20
    assert ts.Lz4(max_pending_bytes="1MiB").max_pending_bytes == 1 << 20


# -- every step under the limit --------------------------------------------------------------


def test_auto_limit_holds_every_step_the_first_included() -> None:
    model, x = _model()
    base, growth, plain = _plain(model, x)
    limit = base + growth // 2
    profile, auto = ts.Profile(), ts.Auto(limit=limit)
    peaks = []
    for _ in range(8):
        meter = _step(model, x, ts.stash(auto, profile=profile))
        peaks.append(meter.peak_bytes)
        assert_grads_equal(plain, _grads(model))
    tolerance = _tolerance(limit - base)
    over = [f"step {i + 1}: {(p - limit) / MIB:+.1f} MiB" for i, p in enumerate(peaks)]
    assert all(p <= limit + tolerance for p in peaks), over


def test_auto_limit_holds_without_a_profile() -> None:
    # NOTE [ Memory limit ] rule 4: nothing measured to plan from, every step.
    model, x = _model()
    base, growth, plain = _plain(model, x)
    limit = base + growth // 2
    auto = ts.Auto(limit=limit)
    for _ in range(3):
        meter = _step(model, x, ts.stash(auto))
        assert_grads_equal(plain, _grads(model))
        assert meter.peak_bytes <= limit + _tolerance(limit - base)


def test_auto_limit_follows_an_optimizer_state_made_at_its_first_step() -> None:
    # The base moves by AdamW's two moments at its first step(): the steps after see it.
    import torch._dynamo

    model, x = _model()
    base, growth, _ = _plain(model, x)
    moments = 2 * sum(p.nbytes for p in model.parameters())
    limit = base + moments + growth // 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile, auto = ts.Profile(), ts.Auto(limit=limit)
    bases, peaks = [], []
    for _ in range(6):
        model.zero_grad(set_to_none=True)
        return_free_memory()
        with PeakRss() as meter:
            with ts.stash(auto, profile=profile) as session:
                loss = model(x)
            loss.backward()
            optimizer.step()
        peaks.append(meter.peak_bytes)
        if session.plan is not None and session.plan.base_bytes is not None:
            bases.append(session.plan.base_bytes)
    assert bases and max(bases) - base >= moments * 3 // 4  # the plans saw the state
    tolerance = _tolerance(limit - base)
    assert all(p <= limit + tolerance for p in peaks), [(p - limit) / MIB for p in peaks]


def test_a_limit_under_what_the_process_holds_is_refused_before_the_step() -> None:
    model, x = _model()
    held = _plain(model, x)[0]
    auto = ts.Auto(limit=held - 64 * MIB)
    said = r"limit .* is under what the device holds .* Pass a limit above"
    with pytest.raises(ts.MemoryLimitError, match=said), ts.stash(auto, profile=ts.Profile()):
        model(x)
    with pytest.raises(ts.MemoryLimitError, match=said), ts.stash(auto):  # without a profile
        model(x)


class Heavy(Blocks):
    """Blocks whose backward makes a 64 MiB gradient: no plan holds a step under that."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16 << 20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.mean()


def test_a_limit_no_plan_reaches_warns_with_the_least_real_peak() -> None:
    torch.manual_seed(0)
    model, x = Heavy(), torch.randn(4096, 512)
    base, growth, plain = _plain(model, x)
    profile = ts.Profile()
    for _ in range(2):  # what a step holds before the model's call, its session's included
        with ts.stash(ts.Auto(limit=base + growth), profile=profile) as session:
            model(x).backward()
    assert session.plan is not None and session.plan.base_bytes is not None
    # Room for half the 64 MiB gradient backward makes, whatever else the base holds.
    profile, auto = ts.Profile(), ts.Auto(limit=session.plan.base_bytes + 32 * MIB)
    # The warning waits for steps of the least plan's own kind to take their real peak.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            _step(model, x, ts.stash(auto, profile=profile))
            assert_grads_equal(plain, _grads(model))
    said = [str(w.message) for w in caught if "cannot be held" in str(w.message)]
    assert len(said) == 1, said  # once per limit
    assert "the least real peak a plan reaches is" in said[0]
    assert "Pass limit >=" in said[0]


def test_a_limit_and_a_device_budget_both_hold() -> None:
    model, x = _model()
    base, growth, _ = _plain(model, x)
    budget = 8 * MIB
    profile, auto = ts.Profile(), ts.Auto(limit=base + growth, device_budget=budget)
    for _ in range(4):
        with ts.stash(auto, profile=profile) as session:
            loss = model(x)
        loss.backward()
        plan = session.plan
        assert plan is None or plan.budget <= budget
        assert session.stats.to_dict()["tiers"]["kept"]["peak_bytes"] <= budget + 8 * MIB


def test_the_plan_table_names_the_limit_and_what_it_leaves() -> None:
    model, x = _model()
    base, growth, _ = _plain(model, x)
    profile, auto = ts.Profile(), ts.Auto(limit=base + growth // 2)
    for _ in range(3):
        with ts.stash(auto, profile=profile) as session:
            loss = model(x)
        loss.backward()
    assert session.plan is not None
    table = session.plan.table()
    assert table.startswith("limit ")
    assert "held before the step" in table and "predicted real peak" in table


# -- the user's counters ----------------------------------------------------------------------


def _high_water() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024


def test_a_profile_leaves_the_processes_peak_counters_as_they_were() -> None:
    model, x = _model()
    _plain(model, x)
    block = torch.ones(256 * MIB // 4)  # a high-water mark above any step's
    del block
    gc.collect()
    high, maxrss = _high_water(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    profile, auto = ts.Profile(), ts.Auto(device_budget=16 * MIB)
    for _ in range(5):
        with ts.stash(auto, profile=profile):
            loss = model(x)
        loss.backward()
    assert any(s.peak_bytes is not None for s in profile.peaks)  # it measured real peaks
    assert _high_water() >= high
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= maxrss


def test_one_step_over_its_kind_does_not_widen_the_margin_two_do() -> None:
    """NOTE [ Memory limit ] rules 3 and 6: a single step's one-time work (the first spill
    files, a writer thread's stack) lies far over its kind's median once; the margin of
    later plans widens only where two steps went over."""
    from tensorstash.planning import _limit
    from tensorstash.planning._records import StepRecord

    def step(peak_mib: int) -> StepRecord:
        return StepRecord(0.1, 0.1, 0, peak_mib * MIB, moved={"disk": MIB}, room_bytes=5 * MIB)

    profile = ts.Profile()
    profile.peaks.extend([step(4), step(24), step(3), step(4)])
    assert profile.overrun() == 0 and _limit.spread(profile) == 0
    profile.peaks.append(step(12))
    assert profile.overrun() == 7 * MIB  # the lesser of the two that went over
    assert _limit.spread(profile) == 8 * MIB  # the second highest over the median, 4 MiB
