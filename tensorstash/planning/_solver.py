"""The search of NOTE [ Plan ] rule 3: the savings a plan takes, cheapest per byte first.

A :class:`Candidate` is the savings taken so far and the bytes they leave
held, at the end of forward and at the peak while backward recomputes. A
:class:`Solver` prices each saving still open against it (with what a
:class:`~tensorstash.planning._calibration.Calibration` read from the steps)
and takes the cheapest per byte until the held bytes fit.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tensorstash.planning._calibration import Calibration, under
from tensorstash.planning.profile import ModuleRecord, Site, SiteRecord

Move = Literal["host", "compressed", "disk"]
"""Where a moved site's tensors go."""
Excluded = Callable[[str], bool]
"""``never(path)``: True for the modules the user forbids recomputing."""


@dataclass(frozen=True)
class Choice:
    """One saving the plan took: what, how many bytes, at what cost."""

    kind: Literal["recompute", "host", "compressed", "disk"]
    target: str
    saved_bytes: int
    cost_s: float


class Candidate:
    """The savings taken so far, and the bytes they leave held (rule 3)."""

    def __init__(self, calibration: Calibration) -> None:
        self.sites: dict[Site, SiteRecord] = calibration.sites
        self.modules: dict[str, ModuleRecord] = calibration.modules
        self.inside = calibration.inside
        self.inside_bytes = calibration.inside_bytes
        self.held = calibration.activation
        self.recomputed: dict[str, Choice] = {}
        self.moved: dict[Site, Choice] = {}
        self.copied = 0  # bytes copied to host so far, against the link's capacity

    def covers(self, path: str) -> bool:
        """Whether ``path`` lies inside a module already recomputed."""
        return any(under(path, outer) for outer in self.recomputed)

    def recompute(self, path: str, saved: int, cost: float) -> None:
        """Take recomputing ``path``, which adds ``saved`` bytes to the choices it replaces.

        It replaces the choices inside it: its own are all they saved and more, at
        ``cost``, its whole forward time (they are no longer made, nor paid for).
        """
        self.held -= saved
        for inner in [p for p in self.recomputed if under(p, path)]:
            saved += self.recomputed.pop(inner).saved_bytes
        for site in [s for s in self.moved if under(s[0], path)]:
            saved += self.moved.pop(site).saved_bytes
        self.recomputed[path] = Choice("recompute", path, saved, cost)

    def move(self, site: Site, kind: Move, saved: int, cost: float, copied: int) -> None:
        """Take moving ``site`` to ``kind``; ``copied``: the bytes that cross the link."""
        self.moved[site] = Choice(kind, site_name(site), saved, cost)
        self.held -= saved
        self.copied += copied

    # The peak held (rule 3) -------------------------------------------------------------

    def held_before(self) -> Callable[[int], int]:
        """``before(order)``: bytes held for sites saved before ``order``, and the inputs
        of regions begun before it, with the choices taken so far (one pass, then a search)."""
        held: list[tuple[int, int]] = []
        for site, record in self.sites.items():
            if any(under(site[0], m) for m in self.recomputed):
                continue
            moved = self.moved.get(site)
            held.append((record.order, record.nbytes - (0 if moved is None else moved.saved_bytes)))
        for path in self.recomputed:
            held.append((self.modules[path].first_order, self.modules[path].input_bytes))
        held.sort()
        orders = [order for order, _ in held]
        totals = list(itertools.accumulate((nbytes for _, nbytes in held), initial=0))
        return lambda order: totals[bisect.bisect_left(orders, order)]

    def region_peaks(self, before: Callable[[int], int]) -> dict[str, int]:
        """Bytes held while backward recomputes each module chosen: what was saved
        before it and is still held (``before``), its inputs, and everything saved inside it."""
        return {
            path: before(self.modules[path].first_order)
            + self.modules[path].input_bytes
            + self.inside_bytes(path)
            for path in self.recomputed
        }

    def held_at_peak(self, recomputed: tuple[str, ...], held: int) -> int:
        """Rule 6: the bytes held at the peak of a step that recomputed ``recomputed`` and
        held ``held`` when forward ended (the sites this candidate moves not counted):
        when forward ends, or while backward recomputes."""
        peak = held
        for path in recomputed:
            record = self.modules.get(path)
            if record is None:
                continue
            before = sum(
                r.nbytes
                for site, r in self.sites.items()
                if r.order < record.first_order
                and not any(under(site[0], m) for m in recomputed)
                and site not in self.moved
            )
            inside = sum(self.sites[site].nbytes for site in self.inside(path))
            peak = max(peak, before + record.input_bytes + inside)
        return peak


@dataclass(frozen=True)
class _Option:
    """A saving the solver may take: its cost, bytes, place in the step, kind and target."""

    cost: float
    saved: int
    order: int
    kind: str
    target: object

    def rank(self) -> tuple[int, int]:
        """Cost per byte in steps of about 10%, then the earlier first (see take_cheapest)."""
        per_byte = self.cost / self.saved
        return (round(math.log(per_byte) / _BUCKET) if per_byte > 0 else -(10**9), self.order)


_BUCKET = math.log(1.1)


class Solver:
    """The greedy of rule 3: prices the savings open to a candidate, takes the cheapest.

    Args:
        calibration: what the steps say each part costs (calibrated or not).
        target: the held bytes the greedy aims at (rule 10: less than the budget
            for a plan that copies on CUDA).
        capacity: bytes the link moves while forward runs (rule 3, CUDA).
    """

    def __init__(self, calibration: Calibration, target: int, capacity: float = 0.0) -> None:
        self.calibration = calibration
        self.taken = Candidate(calibration)
        self.target = target
        self.capacity = capacity
        self.root = calibration.profile._root_name
        self.unsafe = {path for path, record in calibration.modules.items() if record.unsafe}

    # What a saving costs ----------------------------------------------------------------

    def recomputable(self, path: str, never: Excluded) -> bool:
        modules = self.calibration.modules
        if path == self.root or path == "" or never(path) or path not in modules:
            return False
        if modules[path].forward_s <= 0:
            return False  # never timed: its cost is unknown, not free
        if any(under(bad, path) for bad in self.unsafe):
            return False  # rule 4: it or a module inside it is unsafe
        return not self.taken.covers(path)

    def recompute_saving(self, path: str) -> tuple[int, float]:
        """Bytes and seconds that recomputing ``path`` adds to the choices taken so far."""
        calibration, taken = self.calibration, self.taken
        record = calibration.modules[path]
        saved = calibration.inside_bytes(path) - record.input_bytes
        cost = calibration.recompute_cost(path)
        for inner, choice in taken.recomputed.items():
            if under(inner, path):
                saved -= choice.saved_bytes
                cost -= choice.cost_s
        for site, choice in taken.moved.items():
            if under(site[0], path):
                saved -= choice.saved_bytes
                cost -= choice.cost_s
        return saved, max(cost, 0.0)

    def move_option(self, site: Site) -> tuple[Move, int, float]:
        """The cheapest way to move a site off the device: its tier, bytes saved, cost."""
        calibration = self.calibration
        nbytes = calibration.sites[site].nbytes
        rates = calibration.rates
        if calibration.device == "cuda":
            if calibration.copy_s_per_byte is None:
                return "host", nbytes, nbytes / rates.link
            stall = nbytes / rates.link if self.taken.copied + nbytes > self.capacity else 0.0
            return "host", nbytes, nbytes * calibration.copy_s_per_byte + stall
        compressed = nbytes - int(nbytes / rates.ratio)
        disk_cost, lz4_cost = nbytes / rates.disk, nbytes / rates.compress
        if compressed > 0 and lz4_cost / compressed < disk_cost / nbytes:
            return "compressed", compressed, lz4_cost
        return "disk", nbytes, disk_cost

    # Taking savings ---------------------------------------------------------------------

    def take_recompute(self, path: str) -> None:
        if path not in self.calibration.modules or self.taken.covers(path):
            return
        saved, _ = self.recompute_saving(path)
        self.taken.recompute(path, saved, self.calibration.recompute_cost(path))

    def take_move(self, site: Site, kind: Move, cost: float) -> None:
        calibration = self.calibration
        nbytes = calibration.sites[site].nbytes
        ratio = calibration.rates.ratio
        saved = nbytes - int(nbytes / ratio) if kind == "compressed" else nbytes
        copied = nbytes if kind == "host" and calibration.device == "cuda" else 0
        self.taken.move(site, kind, saved, cost, copied)

    def take_hidden_copies(self) -> None:
        """Rule 3, CUDA: copies to host RAM that the link hides, earliest sites first
        (until a step measured what copies cost: rule 9)."""
        taken = self.taken
        for site, record in sorted(self.calibration.sites.items(), key=lambda item: item[1].order):
            if taken.held <= self.target or taken.copied + record.nbytes > self.capacity:
                return
            self.take_move(site, "host", 0.0)

    def take(self, option: _Option) -> None:
        if option.kind == "recompute":
            self.take_recompute(str(option.target))
        else:
            site: Site = option.target  # type: ignore[assignment]
            self.take_move(site, option.kind, option.cost)  # type: ignore[arg-type]

    # Choosing ---------------------------------------------------------------------------

    def options(self, recompute: bool, never: Excluded, moves: bool = True) -> list[_Option]:
        """Every saving still open, valued by how far it lowers the peak held (rule 3).

        The peak held is the most of the held bytes when forward ends and
        while backward recomputes each module chosen. A saving is worth the
        bytes it takes off that peak, at most the bytes it takes off the held
        ones: recomputing a whole model holds as much again while backward
        recomputes it. Once no saving lowers the peak, each is worth the
        held bytes it saves, which the budget is about.
        """
        taken, modules = self.taken, self.calibration.modules
        before = taken.held_before()
        peaks = taken.region_peaks(before)
        now = max([taken.held, *peaks.values()])

        def lowered(saved: int, order: int, own: int = 0, replaced: str | None = None) -> int:
            """How far the peak held falls with ``saved`` bytes fewer from ``order`` on."""
            others = [
                peak - saved if modules[r].first_order > order else peak
                for r, peak in peaks.items()
                if replaced is None or not under(r, replaced)
            ]
            return now - max([taken.held - saved, own, *others])

        found: list[tuple[_Option, int]] = []
        if recompute:
            for path, record in modules.items():
                if not self.recomputable(path, never):
                    continue
                saved, cost = self.recompute_saving(path)
                first = record.first_order
                own = before(first) + record.input_bytes + taken.inside_bytes(path)
                if saved > 0:
                    option = _Option(cost, saved, first, "recompute", path)
                    found.append((option, lowered(saved, first, own, path)))
        for site, site_record in self.calibration.sites.items() if moves else ():
            if site in taken.moved or any(under(site[0], m) for m in taken.recomputed):
                continue
            tier, saved, cost = self.move_option(site)
            order = site_record.order
            if saved > 0:
                found.append((_Option(cost, saved, order, tier, site), lowered(saved, order)))
        if any(lowered > 0 for _, lowered in found):
            return [
                dataclasses.replace(option, saved=min(option.saved, lowered))
                for option, lowered in found
                if lowered > 0
            ]
        return [option for option, _ in found]

    def take_cheapest(self, recompute: bool, never: Excluded, *, moves: bool = True) -> None:
        """Rule 3: the cheapest saving per byte first, until the held bytes fit.

        Costs per byte within about 10% of each other count as equal (a timing's
        noise), and the earlier module or site goes first: its tensors come back
        last in backward, while less is held. A single saving that covers what
        is left, for no more than the cheapest per byte, ends the search.
        """
        while self.taken.held > self.target:
            options = self.options(recompute, never, moves)
            if not options:
                return
            best = min(options, key=_Option.rank)
            need = self.taken.held - self.target
            covering = [o for o in options if o.saved >= need]
            if covering:
                cover = min(covering, key=lambda o: (o.cost, o.order))
                if cover.cost <= best.cost:
                    best = cover
            self.take(best)


def site_name(site: Site) -> str:
    """A site for people: ``module:op#occurrence``."""
    module, op, occurrence = site
    return f"{module or '(top level)'}:{op}#{occurrence}"
