"""Stash statistics across the processes of a ``torch.distributed`` job.

Under DDP and FSDP2 every process (rank) opens its own stash around its own
forward: sessions, worker threads and spill directories are per process, and
nothing tensorstash does crosses processes. This module only brings the
counters together, so that one rank can print what the whole job did.

Example:
    >>> with tensorstash.stash("lz4") as session:
    ...     loss = ddp_model(batch).sum()
    >>> loss.backward()
    >>> gathered = tensorstash.distributed.gather_stats(session.stats)
    >>> if gathered is not None:  # rank 0
    ...     print(gathered.table())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tensorstash.stash import Session
from tensorstash.stats import TIERS, StashStats, human_bytes


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
    Uses ``torch.distributed.gather_object`` (pickled dictionaries; with NCCL,
    call ``torch.cuda.set_device`` first, as ``gather_object`` requires).

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
        >>> gathered = tensorstash.distributed.gather_stats(session.stats)
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
    mine = stats.to_dict()
    receiving = dist.get_rank() == dst
    size = dist.get_world_size(group)
    gathered: list[Any] | None = [None] * size if receiving else None
    dist.gather_object(mine, gathered, dst=dst, group=group)
    if gathered is None:
        return None
    ranks: list[dict[str, Any]] = list(gathered)
    return GatheredStats(
        ranks=ranks, total=StashStats.combined(ranks, concurrent=True, decisions=False)
    )
