"""Which of tensorstash's optional extensions are active here, and why not.

Both are optional (setup.py): without them tensorstash runs, slower or holding
more memory, and :func:`info` is how a user sees which case they are in.
"""

from __future__ import annotations

import os
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
        pool_why: "active", or why not.
    """

    version: str
    torch: str
    fast_path: bool
    fast_path_why: str
    pool: bool
    pool_why: str

    def line(self) -> str:
        """One line, for a report's header."""
        fast = "on" if self.fast_path else f"off ({self.fast_path_why})"
        pool = "on" if self.pool else f"off ({self.pool_why})"
        head = f"tensorstash {self.version}, torch {self.torch}"
        return f"{head}: C fast path {fast}; session pool {pool}"

    def __str__(self) -> str:
        fast = _said(self.fast_path, self.fast_path_why)
        pool = _said(self.pool, self.pool_why)
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
          session pool (tensorstash.memory._alloc): active
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
    )


def _fast_path_why() -> str:
    if _fastpath.compiled is not None:
        return "active"
    flag = os.environ.get("TENSORSTASH_PURE_PYTHON", "")
    if flag not in ("", "0"):
        return f"turned off by TENSORSTASH_PURE_PYTHON={flag}"
    return "not built: no C compiler where tensorstash was installed"
