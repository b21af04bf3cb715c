"""Tests of ``tensorstash bench`` run end to end: the CLI, the rows, the variants, the workloads.

The parts (rows and ratios, the memory meters, budgets, the figure) are in
test_bench_parts.py. Nothing here asserts a timing: the machine is shared.
"""

from __future__ import annotations

import importlib.util
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorstash as ts
from tensorstash import bench
from tensorstash.bench import rounds
from tensorstash.cli import _progress_bar, main

LOSSLESS = ["none", "keep", "cpu", "lz4", "disk", "lz4+disk", "save_on_cpu"]
STASHES = ["keep", "cpu", "lz4", "disk", "lz4+disk"]
AUTOS = ["auto", "auto:1MiB", "auto:50%"]
RAN = [*LOSSLESS, "checkpoint", "recompute", *AUTOS]
ALL = [*RAN, *bench.OPTIONAL_PEERS]

# One torch thread: on a loaded 2-core machine, idle OpenMP threads spin against busy ones.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rows(
    tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None
) -> dict[str, dict[str, Any]]:
    """One real run of the CLI on the tiny model, with twins, shared by the tests below."""
    out = tmp_path_factory.mktemp("bench") / "rows.json"
    policies = ",".join(name for name in ALL if name != "none")
    argv = ["bench", "--model", "tiny", "--steps", "2", "--warmup", "1", "--policies", policies]
    argv += ["--twins", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    return {row["policy"]: row for row in data}


def test_bench_json_has_one_row_per_policy_baseline_first(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", "tiny", "--steps", "1", "--warmup", "0", "--policies", "lz4"]
    assert main([*argv, "--json", str(out)]) == 0
    assert [row["policy"] for row in json.loads(out.read_text())] == ["none", "lz4"]


def test_bench_rows_cover_every_policy(rows: dict[str, dict[str, Any]]) -> None:
    assert sorted(rows) == sorted(ALL)


@pytest.mark.parametrize("policy", RAN)
def test_bench_every_variant_keeps_grads_equal(
    rows: dict[str, dict[str, Any]], policy: str
) -> None:
    """All of them are lossless: recomputed regions restore the RNG state."""
    assert rows[policy]["grads_equal"] is True


@pytest.mark.parametrize("policy", RAN)
def test_bench_rows_measure_every_timed_step(rows: dict[str, dict[str, Any]], policy: str) -> None:
    row = rows[policy]
    assert row["dtype"] == "float32" and row["skipped"] is None
    assert row["step_s"] > 0 and row["overhead"] > 0
    assert len(row["step_times"]) == len(row["step_overheads"]) == 2
    # Every step saves activations on a trimmed heap: its real peak grew (the meters clamp
    # what they read at 0, so 0 is what a meter that saw nothing gives).
    peaks = row["step_peak_bytes"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks), peaks
    assert row["real_peak_bytes"] == int(statistics.median(peaks))


def test_bench_baseline_ratios_are_one(rows: dict[str, dict[str, Any]]) -> None:
    assert rows["none"]["overhead"] == pytest.approx(1.0)
    assert rows["none"]["peak_vs_none"] in (None, pytest.approx(1.0))


def test_bench_rows_carry_the_activation_bytes(rows: dict[str, dict[str, Any]]) -> None:
    """Rule 4: one Keep step counts them, and a Keep session holds exactly that at its peak."""
    activations = rows["none"]["activation_bytes"]
    assert activations > 0
    assert {row["activation_bytes"] for row in rows.values() if not row["skipped"]} == {activations}
    assert rows["keep"]["stash_peak_bytes"]["kept"] == activations


def test_bench_limits_in_bytes_and_as_shares(rows: dict[str, dict[str, Any]]) -> None:
    growth = rows["auto:50%"]["plain_growth"]
    assert growth > 0
    assert rows["auto:1MiB"]["limit_bytes"] == 2**20
    assert rows["auto:50%"]["limit_bytes"] == growth // 2
    assert rows["auto"]["limit_bytes"] is None and rows["keep"]["limit_bytes"] is None
    assert rows["auto:50%"]["over_limit"] is not None and rows["auto"]["over_limit"] is None


@pytest.mark.parametrize("policy", [*STASHES, *AUTOS, "recompute"])
def test_bench_stash_rows_report_tiers(rows: dict[str, dict[str, Any]], policy: str) -> None:
    row = rows[policy]
    assert set(row["tiers"]) == set(row["stash_peak_bytes"]) == {"kept", "host", "disk"}
    for tier in row["tiers"].values():
        assert {"tensors", "bytes", "stored_bytes", "live_bytes", "peak_bytes"} <= set(tier)
    assert row["compression_ratio"] > 0


# On the CPU, CpuOffload has nothing to move: its tensors stay in the "kept" tier.
@pytest.mark.parametrize(
    ("policy", "tier"),
    [("lz4", "host"), ("disk", "disk"), ("lz4+disk", "disk"), ("auto:1MiB", "disk")],
)
def test_bench_policy_moves_bytes_to_its_tier(
    rows: dict[str, dict[str, Any]], policy: str, tier: str
) -> None:
    assert rows[policy]["tiers"][tier]["bytes"] > 0
    assert rows[policy]["stash_peak_bytes"][tier] > 0


def test_bench_auto_under_a_tight_limit_keeps_less_than_it(
    rows: dict[str, dict[str, Any]],
) -> None:
    # A limit 1 MiB over the step's base: what the step keeps is under it, the rest on disk.
    row = rows["auto:1MiB"]
    assert row["stash_peak_bytes"]["kept"] <= row["limit_bytes"] == 2**20
    assert row["tiers"]["disk"]["bytes"] > 0


@pytest.mark.parametrize("policy", ["none", "save_on_cpu", "checkpoint"])
def test_bench_rows_without_a_stash_have_no_tiers(
    rows: dict[str, dict[str, Any]], policy: str
) -> None:
    row = rows[policy]
    assert row["tiers"] is None and row["stash_peak_bytes"] is None
    assert row["compression_ratio"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the optional peers may run")
@pytest.mark.parametrize("policy", bench.OPTIONAL_PEERS)
def test_bench_optional_peers_skip_on_the_cpu_with_the_reason(
    rows: dict[str, dict[str, Any]], policy: str
) -> None:
    row = rows[policy]
    assert row["skipped"] == "needs CUDA streams (a GPU run)"
    assert row["step_s"] is None and row["real_peak_bytes"] is None and row["step_times"] == []
    assert row["grads_equal"] is None


def test_bench_rows_without_a_planner_predict_nothing(rows: dict[str, dict[str, Any]]) -> None:
    """Before the planner exposes ``session.plan``, the prediction fields stay empty."""
    for row in rows.values():
        if getattr(ts.Session, "plan", None) is None:
            assert row["predicted_step_s"] is None and row["predicted_peak_bytes"] is None
        assert set(row) >= {"predicted_step_s", "predicted_peak_bytes", "step_over_predicted"}


def test_bench_auto_budget_rows_have_twins_without_a_plan(
    rows: dict[str, dict[str, Any]],
) -> None:
    """Rule 6 of NOTE [ Fair comparison ]: twins ran in the same rounds, and are no rows."""
    for policy in ("auto:1MiB", "auto:50%"):
        row = rows[policy]
        assert len(row["no_plan_step_times"]) == len(row["no_plan_peak_bytes"]) == 2
        assert all(seconds > 0 for seconds in row["no_plan_step_times"])
    assert not any(bench.NO_PLAN in policy for policy in rows)
    assert rows["keep"]["no_plan_step_times"] == [] and rows["auto"]["no_plan_step_times"] == []


def test_format_table_has_one_line_per_policy_and_the_skipped_ones(
    rows: dict[str, dict[str, Any]],
) -> None:
    parsed = [bench.Row.from_dict(row) for row in rows.values()]
    lines = bench.format_table(parsed).splitlines()
    ran = [row for row in parsed if row.skipped is None]
    assert [line.split()[0] for line in lines[2 : 2 + len(ran)]] == [row.policy for row in ran]
    skipped = [line for line in lines if "skipped:" in line]
    assert len(skipped) == len(parsed) - len(ran)
    assert any(line.startswith("Pareto front") for line in lines)
    said = [line for line in lines if line.startswith("limits over each step's base: ")]
    assert said and "auto:50% = +" in said[0] and "shares of no stash's real peak" in said[0]


def test_bench_step_begins_with_the_last_steps_session_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session kept alive holds its lease on the session pool: the next step would begin
    with the pool's blocks resident and count less growth than it makes."""
    import weakref

    from tensorstash.bench import measure
    from tensorstash.bench.workloads import builtin_workload

    runner = measure.StepRunner(builtin_workload("tiny", 0), torch.device("cpu"), torch.float32, 0)
    runner.take_reference()
    runner.step("auto:50%")
    last = weakref.ref(runner.session)
    seen: list[object] = []
    meter = measure.meter

    def watched(device: torch.device, **options: Any) -> Any:
        seen.append(last())
        return meter(device, **options)

    monkeypatch.setattr(measure, "meter", watched)
    runner.step("none")
    assert seen == [None]


# -- the planner's prediction ------------------------------------------------------------


class FakePlan:
    """What the planner will expose as ``session.plan``."""

    predicted_step_s = 0.5
    base_step_s = 0.4
    predicted_peak_bytes = 2**20
    recompute = ("blocks.0",)

    def table(self) -> str:
        return "fake plan"


def test_bench_auto_rows_show_the_plans_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    def plan(session: ts.Session) -> FakePlan | None:
        return FakePlan() if session.profile is not None else None

    monkeypatch.setattr(ts.Session, "plan", property(plan), raising=False)
    found = bench.run_bench("tiny", ["keep", "auto:1MiB", "recompute"], steps=2, warmup=0)
    keep, auto, recompute = found[1], found[2], found[3]
    assert keep.predicted_step_s is None and keep.step_over_predicted is None
    assert auto.predicted_step_s == 0.5 and auto.predicted_peak_bytes == 2**20
    assert auto.plan_recompute == ("blocks.0",)
    # The step's overhead over none in its round, over the predicted overhead (0.5 / 0.4).
    ratios = sorted(overhead / 1.25 for overhead in auto.step_overheads)
    assert auto.step_over_predicted == pytest.approx(sum(ratios) / 2)
    # "recompute" wraps every block itself: its plan's base is a plain step all the same,
    # and its prediction adds the blocks' recompute (Plan.checkpointed_s).
    ratios = sorted(overhead / 1.25 for overhead in recompute.step_overheads)
    assert recompute.step_over_predicted == pytest.approx(sum(ratios) / 2)
    assert auto.peak_over_predicted == pytest.approx(
        sum(peak / 2**20 for peak in auto.step_peak_bytes) / 2
    )
    table = bench.format_table(found)
    assert f"0.500 s ({auto.step_over_predicted:.2f}x)" in table
    assert "auto:1MiB: the plan recomputes blocks.0" in table


# -- dtypes and the sweep ----------------------------------------------------------------


def test_bench_bfloat16_runs_the_forward_under_autocast() -> None:
    workload = bench.builtin_workload("tiny", seed=0)
    found = bench.run_bench(
        "tiny", ["keep"], steps=1, warmup=0, dtype="bfloat16", workload=workload
    )
    assert [row.dtype for row in found] == ["bfloat16", "bfloat16"]
    assert all(row.grads_equal for row in found)
    assert {p.dtype for p in workload.model.parameters()} == {torch.float32}
    # Autocast saves bf16 activations: fewer bytes than float32 saves.
    float32 = bench.run_bench("tiny", ["keep"], steps=1, warmup=0)
    assert found[1].activation_bytes < float32[1].activation_bytes


@pytest.mark.slow
def test_bench_sweep_runs_both_dtypes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    argv = ["bench", "--sweep", "--model", "tiny", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for dtype in bench.DTYPES:
        assert [row["policy"] for row in data if row["dtype"] == dtype] == list(
            bench.SWEEP_POLICIES
        )
    limits = {row["policy"]: row["limit_bytes"] for row in data if row["dtype"] == "float32"}
    growth = next(row["plain_growth"] for row in data if row["policy"] == "auto:25%")
    assert limits["auto:25%"] == int(growth * 0.25) and limits["auto:75%"] == int(growth * 0.75)
    assert all(row["grads_equal"] for row in data if row["skipped"] is None)
    out_text = capsys.readouterr().out
    assert ") float32, " in out_text and ") bfloat16 autocast, " in out_text


def test_bench_sweep_with_dtype_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--sweep", "--dtype", "bfloat16", "--model", "tiny"])
    assert exit_info.value.code == 2
    assert "--sweep runs float32 and bfloat16 both" in capsys.readouterr().err


def test_bench_sweep_and_policies_are_exclusive() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--sweep", "--policies", "lz4", "--model", "tiny"])
    assert exit_info.value.code == 2


# -- the HF GPT-2 workload ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_bench_hf_gpt2_checkpoints_the_hf_way_with_equal_grads() -> None:
    workload = bench.builtin_workload("gpt2-hf", seed=0)
    assert workload.library_model is not None and workload.checkpointing is not None
    found = bench.run_bench(
        "gpt2-hf", ["checkpoint", "recompute"], steps=1, warmup=0, workload=workload
    )
    assert [row.policy for row in found] == ["none", "checkpoint", "recompute"]
    assert all(row.grads_equal for row in found)
    assert found[2].tiers is not None
    model = workload.library_model
    on = getattr(model, "is_activation_checkpointing", None)
    assert not (model.is_gradient_checkpointing if on is None else on)  # turned off again


def test_bench_hf_gpt2_without_transformers_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name)
    )
    with pytest.raises(bench.WorkloadUnavailable, match=r"pip install tensorstash\[hf\]"):
        bench.builtin_workload("gpt2-hf", seed=0)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "gpt2-hf"])
    assert exit_info.value.code == 2
    assert "--model gpt2-hf builds its model with transformers" in capsys.readouterr().err


# -- usage errors and small pieces -------------------------------------------------------


def test_bench_unknown_policy_names_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--policies", "lz4,bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown policy 'bogus'" in err
    assert "lz4+disk" in err and "checkpoint" in err and "torchtune" in err and "auto:50%" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_cuda_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "sees no CUDA device" in err


def test_run_bench_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="steps=0, warmup=2; pass steps >= 1"):
        bench.run_bench("tiny", ["none"], steps=0)


def test_model_checkpoint_flag_keeps_the_loss() -> None:
    config = bench.CONFIGS["tiny"]
    torch.manual_seed(0)
    model = bench.BenchGPT(config).eval()
    batch = bench.make_batch(config, seed=0)
    plain = model(*batch)
    model.checkpoint = True
    assert torch.equal(model(*batch), plain)


def test_make_batch_is_deterministic() -> None:
    config = bench.CONFIGS["tiny"]
    first, second = bench.make_batch(config, seed=3), bench.make_batch(config, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(first[0][:, 1:], first[1][:, :-1])


@pytest.mark.slow
def test_module_help_runs_in_a_subprocess() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorstash", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--policies" in done.stdout and "--sweep" in done.stdout and "gpt2-hf" in done.stdout


def test_bench_threads_option_sets_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: [])
    assert main(["bench", "--model", "tiny", "--threads", "1", "--policies", "lz4"]) == 0
    assert calls == [1]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal: where tqdm draws its bar."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_and_without_tqdm_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with _progress_bar(2) as advance:
        advance("none")
        advance("lz4")
    drawn = terminal.getvalue()
    assert "bench" in drawn and "2/2" in drawn and "lz4" in drawn, drawn
    terminal.seek(0)
    terminal.truncate()
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    with _progress_bar(2) as advance:
        assert advance("none") is None
        advance("lz4")
    assert terminal.getvalue() == ""


def test_planned_steps_counts_twins_extras_and_skips() -> None:
    # reference + keep, then (warmup + steps) per variant, twins as variants of their own.
    assert bench.planned_steps(["none", "auto:8MiB"], steps=3, warmup=2) == 2 + 2 * 5
    assert bench.planned_steps(["auto:8MiB"], steps=3, warmup=2, twins=True) == 2 + 3 * 5
    assert bench.planned_steps(["lz4"], steps=1, warmup=0, timeline=True) == 2 + 2 * 2
    assert bench.planned_steps(["torchtune"], steps=3, warmup=2, device="cpu") == 2 + 5


@pytest.mark.slow
def test_planned_steps_is_what_run_bench_ticks() -> None:
    ticks: list[str] = []
    policies = ["lz4", "auto:1MiB", "trl"]
    options: dict[str, Any] = {"steps": 1, "warmup": 1, "twins": True, "timeline": True}
    bench.run_bench("tiny", policies, progress=ticks.append, **options)
    assert len(ticks) == bench.planned_steps(policies, **options)
    assert ticks.count("auto:1MiB" + bench.NO_PLAN) == 2 and "trl" not in ticks


@pytest.mark.slow  # a bench run with learning rounds: make test-all
def test_bench_adds_untimed_rounds_while_a_planner_learns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policies = ["none", "auto"]
    ticks: list[str] = []
    rows = bench.run_bench("tiny", policies, steps=2, warmup=2, progress=ticks.append)
    auto = next(row for row in rows if row.policy == "auto")
    # The plan's first steps take its real peak, hooked, and its first quiet step has
    # it made again: all in untimed rounds, so every timed step runs the plan quiet.
    assert 2 < auto.warmup_steps <= 2 + rounds.LEARNING_ROUNDS
    assert auto.quiet_steps == 2 and all(row.warmup_steps == auto.warmup_steps for row in rows)
    extra = auto.warmup_steps - 2
    assert len(ticks) == bench.planned_steps(policies, steps=2, warmup=2) + extra * 2
    title = bench.format_title("tiny", "cpu", "float32", rows, threads=1, warmup=2)
    assert title.endswith(f"after 2 warm-up round(s) and {extra} more while Auto learned its plan")
    monkeypatch.setattr(rounds, "LEARNING_ROUNDS", 0)
    rows = bench.run_bench("tiny", policies, steps=2, warmup=2)
    assert all(row.warmup_steps == 2 for row in rows)


def test_title_names_the_cpus_vector_instructions_and_bfloat16_without_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    title = bench.format_title("tiny", "cpu", "float32", [], threads=1, warmup=2)
    assert "cpu (AVX2) float32" in title
    title = bench.format_title("tiny", "cpu", "bfloat16", [], threads=1, warmup=2)
    assert "cpu (AVX2, no bfloat16 instructions) bfloat16 autocast" in title
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    title = bench.format_title("tiny", "cpu", "bfloat16", [], threads=1, warmup=2)
    assert "cpu (AVX2) bfloat16 autocast" in title
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    title = bench.format_title("tiny", "cpu", "bfloat16", [], threads=1, warmup=2)
    assert "cpu (SVE256) bfloat16 autocast" in title  # only x86 is known to lack them
    assert "cuda float32" in bench.format_title("tiny", "cuda", "float32", [], threads=1, warmup=2)


def test_round_order_rotates_the_first_shuffles_the_rest_and_twins_take_turns() -> None:
    twin = "auto:8MiB" + bench.NO_PLAN
    groups = [["none"], ["auto:8MiB", twin], ["lz4"], ["disk"], ["cpu"]]
    orders = [rounds.round_order(groups, index) for index in range(10)]
    for index, order in enumerate(orders):
        assert sorted(order) == sorted(name for group in groups for name in group)
        at = order.index("auto:8MiB")  # twins side by side, each first in turn
        pair = order[at - 1 : at + 1] if index % 2 else order[at : at + 2]
        assert pair == ([twin, "auto:8MiB"] if index % 2 else ["auto:8MiB", twin])
    assert [order[0] for order in orders[:5]] == ["none", twin, "lz4", "disk", "cpu"]
    assert orders == [rounds.round_order(groups, index) for index in range(10)]  # seeded
    # No variant always follows the same one (a plain rotation would: rule 1).
    for name in ("none", "lz4", "disk", "cpu"):
        before = {order[order.index(name) - 1] for order in orders if order[0] != name}
        assert len(before) >= 2, (name, before)


# -- --memory-snapshot -----------------------------------------------------------------


def test_bench_memory_snapshot_on_cpu_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--memory-snapshot", str(tmp_path / "snap")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--memory-snapshot" in err and "needs --device cuda" in err
    assert not (tmp_path / "snap").exists()


def test_run_bench_memory_snapshot_on_cpu_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --device cuda"):
        bench.run_bench("tiny", ["none"], steps=1, memory_snapshot=tmp_path)


def test_snapshot_round_records_each_policy_in_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The allocator calls are faked, so the file naming and the recording on/off pairs
    # are checked on any machine; the CUDA test below runs the real ones.
    from torch.cuda import memory as cuda_memory

    from tensorstash.bench.snapshot import snapshot_round

    calls: list[tuple[str, Any]] = []

    def record(enabled: str | None = "all", context: str | None = "all", **kwargs: Any) -> None:
        # Stacks at allocations only: with "all", a recomputed dropout failed on CUDA.
        assert enabled is None or context == "alloc"
        calls.append(("record", enabled))

    def dump(filename: str) -> None:
        calls.append(("dump", Path(filename).name))
        Path(filename).write_bytes(b"snapshot")

    monkeypatch.setattr(cuda_memory, "_record_memory_history", record)
    monkeypatch.setattr(cuda_memory, "_dump_snapshot", dump)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    workload = bench.builtin_workload("tiny", seed=0)
    runner = bench.StepRunner(workload, torch.device("cpu"), torch.float32, seed=0)
    runner.take_reference()
    ticks: list[str] = []
    snapshot_round(runner, ["none", "auto:1MiB"], tmp_path / "snap", ticks.append)
    assert calls == [
        ("record", "all"),
        ("dump", "none.pickle"),
        ("record", None),
        ("record", "all"),
        ("dump", "auto_1MiB.pickle"),
        ("record", None),
    ]
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == [
        "auto_1MiB.pickle",
        "none.pickle",
    ]
    assert ticks == ["none", "auto:1MiB"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_memory_snapshot_writes_one_pickle_per_policy(tmp_path: Path) -> None:
    argv = ["bench", "--model", "tiny", "--steps", "1", "--warmup", "0", "--device", "cuda"]
    assert main([*argv, "--policies", "lz4,auto:1MiB", "--memory-snapshot", str(tmp_path)]) == 0
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == ["auto_1MiB.pickle", "lz4.pickle", "none.pickle"]
    assert all(path.stat().st_size > 0 for path in tmp_path.iterdir())


# -- --model-script --------------------------------------------------------------------

SCRIPT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(128, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def make():
    x = torch.randn(256, 128)
    return Net(), (x, torch.randint(4, (256,))), nn.Sequential


def without_blocks():
    model, batch, _ = make()
    return model, batch


def not_a_tuple():
    return Net()


def not_a_module():
    return "net", (torch.randn(2, 128), torch.zeros(2, dtype=torch.long))


def not_a_loss():
    return nn.Linear(128, 4), torch.randn(2, 128)


NOT_CALLABLE = 3
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(SCRIPT)
    return path


def test_bench_model_script_runs_the_users_model(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["bench", "--model-script", f"{script}:make", "--steps", "1", "--warmup", "0"]
    argv += ["--policies", "disk,checkpoint,recompute,auto:50%", "--json", str(out)]
    assert main(argv) == 0
    data = {row["policy"]: row for row in json.loads(out.read_text())}
    assert list(data) == ["none", "disk", "checkpoint", "recompute", "auto:50%"]
    assert all(row["grads_equal"] for row in data.values())
    assert data["disk"]["tiers"]["disk"]["bytes"] > 0
    assert data["auto:50%"]["limit_bytes"] == data["auto:50%"]["plain_growth"] // 2


@pytest.mark.slow
def test_bench_loop_trains_each_policy_of_the_users_model_alone(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "loop.json"
    argv = ["bench", "--model-script", f"{script}:make", "--loop", "7", "--steps", "1"]
    argv += ["--policies", "disk,checkpoint", "--threads", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["none", "disk", "checkpoint"]
    assert all(row["steady_bytes"] > 0 and row["step_s"] > 0 for row in rows.values())
    text = capsys.readouterr().out
    assert "1 round(s) of a 7-step SGD loop, each variant alone in a fresh process" in text
    assert f"allocator {bench.report.ALLOCATOR.name}" in text


def test_loop_rows_pair_each_round_with_no_stashs_and_leave_the_learning_steps_out() -> None:
    from tensorstash.bench.loop import LEARNING, loop_rows

    def run(first: float, later: float, step: float) -> dict[str, list[float]]:
        # The first step (an Auto profile's learning) holds the most; the rest hold `later`.
        peaks = [first] + [later] * (LEARNING + 2)
        seconds = [9.0] * LEARNING + [step] * 3  # the learning steps' times are left out
        return {"peaks": peaks, "seconds": seconds}

    runs = {  # two rounds: the machine was slower in the second, for both
        "none": [run(100, 100, 1.0), run(120, 120, 2.0)],
        "auto:50%": [run(100, 50, 1.5), run(120, 90, 2.2)],
    }
    none, auto = loop_rows(runs)
    assert (none.policy, auto.policy) == ("none", "auto:50%")
    assert (auto.peak_bytes, auto.steady_bytes, auto.step_s) == (110, 70, 1.85)
    assert auto.peak_ratio == 1.0
    assert auto.steady_ratio == pytest.approx((0.5 + 0.75) / 2)  # same-round ratios' median
    assert auto.step_ratio == pytest.approx((1.5 + 1.1) / 2)


@pytest.mark.parametrize(
    "flag", [["--sweep"], ["--twins"], ["--warmup", "1"], ["--device", "cuda"]]
)
def test_bench_loop_with_what_a_loop_does_not_measure_is_a_usage_error(
    flag: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda parses
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--loop", "8", *flag])
    assert exit_info.value.code == 2
    assert f"leave out {flag[0] if flag[0] != '--device' else '--device cuda'}" in (
        capsys.readouterr().err
    )


def test_bench_loop_shorter_than_autos_learning_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--loop", "5"])
    assert exit_info.value.code == 2
    assert "--loop takes more than 5 steps" in capsys.readouterr().err


def test_bench_loop_names_the_policy_whose_run_failed() -> None:
    from tensorstash.bench.loop import run_loops

    def command(name: str) -> list[str]:
        if name == "disk":
            return [sys.executable, "-c", "import sys; sys.exit('no room')"]
        run = json.dumps({"peaks": [1], "seconds": [0.1]})
        return [sys.executable, "-c", f"print({run!r})"]

    with pytest.raises(RuntimeError, match=r"loop of 'disk' failed \(exit status 1\):\nno room"):
        run_loops(["none", "disk"], 1, command)


def test_bench_model_script_without_blocks_skips_checkpoint_by_default(
    script: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(bench, "run_bench", lambda _, names, *a, **k: ran.append(names) or [])
    assert main(["bench", "--model-script", f"{script}:without_blocks"]) == 0
    assert "skipping recompute and checkpoint" in capsys.readouterr().err
    assert ran and not set(ran[0]) & {"recompute", "checkpoint"}


def test_bench_model_script_without_blocks_refuses_checkpoint(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model-script", f"{script}:without_blocks", "--policies", "checkpoint"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "policy 'checkpoint' wraps the model's blocks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("{dir}/missing.py:make", "file '{dir}/missing.py' not found"),
        ("{script}", "must be PATH.py:FUNCTION"),
        ("{script}:nope", "'nope' is not defined; functions defined there: make, not_a_loss"),
        ("{script}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
        ("{script}:not_a_tuple", "returned Net"),
        ("{script}:not_a_module", "returned a str as the model"),
        ("{script}:not_a_loss", "model(*batch) returned a tensor of shape (2, 4)"),
    ],
)
def test_bench_model_script_errors_name_the_problem(
    script: Path,
    target: str,
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fill = {"dir": script.parent, "script": script}
    argv = ["bench", "--model-script", target.format(**fill), "--steps", "1", "--warmup", "0"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--policies", "keep"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err
    assert "returns (model, batch)" in err or "PATH.py:FUNCTION" in err or "scalar loss" in err


def test_bench_model_script_and_model_are_exclusive(script: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--model-script", f"{script}:make"])
    assert exit_info.value.code == 2


# -- tensorstash plan --------------------------------------------------------------------------


def test_plan_command_prints_the_plan_and_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_torch_thread: None
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--limit", "40%", "--steps", "3", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "measured, step 3" in text
    data = json.loads(out.read_text())
    assert data["grads_equal"] is True
    assert data["recompute"] or data["tiers"]  # 40% of a plain step's growth: something saved
    assert data["held_bytes"] < data["activation_bytes"] and data["limit_bytes"] > 0
    assert data["predicted_step_s"] > 0 and len(data["step_s"]) == 3


def test_plan_command_with_one_step_says_it_only_measured(
    capsys: pytest.CaptureFixture[str], one_torch_thread: None
) -> None:
    assert main(["plan", "--model", "tiny", "--limit", "1MiB", "--steps", "1"]) == 0
    assert "the first step measures" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--limit", "--budget"])
def test_plan_command_rejects_a_limit_that_is_not_one(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "tiny", flag, "lots"])
    assert exited.value.code == 2
    assert "a limit is a share of no stash's real peak growth" in capsys.readouterr().err


def test_bench_goes_on_past_an_optional_peer_that_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rule 11 of NOTE [ Fair comparison ]: a peer that raises while it is made is a skipped
    row with its error; the hooks it left pushed go; every other row is measured."""
    from tensorstash.bench import variants

    class Failing:
        def __enter__(self) -> None:
            torch._C._autograd._push_saved_tensors_default_hooks(lambda t: t, lambda t: t)
            raise RuntimeError("You must initialize the accelerate state by calling ...")

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(rounds, "skip_reason", lambda name, device, **where: None)
    monkeypatch.setattr(variants, "_peer_context", lambda name, workload: Failing())
    out = tmp_path / "bench.json"
    code = main(
        ["bench", "--model", "tiny", "--steps", "1", "--warmup", "1",
         "--policies", "keep,trl", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert rows["none"]["grads_equal"] and rows["keep"]["grads_equal"]
    assert rows["trl"]["skipped"].startswith("failed: RuntimeError: You must initialize")
    assert "trl" in capsys.readouterr().out and "skipped: failed: RuntimeError" in (
        bench.format_table([bench.Row.from_dict(row) for row in rows.values()])
    )
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
