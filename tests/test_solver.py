"""The plan's parts (NOTE [ Plan ]): the search (_solver.py) and what the steps say
things cost (_calibration.py), each against figures worked out by hand."""

from __future__ import annotations

import pytest

import tensorstash as ts
from tensorstash.planning import _calibration, _rates, _solver, plan
from tensorstash.planning._calibration import Calibration, pooled, ran, step_noise
from tensorstash.planning._rates import Rates
from tensorstash.planning._solver import Solver
from tensorstash.planning.profile import ModuleRecord, SiteRecord, StepRecord

MiB = 1 << 20
NO_FAULTS = Rates(refault=0.0)  # faults priced at nothing: the figures below stay round


def profile_of(
    modules: dict[str, tuple[float, int, int]],
    sites: dict[str, list[int]],
    steps: list[StepRecord] | None = None,
) -> ts.Profile:
    """``modules``: path -> (forward seconds, input bytes, first order); ``sites``: module
    path -> the bytes of each tensor saved in it, in the order of the step."""
    profile = ts.Profile()
    order = 0
    for path, sizes in sites.items():
        for occurrence, nbytes in enumerate(sizes, 1):
            profile.last[(path, "MulBackward0", occurrence)] = SiteRecord(order, nbytes)
            order += 1
    profile.modules = {
        path: ModuleRecord(1, forward_s, inputs, first, None, path)
        for path, (forward_s, inputs, first) in modules.items()
    }
    total = sum(r.nbytes for r in profile.last.values())
    profile.history.extend(steps or [StepRecord(0.3, 0.7, total, None)])
    profile._root_name = "Net"
    return profile


def two_blocks() -> ts.Profile:
    """Blocks a and b, 4 MiB saved in each, 1 MiB of input each; b holds b.mlp."""
    return profile_of(
        {"a": (0.01, MiB, 0), "b": (0.02, MiB, 1), "b.mlp": (0.005, MiB, 1)},
        {"a": [4 * MiB], "b.mlp": [4 * MiB]},
    )


def test_plan_names_its_parts_where_they_were() -> None:
    assert plan.Rates is _rates.Rates and plan.Choice is _solver.Choice
    assert plan.HOOK_S == _calibration.HOOK_S
    assert plan.weighted_median is _calibration.weighted_median
    assert {"RETURNS_BELOW", "Plan", "make_plan", "Tier", "COPY_ROOM_MAX"} <= set(plan.__all__)
    assert all(hasattr(plan, name) for name in plan.__all__)


def test_candidate_recompute_takes_over_the_choices_inside_it() -> None:
    taken = _solver.Candidate(Calibration(two_blocks(), "cpu", NO_FAULTS))
    taken.recompute("b.mlp", 3 * MiB, 0.005)
    taken.recompute("b", MiB, 0.02)
    assert list(taken.recomputed) == ["b"]
    assert taken.recomputed["b"].saved_bytes == 4 * MiB  # what b.mlp saved, and its own
    assert taken.held == 8 * MiB - 4 * MiB


def test_candidate_holds_at_its_peak_what_backward_holds_while_recomputing() -> None:
    taken = _solver.Candidate(Calibration(two_blocks(), "cpu", NO_FAULTS))
    # Recomputing b: a's 4 MiB are still held, b's 1 MiB input, and b's 4 MiB made again.
    assert taken.held_at_peak(("b",), 5 * MiB) == 9 * MiB
    assert taken.held_at_peak(("a",), 5 * MiB) == 5 * MiB  # nothing before a: its input and 4 MiB
    assert taken.held_at_peak((), 3 * MiB) == 3 * MiB


def test_solver_stops_at_its_target() -> None:
    calibration = Calibration(two_blocks(), "cpu", NO_FAULTS)
    solver = Solver(calibration, 5 * MiB)
    solver.take_cheapest(True, lambda path: False, moves=False)
    assert list(solver.taken.recomputed) == ["a"]  # b lowers no peak: a is held meanwhile
    assert solver.taken.held == 5 * MiB


def test_solver_never_recomputes_what_the_user_forbids() -> None:
    solver = Solver(Calibration(two_blocks(), "cpu", NO_FAULTS), 5 * MiB)
    solver.take_cheapest(True, lambda path: path == "a", moves=False)
    assert "a" not in solver.taken.recomputed


@pytest.mark.parametrize(("compress", "tier"), [(1e9, "disk"), (4e9, "compressed")])
def test_solver_moves_a_cpu_site_the_cheaper_way_per_byte(compress: float, tier: str) -> None:
    rates = Rates(disk=1e9, compress=compress, ratio=2.0, refault=0.0)
    solver = Solver(Calibration(two_blocks(), "cpu", rates), 0)
    site = next(iter(solver.calibration.sites))
    # disk: 4 MiB saved for 4 MiB / 1e9 s; lz4: 2 MiB saved for 4 MiB / compress s.
    cost = 4 * MiB / (1e9 if tier == "disk" else compress)
    assert solver.move_option(site) == (tier, 4 * MiB if tier == "disk" else 2 * MiB, cost)


def test_solver_copies_for_free_what_the_link_hides_on_cuda() -> None:
    solver = Solver(Calibration(two_blocks(), "cuda", NO_FAULTS), MiB, capacity=5 * MiB)
    solver.take_hidden_copies()
    assert [c.cost_s for c in solver.taken.moved.values()] == [0.0]  # the second: 8 > 5 MiB
    assert solver.taken.copied == 4 * MiB and solver.taken.held == 4 * MiB


def test_calibration_pools_the_forward_time_of_twin_modules() -> None:
    modules = {
        "h.0": ModuleRecord(1, 0.01, MiB, 0, None, "Block"),
        "h.1": ModuleRecord(1, 0.03, MiB, 1, None, "Block"),
        "head": ModuleRecord(1, 0.05, MiB, 2, None, "Linear"),
    }
    sites = {(p, "MulBackward0", 1): SiteRecord(i, MiB) for i, p in enumerate(modules)}
    inside = {path: [(path, "MulBackward0", 1)] for path in modules}
    times = {path: r.forward_s for path, r in pooled(modules, inside, sites).items()}
    assert times == pytest.approx({"h.0": 0.02, "h.1": 0.02, "head": 0.05})


def test_calibration_base_is_a_step_that_moved_nothing_less_its_recompute() -> None:
    steps = [
        StepRecord(0.4, 0.6, 8 * MiB, None, recomputed=("a",), recompute_s=0.2),
        StepRecord(0.5, 0.7, 8 * MiB, None, recomputed=("a",), recompute_s=0.1),
        StepRecord(0.5, 0.9, 8 * MiB, None, recomputed=("a",), recompute_s=0.2),
    ]
    profile = profile_of(
        {"a": (0.1, MiB, 0), "b": (0.1, MiB, 1)}, {"a": [4 * MiB], "b": [4 * MiB]}, steps
    )
    calibration = Calibration(profile, "cpu", NO_FAULTS)
    calibration.calibrate()
    assert calibration.recompute_factor == pytest.approx(2.0)  # median of 2, 1, 2
    assert calibration.base_s == pytest.approx(1.1)  # median of 0.8, 1.1, 1.2


def test_calibration_prices_a_tier_by_the_bytes_its_steps_moved() -> None:
    plain = StepRecord(0.5, 0.5, 8 * MiB, None)
    few = StepRecord(0.5, 0.5 + 0.001, 8 * MiB, None, moved={"disk": MiB})  # 1 ms a MiB
    many = StepRecord(0.5, 0.5 + 0.016, 8 * MiB, None, moved={"disk": 8 * MiB})  # 2 ms a MiB
    profile = profile_of({"a": (0.1, MiB, 0)}, {"a": [8 * MiB]}, [plain, few, many])
    calibration = Calibration(profile, "cpu", Rates(disk=1e9, refault=0.0))
    calibration.calibrate()
    # Counted step by step the median would be either; weighted by bytes it is the 8 MiB's.
    assert calibration.rates.disk == pytest.approx(MiB / 0.002)


def test_step_noise_is_the_median_distance_from_the_median() -> None:
    profile = ts.Profile()
    for seconds in (1.0, 2.0, 3.0, 10.0):
        profile.quiet_history.append(StepRecord(seconds, 0.0, 0, None))
    profile.history.extend([StepRecord(5.0, 0.0, 0, None), StepRecord(50.0, 0.0, 0, None)])
    assert step_noise(profile) == pytest.approx(1.0)  # distances 1.5, 0.5, 0.5, 7.5; two: none


def test_ran_takes_the_warm_steps_of_a_plan_once_there_are() -> None:
    cold = StepRecord(1.0, 1.0, 0, None, recomputed=("a",), cold=True)
    warm = StepRecord(1.0, 1.0, 0, None, recomputed=("a",))
    moved = StepRecord(1.0, 1.0, 0, None, recomputed=("a",), moved={"disk": 1})
    assert ran(("a",), False, [cold, warm, moved]) == [warm]
    assert ran(("a",), False, [cold, moved]) == [cold]
    assert ran(("a",), True, [cold, warm, moved]) == [moved]
