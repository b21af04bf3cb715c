"""Tests of ``tensorstash bench``: the embedded model, the measurements and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstash import bench
from tensorstash.cli import _progress_bar, main

LOSSLESS = ["none", "keep", "cpu", "lz4", "disk", "lz4+disk", "save_on_cpu"]
STASHES = ["keep", "cpu", "lz4", "disk", "lz4+disk"]
ALL = [*LOSSLESS, "checkpoint"]


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
    parsed = [bench.Row(**{**row, "step_times": tuple(row["step_times"])}) for row in rows.values()]
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
