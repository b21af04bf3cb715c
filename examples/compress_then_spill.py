"""Compress activations with lz4, then spill them to a directory of your choice.

Run: python examples/compress_then_spill.py [DIRECTORY]
"""

from __future__ import annotations

import sys
import tempfile

import torch
from torch import nn

import tensorstash as ts


def main(directory: str | None = None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    images = torch.randn(16, 3, 64, 64)
    policy = ts.Chain(ts.Lz4(), ts.DiskSpill(directory))
    with ts.stash(policy) as session:
        loss = model(images).logsumexp(dim=1).mean()
    loss.backward()
    print(session.stats.table())
    ratio = session.stats.compression_ratio
    print(f"{session.stats.to_dict()['tiers']['disk']['tensors']} tensors spilled, {ratio:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir())
