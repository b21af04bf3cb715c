"""Which of tensorstash's optional extensions are active here, and why not.

Both are optional (setup.py): without them tensorstash runs, slower or holding
more memory, and :func:`info` is how a user sees which case they are in.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tensorstash.core import _fastpath
from tensorstash.memory import _pool

__all__ = ["Info", "info"]


@dataclass(frozen=True)
class Info:
    """What :func:`info` found.

    Attributes:
        version: tensorstash's version.
        torch: the running torch's version.
        fast_path: whether the session's kept path runs in C (``tensorstash.core._fast``;
            NOTE [ Fast path ] in _fastpath.py).
        fast_path_why: "active", or why not.
        pool: whether the session pool can serve sessions that free memory
            (``tensorstash.memory._alloc``; NOTE [ Session pool ] in _pool.py); where it
            cannot, they trim the heap.
        pool_why: "active" (installed), "ready" (not installed yet: the first CPU session
            that frees memory installs it, and until then PyTorch's CPU allocator is its
            own), or why not.
        pool_installed_at: when the pool became PyTorch's CPU allocator
            (``time.time()``); None where it has not.
        pool_installed_after: seconds from ``import tensorstash`` to then; None where it
            has not.
    """

    version: str
    torch: str
    fast_path: bool
    fast_path_why: str
    pool: bool
    pool_why: str
    pool_installed_at: float | None = None
    pool_installed_after: float | None = None

    def line(self) -> str:
        """One line, for a report's header."""
        fast = "on" if self.fast_path else f"off ({self.fast_path_why})"
        pool = f"off ({self.pool_why})"
        if self.pool:
            pool = "on" if self.pool_installed_at is not None else "on (not installed yet)"
        head = f"tensorstash {self.version}, torch {self.torch}"
        return f"{head}: C fast path {fast}; session pool {pool}"

    def __str__(self) -> str:
        fast = _said(self.fast_path, self.fast_path_why)
        pool = _said(self.pool, self.pool_why)
        if self.pool and self.pool_installed_at is not None:
            clock = time.strftime("%H:%M:%S", time.localtime(self.pool_installed_at))
            pool += f" since {clock} ({self.pool_installed_after or 0:.1f} s after import)"
        elif self.pool:
            pool = "ready (installed when a CPU session first frees memory)"
        return "\n".join(
            [
                f"tensorstash {self.version} (torch {self.torch})",
                f"  C fast path (tensorstash.core._fast):      {fast}",
                f"  session pool (tensorstash.memory._alloc): {pool}",
            ]
        )


def _said(active: bool, why: str) -> str:
    return "active" if active else f"off: {why}"


def info() -> Info:
    """Which optional extensions are active, and why not.

    Returns:
        An :class:`Info`; ``print`` it, or use ``info().line()`` for one line.

    Example:
        >>> import tensorstash as ts
        >>> print(ts.info())  # doctest: +SKIP
        tensorstash 0.1.0.dev0 (torch 2.13.0+cpu)
          C fast path (tensorstash.core._fast):      active
          session pool (tensorstash.memory._alloc): active since 10:02:13 (0.8 s after import)
    """
    from tensorstash import __version__

    pool, pool_why = _pool.status()
    return Info(
        version=__version__,
        torch=torch.__version__,
        fast_path=_fastpath.compiled is not None,
        fast_path_why=_fast_path_why(),
        pool=pool,
        pool_why=pool_why,
        pool_installed_at=_pool.installed_at,
        pool_installed_after=_pool.installed_after(),
    )


def _fast_path_why() -> str:
    if _fastpath.compiled is not None:
        return "active"
    flag = os.environ.get("TENSORSTASH_PURE_PYTHON", "")
    if flag not in ("", "0"):
        return f"turned off by TENSORSTASH_PURE_PYTHON={flag}"
    return "not built: no C compiler where tensorstash was installed"
