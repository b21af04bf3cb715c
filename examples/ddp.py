"""DDP on 2 CPU processes (gloo), each rank with its own stash; rank 0 prints the job's stats.

Every rank opens its own session around its forward; spills go to a private
``tensorstash-<pid>-*`` directory per process inside DIRECTORY, and
``tensorstash.integrations.distributed.gather_stats`` brings the counters to rank 0.

Run: python examples/ddp.py [DIRECTORY]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import tensorstash as ts
from tensorstash.integrations.distributed import gather_stats

WORLD = 2


def train(rank: int, directory: str, steps: int = 3) -> None:
    torch.set_num_threads(1)  # two processes on a small machine
    store = dist.FileStore(os.path.join(directory, f"store-{os.getppid()}"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(rank)  # each rank its own batches
    policy = ts.Chain(ts.Lz4(), ts.DiskSpill(directory))
    for step in range(steps):
        x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
        optimizer.zero_grad()
        with ts.stash(policy) as session:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the gradients as usual
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    gathered = gather_stats(session.stats)  # every rank calls it; rank 0 gets the result
    if gathered is not None:
        print(gathered.table())
    dist.destroy_process_group()


def main(directory: str) -> None:
    mp.spawn(train, args=(directory,), nprocs=WORLD)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:  # the ranks' store file and spill directories, removed with it
        with tempfile.TemporaryDirectory(prefix="tensorstash-ddp-") as scratch:
            main(scratch)
