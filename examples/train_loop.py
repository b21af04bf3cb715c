"""A plain training loop with tensorstash: activations compressed in host RAM.

Run: python examples/train_loop.py
"""

from __future__ import annotations

import torch
from torch import nn

import tensorstash as ts


def main(steps: int = 3) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    for step in range(steps):
        optimizer.zero_grad()
        with ts.stash("lz4") as session:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    print(session.stats.table())


if __name__ == "__main__":
    main()
