"""Bytes per tier and per rank under tensor parallelism: the MLP of issue 15.

Run: ``torchrun --nproc_per_node 2 benchmarks/tensor_parallel_bytes.py``.

Two gloo ranks on the CPU; ``Linear(256, 1024)``, GELU and ``Linear(1024,
256)`` sharded with ``ColwiseParallel`` and ``RowwiseParallel``; one step of a
(64, 256) batch under each policy with ``min_bytes=0``. Rank 0 prints, per
policy and rank, the bytes each tier holds (stored bytes in brackets where
compression changed them) and the reasons tensors were kept untouched, from
``tensorstash.integrations.distributed.gather_stats``.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tensorstash as ts
from tensorstash.integrations.distributed import gather_stats

POLICIES = {
    "disk": lambda directory: ts.DiskSpill(directory=directory),
    "lz4": lambda directory: ts.Lz4(),
    "lz4+disk": lambda directory: ts.Chain(ts.Lz4(), ts.DiskSpill(directory=directory)),
    "auto-64KiB": lambda directory: ts.Auto(device_budget=64 << 10, directory=directory),
}


def _cell(tier: dict[str, Any]) -> str:
    text = f"{tier['bytes']:,}"
    if tier["stored_bytes"] != tier["bytes"]:
        text += f" [{tier['stored_bytes']:,}]"
    return text


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(64, 256)
    lines = [f"{'policy':<11} {'rank':<5} {'kept':>10} {'host':>18} {'disk':>10}  kept untouched"]
    with tempfile.TemporaryDirectory() as directory:
        for name, make in POLICIES.items():
            with ts.stash(make(directory), min_bytes=0) as session:
                loss = mlp(x).square().mean()
            loss.backward()
            mlp.zero_grad(set_to_none=True)
            gathered = gather_stats(session)
            if gathered is None:
                continue
            for rank, stats in enumerate(gathered.ranks):
                tiers = stats["tiers"]
                cells = [_cell(tiers[t]) for t in ("kept", "host", "disk")]
                skipped = ", ".join(f"{why}: {n}" for why, n in sorted(stats["skipped"].items()))
                lines.append(
                    f"{name:<11} {rank:<5} {cells[0]:>10} {cells[1]:>18} {cells[2]:>10}  {skipped}"
                )
    if dist.get_rank() == 0:
        print(f"tensorstash from {ts.__file__}")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
