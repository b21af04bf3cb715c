"""What a stash session did: bytes per tier, time spent, and why tensors were kept.

:class:`StashStats` counts, folds the hot path's counts in and merges sessions;
_render.py shows the counts (``to_dict``, ``metrics``, ``table``)."""

from __future__ import annotations

import collections
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from tensorstash.core import _render
from tensorstash.core._fastpath import compiled
from tensorstash.core._reasons import Reason, Why
from tensorstash.core._render import human_bytes as human_bytes  # where callers import it

Tier = Literal["kept", "host", "disk"]
TIERS: tuple[Tier, ...] = ("kept", "host", "disk")


@dataclass(slots=True)
class TierStats:
    """Counters of one tier.

    Attributes:
        tensors: tensors packed whose bytes rest in this tier.
        bytes: their original size.
        stored_bytes: their size as stored (after compression).
        live_bytes: stored bytes held in this tier now.
        peak_bytes: the most stored bytes held in this tier at once, including
            bytes that rested here only while background work ran (a tensor
            waiting for compression counts in "host" until it is found
            incompressible and left in "kept").
    """

    tensors: int = 0
    bytes: int = 0
    stored_bytes: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0

    def _hold(self, stored: int, beside: int = 0) -> None:
        """Hold ``stored`` more bytes; ``beside``: bytes of this tier counted elsewhere."""
        self.live_bytes += stored
        if self.live_bytes + beside > self.peak_bytes:
            self.peak_bytes = self.live_bytes + beside


class _HotCounts:
    """What the pack hook counts without a lock, until :meth:`StashStats.fold` adds it.

    One thread writes these counts: the thread that runs the session's hooks.
    A kept tensor freed on another thread (backward on a device's thread)
    posts its bytes with :meth:`release`; that thread drains them. The C
    extension's ``HotCounts`` is the same (NOTE [ Fast path ] in _fastpath.py).

    Attributes:
        small_tensors, small_bytes: tensors under ``min_bytes``, and their bytes.
        tensors, bytes: tensors kept where they are by a policy, and their bytes.
        live: bytes of those held now; ``peak``: the most held in the tier at once.
        unpacks: unpacks of those tensors.
        released: true while freed kept tensors' bytes are not yet off ``live``.
        keep_limit, keep_cpu, keep_left: a selector's posted keep limit: the C
            pack keeps up to ``keep_left`` tensors (CPU ones if ``keep_cpu``,
            others if not) without asking it while ``live`` stays within
            ``keep_limit`` (rule 6 of NOTE [ Fast path ]).
    """

    __slots__ = (
        "bytes",
        "keep_cpu",
        "keep_left",
        "keep_limit",
        "live",
        "peak",
        "released",
        "small_bytes",
        "small_tensors",
        "tensors",
        "unpacks",
    )

    def __init__(self) -> None:
        self.small_tensors = self.small_bytes = 0
        self.tensors = self.bytes = self.live = self.peak = self.unpacks = 0
        self.released: collections.deque[int] = collections.deque()
        self.keep_limit, self.keep_cpu, self.keep_left = -1, False, 0

    def post(self, limit: int, on_cpu: bool, count: int) -> None:
        """Let the C pack keep ``count`` tensors (CPU ones if ``on_cpu``, others if not)
        while ``live`` stays within ``limit``, without asking the selector (rule 5 of
        NOTE [ Fast path ]); the Python hooks ask it for every tensor."""
        self.keep_limit, self.keep_cpu, self.keep_left = limit, on_cpu, count

    def unpost(self) -> None:
        """Withdraw what was posted."""
        self.keep_left = 0

    def release(self, nbytes: int) -> None:
        """Post the bytes of a kept tensor freed, on any thread."""
        self.released.append(nbytes)

    def drain(self) -> None:
        """Take the bytes of freed kept tensors off ``live`` (on the hooks' thread)."""
        released = self.released
        while released:
            self.live -= released.popleft()

    def pending(self) -> int:
        """The bytes of freed kept tensors not yet taken off ``live``."""
        return sum(self.released.copy())


HotCounts: Any = _HotCounts if compiled is None else compiled.HotCounts


@dataclass(eq=False, slots=True)
class Decision:
    """One row of the decision log, kept current as background work moves its bytes.

    ``reason`` is why the tensor went where it went; ``waiting`` says it waits in
    the recent window; ``outcomes`` are what background work did with it since.
    :meth:`row` renders it for people.
    """

    module: str
    op: str | None
    shape: list[int]
    dtype: str
    bytes: int
    tier: Tier
    stored_bytes: int
    reason: Reason
    waiting: bool = False
    outcomes: list[Reason] = field(default_factory=list)

    def text(self) -> str:
        """The reason, the window and the outcomes as one line, "; " between them."""
        parts = [self.reason.text()]
        if self.waiting:
            parts.append(Why.RECENT.value)
        parts.extend(outcome.text() for outcome in self.outcomes)
        return "; ".join(parts)

    def row(self) -> dict[str, Any]:
        """The row as the public decision log shows it."""
        return {
            "module": self.module,
            "op": self.op,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "tier": self.tier,
            "stored_bytes": self.stored_bytes,
            "reason": self.text(),
        }


@dataclass(eq=False)
class StashStats:
    """Counters of a stash session, safe to update from background threads.

    ``bytes`` are the tensors' original sizes, ``stored_bytes`` their sizes as
    stored, after compression. The tier "kept" counts tensors left where they
    were (kept by the policy, or not eligible); "host" counts bytes in host RAM
    that the tensors were moved or compressed to; "disk" counts spilled bytes.
    ``quiet`` counts the steps that ran as plain autograd, with no hooks at all:
    under ``Auto`` with a profile, once its plan moves nothing (rule 10 of NOTE
    [ Session ]); the tiers count nothing of such a step. ``skipped`` counts the
    tensors the session kept untouched (not eligible), ``fallbacks`` those a policy
    could not place where it wanted ("disk full", "incompressible"), and
    ``nothing_to_do`` those a policy or a stage of a Chain had no work for, by
    reason (a CPU tensor under ``CpuOffload`` is in host memory already).

    Example:
        >>> with tensorstash.stash("lz4") as session:
        ...     loss = model(x).sum()
        >>> print(session.stats.table())
    """

    tiers: dict[Tier, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    pack_seconds: float = 0.0
    unpack_seconds: float = 0.0
    wait_seconds: float = 0.0
    skipped: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    nothing_to_do: Counter[str] = field(default_factory=Counter)
    deduplicated: int = 0
    unpacks: int = 0
    inside_recompute: int = 0
    returned_bytes: int = 0
    returned_seconds: float = 0.0
    returns: int = 0
    quiet: int = 0
    hot: HotCounts = field(default_factory=HotCounts, repr=False, compare=False)
    _log: list[Decision | dict[str, Any]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- updates (called by the session and by policies) ------------------------

    def add(self, tier: Tier, nbytes: int, stored: int) -> None:
        """Count a packed tensor that now holds ``stored`` bytes in ``tier``."""
        with self._lock:
            counters = self.tiers[tier]
            counters.tensors += 1
            counters.bytes += nbytes
            counters.stored_bytes += stored
            counters._hold(stored, self.hot.live if tier == "kept" else 0)

    def move(self, old: tuple[Tier, int, int], new: tuple[Tier, int, int]) -> None:
        """Move a packed tensor's bytes: ``(tier, nbytes, stored)`` before and after.

        Used when background work finishes (compression shrank the bytes, a
        disk write completed or fell back to memory).
        """
        with self._lock:
            before, after = self.tiers[old[0]], self.tiers[new[0]]
            before.live_bytes -= old[2]
            before.stored_bytes -= old[2]
            if old[0] != new[0]:
                before.tensors -= 1
                before.bytes -= old[1]
                after.tensors += 1
                after.bytes += new[1]
            after.stored_bytes += new[2]
            after._hold(new[2], self.hot.live if new[0] == "kept" else 0)

    def fold(self) -> None:
        """Add the hot path's counts (:class:`HotCounts`) to the tiers.

        Call it on the thread that runs the session's hooks; the session does,
        when its stats are read there and when it exits.
        """
        hot = self.hot
        hot.drain()
        with self._lock:
            if hot.small_tensors:
                self.skipped[_UNDER_MIN_BYTES] += hot.small_tensors
                kept = self.tiers["kept"]
                kept.tensors += hot.small_tensors
                kept.bytes += hot.small_bytes
                kept.stored_bytes += hot.small_bytes
                hot.small_tensors = hot.small_bytes = 0
            if hot.tensors or hot.live or hot.peak:
                kept = self.tiers["kept"]
                kept.tensors += hot.tensors
                kept.bytes += hot.bytes
                kept.stored_bytes += hot.bytes
                kept.live_bytes += hot.live
                kept.peak_bytes = max(kept.peak_bytes, hot.peak)
                hot.tensors = hot.bytes = hot.live = hot.peak = 0
            self.unpacks += hot.unpacks
            hot.unpacks = 0

    def release(self, tier: Tier, stored: int) -> None:
        """Forget ``stored`` live bytes of ``tier``: their packed value was freed."""
        with self._lock:
            self.tiers[tier].live_bytes -= stored

    def skip(self, reason: Reason | str, nbytes: int, count: int = 1) -> None:
        """Count ``count`` tensors (``nbytes`` in all) kept untouched: not eligible (``reason``)."""
        with self._lock:
            self.skipped[str(reason)] += count
            counters = self.tiers["kept"]
            counters.tensors += count
            counters.bytes += nbytes
            counters.stored_bytes += nbytes

    def fallback(self, reason: str) -> None:
        """Count a tensor that a policy could not place where it wanted."""
        with self._lock:
            self.fallbacks[reason] += 1

    def count_nothing_to_do(self, reason: str) -> None:
        """Count a tensor that a policy (or a stage of a Chain) had no work for."""
        with self._lock:
            self.nothing_to_do[reason] += 1

    def returned(self, nbytes: int, seconds: float = 0.0) -> None:
        """Count one hand-back of free memory to the OS: the bytes the resident set fell
        by, and the seconds the call took.

        NOTE [ Returning memory ] in _trim.py, rule 7: the bytes are faulted in
        again when the process reuses them.
        """
        with self._lock:
            self.returns += 1
            self.returned_bytes += nbytes
            self.returned_seconds += seconds

    def timed(self, kind: Literal["pack", "unpack", "wait"], seconds: float) -> None:
        with self._lock:
            if kind == "pack":
                self.pack_seconds += seconds
            elif kind == "unpack":
                self.unpack_seconds += seconds
                self.unpacks += 1
            else:
                self.wait_seconds += seconds

    def log(self, row: Decision | dict[str, Any]) -> None:
        """Append a row to the decision log (``stash(..., record=True)``)."""
        with self._lock:
            self._log.append(row)

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """The decision log, one row per saved tensor in pack order (``record=True``).

        Each row has ``module``, ``op``, ``shape``, ``dtype``, ``bytes``,
        ``tier``, ``stored_bytes`` and ``reason``; a fresh copy on each read.
        """
        with self._lock:
            return [_row(entry) for entry in self._log]

    def count_dedupe(self) -> None:
        with self._lock:
            self.deduplicated += 1

    # -- reading -----------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        """Stored bytes held now, all tiers together."""
        hot = self.hot
        return sum(t.live_bytes for t in self.tiers.values()) + hot.live - hot.pending()

    @property
    def compression_ratio(self) -> float:
        """Original over stored bytes of the tensors moved off the device (1.0 if none)."""
        with self._lock:
            return self._ratio_unlocked()

    def _ratio_unlocked(self) -> float:
        moved = [self.tiers["host"], self.tiers["disk"]]
        stored = sum(t.stored_bytes for t in moved)
        return sum(t.bytes for t in moved) / stored if stored else 1.0

    # -- shown (the text and the keys: _render.py) ------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of every counter (what :meth:`merge` reads)."""
        with self._lock:
            decisions = [_row(entry) for entry in self._log]
            return _render.as_dict(self, self._ratio_unlocked(), decisions)

    def metrics(self, prefix: str = "tensorstash/", *, per: int = 1) -> dict[str, float]:
        """Flat numbers for a logger, as integrations log them.

        Per tier (``kept``, ``host``, ``disk``): ``<tier>_tensors``,
        ``<tier>_bytes`` (original size) and ``<tier>_stored_bytes`` (after
        compression), each divided by ``per`` (a mean over ``per`` steps merged
        together), and ``<tier>_peak_bytes``; then ``compression_ratio``, and
        ``pack_seconds``, ``unpack_seconds``, ``wait_seconds`` and
        ``returned_bytes`` (memory handed back to the OS) divided by ``per``.
        Keys start with ``prefix``.
        """
        return _render.metrics(self.to_dict(), prefix, per)

    def table(self, by: Literal["tier", "module"] = "tier") -> str:
        """A plain-text table for people.

        Args:
            by: "tier": one row per tier, then times and reasons; "module": one
                row per module of the decision log (``stash(..., record=True)``)
                with its bytes per tier.
        """
        if by == "module":
            return _render.module_table(self.decisions, TIERS)
        return _render.tier_table(self.to_dict())

    # -- several sessions ------------------------------------------------------

    def merge(
        self,
        other: StashStats | dict[str, Any],
        *,
        concurrent: bool = False,
        decisions: bool = True,
    ) -> None:
        """Add another session's counters (a ``StashStats`` or its ``to_dict()``) to these.

        Counters and seconds add up. Peaks add up for sessions that held their
        bytes at the same time (``concurrent``: ranks, threads) and are the
        largest of the two for sessions run one after the other (the steps or
        micro-batches of a loop). ``decisions``: extend the decision log too.
        """
        data = other.to_dict() if isinstance(other, StashStats) else other
        with self._lock:
            for name in TIERS:
                into, came = self.tiers[name], data["tiers"][name]
                into.tensors += came["tensors"]
                into.bytes += came["bytes"]
                into.stored_bytes += came["stored_bytes"]
                into.live_bytes += came["live_bytes"]
                peak = came["peak_bytes"]
                into.peak_bytes = (
                    into.peak_bytes + peak if concurrent else max(into.peak_bytes, peak)
                )
            self.pack_seconds += data["pack_seconds"]
            self.unpack_seconds += data["unpack_seconds"]
            self.wait_seconds += data["wait_seconds"]
            self.unpacks += data["unpacks"]
            self.deduplicated += data["deduplicated"]
            self.inside_recompute += data.get("inside_recompute", 0)
            self.returned_bytes += data.get("returned_bytes", 0)
            self.returned_seconds += data.get("returned_seconds", 0.0)
            self.returns += data.get("returns", 0)
            self.quiet += data.get("quiet", 0)
            self.skipped.update(data["skipped"])
            self.fallbacks.update(data["fallbacks"])
            self.nothing_to_do.update(data.get("nothing_to_do", {}))
            if decisions:
                self._log.extend(dict(row) for row in data["decisions"])

    @classmethod
    def combined(
        cls,
        parts: list[StashStats] | list[dict[str, Any]],
        *,
        concurrent: bool = False,
        decisions: bool = True,
    ) -> StashStats:
        """New stats holding the sum of ``parts`` (see :meth:`merge`)."""
        total = cls()
        for part in parts:
            total.merge(part, concurrent=concurrent, decisions=decisions)
        return total


_UNDER_MIN_BYTES = Why.UNDER_MIN_BYTES.value


def _row(entry: Decision | dict[str, Any]) -> dict[str, Any]:
    return entry.row() if isinstance(entry, Decision) else dict(entry)
