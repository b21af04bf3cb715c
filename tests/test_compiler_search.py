"""The search over the partitioner's settings (rule 5 of NOTE [ Compiled code ] in
tensorstash/planning/compiler.py), fed by hand: which setting each step runs at, and the plan."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tensorstash.core import _support
from tensorstash.planning import compiler
from tensorstash.planning.compiler import CHANCES, EXPLORE, SETTINGS, TIE, CompiledSearch

MIB = 2**20

# What a compiled GPT-2 kept at each setting.
KEPT = {1.0: 28 * MIB, 0.5: 12 * MIB, 0.25: 8 * MIB, 0.1: 3 * MIB, 0.0: 0}

Steps = dict[float, list[tuple[float, int]]]


def _run(
    search: CompiledSearch,
    steps: Steps,
    compiling: dict[float, float] | None = None,
    kept: dict[float, int] = KEPT,
) -> list[float | None]:
    """Step the search to its end, or to a step that stows (rule 12). Each setting's
    first step compiles, and gives the time in ``compiling`` (none: the step was not
    timed); its later steps take their next (seconds, peak) from ``steps``, the last one
    again once the others are taken."""
    ran: list[float | None] = []
    compiled: set[float] = set()
    for _ in range(20):
        setting = search.setting_for_step()
        ran.append(setting)
        if search.settled or search.moving:  # settled, or stepping a carry (rule 12)
            return ran
        assert setting is not None
        search.measured(setting, kept[setting], 0 if kept[setting] == 0 else 5)
        if setting not in compiled:
            compiled.add(setting)
            if compiling and setting in compiling:
                search.timed(setting, compiling[setting], 0, compiled=True)
        elif steps.get(setting):
            seconds, peak = steps[setting].pop(0) if len(steps[setting]) > 1 else steps[setting][0]
            search.timed(setting, seconds, peak, compiled=False)
    raise AssertionError(f"the search did not settle: {ran}")


def _fitting_steps() -> Steps:
    """A step at each setting a 13 MiB budget fits: 0.1 holds least, and is the plan."""
    return {0.1: [(1.0, 44 * MIB)], 0.25: [(1.0, 51 * MIB)], 0.5: [(1.0, 56 * MIB)]}


def _compiled_down_to_explore() -> list[float]:
    first_fit = SETTINGS.index(0.5)  # the first to fit a 13 MiB budget
    return list(SETTINGS[: first_fit + 1 + EXPLORE])


def test_search_leaves_compiled_code_that_fits_untouched() -> None:
    search = CompiledSearch(budget=40 * MIB)
    assert _run(search, {}) == [1.0, None]
    assert search.plan().quiet and search.plan().settled


def test_search_times_each_setting_from_the_step_that_compiled_it() -> None:
    """Compiling steps give their time: the setting that keeps least and is as fast is
    stepped once for its real peak, each fitting one above it once more, and the search
    settles."""
    search = CompiledSearch(budget=13 * MIB)
    compiling = {0.5: 1.3, 0.25: 1.3, 0.1: 1.25}
    steps = {0.1: [(1.0, 44 * MIB)], 0.25: [(1.05, 51 * MIB)], 0.5: [(1.1, 50 * MIB)]}
    ran = _run(search, steps, compiling)
    compiled = _compiled_down_to_explore()
    assert ran[: len(compiled)] == compiled  # each setting compiled once, in order
    assert ran[len(compiled) :] == [0.1, 0.25, 0.5, 0.1]  # three steps, then the plan
    plan = search.plan()
    assert plan.setting == 0.1 and plan.kept_bytes == 3 * MIB
    assert plan.predicted_step_s == 1.0 and plan.predicted_peak_bytes == 44 * MIB
    assert search.trials[0.5].seconds == [1.1] and search.trials[0.5].compiling_s == [1.3]
    assert [t.setting for t in plan.trials] == compiled
    assert "activation_memory_budget=0.1" in plan.table()


def test_search_goes_up_while_the_setting_above_holds_less() -> None:
    """Real peaks are not monotonic: the setting that keeps least may peak highest. The
    setting above is stepped though its compiling step looked slow (a first run is)."""
    kept = {**KEPT, 0.0: MIB}
    search = CompiledSearch(budget=KEPT[0.25])  # 0.25 fits first: 0.1 and 0 are tried
    compiling = {0.5: 1.3, 0.25: 1.3, 0.1: 1.3, 0.0: 1.0}
    steps = {0.0: [(1.0, 64 * MIB)], 0.1: [(1.0, 46 * MIB)], 0.25: [(1.0, 51 * MIB)]}
    ran = _run(search, steps, compiling, kept)
    assert ran[-5:] == [0.0, 0.1, 0.25, 0.5, 0.1]  # 0.5: over the budget (rule 11)
    assert search.choice == 0.1


def test_search_steps_every_fitting_setting_above_for_its_peak() -> None:
    """Real peaks need not fall and then rise: the bench's ``small`` under bf16 autocast
    peaked at 29.5 MiB at 0.1, 30.1 at 0.25 and 27.6 at 0.5. A search that stopped
    where the peak first rose kept 0.1; every fitting setting is stepped, and 0.5 is."""
    search = CompiledSearch(budget=13 * MIB)
    compiling = {0.5: 1.0, 0.25: 1.0, 0.1: 1.0}
    steps = {
        0.1: [(1.0, int(29.5 * MIB))],
        0.25: [(1.0, int(30.1 * MIB))],
        0.5: [(1.0, int(27.6 * MIB))],
    }
    ran = _run(search, steps, compiling)
    assert ran[len(_compiled_down_to_explore()) :] == [0.1, 0.25, 0.5, 0.5]
    assert search.choice == 0.5


def test_search_steps_a_setting_above_that_held_less_again_before_leaving_it_out() -> None:
    """A setting that keeps more and held less than the plan, slow over its compiling
    step and one step more, is stepped to CHANCES timings: its third is as fast."""
    search = CompiledSearch(budget=13 * MIB)
    compiling = {0.5: 1.5, 0.25: 1.0, 0.1: 1.0}
    steps = {
        0.1: [(1.0, int(29.5 * MIB))],
        0.25: [(1.0, int(30.1 * MIB))],
        0.5: [(1.4, int(27.6 * MIB)), (1.0, int(27.6 * MIB))],
    }
    ran = _run(search, steps, compiling)
    assert ran[len(_compiled_down_to_explore()) :] == [0.1, 0.25, 0.5, 0.5, 0.5]
    assert search.choice == 0.5 and search.trials[0.5].timings == CHANCES


def test_search_takes_the_lowest_real_peak_among_the_nearly_fastest() -> None:
    """Within TIE of the fastest, memory decides; past it, speed does."""
    slow = 1.0 + TIE + 0.05
    search = CompiledSearch(budget=13 * MIB)
    compiling = {0.5: 1.0, 0.25: 1.0 + TIE / 2, 0.1: slow}
    steps = {0.1: [(slow, 40 * MIB)], 0.25: [(1.0 + TIE / 2, 46 * MIB)], 0.5: [(1.0, 50 * MIB)]}
    _run(search, steps, compiling)
    assert search.choice == 0.25
    assert search.trials[0.1].timings == CHANCES  # left out for speed only after a few steps
    assert search.trials[0.5].timings == CHANCES  # as many as the fastest one has


def test_search_steps_a_setting_that_keeps_less_again_before_leaving_it_out() -> None:
    """One slow step (a busy machine) does not rule out the setting that holds least."""
    search = CompiledSearch(budget=13 * MIB)
    compiling = {0.5: 1.0, 0.25: 1.1, 0.1: 2.2}
    steps = {0.1: [(1.07, 44 * MIB)], 0.25: [(1.1, 56 * MIB)], 0.5: [(1.0, 50 * MIB)]}
    ran = _run(search, steps, compiling)
    assert ran[len(_compiled_down_to_explore()) :] == [0.1, 0.25, 0.5, 0.1]
    assert search.choice == 0.1


def test_search_does_not_leave_out_what_keeps_less_for_another_settings_lucky_step() -> None:
    """As the compiled GPT-2 sweep ran on 2 cores: the fastest setting had one step far
    under its others, and the setting that keeps less two steps just over TIE of it. Its
    third step, and the fastest's median, show them as fast: memory decides."""
    search = CompiledSearch(budget=13 * MIB)
    compiling = {0.5: 1.30, 0.25: 0.99, 0.1: 1.47}
    steps = {
        0.1: [(1.16, 44 * MIB), (1.20, 44 * MIB)],
        0.25: [(1.24, 51 * MIB), (1.37, 51 * MIB)],
        0.5: [(1.3, 60 * MIB)],
    }
    ran = _run(search, steps, compiling)
    assert 0.99 * (1 + TIE) < 1.16  # two steps alone would have left 0.1 out
    assert ran[len(_compiled_down_to_explore()) :] == [0.1, 0.1, 0.25, 0.5, 0.1]
    assert search.choice == 0.1 and search.plan().predicted_peak_bytes == 44 * MIB


def test_search_steps_a_setting_whose_compile_was_not_timed() -> None:
    search = CompiledSearch(budget=13 * MIB)
    steps = {0.5: [(1.0, 50 * MIB)], 0.25: [(1.0, 56 * MIB)], 0.1: [(1.0, 44 * MIB)]}
    ran = _run(search, steps)  # no compile step timed: each setting is stepped for its time
    assert ran[len(_compiled_down_to_explore()) :] == [0.1, 0.25, 0.5, 0.1]
    assert search.choice == 0.1


# What the bench's ``small`` kept under bf16 autocast at each setting (rule 11).
SMALL_BF16 = {1.0: 34 * MIB, 0.5: 14 * MIB, 0.25: 8 * MIB, 0.1: 5 * MIB, 0.0: 0}


def _small_bf16_steps(peak_at_half: float, step_at_half: float) -> Steps:
    """A budget of 8.5 MiB fits 0.25 and 0.1; 0.5, over it, ran as given."""
    return {
        0.1: [(1.05, int(31.1 * MIB))],
        0.25: [(1.07, int(31.5 * MIB))],
        0.5: [(step_at_half, int(peak_at_half * MIB))],
    }


def test_search_names_the_setting_over_the_budget_that_held_less_and_warns_once() -> None:
    """Rule 11: the bench's ``small`` under bf16 autocast at a quarter of its bytes kept
    0.1 and held 31.1 MiB, where 0.5, over the budget, held 27.1 MiB at a faster step.
    The plan keeps to the budget, and says which budget would hold less."""
    search = CompiledSearch(budget=int(8.5 * MIB))
    compiling = {0.5: 1.0, 0.25: 1.1, 0.1: 1.1}
    # the warning comes as the plan is made
    with pytest.warns(RuntimeWarning, match="activation_memory_budget=0.5, which keeps 14.0 MiB"):
        ran = _run(search, _small_bf16_steps(27.1, 1.0), compiling, SMALL_BF16)
    assert ran[-2:] == [0.5, 0.1]  # one step over the budget for its peak, then the plan
    assert ran.count(0.5) == 2  # its compile, and that one step: nothing compiled again
    plan = search.plan()
    assert plan.setting == 0.1 and plan.kept_bytes <= plan.budget_bytes
    assert plan.over is search.trials[0.5]
    assert plan.advice is not None and f"{14 * MIB} bytes or more" in plan.advice
    assert "buys no real memory" in plan.table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert search.setting_for_step() == 0.1  # once per budget: no second warning


def test_search_steps_each_setting_over_the_budget_and_names_the_one_that_held_less() -> None:
    """Rule 11: the bench's ``small`` in float32 at a quarter of its bytes: 0.25 and 0.5
    are over the budget; 0.25 held more than the plan (0.1), 0.5 held less."""
    kept = {1.0: 47 * MIB, 0.5: 26 * MIB, 0.25: 14 * MIB, 0.1: 7 * MIB, 0.0: 0}
    search = CompiledSearch(budget=12 * MIB)
    steps = {
        0.1: [(1.1, 34 * MIB)],
        0.25: [(1.07, int(40.6 * MIB))],
        0.5: [(1.0, 33 * MIB)],
    }
    ran = _run(search, steps, {0.5: 1.0, 0.25: 1.07, 0.1: 1.1}, kept)
    assert ran[-3:] == [0.25, 0.5, 0.1]  # each over the budget once, least kept first
    plan = search.plan()
    assert plan.setting == 0.1 and plan.over is search.trials[0.5]
    assert plan.advice is not None and f"{26 * MIB} bytes or more" in plan.advice


def test_search_steps_no_setting_over_the_budget_at_1() -> None:
    """Rule 11: 1.0's graphs under the pair compiled in the first step, with the
    session's module hooks on; a planned step at 1.0 would compile them again. A 13 MiB
    budget fits 0.5, so the setting over it is 1.0: no step more."""
    search = CompiledSearch(budget=13 * MIB)
    ran = _run(search, _fitting_steps(), {0.5: 1, 0.25: 1, 0.1: 1})
    assert ran.count(1.0) == 1 and search.plan().over is None


@pytest.mark.parametrize(
    ("peak_at_half", "step_at_half"),
    [(31.0, 1.0), (27.1, 1.05 * (1 + TIE) + 0.05)],
    ids=["held-about-as-much", "slower"],
)
def test_search_names_no_setting_over_the_budget_that_held_as_much_or_ran_slower(
    peak_at_half: float, step_at_half: float
) -> None:
    """Rule 11: a setting over the budget is named only where it held ``LOWER`` less at a
    step as fast: otherwise the budget buys memory, or time is what it costs."""
    search = CompiledSearch(budget=int(8.5 * MIB))
    steps = _small_bf16_steps(peak_at_half, step_at_half)
    for _ in range(CHANCES):  # enough timings of 0.5 to tell it slower
        steps[0.5].append(steps[0.5][0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning as the plan is made
        _run(search, steps, {0.5: step_at_half, 0.25: 1.1, 0.1: 1.1}, SMALL_BF16)
    plan = search.plan()
    assert plan.setting == 0.1 and plan.over is None and plan.advice is None
    assert "buys no real memory" not in plan.table()


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


def test_search_settled_steps_at_its_choice_only() -> None:
    """No recompile after settling: every later step runs the chosen setting's graphs."""
    search = CompiledSearch(budget=13 * MIB)
    _run(search, _fitting_steps(), {0.5: 1, 0.25: 1, 0.1: 1})
    assert [search.setting_for_step() for _ in range(5)] == [0.1] * 5


def test_a_compiling_step_gives_its_time_and_no_peak() -> None:
    search = CompiledSearch(budget=13 * MIB)
    search.measured(0.5, KEPT[0.5], 5)
    search.timed(0.5, 1.2, 300 * MIB, compiled=True)  # the peak is the compiler's
    trial = search.trials[0.5]
    assert trial.compiling_s == [1.2] and trial.best_s == 1.2
    assert trial.seconds == [] and trial.step_s is None and trial.peak_bytes is None
    search.setting_for_step()
    assert "~1.200 s" in search.plan().table()


def test_compile_clock_counts_the_time_between_its_brackets() -> None:
    now = [10.0]
    clock = compiler._CompileClock(lambda: now[0])
    clock.started()
    now[0] = 13.0
    assert clock.read() == 3.0  # the compile under way counts
    clock.ended()
    now[0] = 20.0
    assert clock.read() == 3.0
    clock.ended()  # an end without a start (callbacks registered mid-compile) adds nothing
    assert clock.read() == 3.0


def test_compiled_step_takes_the_compile_out_of_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(compiler, "_CLOCK", compiler._CompileClock(lambda: now[0]))
    search = CompiledSearch(budget=13 * MIB)
    step = compiler.CompiledStep(search, 0.5, 0, torch.device("cpu"), known=True)
    step.count.bytes, step.count.tensors = KEPT[0.5], 5  # what the inlined pack counts
    compiler._CLOCK.started()
    now[0] += 20.0  # a lazy backward compile, after the forward
    assert step.exited() is search
    compiler._CLOCK.ended()
    with compiler._PENDING_LOCK:
        compiler._PENDING.remove(step)  # backward's end, given by hand
    step.finished(step.start + 20.5)
    trial = search.trials[0.5]
    assert trial.kept_bytes == KEPT[0.5]
    assert trial.compiling_s == [pytest.approx(0.5)] and trial.peaks == []


def test_search_made_again_when_a_step_outgrows_the_plan() -> None:
    """Rule 9: with dynamic shapes a step may keep more; a setting keeps the most."""
    search = CompiledSearch(budget=13 * MIB)
    _run(search, _fitting_steps(), {0.5: 1, 0.25: 1, 0.1: 1})
    assert search.settled and search.choice == 0.1
    search.measured(0.1, 2 * MIB, 5)  # a smaller step: the setting still keeps its most
    assert search.trials[0.1].kept_bytes == KEPT[0.1] and search.settled
    search.measured(0.1, 14 * MIB, 5)  # a longer sequence: over the budget
    assert not search.settled and search.trials[0.1].kept_bytes == 14 * MIB
    assert search.setting_for_step() == 0.25 and search.settled  # from the steps taken


def test_counting_ops_stay_out_of_cuda_graphs() -> None:
    """Rule 8: a CUDA graph's replay would skip them, and count nothing."""
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no cudagraph_unsafe tag")
    for op in (torch.ops.tensorstash.saved.default, torch.ops.tensorstash.reached.default):
        assert torch.Tag.cudagraph_unsafe in op.tags


def test_a_step_at_a_setting_on_the_cpu_leases_the_session_pool_until_backward_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 10: the lease covers the backward, where the recompute walks its blocks."""
    from tensorstash.memory import _pool

    if _pool.compiled is None:
        pytest.skip(f"no session pool here: {_pool.status()[1]}")
    caps: list[int] = []
    lease = _pool.lease
    monkeypatch.setattr(_pool, "lease", lambda cap: caps.append(cap) or lease(cap))
    search = CompiledSearch(budget=13 * MIB)
    search.device = torch.device("cpu")
    search.measured(1.0, 64 * MIB, 5)
    step = compiler.CompiledStep(search, 0.5, 0, None, known=True)
    assert step.lease is not None and caps == [4 * MIB]  # what 1.0 keeps over POOL_SHARE
    step.count.bytes, step.count.tensors = KEPT[0.5], 5
    step.exited()
    assert step.lease is not None  # the session closed; its backward has not run yet
    compiler._backward_ended()
    assert step.lease is None and step not in compiler._PENDING
    assert compiler.CompiledStep(search, 0.5, 0, None, known=True, pool=None).lease is None
    search.device = torch.device("cuda")
    assert compiler.CompiledStep(search, 0.5, 0, None, known=True).lease is None
    assert caps == [4 * MIB]
    small = CompiledSearch(budget=MIB)
    small.device = torch.device("cpu")
    small.measured(1.0, 8 * MIB, 5)
    held = compiler.CompiledStep(small, 0.5, 0, None, known=True).lease
    assert held is not None
    held.close()
    assert caps == [4 * MIB, compiler.POOL_LEAST]


@pytest.mark.parametrize(
    ("fn", "random"),
    [
        (lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q), False),
        (lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1), True),
        (lambda q: torch.nn.functional.dropout(q, 0.1), True),
        (lambda q: q + torch.rand_like(q), True),
        (lambda q: q.tanh(), False),
    ],
    ids=["attention", "attention-dropout", "dropout", "rand", "tanh"],
)
def test_random_steps_are_those_that_draw(fn: object, random: bool) -> None:
    """Rule 7: attention at dropout 0 is tagged as seeded, yet draws nothing."""
    q = torch.randn(1, 2, 4, 8)
    before = compiler._generators()
    fn(q)  # type: ignore[operator]
    assert compiler._drew(before, compiler._generators()) is random


def test_a_plan_at_0_made_before_the_model_drew_is_made_again() -> None:
    """Rule 7: a search settled at 0 (the model in eval mode) whose step then draws (back
    in training) never runs at 0 again; one settled at another setting stays."""
    search = CompiledSearch(10 * MIB)
    for setting in (1.0, 0.5, 0.0):
        search.measured(setting, KEPT[setting], 5)
    search._settle(0.5)
    search.drew()
    assert search.random and search.settled and search.setting_for_step() == 0.5
    search._settle(0.0)
    search.drew()
    assert not search.settled
    assert search.setting_for_step() != 0.0


def test_a_search_whose_steps_draw_never_compiles_0() -> None:
    """Rule 7: at 0 the partitioner recomputes random ops whatever they are marked."""
    search = CompiledSearch(budget=1 * MIB)  # nothing fits: every setting is worth a try
    search.measured(1.0, KEPT[1.0], 5)
    search.drew()
    tried = []
    for _ in range(12):
        setting = search.setting_for_step()
        if search.settled:
            break
        tried.append(setting)
        if setting not in search.trials or search.trials[setting].kept_bytes is None:
            search.measured(setting, KEPT[setting], 5)
        search.timed(setting, 1.0, 10 * MIB, compiled=False)
    assert 0.0 not in tried and search.choice != 0.0
    assert search.choice == min((s for s in KEPT if s > 0), key=KEPT.get)


def test_a_step_whose_backward_ran_inside_its_session_ends_when_it_closes() -> None:
    """Rule 3: `with stash: loss = f(x); loss.backward()` ends the backward before the
    session closes; the step takes that end, and holds nothing past it."""
    search = CompiledSearch(budget=13 * MIB)
    search.device = torch.device("cpu")
    search.measured(1.0, 64 * MIB, 5)
    step = compiler.CompiledStep(search, 0.5, 0, torch.device("cpu"), known=True)
    step.count.bytes, step.count.tensors = KEPT[0.5], 5
    compiler._backward_ended()  # what the compiled backward's unpack queues
    step.exited()
    assert step not in compiler._PENDING and step.lease is None
    trial = search.trials[0.5]
    assert len(trial.seconds) == 1 and len(trial.peaks) == 1


def test_a_settled_plans_steps_are_timed_and_take_no_real_peak() -> None:
    """Rule 5: the prediction follows the plan's last steps, as the machine runs them now."""
    search = CompiledSearch(budget=13 * MIB)
    search.device = torch.device("cpu")
    search.measured(1.0, 64 * MIB, 5)
    search.measured(0.5, KEPT[0.5], 5)
    search.timed(0.5, 1.0, 40 * MIB, compiled=False)
    search._settle(0.5)
    for _ in range(compiler.WINDOW + 2):
        step = compiler.CompiledStep(
            search, 0.5, 0, torch.device("cpu"), known=True, pool=None, peak=False
        )
        assert step.meter is None
        step.count.bytes, step.count.tensors = KEPT[0.5], 5
        step.exited()
        compiler._backward_ended()
    trial = search.trials[0.5]
    assert len(trial.seconds) == compiler.WINDOW and trial.peaks == [40 * MIB]
    assert 1.0 not in trial.seconds  # the search's own step has left the window
    assert search.setting_for_step() == 0.5
    assert search.plan().predicted_step_s == trial.step_s < 1.0


# -- rule 12: the setting over the budget, carried out with its excess on the disk tier --

FLOAT32 = {1.0: 47 * MIB, 0.5: 26 * MIB, 0.25: 14 * MIB, 0.1: 7 * MIB, 0.0: 0}
"""What the bench's ``small`` kept at each setting in float32."""


def _float32_steps() -> Steps:
    """``small`` in float32 at a quarter of its bytes: 0.1 fits and held 34 MiB; 0.5,
    over the budget, held 33 MiB at a faster step."""
    return {0.1: [(1.1, 34 * MIB)], 0.25: [(1.07, int(40.6 * MIB))], 0.5: [(1.0, 33 * MIB)]}


def _carry(
    search: CompiledSearch, kept: int, seconds: float, peak: int
) -> tuple[list[tuple[float | None, int]], bool]:
    """Step the search from where :func:`_run` left it, where it stepped the carry: the
    carry's first step compiles, the next ones take ``(seconds, peak)``. Returns each
    step's (setting, moving), and whether the search warned (rule 11)."""
    ran: list[tuple[float | None, int]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(8):
            setting = search.setting_for_step()
            ran.append((setting, search.moving))
            if search.settled:
                break
            assert setting is not None and search.moving > 0
            search.measured(setting, kept, 5, search.moving)
            compiled = index == 0
            search.timed(
                setting,
                seconds,
                None if compiled else peak,
                compiled=compiled,
                moving=search.moving,
            )
    return ran, any(issubclass(w.category, RuntimeWarning) for w in caught)


def _searched_to_the_carry() -> CompiledSearch:
    search = CompiledSearch(budget=12 * MIB)
    search.device = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plan is not made yet: no rule 11 warning
        ran = _run(search, _float32_steps(), {0.5: 1.0, 0.25: 1.07, 0.1: 1.1}, FLOAT32)
    assert search.moving and not search.settled
    assert ran[-3:] == [0.25, 0.5, 0.5]  # rule 11's steps over the budget, then the carry
    return search


def test_search_carries_the_setting_over_the_budget_that_held_less_with_its_excess_on_disk() -> (
    None
):
    """Rule 12: 0.5 keeps 26 MiB, over a 12 MiB budget, and held less than the plan
    (0.1); with 14 MiB a graph stowed it keeps 11.4 MiB and held 25 MiB at a step as fast:
    it is the plan, made with one compile more, and nothing to warn of."""
    search = _searched_to_the_carry()
    assert search.moving == 14 * MIB  # what 0.5 keeps over the budget
    ran, warned = _carry(search, int(11.4 * MIB), 1.05, 25 * MIB)
    assert ran[-1] == (0.5, 14 * MIB) and len(ran) == 3  # its compile, its peak, the plan
    assert not warned
    plan = search.plan()
    assert plan.setting == 0.5 and plan.moving == 14 * MIB and plan.settled
    assert plan.kept_bytes is not None and plan.kept_bytes <= plan.budget_bytes
    assert plan.predicted_peak_bytes == 25 * MIB and plan.over is None
    assert "written to the disk tier" in plan.asked and "+ disk" in plan.table()
    assert search.setting_for_step() == 0.5 and search.moving == 14 * MIB  # settled


@pytest.mark.parametrize(
    ("kept", "seconds", "peak"),
    [
        (int(12.5 * MIB), 1.05, 25 * MIB),  # could not stow enough: over the budget
        (int(11.4 * MIB), 1.05, int(33.8 * MIB)),  # held about what the plan holds
        (int(11.4 * MIB), 1.1 * (1 + TIE) + 0.05, 25 * MIB),  # slower
    ],
    ids=["over-the-budget", "held-as-much", "slower"],
)
def test_search_keeps_its_plan_where_the_carry_does_not_pay(
    kept: int, seconds: float, peak: int
) -> None:
    """Rule 12: the carry is the plan only where it fits, held ``LOWER`` less than the
    plan and stepped as fast; else the plan stays, and rule 11 warns."""
    search = _searched_to_the_carry()
    ran, warned = _carry(search, kept, seconds, peak)
    assert ran[-1] == (0.1, 0) and warned
    if seconds > 1.1 * (1 + TIE):  # left out for speed only after CHANCES timings
        assert search.carry is not None and search.carry.timings == CHANCES
    plan = search.plan()
    assert plan.setting == 0.1 and plan.moving == 0 and plan.over is search.trials[0.5]
    assert "+ disk" in plan.table()  # what was tried is shown


def test_search_carries_nothing_on_a_device() -> None:
    """Rule 12: on a GPU, what leaves the device is the compiler's own offload."""
    search = CompiledSearch(budget=12 * MIB)
    search.device = torch.device("cuda")
    ran = _run(search, _float32_steps(), {0.5: 1.0, 0.25: 1.07, 0.1: 1.1}, FLOAT32)
    assert ran[-1] == 0.1 and search.moving == 0 and search.carry is None


def test_search_keeps_its_carry_while_it_fits_a_budget_that_moves() -> None:
    """Rule 12: a budget that moves a little keeps a carry that still fits it (nothing
    compiles again); one the carry no longer fits drops it, and the search goes on
    without it, never finding the old carry's graphs."""
    search = _searched_to_the_carry()
    _carry(search, int(11.4 * MIB), 1.05, 25 * MIB)
    search.rebudget(int(12.2 * MIB))
    assert search.carried and search.settled
    assert search.setting_for_step() == 0.5 and search.moving == 14 * MIB
    search.rebudget(11 * MIB)
    assert search.carry is None and not search.carried and not search.settled
    search.setting_for_step()
    assert search.moving != 14 * MIB


# -- under a memory limit (rule 13) ------------------------------------------------------------


def test_search_under_a_limit_budgets_half_the_room_before_a_peak_is_measured() -> None:
    search = CompiledSearch(0, limited=True)
    search.under_limit(limit=500 * MIB, base=400 * MIB)
    assert search.budget == 50 * MIB  # half the room, nothing measured yet
    plan = search.plan()
    assert plan.limit_bytes == 500 * MIB and plan.base_bytes == 400 * MIB
    assert plan.table().startswith("limit 500.0 MiB: 400.0 MiB held before the step")


def test_search_under_a_limit_budgets_the_room_less_what_its_steps_held_besides() -> None:
    search = CompiledSearch(0, limited=True)
    search.under_limit(limit=500 * MIB, base=400 * MIB)
    search.measured(1.0, KEPT[1.0], 5)
    search.timed(1.0, 1.0, 60 * MIB, compiled=False, room=100 * MIB)  # 32 MiB besides
    search.under_limit(limit=500 * MIB, base=400 * MIB)
    margin = max(1 << 20, int(0.04 * 100 * MIB))
    assert search.budget == (100 * MIB - margin - 32 * MIB) // MIB * MIB
    # A setting whose steps held more besides what it kept sets the budget.
    search.measured(0.5, KEPT[0.5], 5)
    search.timed(0.5, 1.0, 56 * MIB, compiled=False, room=100 * MIB)  # 44 MiB besides
    search.under_limit(limit=500 * MIB, base=400 * MIB)
    assert search.budget == (100 * MIB - margin - 44 * MIB) // MIB * MIB


def test_search_under_a_limit_widens_its_margin_by_what_a_step_went_over() -> None:
    search = CompiledSearch(0, limited=True)
    search.measured(0.5, KEPT[0.5], 5)
    search.timed(0.5, 1.0, 110 * MIB, compiled=False, room=100 * MIB)  # 10 MiB over its room
    search.under_limit(limit=500 * MIB, base=400 * MIB)
    assert search.widened == 10 * MIB
    margin = max(1 << 20, int(0.04 * 100 * MIB)) + 10 * MIB
    assert search.budget == max(0, (100 * MIB - margin - 98 * MIB) // MIB * MIB)


def test_search_under_a_limit_steps_no_setting_over_its_budget() -> None:
    # Rule 13: rule 11 steps a setting over the budget for its real peak (past the step
    # that compiled it); under a limit such a step could pass the limit, and none runs.
    steps = {0.1: [(1.0, 40 * MIB)], 0.25: [(1.0, 44 * MIB)], 0.5: [(1.0, 30 * MIB)]}
    compiling = {0.5: 1.0, 0.25: 1.0, 0.1: 1.0, 0.0: 1.0}
    free = CompiledSearch(8 * MIB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rule 11's advice, not this test's point
        ran = _run(free, {k: list(v) for k, v in steps.items()}, compiling)
    assert ran.count(0.5) > 1  # without a limit, 0.5 (12 MiB, over) is stepped again
    search = CompiledSearch(0, limited=True)
    search.under_limit(limit=400 * MIB + 16 * MIB, base=400 * MIB)  # a budget of 8 MiB
    assert search.budget == 8 * MIB
    ran = _run(search, {k: list(v) for k, v in steps.items()}, compiling)
    assert search.settled and ran.count(0.5) == 1  # compiled on the way down, never stepped
    assert search.plan().carry is None and search.plan().moving == 0


# -- rule 13: where a step runs, and its time there --


def test_a_steps_device_is_where_most_of_what_counts_is_not_the_last_tensor_saved() -> None:
    """On CUDA, SDPA's memory-efficient kernel saves its RNG seed and offset as CPU
    scalars; one of them saved last made the step read the host's memory for its budget,
    lease a CPU pool and pass the carry's gate. (``meta`` stands in for the device.)"""
    search = CompiledSearch(budget=13 * MIB)
    step = compiler.CompiledStep(search, 1.0, 64 << 10, None)
    for _ in range(3):
        step.count.saved(torch.empty(1 << 20, device="meta"))  # 4 MiB each
        torch.ops.tensorstash.saved(torch.zeros((), dtype=torch.int64), compiler.SCHEME)  # seed
    torch.ops.tensorstash.saved(torch.empty(1 << 20, dtype=torch.uint8), compiler.SCHEME)
    assert step.count.bytes == 13 * MIB and step.count.tensors == 4  # the seeds: too small
    assert step.count.device == torch.device("meta")
    assert step.exited() is search and search.device == torch.device("meta")
    compiler._backward_ended()


def test_a_step_whose_graphs_kept_nothing_that_counts_runs_where_the_model_is() -> None:
    """Rule 13: with only tensors under ``min_bytes`` counted, the model's parameters
    tell the device; the search is made for it (its budget is read there)."""
    made: list[torch.device] = []

    def search_for(device: torch.device) -> CompiledSearch:
        made.append(device)
        return CompiledSearch(budget=13 * MIB)

    step = compiler.CompiledStep(
        search_for, 1.0, 64 << 10, None, model_device=lambda: torch.device("meta")
    )
    torch.ops.tensorstash.saved.default(torch.zeros(()), compiler.SCHEME)
    step.count.tensors = 1  # a graph of AOTAutograd's ran (under min_bytes: not counted)
    search = step.exited()
    assert made == [torch.device("meta")] and search is not None
    assert search.device == torch.device("meta")


class _Span:
    """A device clock by hand: its end is marked at the backward's end, and the device
    gets there when the test says so."""

    def __init__(self, seconds: float) -> None:
        self.given = seconds
        self.ended = False
        self.there = False
        self.waited = 0

    def backward_ended(self) -> None:
        self.ended = True

    def seconds(self, wait: bool) -> float | None:
        if not self.ended:
            return None
        if not self.there:
            if not wait:
                return None
            self.waited += 1
            self.there = True
        return self.given


def test_a_step_on_a_device_is_timed_by_the_device_not_the_host() -> None:
    """Rule 13: the host's clock ends when the backward's kernels are queued; the device's
    when they ran. The search waits for the device's figure while it searches."""
    search = CompiledSearch(budget=13 * MIB)
    search.device = torch.device("meta")
    search.measured(1.0, 64 * MIB, 5)
    spans: list[_Span] = []

    def span(device: torch.device) -> _Span:
        spans.append(_Span(2.5))
        return spans[-1]

    step = compiler.CompiledStep(search, 0.5, 0, torch.device("meta"), known=True, span=span)
    step.count.bytes, step.count.tensors = KEPT[0.5], 5
    step.exited()
    compiler._backward_ended()  # the host is done at once; the device is not
    trial = search.trials[0.5]
    assert trial.seconds == [] and spans[0].ended and len(search.untimed) == 1
    search.setting_for_step()  # searching: waits for the device
    assert spans[0].waited == 1 and trial.seconds == [2.5] and not search.untimed


def test_a_settled_plans_device_times_are_taken_once_the_device_gave_them() -> None:
    """Rule 13: a settled plan's step does not wait for the device; its figure is taken
    at a later step, once there."""
    search = CompiledSearch(budget=13 * MIB)
    search.device = torch.device("meta")
    search.measured(1.0, 64 * MIB, 5)
    search.measured(0.5, KEPT[0.5], 5)
    search.timed(0.5, 1.0, 40 * MIB, compiled=False)
    search._settle(0.5)
    span = _Span(1.5)
    step = compiler.CompiledStep(
        search, 0.5, 0, torch.device("meta"), known=True, peak=False, span=lambda d: span
    )
    step.count.bytes, step.count.tensors = KEPT[0.5], 5
    step.exited()
    compiler._backward_ended()
    assert search.setting_for_step() == 0.5
    assert span.waited == 0 and search.trials[0.5].seconds == [1.0] and search.untimed
    span.there = True
    search.setting_for_step()
    assert search.trials[0.5].seconds == [1.0, 1.5] and not search.untimed


def test_a_step_on_cuda_is_timed_by_cuda_events() -> None:
    assert compiler.device_span(torch.device("cpu")) is None
    assert compiler.device_span(torch.device("meta")) is None
    if torch.cuda.is_available():
        assert isinstance(compiler.device_span(torch.device("cuda")), compiler.CudaSpan)


# -- rule 8: recording CUDA graphs compiles nothing; rule 14: no compile fails for us --

planned = pytest.mark.skipif(
    _support.missing(_support.COMPILED) is not None,
    reason=str(_support.missing(_support.COMPILED)),  # a pair's settings need torch 2.10
)


def _args(trigger: str) -> Any:
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    return CallbackArgs(CallbackTrigger[trigger], "911/0")


@planned
def test_recording_a_cuda_graph_sets_nothing_and_is_kept_out_of_the_steps_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mode="reduce-overhead"`` records CUDA graphs mid-step, inside dynamo's compile
    callbacks: the partitioner's settings are not patched then (nothing compiles), and
    the recording's time is taken out of the step's, as a compile's is."""
    import torch._functorch.config as functorch_config

    now = [100.0]
    monkeypatch.setattr(compiler, "_CLOCK", compiler._CompileClock(lambda: now[0]))
    pair = compiler.hooks_for(0.25)
    user = functorch_config.activation_memory_budget
    with torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack):
        compiler._compile_starts(_args("CUDAGRAPH_RECORDING"))
        assert functorch_config.activation_memory_budget == user
        now[0] += 3.0
        compiler._compile_ends(_args("CUDAGRAPH_RECORDING"))
        compiler._compile_starts(_args("DYNAMO"))  # a compile under the pair: its setting
        assert functorch_config.activation_memory_budget == 0.25
        compiler._compile_ends(_args("DYNAMO"))
    assert functorch_config.activation_memory_budget == user
    assert compiler._CLOCK.read() == 3.0


@planned
def test_a_compile_callback_that_fails_warns_and_the_compile_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 14: an error in tensorstash's compile callbacks never fails the user's compile."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("functorch moved")

    monkeypatch.setattr(compiler, "_SaveRandom", broken)  # made as a compile at 0.25 starts
    monkeypatch.setattr(compiler, "_WARNED", [])
    pair = compiler.hooks_for(0.25)
    fn = torch.compile(lambda x: x.sin().sum(), backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    with (
        pytest.warns(RuntimeWarning, match="functorch moved"),
        torch.autograd.graph.saved_tensors_hooks(pair.pack, pair.unpack),
    ):
        loss = fn(x)
    loss.backward()
    assert torch.equal(x.grad, x.cos().detach())
    assert compiler._local.patches == []  # what the failed start left was taken back
