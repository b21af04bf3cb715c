"""Tests of ``tensorstash bench``: the embedded model, the measurements and the CLI."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstash import bench
from tensorstash.bench import plot as _plot
from tensorstash.bench import rounds
from tensorstash.cli import _progress_bar, main

LOSSLESS = ["none", "keep", "cpu", "lz4", "disk", "lz4+disk", "save_on_cpu"]
STASHES = ["keep", "cpu", "lz4", "disk", "lz4+disk"]
ALL = [*LOSSLESS, "checkpoint", "auto:1MiB"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One real run of the CLI on the tiny model, shared by the tests below."""
    out = tmp_path_factory.mktemp("bench") / "rows.json"
    policies = ",".join(name for name in ALL if name != "none")
    argv = ["bench", "--model", "tiny", "--steps", "2", "--warmup", "0", "--policies", policies]
    argv += ["--json", str(out)]
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


@pytest.mark.parametrize("policy", LOSSLESS)
def test_bench_lossless_policy_grads_equal(rows: dict[str, dict[str, Any]], policy: str) -> None:
    assert rows[policy]["grads_equal"] is True


@pytest.mark.parametrize("policy", ALL)
def test_bench_times_are_positive(rows: dict[str, dict[str, Any]], policy: str) -> None:
    row = rows[policy]
    assert row["overhead"] > 0
    assert row["step_s"] > 0
    assert len(row["step_times"]) == 2
    assert row["peak_rss_bytes"] >= 0


def test_bench_baseline_overhead_is_one(rows: dict[str, dict[str, Any]]) -> None:
    assert rows["none"]["overhead"] == pytest.approx(1.0)


@pytest.mark.parametrize("policy", STASHES)
def test_bench_stash_rows_report_tiers(rows: dict[str, dict[str, Any]], policy: str) -> None:
    row = rows[policy]
    assert set(row["tiers"]) == {"kept", "host", "disk"}
    for tier in row["tiers"].values():
        assert {"tensors", "bytes", "stored_bytes", "live_bytes", "peak_bytes"} <= set(tier)
    assert row["compression_ratio"] > 0
    assert row["peak_bytes"] is not None and row["peak_bytes"] >= 0


def test_bench_keep_peak_is_what_it_holds(rows: dict[str, dict[str, Any]]) -> None:
    kept = rows["keep"]["tiers"]["kept"]
    assert rows["keep"]["peak_bytes"] == kept["peak_bytes"] > 0


# On the CPU, CpuOffload has nothing to move: its tensors stay in the "kept" tier.
@pytest.mark.parametrize(
    ("policy", "tier"), [("lz4", "host"), ("disk", "disk"), ("lz4+disk", "disk")]
)
def test_bench_policy_moves_bytes_to_its_tier(
    rows: dict[str, dict[str, Any]], policy: str, tier: str
) -> None:
    assert rows[policy]["tiers"][tier]["bytes"] > 0


@pytest.mark.parametrize("policy", ["none", "save_on_cpu", "checkpoint"])
def test_bench_rows_without_a_stash_have_no_tiers(
    rows: dict[str, dict[str, Any]], policy: str
) -> None:
    assert rows[policy]["tiers"] is None
    assert rows[policy]["compression_ratio"] is None


def test_bench_unknown_policy_names_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--policies", "lz4,bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown policy 'bogus'" in err
    assert "lz4+disk" in err and "checkpoint" in err


def test_resolve_policies_puts_baseline_first_and_drops_repeats() -> None:
    assert bench.resolve_policies(["lz4", "none", "lz4", "disk"]) == ["none", "lz4", "disk"]


def test_resolve_policies_unknown_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"tensorstash bench: unknown policy 'zstd'.*none, keep"):
        bench.resolve_policies(["zstd"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_cuda_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "sees no CUDA device" in err


def test_run_bench_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="steps=0, warmup=1; pass steps >= 1"):
        bench.run_bench("tiny", ["none"], steps=0)


def test_format_table_has_one_line_per_policy(rows: dict[str, dict[str, Any]]) -> None:
    parsed = [bench.Row.from_dict(row) for row in rows.values()]
    lines = bench.format_table(parsed).splitlines()
    body = lines[2 : 2 + len(parsed)]
    assert [line.split()[0] for line in body] == [row.policy for row in parsed]


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


def test_module_help_runs_in_a_subprocess() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorstash", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--policies" in done.stdout and "--json" in done.stdout


def test_progress_bar_without_tqdm_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    with _progress_bar(2) as advance:
        advance("none")
        advance("lz4")


# -- JSON fields, Auto's profile -------------------------------------------------------


@pytest.mark.parametrize("policy", ALL)
def test_bench_json_rows_have_the_documented_fields(
    rows: dict[str, dict[str, Any]], policy: str
) -> None:
    row = rows[policy]
    assert {"policy", "peak_bytes", "step_s", "overhead", "grads_equal", "tiers"} <= set(row)
    assert len(row["step_overheads"]) == len(row["step_peak_bytes"]) == 2
    assert row["timeline"] is None  # only with --plot


def test_bench_auto_budget_row_learns_across_timed_steps(
    rows: dict[str, dict[str, Any]],
) -> None:
    row = rows["auto:1MiB"]
    assert row["grads_equal"] is True
    assert all(peak > 0 for peak in row["step_peak_bytes"])
    # The plan keeps what fits in the budget, as the first step does; the rest goes out.
    assert 0 < row["tiers"]["kept"]["peak_bytes"] <= 2**20
    assert row["tiers"]["disk"]["bytes"] > 0


def test_bench_auto_budget_row_has_a_twin_without_a_plan(
    rows: dict[str, dict[str, Any]],
) -> None:
    """Rule 6 of NOTE [ Fair comparison ]: the twin ran in the same rounds, and is no row."""
    row = rows["auto:1MiB"]
    assert len(row["no_plan_step_times"]) == len(row["no_plan_peak_bytes"]) == 2
    assert all(seconds > 0 for seconds in row["no_plan_step_times"])
    assert all(peak > 0 for peak in row["no_plan_peak_bytes"])
    assert not any(bench.NO_PLAN in policy for policy in rows)
    assert rows["keep"]["no_plan_step_times"] == []


def test_twins_run_beside_their_variant_in_turn_first() -> None:
    every = rounds._with_twins(["none", "auto:8MiB", "lz4"], steps=2)
    twin = "auto:8MiB" + bench.NO_PLAN
    assert every == ["none", "auto:8MiB", twin, "lz4"]
    assert rounds._round_order(every, 0) == every
    assert rounds._round_order(every, 1) == ["none", twin, "auto:8MiB", "lz4"]
    assert rounds._with_twins(["none", "auto:8MiB"], steps=1) == ["none", "auto:8MiB"]


def test_planned_steps_counts_the_twins() -> None:
    assert bench.planned_steps(["none", "auto:8MiB"], steps=3, warmup=1) == 1 + 2 * 5 + 5
    assert bench.planned_steps(["none", "auto:8MiB"], steps=1, warmup=1) == 1 + 2 * 3


def _auto_row(step_times: tuple[float, ...], no_plan: tuple[float, ...]) -> bench.Row:
    count = len(step_times)
    return bench.Row(
        policy="auto:8MiB",
        peak_bytes=10 * 2**20,
        peak_rss_bytes=0,
        step_s=statistics.median(step_times),
        step_times=step_times,
        overhead=1.25,
        grads_equal=True,
        tiers=None,
        compression_ratio=None,
        step_overheads=(2.0,) * count,
        step_peak_bytes=(10 * 2**20,) + (8 * 2**20,) * (count - 1),
        no_plan_step_times=no_plan,
        no_plan_peak_bytes=(10 * 2**20,) * len(no_plan),
    )


def test_format_table_reports_the_plan_against_the_twin() -> None:
    # Same-round ratios of steps 2-4: 0.9, 0.8, 1.0; step 1 (no plan in either) is left out.
    table = bench.format_table([_auto_row((0.5, 0.27, 0.24, 0.3), (0.1, 0.3, 0.3, 0.3))])
    assert (
        "auto:8MiB: steps 2-4, step time 0.90x that without a plan (median of same-round "
        "ratios); peak 8.0 MiB against 10.0 MiB without"
    ) in table
    assert "without a plan (a fresh Profile every step)" in table


def test_format_table_says_nothing_of_a_plan_without_a_twin() -> None:
    assert "without a plan" not in bench.format_table([_auto_row((0.5, 0.3), ())])
    assert "without a plan" not in bench.format_table([_auto_row((0.5,), (0.4,))])


# -- --plot ------------------------------------------------------------------------------


def test_bench_plot_writes_a_png(tmp_path: Path) -> None:
    png, out = tmp_path / "bench.png", tmp_path / "rows.json"
    argv = ["bench", "--model", "tiny", "--steps", "1", "--warmup", "0"]
    argv += ["--policies", "keep", "--plot", str(png), "--json", str(out)]
    assert main(argv) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert 10_000 < len(data) < 150_000
    timelines = {row["policy"]: row["timeline"] for row in json.loads(out.read_text())}
    keep = timelines["keep"]
    # Forward rises, backward falls: the peak comes at the end of forward, nothing is left.
    assert keep["kept"][0] == 0 and max(keep["kept"]) > 0 and keep["kept"][-1] == 0
    peak_at = keep["t_s"][keep["kept"].index(max(keep["kept"]))]
    assert peak_at <= keep["backward_at_s"]
    assert keep["t_s"] == sorted(keep["t_s"])


def test_bench_plot_without_matplotlib_fails_before_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import raise ImportError

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(bench, "run_bench", no_training)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny", "--plot", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    assert "pip install tensorstash[plot]" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_skips_panels_without_data(tmp_path: Path) -> None:
    row = bench.Row(
        policy="none",
        peak_bytes=None,
        peak_rss_bytes=2**20,
        step_s=0.1,
        step_times=(0.1,),
        overhead=1.0,
        grads_equal=True,
        tiers=None,
        compression_ratio=None,
        timeline={"t_s": [0.0, 0.1], "kept": [0, 0], "host": [0, 0], "disk": [0, 0]},
    )
    path = _plot.plot([row], tmp_path / "one.png", title="one row")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_plot_draws_auto_without_a_plan(tmp_path: Path) -> None:
    """The twin's point and the arrow to the plan (rule 6), and nothing for a row without one."""
    pytest.importorskip("matplotlib")
    planned = _auto_row((0.5, 0.27, 0.24, 0.3), (0.1, 0.3, 0.3, 0.3))
    assert _plot._learns(planned) and not _plot._learns(_auto_row((0.5, 0.3), ()))
    path = _plot.plot([planned], tmp_path / "auto.png", title="auto")
    assert path.read_bytes().startswith(b"\x89PNG")


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

    calls: list[tuple[str, Any]] = []

    def record(enabled: str | None = "all", **kwargs: Any) -> None:
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
    rounds._snapshot_round(runner, ["none", "auto:1MiB"], tmp_path / "snap", ticks.append)
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
    argv += ["--policies", "disk,checkpoint,recompute", "--json", str(out)]
    assert main(argv) == 0
    data = {row["policy"]: row for row in json.loads(out.read_text())}
    assert list(data) == ["none", "disk", "checkpoint", "recompute"]
    assert all(row["grads_equal"] for row in data.values())
    assert data["disk"]["tiers"]["disk"]["bytes"] > 0


def test_bench_model_script_without_blocks_skips_checkpoint_by_default(
    script: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(bench, "run_bench", lambda _, names, *a, **k: ran.append(names) or [])
    monkeypatch.setattr(bench, "format_table", lambda rows, device: "")
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
