"""Planning compiled code with the compiler's own means.

# NOTE [ Compiled code ]
1. A graph compiled by ``torch.compile`` is one ``autograd.Function`` to
   saved-tensor hooks: hooks pushed around it see every tensor it saves at
   its forward's end, and backward unpacks all of them before its backward
   starts, so moving them saves nothing at the peak and copies outside the
   graph. Compiled code is planned through the compiler instead: its
   partitioner's activation memory budget
   (``torch._functorch.config.activation_memory_budget``) decides what the
   compiled forward keeps and what its backward recomputes.
2. An ``Auto`` session with a :class:`~tensorstash.Profile` pushes, once
   ``torch.compile`` was used in the process, a :class:`CompilerHooks` pair
   of ``torch.fx.GraphModule`` hooks instead of its own. AOTAutograd inlines
   such a pair into the graphs it compiles under it and turns hooks off
   while those graphs run: no eager hook runs around compiled code. Eager
   code calls the pair as ordinary hooks, which hand the tensor to the
   session's own pair (``handing``).
3. The inlined pack passes each saved tensor through ``tensorstash::saved``,
   which adds its bytes (those at or over the session's ``min_bytes``) to the
   thread's count and returns an empty token; the inlined unpack passes the
   token to ``tensorstash::reached``, which notes the end of the backward
   pass (``queue_callback``). So a session learns, without eager hooks, how
   many bytes the compiled forward kept for backward and when its backward
   ended. AOTAutograd applies inlined hooks to the intermediates a graph
   keeps only for backward (its donated buffers), not to its inputs and
   outputs, which the caller holds anyway: those intermediates are what the
   budget covers, and what the partitioner's setting changes.
4. Dynamo guards on the identity of inlined hooks and not on functorch
   settings: one pair per budget setting is made for the process and reused,
   so a graph compiles once per setting, and a setting's graphs are found
   again by its pair. While a graph compiles under a pair, a compile callback
   sets the partitioner's budget to the pair's and puts the user's value back
   after; dynamo compiles under a lock, so no
   other thread's compile sees them.
5. The search (:class:`CompiledSearch`, one per profile and budget): the
   first step runs at the default partitioner (1.0), which tells whether the
   session's code is compiled at all. If what it keeps fits the budget, the
   steps after it push nothing: the user's own graphs run untouched. Else
   the smaller settings are compiled in turn, once each, and every setting
   whose kept bytes fit is then run once more, for a step not slowed by
   compiling; the plan is, among the fitting settings whose step is within
   ``TIE`` of the fastest one's, the one with the lowest real peak: real
   peaks are not monotonic in the setting (fewer kept bytes may still peak
   higher in backward), and the budget is there to hold memory, so a setting
   that holds less at about the same speed is the better one. No fitting
   setting then has both a lower real peak and a faster step. Steps compare
   by their fastest timing, and a setting with a lower real peak than the
   choice that one step's time left out is timed once more (a step on a
   shared machine can take twice its time). Once settled,
   steps are no longer timed (the real-memory meter costs a little). Settings smaller than the
   largest that fits are tried only up to ``EXPLORE`` of them.
6. A step that runs compiled code is planned whole by the search: tensors
   saved by eager code in such a step are kept where they are (counted).
7. Graphs that draw random numbers (dropout) run untouched: under a memory
   budget below 1.0 the partitioner (inductor's and aot_eager's alike, torch
   2.13, CPU) recomputes a random op in backward with other random values,
   so the gradient no longer matches the forward (same loss, gradients
   2e-3 apart on a two-block MLP with dropout 0.1). The graph compiled under
   the default partitioner's pair says so (any node tagged
   ``nondeterministic_seeded`` in its forward), before any other setting is
   tried; the plan then asks the compiler for nothing, and says why. A pair
   whose graphs were compiled before (by another profile) answers for them.
"""

from __future__ import annotations

import operator
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, fx, nn

from tensorstash.core.stats import human_bytes
from tensorstash.memory._memory import meter

SETTINGS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.1, 0.0)
"""The partitioner budgets the search tries, the default partitioner first (rule 5)."""
TIE = 0.15
"""Fitting settings whose step is within this share of the fastest one's are as fast,
and the one with the lowest real peak among them is the plan (rule 5): each is timed
over one step, and one step's time varies by about that much on a shared machine."""
EXPLORE = 2
"""Fitting settings tried below the largest that fits (rule 5)."""

_local = threading.local()


def _count() -> _Count:
    count: _Count | None = getattr(_local, "count", None)
    if count is None:
        count = _local.count = _Count()
    return count


@dataclass
class _Count:
    """This thread's reading of the inlined hooks (rule 3)."""

    bytes: int = 0
    tensors: int = 0
    min_bytes: int = 0
    device: torch.device | None = None
    random: bool = False


@torch.library.custom_op("tensorstash::saved", mutates_args=())
def _saved(tensor: Tensor) -> Tensor:
    count = _count()
    nbytes = tensor.nbytes
    if nbytes >= count.min_bytes:
        count.bytes += nbytes
        count.tensors += 1
    count.device = tensor.device
    return tensor.new_empty(0)


@_saved.register_fake
def _saved_fake(tensor: Tensor) -> Tensor:
    return tensor.new_empty(0)


@torch.library.custom_op("tensorstash::reached", mutates_args=())
def _reached(token: Tensor) -> None:
    global _queued
    with _PENDING_LOCK:
        if _queued or not _PENDING:
            return
        _queued = True
    torch.autograd.Variable._execution_engine.queue_callback(_backward_ended)


@_reached.register_fake
def _reached_fake(token: Tensor) -> None:
    return None


fx.node.has_side_effect(torch.ops.tensorstash.reached.default)

_PENDING: list[CompiledStep] = []  # steps whose forward ended, waiting for their backward
_PENDING_LOCK = threading.Lock()
_queued = False


def _backward_ended() -> None:
    """Rule 3: a backward through compiled graphs ended (on the engine's thread)."""
    global _queued
    now = time.perf_counter()
    with _PENDING_LOCK:
        _queued = False
        steps = _PENDING[:]
        _PENDING.clear()
    for step in steps:
        step.finished(now)


def _compiling() -> dict[str, Any] | None:
    """What AOTAutograd says of the saved tensor it is asking about (its graphs, its
    node), or None for an eager call."""
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    return _get_saved_tensor_hook_context()


def prepare() -> CompilerHooks:
    """The default partitioner's pair, and what its calls import, made before a step is
    timed: a profile's first step would otherwise carry that one-time work."""
    _compiling()
    return hooks_for(1.0)


def _pack_graph() -> fx.Graph:
    graph = fx.Graph()
    tensor = graph.placeholder("tensor")
    token = graph.call_function(torch.ops.tensorstash.saved.default, (tensor,))
    graph.output((tensor, token))
    return graph


def _unpack_graph() -> fx.Graph:
    graph = fx.Graph()
    packed = graph.placeholder("packed")
    tensor = graph.call_function(operator.getitem, (packed, 0))
    token = graph.call_function(operator.getitem, (packed, 1))
    graph.call_function(torch.ops.tensorstash.reached.default, (token,))
    graph.output(tensor)
    return graph


class _Handed:
    """A tensor eager code saved under a :class:`CompilerHooks` pair, packed by a session."""

    __slots__ = ("unpack", "value")

    def __init__(self, unpack: Callable[[Any], Tensor], value: Any) -> None:
        self.unpack = unpack
        self.value = value


def _draws_random(graph: Any) -> bool:
    """Whether a compiled forward graph draws random numbers (rule 7)."""
    seeded = torch.Tag.nondeterministic_seeded
    return any(
        node.op == "call_function" and seeded in getattr(node.target, "tags", ())
        for node in getattr(graph, "nodes", ())
    )


class _Pack(fx.GraphModule):
    def __init__(self, setting: float) -> None:
        super().__init__(nn.Module(), _pack_graph())
        self.setting = setting
        self.random = False  # a graph compiled under it draws random numbers (rule 7)

    def __call__(self, tensor: Tensor) -> Any:
        context = _compiling()
        if context is not None:
            if _draws_random(context.get("_fw_graph")):
                self.random = _count().random = True
            return super().__call__(tensor)  # traced, then inlined (rule 2)
        hooks = getattr(_local, "handing", None)
        if not hooks:
            return tensor
        pack, unpack = hooks[-1]
        return _Handed(unpack, pack(tensor))


class _Unpack(fx.GraphModule):
    def __call__(self, packed: Any) -> Any:
        if _compiling() is not None:
            return super().__call__(packed)
        if isinstance(packed, _Handed):
            return packed.unpack(packed.value)
        return packed


class CompilerHooks:
    """The pair of inlined hooks for one partitioner budget (rules 2-4); one per setting.

    Attributes:
        setting: the partitioner's ``activation_memory_budget`` its graphs compile with.
        pack, unpack: the hooks to push.
    """

    def __init__(self, setting: float) -> None:
        self.setting = setting
        self.pack = _Pack(setting)
        self.unpack = _Unpack(nn.Module(), _unpack_graph())

    def __repr__(self) -> str:
        return f"CompilerHooks({self.setting})"


_PAIRS: dict[float, CompilerHooks] = {}
_PAIRS_LOCK = threading.Lock()


def hooks_for(setting: float) -> CompilerHooks:
    """The process's pair for ``setting`` (rule 4: the same object every time)."""
    with _PAIRS_LOCK:
        pair = _PAIRS.get(setting)
        if pair is None:
            pair = _PAIRS[setting] = CompilerHooks(setting)
        _watch_compiles()
        return pair


def _watch_compiles() -> None:
    """Rule 4: set the pair's budget while a graph compiles under it. Registered again
    where ``torch._dynamo.reset()`` cleared dynamo's callbacks."""
    handler = torch._dynamo.callback_handler
    if _compile_starts not in getattr(handler, "start_callbacks", ()):
        handler.register_start_callback(_compile_starts)
        handler.register_end_callback(_compile_ends)
        for pair in _PAIRS.values():  # a reset dropped every graph: none is known yet
            pair.pack.random = False


def _compile_starts(*_: Any) -> None:
    import torch._functorch.config as config

    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    saved: list[Any] = getattr(_local, "patches", None) or []
    _local.patches = saved
    if top is None or not isinstance(top[0], _Pack):
        saved.append(None)
        return
    patch = config.patch(activation_memory_budget=top[0].setting)
    patch.__enter__()
    saved.append(patch)


def _compile_ends(*_: Any) -> None:
    saved: list[Any] = getattr(_local, "patches", None) or []
    if saved:
        patch = saved.pop()
        if patch is not None:
            patch.__exit__(None, None, None)


def dynamo_live() -> bool:
    """Whether ``torch.compile`` has been used in this process (dynamo is imported then)."""
    return "torch._dynamo" in sys.modules


@dataclass
class Trial:
    """What the steps at one setting measured.

    Attributes:
        setting: the partitioner budget.
        kept_bytes: what the compiled forward kept for backward (rule 3), the
            last step's; None until a step ran at it.
        seconds, peaks: each step not slowed by compiling: forward to the end
            of backward, and its real peak growth.
        timable: its steps keep a tensor, whose unpack shows where backward ends.
    """

    setting: float
    kept_bytes: int | None = None
    seconds: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    timable: bool = True

    @property
    def step_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def best_s(self) -> float | None:
        """Its fastest step: what it costs where nothing else slowed it."""
        return min(self.seconds) if self.seconds else None

    @property
    def peak_bytes(self) -> int | None:
        return int(statistics.median(self.peaks)) if self.peaks else None


@dataclass(frozen=True)
class CompilerPlan:
    """The plan for a step of compiled code (see NOTE [ Compiled code ] in compiler.py).

    Attributes:
        budget_bytes: the bytes the compiled forward may keep for backward.
        setting: the partitioner budget the plan asks the compiler for; None:
            the user's own graphs, untouched (what they keep fits).
        kept_bytes: what the compiled forward keeps at that setting.
        predicted_step_s, predicted_peak_bytes: measured at that setting.
        trials: every setting tried, in order.
        settled: the search ended; False while it still tries settings.
    """

    budget_bytes: int
    setting: float | None
    kept_bytes: int | None
    predicted_step_s: float | None
    predicted_peak_bytes: int | None
    trials: tuple[Trial, ...]
    settled: bool
    random: bool = False

    @property
    def quiet(self) -> bool:
        """Whether the plan pushes nothing (the user's graphs run untouched)."""
        return self.setting is None

    recompute: tuple[str, ...] = ()
    base_step_s: float | None = None
    fits = True

    def _fits(self) -> bool:
        return self.kept_bytes is not None and self.kept_bytes <= self.budget_bytes

    def table(self) -> str:
        """The plan for people: the budget, what the compiler was asked for, each trial."""
        asked = (
            "nothing: the compiled graphs keep what fits, and run untouched"
            if self.setting is None
            else f"activation_memory_budget={self.setting}"
        )
        if self.random and self.setting is None and not self._fits():
            asked = (
                "nothing: the compiled graphs draw random numbers (dropout), which the "
                "partitioner's memory budget recomputes with other values; they run untouched"
            )
        lines = [
            f"compiled code: budget {human_bytes(self.budget_bytes)} kept for backward; "
            f"the compiler is asked for {asked}" + ("" if self.settled else " (still searching)")
        ]
        for trial in self.trials:
            kept = "-" if trial.kept_bytes is None else human_bytes(trial.kept_bytes)
            step = "-" if trial.step_s is None else f"{trial.step_s:.3f} s"
            peak = "-" if trial.peak_bytes is None else human_bytes(trial.peak_bytes)
            lines.append(
                f"  activation_memory_budget={trial.setting:<5} keeps {kept:>10}  "
                f"step {step:>9}  real peak {peak:>10}"
            )
        return "\n".join(lines)


class CompiledSearch:
    """Rule 5: the setting a profile's compiled steps run at, for one ``Auto`` budget.

    Args:
        budget: the bytes the compiled forward may keep for backward (updated
            as the session resolves it each step: a default budget follows free
            memory).
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.trials: dict[float, Trial] = {}
        self.choice: float | None = None
        self.settled = False
        self.current: float | None = 1.0
        self.random = False  # rule 7: the graphs draw random numbers

    def rebudget(self, budget: int) -> None:
        """The budget resolved to ``budget`` this step: choose again from the trials if
        the choice no longer fits or a setting that did not fit now does."""
        if budget == self.budget:
            return
        before = self._fitting()
        self.budget = budget
        if self.settled and self._fitting() != before:
            self.settled = False

    def setting_for_step(self) -> float | None:
        """The setting the next step runs at (None: push nothing)."""
        self.current = self._next()
        return self.current

    def _next(self) -> float | None:
        if self.settled:
            return self.choice
        if 1.0 not in self.trials:
            return 1.0
        fits = self._fitting()
        if 1.0 in fits or self.random:  # rule 7: no other setting is safe with randomness
            self.settled, self.choice = True, None
            return None
        for setting in self._to_compile(fits):
            if setting not in self.trials:
                return setting
        for setting in fits:  # a step not slowed by compiling, at each fitting setting
            trial = self.trials[setting]
            if trial.timable and not trial.seconds:
                return setting
        again = self._ruled_out_once(fits)
        if again is not None:
            return again
        self._choose(fits)
        return self.choice

    def _ruled_out_once(self, fits: list[float]) -> float | None:
        """A fitting setting with a lower real peak than the choice would have, left out
        for its speed after one step: timed once more (one slow step may be noise)."""
        timed = [self.trials[s] for s in fits if self.trials[s].best_s is not None]
        if not timed:
            return None
        choice = self._best(timed)
        lower = [
            t
            for t in timed
            if len(t.seconds) < 2 and (t.peak_bytes or 0) < (choice.peak_bytes or 0)
        ]
        return lower[0].setting if lower else None

    @staticmethod
    def _best(timed: list[Trial]) -> Trial:
        fastest = min(t.best_s or 0.0 for t in timed)
        close = [t for t in timed if (t.best_s or 0.0) <= fastest * (1 + TIE)]
        return min(close, key=lambda t: (t.peak_bytes or 0, -t.setting))

    def _fitting(self) -> list[float]:
        return [
            setting
            for setting, trial in self.trials.items()
            if trial.kept_bytes is not None and trial.kept_bytes <= self.budget
        ]

    def _to_compile(self, fits: list[float]) -> list[float]:
        """The settings still worth compiling: down to ``EXPLORE`` below the first fit."""
        order = list(SETTINGS)
        if not fits:
            return order
        first = order.index(max(fits))
        return order[: first + 1 + EXPLORE]

    def _choose(self, fits: list[float]) -> None:
        self.settled = True
        timed = [self.trials[s] for s in fits if self.trials[s].best_s is not None]
        if not timed:  # none timed (or none fits): the least the compiler keeps
            known = [t for t in self.trials.values() if t.kept_bytes is not None]
            fitting = [t for t in known if t.setting in fits] or known
            self.choice = (
                max(fitting, key=lambda t: (-(t.kept_bytes or 0), t.setting)).setting
                if fitting
                else None
            )
            return
        self.choice = self._best(timed).setting

    def measured(self, setting: float, kept: int, tensors: int) -> None:
        """A step at ``setting`` kept ``kept`` bytes in ``tensors`` tensors (none: its
        backward's end cannot be seen, so it is never timed)."""
        trial = self.trials.setdefault(setting, Trial(setting))
        trial.kept_bytes = kept
        trial.timable = tensors > 0

    def plan(self) -> CompilerPlan:
        """The plan of the step about to run (after :meth:`setting_for_step`)."""
        setting = self.current
        trial = self.trials.get(1.0 if setting is None else setting)
        return CompilerPlan(
            self.budget,
            setting,
            None if trial is None else trial.kept_bytes,
            None if trial is None else trial.step_s,
            None if trial is None else trial.peak_bytes,
            tuple(self.trials[s] for s in SETTINGS if s in self.trials),
            self.settled,
            self.random,
        )


@dataclass
class _Known:
    """What a profile's steps told of compiled code."""

    compiled: bool | None = None  # None: not known yet
    device: torch.device | None = None
    searches: dict[Any, CompiledSearch] = field(default_factory=dict)


_KNOWN: WeakKeyDictionary[Any, _Known] = WeakKeyDictionary()


def known(profile: Any) -> _Known:
    """What ``profile``'s steps told of compiled code so far."""
    found = _KNOWN.get(profile)
    if found is None:
        found = _KNOWN[profile] = _Known()
    return found


def search_for(profile: Any, spec: Any, budget: int) -> CompiledSearch:
    """The search of ``profile`` for the Auto budget ``spec`` (as the user gave it),
    resolved to ``budget`` bytes now; a search never serves another spec."""
    searches = known(profile).searches
    search = searches.get(spec)
    if search is None:
        search = searches[spec] = CompiledSearch(budget)
    search.rebudget(budget)
    return search


class CompiledStep:
    """One session's step under a pair: what its compiled graphs kept, its time and peak.

    Args:
        search: the profile's search, or a function giving it from the step's
            device once the step has run (the first step: the budget depends on it).
        setting: the setting of the pair pushed.
        min_bytes: the session's floor (rule 3).
        device: where the step runs, for its real peak (None: not known yet).
        known: the profile's steps ran compiled code before (a step that keeps
            nothing still ran it).
    """

    def __init__(
        self,
        search: CompiledSearch | Callable[[torch.device], CompiledSearch],
        setting: float,
        min_bytes: int,
        device: torch.device | None,
        *,
        known: bool = False,
    ) -> None:
        self.search = search
        self.setting = setting
        self.known = known
        self.pair = hooks_for(setting)
        count = _count()
        count.bytes = count.tensors = 0
        count.random = self.pair.pack.random  # graphs compiled before, under this pair
        count.min_bytes = min_bytes
        self.count = count
        self.graphs = _graphs()
        self.start = time.perf_counter()
        self.meter = meter(device, sync=False) if device is not None else None
        if self.meter is not None:
            self.meter.start()

    def exited(self) -> CompiledSearch | None:
        """The forward ended, the pair still pushed: note what the compiled graphs kept.

        Returns:
            The search, or None where no compiled graph ran in the step.
        """
        count = self.count
        compiled_now = _graphs() != self.graphs
        if count.tensors == 0 and not self.known:  # no graph of AOTAutograd's kept a tensor
            self._stop()
            return None
        search = self.search
        if not isinstance(search, CompiledSearch):
            search = self.search = search(count.device or torch.device("cpu"))
        search.random = search.random or count.random
        search.measured(self.setting, count.bytes, count.tensors)
        if compiled_now or self.meter is None or not count.tensors:
            self._stop()  # compiling is not stepping (rule 5)
        else:
            with _PENDING_LOCK:
                _PENDING.append(self)
        return search

    def finished(self, ended: float) -> None:
        """Its backward ended at ``ended``: the step's time and real peak."""
        peak = self._stop()
        search = self.search
        if peak is None or not isinstance(search, CompiledSearch):
            return
        trial = search.trials.get(self.setting)
        if trial is not None:
            trial.seconds.append(ended - self.start)
            trial.peaks.append(peak)

    def _stop(self) -> int | None:
        if self.meter is None:
            return None
        measuring, self.meter = self.meter, None
        return measuring.stop()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def handing(pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> None:
    """Eager tensors saved under a pair on this thread go to this session's pair (rule 2)."""
    stack: list[tuple[Any, Any]] | None = getattr(_local, "handing", None)
    if stack is None:
        stack = _local.handing = []
    stack.append((pack, unpack))


def handed() -> None:
    """The session that called :func:`handing` closed."""
    stack: list[tuple[Any, Any]] = getattr(_local, "handing", None) or []
    if stack:
        stack.pop()
