"""Tests of the bench's parts: rows and their ratios, the Pareto front, budgets, the memory
meters and the figure. The whole runs are in test_bench.py."""

from __future__ import annotations

import importlib.metadata
import math
import mmap
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstash as ts
from tensorstash import bench
from tensorstash.bench import plot as _plot
from tensorstash.bench.measure import StepResult
from tensorstash.bench.rows import same_round_median, summarize
from tensorstash.memory._memory import PeakRss

MIB = 2**20

# One torch thread: on a loaded 2-core machine, idle OpenMP threads spin against busy ones.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(seconds: float, peak: int, **kwargs: Any) -> StepResult:
    return StepResult(seconds, grads_equal=True, stats=None, peak_bytes=peak, **kwargs)


def _row(policy: str, step_s: float, peak: int, dtype: str = "float32", **kwargs: Any) -> bench.Row:
    overhead = kwargs.pop("overhead", step_s)  # against a 1 s step of none's
    return bench.Row(policy, dtype, step_s, overhead, peak, 1.0, grads_equal=True, **kwargs)


# -- rows ----------------------------------------------------------------------------------


def test_summarize_takes_medians_of_same_round_ratios() -> None:
    """Rule 9: a median of ratios, which differs from the ratio of the medians here."""
    baseline = [_step(1.0, 100), _step(2.0, 100), _step(4.0, 50)]
    mine = [_step(1.5, 50), _step(2.0, 80), _step(8.0, 50)]
    row = summarize("lz4", "float32", mine, baseline)
    assert row.overhead == pytest.approx(1.5)  # ratios 1.5, 1.0, 2.0
    assert statistics.median([1.5, 2.0, 8.0]) / statistics.median([1.0, 2.0, 4.0]) == 1.0
    assert row.peak_vs_none == pytest.approx(0.8)  # ratios 0.5, 0.8, 1.0
    assert row.step_s == 2.0 and row.real_peak_bytes == 50
    assert row.step_overheads == (1.5, 1.0, 2.0) and row.step_peak_bytes == (50, 80, 50)


def test_summarize_counts_warm_up_gradients() -> None:
    wrong = StepResult(1.0, grads_equal=False, stats=None, peak_bytes=1)
    row = summarize("lz4", "float32", [_step(1.0, 1)], [_step(1.0, 1)], [wrong])
    assert row.grads_equal is False


def test_same_round_median_skips_rounds_without_a_base() -> None:
    assert same_round_median([1.0, 3.0], [0.0, 2.0]) == 1.5
    assert math.isnan(same_round_median([1.0], [0.0]))


def test_row_round_trips_through_json_with_skips() -> None:
    skipped = bench.Row.skip("trl", "bfloat16", "needs CUDA streams (a GPU run)")
    data = skipped.to_dict()
    assert data["step_s"] is None and data["overhead"] is None and data["peak_vs_none"] is None
    back = bench.Row.from_dict(data)
    assert back.skipped == skipped.skipped and math.isnan(back.step_s)
    measured = _row("lz4", 0.5, MIB, step_times=(0.5, 0.6), plan_recompute=("blocks.0",))
    assert bench.Row.from_dict(measured.to_dict()) == measured


def test_table_names_the_budget_a_compiled_plan_advises() -> None:
    """Rule 11 of NOTE [ Compiled code ]: where a plan's budget buys no real memory, the
    bench says which budget would, under the row's plan, and keeps it in the JSON."""
    advice = "the budget 8.5 MiB buys no real memory here: ..."
    auto = _row("auto:25%", 1.07, 31 * MIB, plan_compiler="activation_memory_budget=0.1",
                plan_advice=advice)  # fmt: skip
    table = bench.format_table([_row("none", 1.0, 44 * MIB), auto])
    asked = "auto:25%: the compiler is asked for activation_memory_budget=0.1"
    assert f"{asked}\nauto:25%: {advice}" in table
    assert bench.Row.from_dict(auto.to_dict()).plan_advice == advice


@pytest.mark.parametrize(
    ("warmup_steps", "says"),
    [
        (2, "medians of 1 timed round(s) after 2 warm-up round(s)"),
        (5, "medians of 1 timed round(s) after 2 warm-up round(s) and 3 more while Auto learned"),
    ],
)
def test_title_says_which_untimed_rounds_ran_and_why(warmup_steps: int, says: str) -> None:
    row = _row("auto:50%", 1.0, 1, step_times=(1.0,), warmup_steps=warmup_steps)
    title = bench.format_title("tiny", "cpu", "float32", [row], threads=1, warmup=2)
    assert title.endswith(says) if warmup_steps == 2 else says in title, title


def test_cli_version_names_tensorstash_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorstash.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out == f"tensorstash {ts.__version__} (torch {torch.__version__})\n"
    assert ts.__version__ == importlib.metadata.version("tensorstash")  # one version


def test_pareto_front_keeps_what_nothing_beats() -> None:
    rows = [
        _row("none", 1.0, 100),
        _row("checkpoint", 1.3, 60),
        _row("slow", 1.5, 60),  # as small as checkpoint, slower: beaten
        _row("auto", 1.2, 70),
        _row("worse", 1.2, 80),  # as fast as auto, larger: beaten
        bench.Row.skip("trl", "float32", "not here"),
        replace(_row("wrong", 1.0, 10), grads_equal=False, grads_close=False),  # left out
        replace(_row("close", 1.25, 65), grads_equal=False, grads_close=True),
    ]
    front = [row.policy for row in bench.pareto_front(rows)]
    assert front == ["none", "checkpoint", "auto", "close"]


def test_pareto_front_compares_steps_by_their_same_round_ratios() -> None:
    # A noisy machine: the slow rounds fell on "auto"'s steps more than on "disk"'s.
    rows = [
        _row("none", 0.24, 100, overhead=1.0),
        _row("disk", 0.35, 35, overhead=1.43),
        _row("auto", 0.39, 39, overhead=1.07),
    ]
    assert [row.policy for row in bench.pareto_front(rows)] == ["none", "disk", "auto"]


def test_pareto_front_keeps_rows_that_differ_by_noise() -> None:
    """Three budgets that chose one plan: 0.1 MiB and 2% apart are the same point."""
    rows = [
        _row("none", 1.0, 100 * MIB),
        _row("auto:25%", 1.08, int(35.9 * MIB)),
        _row("auto:50%", 1.06, int(35.9 * MIB)),
        _row("auto:75%", 1.08, 36 * MIB),
        _row("slower", 1.10, 36 * MIB),  # 4% slower than auto:50%, no smaller: beaten
        _row("larger", 1.06, 37 * MIB),  # as fast as auto:50%, 3% larger: beaten
    ]
    front = [row.policy for row in bench.pareto_front(rows)]
    assert front == ["none", "auto:25%", "auto:50%", "auto:75%"]


def test_pareto_front_takes_a_step_as_faster_by_its_rounds() -> None:
    """A sign test over the rounds: one plan's rows, 10% apart in their medians but each
    the faster in half the rounds, do not beat each other; a row 1% faster in every one
    of 8 rounds does."""
    even = (1.0, 1.3, 1.0, 1.3, 1.0, 1.3, 1.2, 1.2)
    odd = (1.3, 1.0, 1.3, 1.0, 1.3, 1.0, 1.1, 1.1)
    rows = [
        _row("none", 1.0, 100 * MIB, step_times=(1.0,) * 8),
        _row("a", 1.2, 30 * MIB, overhead=1.2, step_times=even),
        _row("b", 1.1, 30 * MIB, overhead=1.1, step_times=odd),
        _row("slower", 1.11, 30 * MIB, overhead=1.11, step_times=tuple(t * 1.01 for t in odd)),
    ]
    assert [row.policy for row in bench.pareto_front(rows)] == ["none", "a", "b"]
    assert bench.rows.faster(rows[2], rows[3]) and not bench.rows.faster(rows[2], rows[1])


def test_plan_effect_compares_the_row_with_its_twin() -> None:
    row = _row(
        "auto:8MiB", 0.3, 8 * MIB,
        step_times=(0.27, 0.24, 0.3), step_peak_bytes=(8 * MIB,) * 3,
        no_plan_step_times=(0.3, 0.3, 0.3), no_plan_peak_bytes=(10 * MIB,) * 3,
    )  # fmt: skip
    effect = row.plan_effect()
    assert effect is not None
    assert effect.ratio == pytest.approx(0.9) and effect.steps == 3
    assert (effect.peak_bytes, effect.no_plan_peak_bytes) == (8 * MIB, 10 * MIB)
    assert _row("auto:8MiB", 0.3, 1).plan_effect() is None
    table = bench.format_table([row])
    assert "auto:8MiB: step time 0.90x that without a plan over 3 rounds" in table
    assert "real peak 8.0 MiB against 10.0 MiB" in table


# -- budgets and names ---------------------------------------------------------------------


def test_limit_bytes_as_sizes_and_shares() -> None:
    assert bench.limit_bytes("auto:8MiB", None) == 8 * MIB
    assert bench.limit_bytes("auto:50%", 1000) == 500
    assert bench.limit_bytes("auto:0.5", 1000) == 500  # one grammar: 0.5 is 50%
    assert bench.limit_bytes("auto:12.5%", 1000) == 125
    assert bench.limit_bytes("lz4", 1000) is None


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("auto:0%", "as a share must be in"),
        ("auto:half%", "a limit is a share of no stash's real peak growth"),
        ("auto:50%", "pass plain_growth"),
    ],
)
def test_limit_bytes_errors_say_what_to_pass(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench.limit_bytes(name, None)


def test_resolve_policies_puts_baseline_first_and_drops_repeats() -> None:
    assert bench.resolve_policies(["lz4", "none", "lz4", "auto:50%", "trl"]) == [
        "none",
        "lz4",
        "auto:50%",
        "trl",
    ]


@pytest.mark.parametrize("name", ["zstd", "auto:lots", "auto:-3%"])
def test_resolve_policies_unknown_raises_value_error(name: str) -> None:
    with pytest.raises(
        ValueError, match=rf"tensorstash bench: unknown policy '{name}'.*none, keep"
    ):
        bench.resolve_policies([name])


def test_skip_reason_names_cuda_then_the_install() -> None:
    cpu = torch.device("cpu")
    assert bench.skip_reason("lz4", cpu) is None
    assert bench.skip_reason("torchtune", cpu) == "needs CUDA streams (a GPU run)"
    assert bench.skip_reason("recompute", cpu) is None
    assert "compile:<b>" in (bench.skip_reason("recompute", cpu, compiled=True) or "")


# -- the real memory meters ----------------------------------------------------------------


@pytest.mark.parametrize(
    "reset, native",
    [(True, True), (False, True), (False, False)],
    ids=["high-water mark", "native sampler", "python sampler"],
)
def test_peak_rss_sees_memory_touched_and_freed_inside(
    reset: bool, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorstash.memory import _memory

    if not native:
        monkeypatch.setattr(_memory, "_sampler", None)
    elif not reset and _memory._sampler is None:
        pytest.skip("the native sampler is not built here")
    bench.return_free_memory()
    with PeakRss(reset=reset) as meter:
        block = torch.ones(64 * MIB // 4)  # 64 MiB, every page written
        time.sleep(0.05)  # long enough for the sampler, which wakes every half millisecond
        del block
    assert meter.sampled is not reset
    assert meter.delta_bytes >= 48 * MIB
    assert meter.peak_bytes >= meter.start_bytes + meter.delta_bytes


def _high_water() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's VmHWM")
def test_peak_rss_leaves_the_processes_peak_counters_as_they_were() -> None:
    # Rule 1 of NOTE [ Real memory ]: a profile's meter never resets VmHWM or ru_maxrss.
    import resource

    block = torch.ones(96 * MIB // 4)  # a high-water mark well above the region's peak
    del block
    bench.return_free_memory()
    high, maxrss = _high_water(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with PeakRss() as meter:
        small = torch.ones(16 * MIB // 4)
        time.sleep(0.02)
        del small
    assert meter.delta_bytes >= 12 * MIB
    assert _high_water() >= high
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= maxrss


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's VmHWM")
def test_peak_rss_takes_a_new_high_water_mark_as_the_exact_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A peak too short for any sampler, but a new high for the process: VmHWM has it.
    from tensorstash.memory import _memory

    monkeypatch.setattr(_memory, "_sampler", None)
    bench.return_free_memory()
    with PeakRss(interval_s=0.5) as meter:  # the thread never wakes inside the region
        block = torch.ones((_high_water() * 1024 + 64 * MIB) // 4)
        del block
    assert meter.peak_bytes >= _high_water() * 1024 - MIB


def test_a_step_on_cuda_begins_from_collected_garbage_and_a_kept_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rule 3 of NOTE [ Real memory ]: the heap is handed back only where RSS is measured.
    from tensorstash.memory import _memory

    trims: list[int] = []
    monkeypatch.setattr(_memory, "release_free_heap", lambda: trims.append(1))
    bench.return_free_memory(torch.device("cuda", 0))
    assert trims == []
    bench.return_free_memory(torch.device("cpu"))
    bench.return_free_memory()
    assert trims == [1, 1]


def test_peak_rss_of_a_region_that_allocates_nothing_is_small() -> None:
    bench.return_free_memory()
    with PeakRss() as meter:
        sum(range(1000))
    assert meter.delta_bytes < 8 * MIB


@pytest.mark.skipif(sys.platform != "linux", reason="minor page faults as Linux counts them")
def test_peak_rss_counts_the_bytes_a_region_faults_in_not_those_already_resident() -> None:
    payload = b"\1" * (32 * MIB)  # made, and faulted in, before either region
    region = mmap.mmap(-1, 32 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with PeakRss() as fresh:
        region.write(payload)  # the first touch of every page
    region.seek(0)
    with PeakRss() as again:
        region.write(payload)  # the same pages, now resident
    region.close()
    assert fresh.faulted_bytes is not None and again.faulted_bytes is not None
    assert fresh.faulted_bytes >= 30 * MIB
    assert again.faulted_bytes < fresh.faulted_bytes - 24 * MIB


# -- --plot --------------------------------------------------------------------------------


def test_bench_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    found = bench.run_bench("tiny", ["keep", "disk"], steps=1, warmup=0, timeline=True)
    assert _plot.plot(found, png, title="tiny").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert 10_000 < png.stat().st_size < 200_000
    keep = found[1].timeline
    assert keep is not None
    # Forward rises, backward falls: the peak comes at the end of forward, nothing is left.
    assert keep["kept"][0] == 0 and max(keep["kept"]) > 0 and keep["kept"][-1] == 0
    peak_at = keep["t_s"][keep["kept"].index(max(keep["kept"]))]
    assert peak_at <= keep["backward_at_s"]
    assert keep["t_s"] == sorted(keep["t_s"])
    assert len(keep["real"]) == len(keep["t_s"]) and max(keep["real"]) > 0


def test_plot_places_steps_at_none_s_median_times_the_same_round_ratio() -> None:
    rows = [_row("none", 0.24, 100, overhead=1.0), _row("auto:50%", 0.39, 39, overhead=1.07)]
    at = _plot._step_axis(rows)
    assert at(rows[1]) == pytest.approx(0.24 * 1.07)
    assert _plot._step_axis(rows[1:])(rows[1]) == 0.39  # no row of none: its own median


def test_plot_draws_both_dtypes_predictions_twins_and_skips(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        _row("none", 0.1, 80 * MIB),
        _row("checkpoint", 0.13, 50 * MIB),
        _row(
            "auto:50%", 0.12, 55 * MIB,
            predicted_step_s=0.11, predicted_peak_bytes=50 * MIB,
            step_times=(0.12,), step_peak_bytes=(55 * MIB,),
            no_plan_step_times=(0.2,), no_plan_peak_bytes=(60 * MIB,),
        ),
        _row("none", 2.0, 40 * MIB, dtype="bfloat16"),
        _row("checkpoint", 2.5, 30 * MIB, dtype="bfloat16"),
        bench.Row.skip("trl", "float32", "needs CUDA streams (a GPU run)"),
    ]  # fmt: skip
    path = _plot.plot(rows, tmp_path / "sweep.png", title="sweep " * 40)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_bench_plot_without_matplotlib_fails_before_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorstash.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import raise ImportError

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(bench, "run_bench", no_training)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--plot", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert "pip install tensorstash[plot]" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bf16_gradients_are_close_within_a_rounding_and_not_past_a_wrong_mask() -> None:
    """Under bfloat16 autocast a recompute that skips one rounding moves a gradient by
    about bfloat16's epsilon; dropout drawn anew moves it by most of its norm."""
    from tensorstash.bench.measure import BF16_CLOSE, _close_bf16

    reference = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    rounded = reference.bfloat16().float()  # each element off by up to 2**-9 of itself
    assert not torch.equal(rounded, reference) and _close_bf16(rounded, reference)
    masked = reference * (torch.rand(256, 256, generator=torch.Generator().manual_seed(1)) > 0.1)
    assert not _close_bf16(masked, reference)
    assert not _close_bf16(reference * (1 + 2 * BF16_CLOSE), reference)
    assert _close_bf16(torch.zeros(3), torch.zeros(3))
