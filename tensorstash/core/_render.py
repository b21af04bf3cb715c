"""How a session's counters are shown: a JSON-ready copy, flat metrics for a logger,
and plain-text tables for people. :class:`~tensorstash.core.stats.StashStats` counts;
these functions only read what it hands them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorstash.core.stats import StashStats

_TIER_KEYS = ("tensors", "bytes", "stored_bytes", "live_bytes", "peak_bytes")


def as_dict(stats: StashStats, ratio: float, decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """Every counter of ``stats`` as plain values: what ``StashStats.to_dict`` returns
    and ``StashStats.merge`` reads. The caller holds the stats' lock."""
    return {
        "tiers": {
            name: {key: getattr(t, key) for key in _TIER_KEYS} for name, t in stats.tiers.items()
        },
        "compression_ratio": ratio,
        "pack_seconds": stats.pack_seconds,
        "unpack_seconds": stats.unpack_seconds,
        "wait_seconds": stats.wait_seconds,
        "unpacks": stats.unpacks,
        "deduplicated": stats.deduplicated,
        "inside_recompute": stats.inside_recompute,
        "returned_bytes": stats.returned_bytes,
        "returned_seconds": stats.returned_seconds,
        "returns": stats.returns,
        "quiet": stats.quiet,
        "skipped": dict(stats.skipped),
        "fallbacks": dict(stats.fallbacks),
        "nothing_to_do": dict(stats.nothing_to_do),
        "decisions": decisions,
    }


def metrics(data: dict[str, Any], prefix: str, per: int) -> dict[str, float]:
    """Flat numbers for a logger from :func:`as_dict`'s ``data`` (see ``StashStats.metrics``)."""
    out: dict[str, float] = {}
    for name, counters in data["tiers"].items():
        for key in ("tensors", "bytes", "stored_bytes"):
            out[f"{prefix}{name}_{key}"] = counters[key] / per
        out[f"{prefix}{name}_peak_bytes"] = float(counters["peak_bytes"])
    out[f"{prefix}compression_ratio"] = float(data["compression_ratio"])
    for key in ("pack_seconds", "unpack_seconds", "wait_seconds", "returned_bytes"):
        out[f"{prefix}{key}"] = data[key] / per
    return out


def tier_table(data: dict[str, Any]) -> str:
    """One row per tier, then times and reasons, from :func:`as_dict`'s ``data``."""
    header = f"{'tier':<6} {'tensors':>8} {'bytes':>11} {'stored':>11} {'live':>11} {'peak':>11}"
    lines = [header, "-" * len(header)]
    for name, t in data["tiers"].items():
        lines.append(
            f"{name:<6} {t['tensors']:>8} {human_bytes(t['bytes']):>11} "
            f"{human_bytes(t['stored_bytes']):>11} {human_bytes(t['live_bytes']):>11} "
            f"{human_bytes(t['peak_bytes']):>11}"
        )
    lines.append(
        f"compression {data['compression_ratio']:.2f}x  pack {data['pack_seconds']:.3f}s  "
        f"unpack {data['unpack_seconds']:.3f}s  wait {data['wait_seconds']:.3f}s  "
        f"deduplicated {data['deduplicated']}"
    )
    if data["returns"]:
        lines.append(
            f"handed back to the OS: {human_bytes(data['returned_bytes'])} in "
            f"{data['returns']} call(s) ({data['returned_seconds']:.3f}s), faulted in "
            "again when reused"
        )
    if data["quiet"]:
        lines.append(
            f"quiet {data['quiet']} time(s): Auto's plan moved nothing, so the step ran as "
            "plain autograd (nothing counted; see session.plan)"
        )
    if data["inside_recompute"]:
        lines.append(
            f"opened inside a recomputed region {data['inside_recompute']} time(s): "
            "tensors passed through untouched"
        )
    for title, reasons in (
        ("kept untouched", data["skipped"]),
        ("nothing to do", data.get("nothing_to_do", {})),
        ("fallbacks", data["fallbacks"]),
    ):
        if reasons:
            text = ", ".join(f"{why}: {n}" for why, n in sorted(reasons.items()))
            lines.append(f"{title}: {text}")
    return "\n".join(lines)


def module_table(rows: list[dict[str, Any]], tiers: Sequence[str]) -> str:
    """One row per module of the decision log ``rows``, with its bytes per tier."""
    if not rows:
        return "no decisions recorded: open the stash with record=True"
    per: dict[str, dict[str, int]] = {}
    for row in rows:
        sums = per.setdefault(row["module"] or "(no module)", dict.fromkeys(tiers, 0))
        sums[row["tier"]] += row["bytes"] if row["reason"] != "deduplicated" else 0
        sums.setdefault("tensors", 0)
        sums["tensors"] += 1
    width = max(len("module"), *(len(name) for name in per))
    header = f"{'module':<{width}} {'tensors':>8}" + "".join(f" {t:>11}" for t in tiers)
    lines = [header, "-" * len(header)]
    for name, sums in per.items():
        cells = " ".join(f"{human_bytes(sums[t]):>11}" for t in tiers)
        lines.append(f"{name:<{width}} {sums['tensors']:>8} {cells}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
