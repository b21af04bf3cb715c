"""StashStats across sessions: merge, combined, metrics."""

from __future__ import annotations

import tensorstash as ts


def _two() -> tuple[ts.StashStats, ts.StashStats]:
    first, second = ts.StashStats(), ts.StashStats()
    first.add("host", 1000, 250)
    first.skip("parameter", 64)
    first.log({"module": "a", "tier": "host"})
    second.add("host", 3000, 750)
    second.add("disk", 500, 500)
    second.fallback("incompressible")
    second.count_nothing_to_do("already in host memory (CpuOffload)")
    second.timed("wait", 0.5)
    return first, second


def test_combined_adds_counters_and_keeps_the_largest_peak_of_sessions_in_turn() -> None:
    first, second = _two()
    total = ts.StashStats.combined([first, second])
    assert total.tiers["host"].bytes == 4000 and total.tiers["host"].stored_bytes == 1000
    assert total.tiers["host"].peak_bytes == 750  # the larger of 250 and 750
    assert total.tiers["disk"].tensors == 1 and total.tiers["kept"].bytes == 64
    assert total.compression_ratio == (4000 + 500) / (1000 + 500)
    assert total.skipped == {"parameter": 1} and total.fallbacks == {"incompressible": 1}
    assert total.nothing_to_do == {"already in host memory (CpuOffload)": 1}
    assert total.wait_seconds == 0.5 and total.decisions == [{"module": "a", "tier": "host"}]


def test_peaks_of_concurrent_sessions_add_up() -> None:
    first, second = _two()
    first.release("host", 250)
    second.release("host", 750)
    in_turn = ts.StashStats.combined([first, second])
    at_once = ts.StashStats.combined([first.to_dict(), second.to_dict()], concurrent=True)
    assert in_turn.tiers["host"].peak_bytes == 750
    assert at_once.tiers["host"].peak_bytes == 1000
    assert ts.StashStats.combined([first], decisions=False).decisions == []


def test_metrics_are_flat_numbers_per_step() -> None:
    first, second = _two()
    values = ts.StashStats.combined([first, second]).metrics(per=2)
    assert values["tensorstash/host_bytes"] == 2000 and values["tensorstash/host_tensors"] == 1
    assert values["tensorstash/wait_seconds"] == 0.25
    assert values["tensorstash/compression_ratio"] == 4500 / 1500
    assert all(isinstance(v, float) for v in values.values())
    assert set(first.metrics("x.")) == {key.replace("tensorstash/", "x.") for key in values}
