"""The search over the partitioner's settings (rule 5 of NOTE [ Compiled code ] in
tensorstash/planning/compiler.py), fed by hand: which setting each step runs at, and the plan."""

from __future__ import annotations

from tensorstash.planning.compiler import EXPLORE, SETTINGS, TIE, CompiledSearch

MIB = 2**20

# What a compiled GPT-2 kept at each setting, and its step and real peak there.
KEPT = {1.0: 28 * MIB, 0.5: 12 * MIB, 0.25: 8 * MIB, 0.1: 3 * MIB, 0.0: 0}


def _run(search: CompiledSearch, steps: dict[float, list[tuple[float, int]]]) -> list[float | None]:
    """Step the search to its end: each setting's step compiles first (untimed), then takes
    its next (seconds, peak) from ``steps``."""
    ran: list[float | None] = []
    compiled: set[float] = set()
    for _ in range(20):
        setting = search.setting_for_step()
        ran.append(setting)
        if search.settled:
            return ran
        assert setting is not None
        search.measured(setting, KEPT[setting], 0 if KEPT[setting] == 0 else 5)
        if setting in compiled and steps.get(setting):
            seconds, peak = steps[setting].pop(0)
            search.trials[setting].seconds.append(seconds)
            search.trials[setting].peaks.append(peak)
        compiled.add(setting)
    raise AssertionError(f"the search did not settle: {ran}")


def test_search_leaves_compiled_code_that_fits_untouched() -> None:
    search = CompiledSearch(budget=40 * MIB)
    assert _run(search, {}) == [1.0, None]
    assert search.plan().quiet and search.plan().settled


def test_search_compiles_down_to_explore_below_the_first_fit_then_times_each_fit() -> None:
    search = CompiledSearch(budget=13 * MIB)
    steps = {0.5: [(1.0, 50 * MIB)], 0.25: [(1.1, 56 * MIB)], 0.1: [(1.05, 44 * MIB)]}
    ran = _run(search, steps)
    first_fit = SETTINGS.index(0.5)
    compiled = list(SETTINGS[: first_fit + 1 + EXPLORE])
    assert ran[: len(compiled)] == compiled  # each setting compiled once, in order
    assert ran[len(compiled) :] == [0.5, 0.25, 0.1, 0.1]  # timed once each, then the plan
    plan = search.plan()
    assert plan.setting == 0.1 and plan.kept_bytes == 3 * MIB
    assert [t.setting for t in plan.trials] == compiled
    assert "activation_memory_budget=0.1" in plan.table()


def test_search_takes_the_lowest_real_peak_among_the_nearly_fastest() -> None:
    """Within TIE of the fastest, memory decides; past it, speed does."""
    slow = 1.0 + TIE + 0.05
    search = CompiledSearch(budget=13 * MIB)
    steps = {
        0.5: [(1.0, 50 * MIB)],
        0.25: [(1.0 + TIE / 2, 46 * MIB)],
        0.1: [(slow, 40 * MIB), (slow, 40 * MIB)],
    }
    _run(search, steps)
    assert search.choice == 0.25
    assert len(search.trials[0.1].seconds) == 2  # left out for speed only after two steps


def test_search_times_a_lower_peak_setting_again_before_leaving_it_out() -> None:
    """One slow step (a busy machine) does not rule out the setting that holds least."""
    search = CompiledSearch(budget=13 * MIB)
    steps = {
        0.5: [(1.0, 50 * MIB)],
        0.25: [(1.1, 56 * MIB)],
        0.1: [(2.2, 43 * MIB), (1.07, 44 * MIB)],
    }
    _run(search, steps)
    assert search.choice == 0.1


def test_search_with_nothing_fitting_takes_the_least_kept() -> None:
    search = CompiledSearch(budget=1)
    ran = _run(search, {})
    assert ran[:-1] == list(SETTINGS) and search.choice == 0.0


def test_search_chooses_again_when_its_budget_moves() -> None:
    search = CompiledSearch(budget=40 * MIB)
    _run(search, {})
    assert search.choice is None
    search.rebudget(13 * MIB)  # 1.0 no longer fits: search on from what it knows
    assert not search.settled
    assert search.setting_for_step() == 0.5
