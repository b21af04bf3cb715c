"""Stash statistics across the processes of a ``torch.distributed`` job.

Under DDP and FSDP2 every process (rank) opens its own stash around its own
forward: sessions, worker threads and spill directories are per process, and
nothing tensorstash does crosses processes. This module only brings the
counters together, so that one rank can print what the whole job did.

Example:
    >>> with tensorstash.stash("lz4") as session:
    ...     loss = ddp_model(batch).sum()
    >>> loss.backward()
    >>> gathered = tensorstash.integrations.distributed.gather_stats(session.stats)
    >>> if gathered is not None:  # rank 0
    ...     print(gathered.table())
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tensorstash.core._layout import memory
from tensorstash.core.stats import TIERS, StashStats, human_bytes
from tensorstash.session.stash import Session


@dataclass(frozen=True)
class GatheredStats:
    """The stash statistics of every rank of a group, as gathered on one rank.

    Attributes:
        ranks: each rank's ``StashStats.to_dict()``, in group rank order.
        total: the counters of all ranks summed, as a :class:`StashStats`
            (``table()`` and ``to_dict()`` work on it; it has no decision
            log). Live and peak bytes are summed per rank: each process holds
            its own memory, so the summed peak bounds what the job held at
            once.
    """

    ranks: list[dict[str, Any]]
    total: StashStats

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"ranks": [...], "total": {...}}``."""
        return {"ranks": self.ranks, "total": self.total.to_dict()}

    def table(self) -> str:
        """A plain-text table: bytes per tier for each rank, then the summed table."""
        header = f"{'rank':<6} {'kept':>11} {'host':>11} {'disk':>11} {'stored':>11} {'peak':>11}"
        lines = [header, "-" * len(header)]
        for rank, data in enumerate(self.ranks):
            tiers = data["tiers"]
            cells = " ".join(f"{human_bytes(tiers[t]['bytes']):>11}" for t in TIERS)
            moved = sum(tiers[t]["stored_bytes"] for t in ("host", "disk"))
            peak = sum(tiers[t]["peak_bytes"] for t in TIERS)
            lines.append(f"{rank:<6} {cells} {human_bytes(moved):>11} {human_bytes(peak):>11}")
        lines.append("")
        lines.append(f"all {len(self.ranks)} ranks:")
        lines.append(self.total.table())
        return "\n".join(lines)


def gather_stats(
    stats: StashStats | Session, *, group: Any = None, dst: int = 0
) -> GatheredStats | None:
    """Gather every rank's stash statistics on rank ``dst``.

    A collective: every rank of ``group`` must call it, with the same ``dst``.
    The statistics travel as JSON in uint8 tensors (with NCCL, on the current
    CUDA device: call ``torch.cuda.set_device`` first).

    Args:
        stats: this rank's :class:`StashStats`, or its :class:`Session`.
        group: the process group (default: the whole job).
        dst: the global rank that receives the statistics.

    Returns:
        On ``dst``: a :class:`GatheredStats` (each rank's ``to_dict()`` and
        their sum). On every other rank: None.

    Raises:
        RuntimeError: torch.distributed is not available or not initialized.
        TypeError: ``stats`` is neither a StashStats nor a stash session.

    Example:
        >>> gathered = tensorstash.integrations.distributed.gather_stats(session.stats)
        >>> if gathered is not None:
        ...     print(gathered.table())
    """
    if isinstance(stats, Session):
        stats = stats.stats
    if not isinstance(stats, StashStats):
        raise TypeError(
            "tensorstash.distributed.gather_stats: stats must be a tensorstash.StashStats "
            f"(session.stats) or a stash session; got {type(stats).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "tensorstash.distributed.gather_stats: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first, or print session.stats.table() "
            "in a single process"
        )
    gathered = _gather_json(stats.to_dict(), group, dst)
    if gathered is None:
        return None
    return GatheredStats(
        ranks=gathered, total=StashStats.combined(gathered, concurrent=True, decisions=False)
    )


def _gather_json(value: dict[str, Any], group: Any, dst: int) -> list[dict[str, Any]] | None:
    """Every rank's ``value`` on ``dst``, as JSON bytes in uint8 tensors.

    Not ``gather_object``: it pickles through NumPy, which tensorstash does not
    require, and unpickles what other processes send.
    """
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    count = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    receiving = dist.get_rank() == dst
    parts = [torch.empty_like(padded) for _ in sizes] if receiving else None
    dist.gather(padded, parts, dst=dst, group=group)
    if parts is None:
        return None
    return [
        json.loads(bytes(memory(part.cpu().contiguous())[:size]))
        for part, size in zip(parts, sizes, strict=True)
    ]
