"""Hold a small model's activations to a budget with ts.Auto, and see where each tensor went.

Auto keeps saved tensors while the session's kept bytes stay within
``device_budget``, then moves the rest out (on a CPU, whose device memory is
host RAM: compressed and spilled to disk). ``record=True`` keeps a decision
log, one row per saved tensor, that says why.

Run: python examples/selector_budget.py [SCRATCH_DIRECTORY]
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter, defaultdict

import torch

import tensorstash as ts
from tensorstash.bench import CONFIGS, BenchGPT, make_batch
from tensorstash.core.stats import human_bytes

BUDGET = 2 << 20  # 2 MiB: about a third of what the tiny bench model saves


def main(directory: str) -> None:
    config = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = BenchGPT(config).train()
    tokens, targets = make_batch(config, seed=0)

    with ts.stash(ts.Auto(device_budget=BUDGET, directory=directory), record=True) as session:
        loss = model(tokens, targets)
    loss.backward()
    stats = session.stats

    print(f"Auto(device_budget={human_bytes(BUDGET)}) on the tiny bench model, bytes per tier:")
    print(stats.table())
    print()
    print("bytes per module and tier:")
    print(stats.table(by="module"))
    print()
    print("decisions per module (tier: count, reason):")
    by_module: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for row in session.decisions:
        by_module[row["module"] or "(no module)"][(row["tier"], row["reason"])] += 1
    for module, decisions in by_module.items():
        print(f"  {module}")
        for (tier, reason), count in decisions.items():
            print(f"    {tier:<5} x{count:<3} {reason}")

    # The budget holds up to one tensor: the one whose arrival crossed it.
    kept_peak = stats.to_dict()["tiers"]["kept"]["peak_bytes"]
    largest = max(row["bytes"] for row in session.decisions)
    held = kept_peak <= BUDGET + largest
    print()
    print(
        f"kept tier peak {human_bytes(kept_peak)} <= budget {human_bytes(BUDGET)} "
        f"+ largest tensor {human_bytes(largest)}: {'held' if held else 'NOT held'}"
    )
    if not held:
        raise SystemExit("selector_budget: the kept tier went past the budget")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir())
