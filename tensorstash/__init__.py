"""tensorstash: move the tensors autograd saves for backward out of the way.

Example:
    >>> import tensorstash as ts
    >>> with ts.stash(ts.Chain(ts.Lz4(), ts.DiskSpill())) as session:
    ...     loss = model(batch).sum()
    >>> loss.backward()
    >>> print(session.stats.table())
"""

from tensorstash._info import info
from tensorstash._verify import VerifyError
from tensorstash.auto import Auto, Memory, Select
from tensorstash.compress import Lz4
from tensorstash.cpu import CpuOffload
from tensorstash.disk import DiskSpill, SpillError
from tensorstash.plan import Plan
from tensorstash.policy import Chain, Context, Defer, Keep, Packed, Policy
from tensorstash.profile import Profile
from tensorstash.recompute import recompute, recompute_modules, unrecompute
from tensorstash.stash import Session, pause, stash
from tensorstash.stats import StashStats

__all__ = [
    "Auto",
    "Chain",
    "Context",
    "CpuOffload",
    "Defer",
    "DiskSpill",
    "Keep",
    "Lz4",
    "Memory",
    "Packed",
    "Plan",
    "Policy",
    "Profile",
    "Select",
    "Session",
    "SpillError",
    "StashStats",
    "VerifyError",
    "info",
    "pause",
    "recompute",
    "recompute_modules",
    "stash",
    "unrecompute",
]

__version__ = "0.1.0.dev0"
