"""tensorstash: move the tensors autograd saves for backward out of the way.

Example:
    >>> import tensorstash as ts
    >>> with ts.stash(ts.Chain(ts.Lz4(), ts.DiskSpill())) as session:
    ...     loss = model(batch).sum()
    >>> loss.backward()
    >>> print(session.stats.table())
"""

# First: torch, without its warning where numpy is not installed (_torch.py).
from tensorstash import _torch  # noqa: F401  # isort: skip

from tensorstash.core import _support

# NOTE [ Support range ] rule 1, before a module that needs a newer torch is imported.
_support.check_floor()

from tensorstash import _aliases
from tensorstash._info import info
from tensorstash.core.policy import Chain, Context, Defer, Keep, Packed, Policy
from tensorstash.core.stats import StashStats
from tensorstash.planning.auto import Auto, Memory, MemoryLimitError, Select
from tensorstash.planning.plan import Plan
from tensorstash.planning.profile import Profile
from tensorstash.session._verify import VerifyError
from tensorstash.session.stash import Session, pause, stash
from tensorstash.tiers.compress import Lz4
from tensorstash.tiers.cpu import CpuOffload
from tensorstash.tiers.disk import DiskSpill, SpillError
from tensorstash.tiers.recompute import recompute, recompute_modules, unrecompute

_aliases.install()  # old import paths: tensorstash.disk, tensorstash.lightning, ...

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
    "MemoryLimitError",
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
