"""Profile one model's training step under a few policies, to pick one.

Runs the tiny bench model (``tensorstash.bench``) for two timed steps under
each policy, interleaved, after one untimed step each, and prints, per policy:
the real peak (how far the process's resident memory grew over a step), the
peak bytes each tier held (kept where they were, host RAM, disk), the
compression ratio, and the step time relative to no stash. Spill files go to the scratch directory.

Run: python examples/memory_profile.py [SCRATCH_DIRECTORY]
"""

from __future__ import annotations

import sys
import tempfile

from tensorstash.bench import Row, run_bench
from tensorstash.core.stats import human_bytes

POLICIES = ["keep", "lz4", "disk", "auto:1MiB", "recompute", "checkpoint"]


def cells(row: Row) -> list[str]:
    if row.tiers is None:  # not a stash: nothing counted per tier
        peaks = ["-", "-", "-"]
        ratio = "-"
    else:
        peaks = [human_bytes(row.tiers[tier]["peak_bytes"]) for tier in ("kept", "host", "disk")]
        ratio = f"{row.compression_ratio:.2f}x"
    real = "-" if row.real_peak_bytes is None else human_bytes(row.real_peak_bytes)
    timing = [f"{row.step_s * 1e3:.0f} ms", f"{row.overhead:.2f}x"]
    return [row.policy, real, *peaks, ratio, *timing]


def main(directory: str) -> None:
    # The "disk" policies spill to the system temporary directory: point it at the scratch one.
    tempfile.tempdir = directory
    rows = run_bench("tiny", POLICIES, steps=2, warmup=1)
    header = ["policy", "real peak", "kept peak", "host peak", "disk peak", "ratio", "step"]
    header.append("vs none")
    table = [header, *(cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    print("real peak and peak stored bytes per tier over one step of the tiny bench model, CPU:")
    for i, line in enumerate(table):
        print(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if i == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    print()
    print("real peak: growth of the process's resident memory over the step; kept: left in")
    print("device memory (here RAM); host: moved or compressed into host RAM; disk: spilled.")
    print("Pick the fastest policy whose real peak fits your budget.")
    unequal = [row.policy for row in rows if not row.grads_equal]
    if unequal:
        raise SystemExit(f"memory_profile: gradients differ from plain autograd under {unequal}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir())
