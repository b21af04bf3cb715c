"""``--memory-snapshot``: one step per variant under the CUDA allocator's history (rule 7)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tensorstash.bench.measure import StepRunner


def check_memory_snapshot(device: str | torch.device) -> None:
    """Raise ValueError unless ``device`` can record allocator snapshots (CUDA)."""
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"tensorstash bench: --memory-snapshot records the CUDA caching allocator's "
            f"history and needs --device cuda (got {str(device)!r}); on the CPU use --plot "
            "for live bytes per tier over a step"
        )


def snapshot_file(directory: Path, policy: str) -> Path:
    """Where ``--memory-snapshot`` writes the snapshot of ``policy``: a safe file name."""
    return directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', policy)}.pickle"


def snapshot_round(
    runner: StepRunner, names: list[str], directory: Path, tick: Callable[[str], None]
) -> None:
    """Rule 7 of NOTE [ Fair comparison ]: one step per variant under the allocator's history."""
    from torch.cuda import memory as cuda_memory

    directory.mkdir(parents=True, exist_ok=True)
    # Each file holds one step: the history of the step before is dropped where torch can.
    parameters = inspect.signature(cuda_memory._record_memory_history).parameters
    options: dict[str, Any] = {"clear_history": True} if "clear_history" in parameters else {}
    if "context" in parameters:
        # Stacks of allocations only: recording them at frees too ("all", the default) made
        # a recomputed dropout fail in backward (SystemError, torch 2.11 on an H200).
        options["context"] = "alloc"
    for name in names:
        torch.cuda.synchronize(runner.device)
        cuda_memory._record_memory_history(max_entries=200_000, device=runner.device, **options)
        try:
            runner.step(name)
            cuda_memory._dump_snapshot(str(snapshot_file(directory, name)))
        finally:
            cuda_memory._record_memory_history(enabled=None, device=runner.device)
        tick(name)
