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
   session's own pair (``handing``), with dynamo off (core/_frames.py): eager
   code inside a compiled function (past a graph break) runs under dynamo's
   frame callback, which would otherwise trace the hooks as user code. This
   needs torch 2.10 (NOTE [ Support range ] in core/_support.py); before it,
   ``Auto`` plans compiled code as eager code, and its plan table says so.
3. The inlined pack passes each saved tensor through ``tensorstash::saved``,
   which adds its bytes (those at or over the session's ``min_bytes``) to the
   thread's count and returns an empty token; the inlined unpack passes the
   token to ``tensorstash::reached``, which notes the end of the backward
   pass (``queue_callback``). So a session learns, without eager hooks, how
   many bytes the compiled forward kept for backward and when its backward
   ended: after the session closed, or before, where the backward runs
   inside it (the session then takes that end, and gives back at once what
   it held until the backward's end). AOTAutograd applies inlined hooks to the intermediates a graph
   keeps only for backward (its donated buffers), not to its inputs and
   outputs, which the caller holds anyway: those intermediates are what the
   budget covers, and what the partitioner's setting changes.
4. Dynamo guards on the identity of inlined hooks and not on functorch
   settings: one pair per budget setting is made for the process and reused,
   so a graph compiles once per setting, and a setting's graphs are found
   again by its pair. While a graph compiles under a pair, a compile callback
   sets the partitioner's budget to the pair's and puts the user's value back
   after; dynamo compiles under a lock, so no other thread's compile sees
   them.
5. The search (:class:`CompiledSearch`, one per profile and budget): the
   first step runs at the default partitioner (1.0), which tells whether the
   session's code is compiled at all. If what it keeps fits the budget, the
   steps after it push nothing: the user's own graphs run untouched. Else the
   smaller settings are compiled in turn, once each, down to ``EXPLORE``
   below the largest that fits. Compiling is not stepping: a step that
   compiled gives its time less the time spent compiling (dynamo's compile
   callbacks bracket each compile, the backward's lazy one included), and no
   real peak (the compiler's own memory is in it); so each setting has a time
   once compiled, without a step more. The plan is, among the fitting
   settings whose step is within ``TIE`` of the fastest one's, the one with
   the lowest real peak: the budget is there to hold memory, so a setting
   that holds less at about the same speed is the better one. Real peaks are
   not monotonic in the setting, nor do they fall and then rise (fewer kept
   bytes may still peak higher, where backward recomputes more at once: the
   bench's ``small`` under bf16 autocast peaked at 29.5 MiB at 0.1, 30.1 at
   0.25 and 27.6 at 0.5): the search steps once at the setting that keeps
   least among the fast ones and at every fitting setting that keeps more
   (whatever its compiling step's time said: the first run of new graphs is
   slower than the next), and takes the lowest real peak among those as
   fast. Every step at a setting that is not the plan is a step at another
   peak, so the search takes no more than that, but a setting that keeps
   less than the fastest one, or keeps more and held less than the plan, is
   left out for speed only once it and the fastest have ``CHANCES`` timings,
   and only where its fastest and its median timing are both more than
   ``TIE`` behind the fastest one's. Other work on a machine slows a step and
   never speeds it, so the fastest timing is the setting's own cost, but on a
   busy machine few steps reach it: in the compiled sweeps on 2 cores most
   steps ran 10-40% over their setting's fastest, and the fastest of two
   timings against the fastest of another's left out a setting as fast as the
   choice (and holding less) one search in five on HF GPT-2 and one in ten on
   ``small``; three timings each and both figures leave it out one in twelve
   and one in fifty (resampled from those sweeps' steps).
   Once settled, steps take no real peak (the real-memory meter costs a
   little) but are still timed: the plan's predicted step is the median of
   its setting's last ``WINDOW`` steps, as the machine runs them now, not only
   the one or two the search took.
6. A step that runs compiled code is planned whole by the search: tensors
   saved by eager code in such a step are kept where they are (counted).
7. Random ops are saved, never recomputed. Below 1.0 the partitioner's
   memory budget takes random ops (dropout) as recomputable like any other,
   and a random op recomputed in backward draws other values: the same loss,
   other gradients (inductor's and aot_eager's alike). So while a graph
   compiles under a pair below 1.0, a joint-graph pass
   (``torch._functorch.config.joint_custom_pass``, run before the user's own)
   marks every random op of the forward ``MUST_SAVE``, which the budget's
   solver honours: what the random op drew is kept, what follows from it may
   still be recomputed. At a budget of 0 the partitioner recomputes every op
   whatever it is marked, so the search leaves 0 out for a step whose forward
   draws random numbers, where it moves a default generator (the CPU's state,
   or a CUDA device's offset). The forward that runs tells, not the graph
   compiled: graphs found in the compile cache are not compiled again, so
   nothing at compile time would see them; attention and dropout at a
   probability of 0 draw nothing, and eager code that draws in the forward
   counts too. AOTAutograd's cache leaves the joint pass out of its key; the
   pack graph names the scheme (:data:`SCHEME`) as a constant argument of
   ``tensorstash::saved``, so graphs cached by a pair that compiled without the
   pass are never found for one that compiles with it.
8. A CUDA graph's replay runs no Python, so ``tensorstash::saved`` and
   ``tensorstash::reached`` would count nothing after the graph was recorded
   (``mode="reduce-overhead"``): both are tagged ``cudagraph_unsafe``, and
   inductor leaves them out of the CUDA graphs it records (it partitions the
   graph around them, or records none for it). On the CPU inductor records
   no CUDA graphs: that mode compiles as the default one does. Recording
   runs mid-step inside dynamo's compile callbacks: it compiles nothing, so
   no setting is patched then, and its time is kept out of the step's as a
   compile's is (the step that recorded gives its time less the recording,
   and no real peak: the graphs' memory pool is made then).
9. With dynamic shapes a step may keep more than the steps before it: a
   setting fits where the most any of its steps kept fits, and a plan whose
   step kept more than the budget is searched again from what is known. A
   plan that pushes nothing (what the graphs keep fits at 1.0) runs the
   user's graphs untouched and measures nothing more: a larger step later is
   not seen.
10. On the CPU a step at a setting leases the session pool (NOTE [ Session
    pool ] in memory/_pool.py) from its start to the end of its backward, as
    ``Auto``'s planned eager steps do: what the partitioner recomputes is
    freed and made again in backward, and glibc lands each new block on other
    free pages, so the step's resident set grows by what it walks; the pool
    serves those blocks from the ones waiting, and the step holds less at its
    peak than the compiler alone does at the same setting, at its speed. The
    cap is a sixteenth of what the graphs keep at 1.0 (the activation bytes
    the compiler would keep), at least ``POOL_LEAST``: a planned step keeps
    far less than that, and the blocks waiting add to its peak. With
    ``Auto``'s eager cap, a quarter (at least 8 MiB), ``small`` and HF GPT-2
    (float32, 2 threads) held 35.8 and 29.5 MiB at their plans; with a
    sixteenth (at least 2 MiB), 33.0-34.2 and 27.8, at the same step within
    the noise (their overheads over the compiled model, two runs each:
    1.02-1.21x against 1.12-1.18x, and 1.10-1.28x against 1.01-1.26x). A
    step that pushes nothing has no backward end to close a lease at, and
    runs the user's graphs untouched.
11. A budget can cost step time and buy no real memory: what the forward
    keeps is not all a step holds at its peak (the parameters' gradients,
    what backward recomputes at once), and a setting that keeps less may peak
    higher. The bench's ``small`` under bf16 autocast (2 threads), at a budget
    of a quarter of what it keeps at 1.0 (8.5 MiB), planned 0.1 and held 31.1
    MiB at 1.07x the compiled model's step, while 0.5, which keeps 14.1 MiB,
    held 27.1 MiB at 1.02x; every setting that fits, 0.1 to 0.26 on a finer
    grid, held 27-32 MiB at a slower step. So before it settles, the search
    steps once at each setting over the budget (compiled on the way down, so no
    compile more) for its real peak, those below 1.0 (1.0's
    graphs under the pair compiled in the first step, with the session's module
    hooks on, so a planned step at 1.0 would compile them again: HF GPT-2 did,
    once the search was done; and 1.0 is the compiled model alone, whose peak
    the user has). Of those that held ``LOWER`` less than the plan at a step
    as fast (``TIE``), the one that keeps least is named: the plan's table
    says so, and a warning, once per budget, gives the budget that would hold
    less at a faster step (at a quarter of ``small``'s float32 bytes, 0.25 is
    over the budget and held more than 0.1, 0.5 held less). The plan keeps to
    the budget all the same: the budget is the user's, and what the forward
    keeps is what it bounds. (Under the pool a planned step's real peak was the
    same within 0.3 MiB from step to step, so one step tells.) In float32 the
    same model at a half and a quarter of its bytes plans 0.1 (34.0 MiB), where
    0.5 keeps 25.6 MiB, a little over half, and held 32.9 MiB at a faster step.
12. On the CPU, the setting rule 11 names is carried out within the budget:
    what it keeps over the budget goes to the disk tier inside its graphs
    (``_stowing.py``). Its pair (one per setting and bytes, rule 4; the bytes
    are in its pack graph, so the compile cache keys them) traces, for the
    first dense tensors of 256 KiB or more a forward graph keeps, until that
    many bytes, ``tensorstash::stow`` instead of the pack of rule 3: the tensor
    is written by the training thread (the graph may write over its buffer
    once its last use is past) and a token owns the written value until
    autograd frees it. Its unpack traces ``tensorstash::fetch``, which reads the
    value back into a tensor the backward owns (the backward may write over
    it, and a second backward reads it again). AOTAutograd inlines both at the
    forward's end and the backward's start, where moving saves nothing at the
    peak: a graph inductor compiles under a pair that moves runs a post-grad
    pass (``_stowing.with_placement``, before the user's own) that puts each
    stow after its tensor's last forward use and each fetch before its value's
    first backward use; so does the backward compiled lazily for it, with no
    pair pushed then, found by the compile id dynamo gives both. Every other
    compile, the user's own among them, runs as it would without tensorstash.
    The carry is compiled once and stepped
    for its real peak, and is the plan where it keeps within the budget, held
    ``LOWER`` less than the plan at a step as fast (``TIE``; left out for speed
    only once it has ``CHANCES`` timings, as in rule 5); else the plan stays,
    and rule 11 warns. A budget its carry no longer fits drops it. On a device, what
    leaves it is the compiler's own offload; no carry is made there.
13. A step runs where most of the bytes its graphs keep are, those at or over
    ``min_bytes`` (``tensorstash::saved`` counts them by device): on CUDA,
    SDPA's memory-efficient kernel saves its RNG seed and offset as CPU
    scalars, which tell nothing of where the step runs. Where nothing counts,
    the model's parameters tell. A step on CUDA is timed on the device: CUDA
    events on the current stream where the step opens and when its backward
    ends (autograd runs that callback on the streams of the code that called
    backward, synced with the backward's own), so that queued work is in the
    time and a setting that recomputes more does not look as fast. The figure
    is read at the search's next step: while it searches it waits for the
    device there, at the edge of the steps it measures; a settled plan takes
    the figures the device has given and reads the rest later.
14. A compile never fails for tensorstash: an error in its compile callbacks
    is warned of once, and the compile goes on with the compiler's own
    settings (the search then sees what the graphs keep, and plans on that).
"""

from __future__ import annotations

import contextlib
import operator
import statistics
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, fx, nn

from tensorstash.core._frames import keep_out
from tensorstash.core._timers import CudaTimer
from tensorstash.core.stats import human_bytes
from tensorstash.memory import _pool
from tensorstash.memory._memory import meter
from tensorstash.planning import _limit, _stowing

SETTINGS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.1, 0.0)
"""The partitioner budgets the search tries, the default partitioner first (rule 5)."""
TIE = 0.15
"""Fitting settings whose step is within this share of the fastest one's are as fast,
and the one with the lowest real peak among them is the plan (rule 5): each is timed
over a few steps, and a single step's time varies about that much."""
CHANCES = 3
"""The timings a setting and the fastest one have before the setting is left out for
speed, where it keeps less than the fastest or held less than the plan (rule 5)."""
EXPLORE = 2
"""Fitting settings tried below the largest that fits (rule 5)."""
SCHEME = "random-saved"
"""What compiling under a pair does to the joint graph (rule 7); named in the pack graph,
so that the compile cache keys it."""
WINDOW = 16
"""The steps of a setting whose times make its step (rule 5): a settled plan's steps are
timed too, and its predicted step follows the last of them."""
POOL_SHARE = 16
"""The session pool's cap for a step at a setting on the CPU is what the graphs keep at
1.0 over this (rule 10)."""
POOL_LEAST = 2 << 20
"""The least cap of the session pool a step at a setting leases on the CPU (rule 10)."""
LOWER = 0.02
"""A setting over the budget that held this share less than the plan at its real peak,
at a step as fast, is named in the plan (rule 11): the margin by which the bench calls
one real peak lower than another."""

_local = threading.local()


def _count() -> _Count:
    count: _Count | None = getattr(_local, "count", None)
    if count is None:
        count = _local.count = _Count()
    return count


thread_count = _count


@dataclass
class _Count:
    """This thread's reading of the inlined hooks (rule 3)."""

    bytes: int = 0
    tensors: int = 0
    moved: int = 0  # rule 12: the bytes stowed
    min_bytes: int = 0
    devices: dict[torch.device, int] = field(default_factory=dict)  # counted bytes, by device

    @property
    def device(self) -> torch.device | None:
        """Where the step runs (rule 13): the device of most of the bytes counted; None
        where nothing counted."""
        devices = self.devices
        return max(devices, key=devices.__getitem__) if devices else None

    def saved(self, tensor: Tensor) -> None:
        """A compiled forward keeps ``tensor`` for backward (``tensorstash::saved``)."""
        nbytes = tensor.nbytes
        if nbytes >= self.min_bytes:
            self.bytes += nbytes
            self.tensors += 1
            self.counted(tensor, nbytes)  # rule 13: under min_bytes, it tells no device

    def counted(self, tensor: Tensor, nbytes: int) -> None:
        """A tensor at or over ``min_bytes`` the step keeps or stows."""
        device = tensor.device
        self.devices[device] = self.devices.get(device, 0) + nbytes


_OP_TAGS = _stowing.OP_TAGS  # rule 8


@torch.library.custom_op(
    "tensorstash::saved",
    mutates_args=(),
    schema="(Tensor tensor, str scheme) -> Tensor",
    **_OP_TAGS,
)
def _saved(tensor: Tensor, scheme: str) -> Tensor:
    _count().saved(tensor)
    return tensor.new_empty(0)


@_saved.register_fake
def _saved_fake(tensor: Tensor, scheme: str) -> Tensor:
    return tensor.new_empty(0)


@torch.library.custom_op(
    "tensorstash::reached", mutates_args=(), schema="(Tensor token) -> ()", **_OP_TAGS
)
def _reached(token: Tensor) -> None:
    note_reached()


def note_reached() -> None:
    """Rule 3: a compiled backward began; its end is noted once the engine's pass ends."""
    global _queued
    with _PENDING_LOCK:
        if _queued:
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
_ENDED: list[float] = []  # when the last backward through compiled graphs ended, if any
_SPANS: weakref.WeakSet[Span] = weakref.WeakSet()  # rule 13: device clocks of open steps


def _backward_ended() -> None:
    """Rule 3: a backward through compiled graphs ended (on the engine's thread)."""
    global _queued
    now = time.perf_counter()
    with _PENDING_LOCK:
        _queued = False
        _ENDED[:] = [now]
        steps = _PENDING[:]
        _PENDING.clear()
        spans = list(_SPANS)
    for span in spans:  # rule 13: the device's end, before the steps read it
        span.backward_ended()
    for step in steps:
        step.finished(now)


def _last_backward_end() -> float | None:
    with _PENDING_LOCK:
        return _ENDED[0] if _ENDED else None


def _compiling() -> dict[str, Any] | None:
    """What AOTAutograd says of the saved tensor it is asking about (its graphs, its
    node), or None for an eager call, or where AOTAutograd inlines no hooks (before
    torch 2.10: NOTE [ Support range ] in core/_support.py)."""
    # Not imported until AOTAutograd first compiles: an eager call then, and importing it
    # here would bring in the compiler (several MiB) for a model that never compiles.
    graph_compile = sys.modules.get("torch._functorch._aot_autograd.graph_compile")
    context = getattr(graph_compile, "_get_saved_tensor_hook_context", None)
    return None if context is None else context()


def prepare() -> CompilerHooks:
    """The default partitioner's pair, made before a step is timed: a profile's first step
    would otherwise carry that one-time work."""
    return hooks_for(1.0)


def _pack_graph(scheme: str) -> fx.Graph:
    graph = fx.Graph()
    tensor = graph.placeholder("tensor")
    token = graph.call_function(torch.ops.tensorstash.saved.default, (tensor, scheme))
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


def _generators() -> tuple[Any, ...]:
    """Where the default generators stand (rule 7): the CPU's state, and each CUDA
    device's offset where CUDA is initialized."""
    marks: list[Any] = [torch.default_generator.get_state()]
    if torch.cuda.is_initialized():
        marks += [generator.get_offset() for generator in torch.cuda.default_generators]
    return tuple(marks)


def _drew(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """Whether a default generator moved between two readings of :func:`_generators`."""
    if len(before) != len(after):
        return True
    return any(
        not torch.equal(a, b) if isinstance(a, Tensor) else a != b
        for a, b in zip(before, after, strict=True)
    )


class _Pack(fx.GraphModule):
    def __init__(self, setting: float, moving: int = 0) -> None:
        # Rule 12: what a pair moves is in its graph, so the compile cache keys it.
        self.scheme = SCHEME if not moving else f"{SCHEME};moving={moving}"
        super().__init__(nn.Module(), _pack_graph(self.scheme))
        self.setting = setting
        self.moving = moving
        self._tracing: Any = None  # the forward graph being traced, and what it stows
        self._stowed = 0
        self._decided: dict[Any, bool] = {}

    def __call__(self, tensor: Tensor) -> Any:
        context = _compiling()
        if context is not None:
            if self.moving and self._stows(tensor, context.get("_fw_graph"), context.get("_node")):
                return _stowing.stow(tensor, self.scheme)  # rule 12
            return super().__call__(tensor)  # traced, then inlined (rule 2)
        hooks = getattr(_local, "handing", None)
        if not hooks:
            return tensor
        pack, unpack, _ = hooks[-1]
        return _Handed(unpack, pack(tensor))

    def _stows(self, tensor: Tensor, graph: Any, node: Any) -> bool:
        """Rule 12: whether the tensor being traced is stowed: the first movable ones a
        forward graph keeps, until ``moving`` bytes a graph are stowed. AOTAutograd calls the hook
        more than once for a saved node: the first answer holds."""
        if graph is not self._tracing:
            self._tracing, self._stowed, self._decided = graph, 0, {}
        decided = self._decided.get(node)
        if decided is None:
            decided = _stowing.movable(tensor) and self._stowed < self.moving
            self._stowed += tensor.nbytes if decided else 0
            self._decided[node] = decided
        return decided


class _Unpack(fx.GraphModule):
    def __call__(self, packed: Any) -> Any:
        if _compiling() is not None:
            if len(packed) == 4:  # stowed (rule 12): token, shape, stride, dtype
                return _stowing.fetch(packed)
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

    def __init__(self, setting: float, moving: int = 0) -> None:
        self.setting = setting
        self.moving = moving
        self.pack = _Pack(setting, moving)
        self.unpack = _Unpack(nn.Module(), _unpack_graph())

    def __repr__(self) -> str:
        return f"CompilerHooks({self.setting}, moving={self.moving})"


_PAIRS: dict[tuple[float, int], CompilerHooks] = {}
_PAIRS_LOCK = threading.Lock()

# Rule 2: the pair's calls run with dynamo off. Autograd calls a saved-tensor hook from
# the frame that saves the tensor; where that frame runs eagerly inside a compiled
# function (past a graph break, or a frame dynamo skips), dynamo would trace the hook, and
# the session's hooks it hands to, as user code.
keep_out(_Pack.__call__, _Unpack.__call__)


def hooks_for(setting: float, moving: int = 0) -> CompilerHooks:
    """The process's pair for ``setting`` that stows ``moving`` bytes a graph (rule 12),
    the same object every time (rule 4)."""
    with _PAIRS_LOCK:
        pair = _PAIRS.get((setting, moving))
        if pair is None:
            pair = _PAIRS[(setting, moving)] = CompilerHooks(setting, moving)
        _watch_compiles()
        return pair


def _watch_compiles() -> None:
    """Rule 4: set the pair's budget while a graph compiles under it. Registered again
    where ``torch._dynamo.reset()`` cleared dynamo's callbacks."""
    import torch._dynamo

    handler = torch._dynamo.callback_handler
    if _compile_starts not in getattr(handler, "start_callbacks", ()):
        handler.register_start_callback(_compile_starts)
        handler.register_end_callback(_compile_ends)


class _CompileClock:
    """The seconds this process spent compiling (rule 5): dynamo's compile callbacks
    bracket each compile, outermost only, the backward's lazy compile included.

    Args:
        clock: the clock read at each bracket (injected for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._total = 0.0
        self._since: float | None = None

    def started(self) -> None:
        self._since = self._clock()

    def ended(self) -> None:
        if self._since is not None:
            self._total += self._clock() - self._since
            self._since = None

    def read(self) -> float:
        """The seconds spent compiling so far, the compile under way included."""
        since = self._since
        return self._total + (0.0 if since is None else self._clock() - since)


_CLOCK = _CompileClock()


class Span(Protocol):
    """Rule 13: a step's clock on its device."""

    def backward_ended(self) -> None:
        """The backward ended (on the engine's thread): mark the device's end."""

    def seconds(self, wait: bool) -> float | None:
        """From the step's start to the last end marked, once the device got there; None
        before an end was marked, or while the device is not there yet and not ``wait``."""


class CudaSpan:
    """Rule 13: a step's time on a CUDA device, from events on its current stream.

    The start is recorded where the step opens; the end in the callback autograd runs
    when a backward ends, on the streams of the code that called backward, which
    autograd has synced with the backward's own.
    """

    def __init__(self, device: torch.device) -> None:
        self.timer = CudaTimer(device)
        self.start = self.timer.mark()
        self.end: Any = None

    def backward_ended(self) -> None:
        self.end = self.timer.mark()

    def seconds(self, wait: bool) -> float | None:
        end = self.end
        if end is None or not (wait or self.timer.done(end)):
            return None
        return self.timer.seconds(self.start, end)


def device_span(device: torch.device) -> Span | None:
    """Rule 13: the clock of a step on ``device``: CUDA events on CUDA, else None (the
    host's clock, the CPU's own)."""
    return CudaSpan(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class Untimed:
    """Rule 13: a step whose backward ended, and whose time the device has yet to give."""

    span: Span
    setting: float
    compiling_s: float
    peak: int | None
    compiled: bool
    moving: int


_MOVING: dict[str, None] = {}
"""Rule 12: the compile ids of forwards compiled under a pair that moves, until their
backward compiles (oldest first)."""
MOVING_KEPT = 256
"""The compile ids :data:`_MOVING` keeps at most: a forward whose backward never compiles
(one run without grad, say) leaves its id behind."""
_WARNED: list[str] = []


def _compile_starts(args: Any = None) -> None:
    """Rules 4, 7, 8 and 12 as dynamo's callbacks bracket a compile (``args``: dynamo's
    ``CallbackArgs``, what started it and its compile id); rule 14: never fails it."""
    _CLOCK.started()
    saved: list[Any] = getattr(_local, "patches", None) or []
    _local.patches = saved
    patches = contextlib.ExitStack()
    saved.append(patches)
    try:
        _set_for_compile(patches, args)
    except Exception as error:  # rule 14
        patches.close()
        _warn_once(error)


def _set_for_compile(patches: contextlib.ExitStack, args: Any) -> None:
    import torch._functorch.config as config

    trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
    if trigger == "CUDAGRAPH_RECORDING":
        return  # rule 8: recording compiles nothing; its time is kept out as a compile's
    compile_id = str(getattr(args, "compile_id", ""))
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    pack = top[0] if top is not None and isinstance(top[0], _Pack) else None
    if trigger == "LAZY_BACKWARD":  # rule 12: compiled with no pair pushed
        moving = compile_id in _MOVING
        _MOVING.pop(compile_id, None)
    else:
        moving = pack is not None and pack.moving > 0
        if moving:
            _MOVING[compile_id] = None
            while len(_MOVING) > MOVING_KEPT:
                del _MOVING[next(iter(_MOVING))]
    if moving:
        import torch._inductor.config as inductor_config

        passes = _stowing.with_placement(inductor_config.post_grad_custom_post_pass)
        if passes is not None:
            patches.enter_context(inductor_config.patch(post_grad_custom_post_pass=passes))
    if pack is None:
        return
    setting = pack.setting
    changes: dict[str, Any] = {"activation_memory_budget": setting}
    if setting < 1.0:  # rule 7
        changes["joint_custom_pass"] = _SaveRandom(config.joint_custom_pass)
    patches.enter_context(config.patch(**changes))


def _warn_once(error: Exception) -> None:
    """Rule 14: a compile callback failed; the compile goes on without its settings."""
    said = f"{type(error).__name__}: {error}"
    if said in _WARNED:
        return
    _WARNED.append(said)
    warnings.warn(
        "tensorstash: setting the compiler up for a compile failed; the compile goes on "
        f"with the compiler's own settings ({said}). This is a bug in tensorstash: please "
        "report it with the versions of tensorstash.info()",
        RuntimeWarning,
        stacklevel=2,
    )


class _SaveRandom:
    """Rule 7: the joint-graph pass that marks the forward's random ops ``MUST_SAVE``,
    then runs the pass the user set, if any.

    Args:
        then: the user's own ``joint_custom_pass`` (None: none).
    """

    def __init__(self, then: Callable[[fx.GraphModule, Any], fx.GraphModule] | None) -> None:
        self.then = then

    def __call__(self, joint: fx.GraphModule, inputs: Any) -> fx.GraphModule:
        save_random_ops(joint.graph)
        return joint if self.then is None else self.then(joint, inputs)


def save_random_ops(joint: fx.Graph) -> int:
    """Mark the random ops of a joint graph's forward ``MUST_SAVE`` (rule 7), except those
    the user's own checkpointing already marked: how many were marked.

    The backward's nodes are those that depend on a tangent (:func:`forward_nodes`);
    nothing there is marked.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    marked = 0
    for node in forward_nodes(joint):
        if _is_random(node) and "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def forward_nodes(joint: fx.Graph) -> list[fx.Node]:
    """The nodes of a joint graph's forward: those that depend on no tangent."""
    backward: set[fx.Node] = set()
    forward = []
    for node in joint.nodes:
        tangent = node.op == "placeholder" and "tangents" in str(node.target)
        if tangent or any(used in backward for used in node.all_input_nodes):
            backward.add(node)
        else:
            forward.append(node)
    return forward


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
    return torch.Tag.nondeterministic_seeded in tags


def _compile_ends(args: Any = None) -> None:
    _CLOCK.ended()
    saved: list[Any] = getattr(_local, "patches", None) or []
    if saved:
        try:
            saved.pop().close()
        except Exception as error:  # rule 14
            _warn_once(error)


def dynamo_live() -> bool:
    """Whether ``torch.compile`` has been used in this process (dynamo is imported then)."""
    return "torch._dynamo" in sys.modules


def compiled_some() -> bool:
    """Whether dynamo has compiled a graph in this process (checkpointing imports dynamo
    without compiling anything)."""
    return dynamo_live() and _graphs() > 0


@dataclass
class Trial:
    """What the steps at one setting measured.

    Attributes:
        setting: the partitioner budget.
        kept_bytes: what the compiled forward kept for backward (rule 3), the
            last step's; None until a step ran at it.
        seconds, peaks: each step not slowed by compiling: forward to the end
            of backward, and its real peak growth.
        compiling_s: each step that compiled: forward to the end of backward,
            less the time spent compiling (its real peak is the compiler's, so
            none is taken).
        timable: its steps keep a tensor, whose unpack shows where backward ends.
    """

    setting: float
    kept_bytes: int | None = None
    seconds: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    compiling_s: list[float] = field(default_factory=list)
    timable: bool = True
    room: int | None = None  # rule 13: the least room a step that took its peak had

    @property
    def step_s(self) -> float | None:
        """Its step, from the steps that did not compile (what a settled step costs)."""
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def all_s(self) -> list[float]:
        """Its steps' times, those that compiled included."""
        return self.seconds + self.compiling_s

    @property
    def best_s(self) -> float | None:
        """Its fastest step: what it costs where nothing else slowed it."""
        return min(self.all_s, default=None)

    @property
    def typical_s(self) -> float | None:
        """Its median step."""
        return statistics.median(self.all_s) if self.all_s else None

    @property
    def timings(self) -> int:
        return len(self.all_s)

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

    over: Trial | None = None
    """Rule 11: of the settings over the budget that held ``LOWER`` less than the plan at
    their real peak at a step as fast, the one that keeps least; else None."""
    moving: int = 0
    """Rule 12: the bytes a graph stows to the disk tier (0: none)."""
    carry: Trial | None = None
    """Rule 12: the steps of the setting over the budget with what it keeps over the
    budget stowed, where the search tried it."""
    recompute: tuple[str, ...] = ()
    base_step_s: float | None = None
    fits = True
    limit_bytes: int | None = None
    """Rule 13: the memory limit the plan holds, or None (a budget of kept bytes)."""
    base_bytes: int | None = None
    """Rule 13: what the device held before the step (the limit less this is its room)."""

    @property
    def saves_random(self) -> bool:
        """Whether the compiler is asked for a budget that keeps the random ops' draws
        (rule 7): the graphs draw, and the setting is below 1.0."""
        return self.random and self.setting is not None and self.setting < 1.0

    @property
    def asked(self) -> str:
        """What the compiler is asked for, in a few words."""
        if self.setting is None:
            return "nothing (the compiled graphs keep what fits)"
        saved = ", random ops saved" if self.saves_random else ""
        moved = (
            f", about {human_bytes(self.moving)} a graph of what it keeps written to the disk "
            "tier after its last forward use and read back before its first backward use"
            if self.moving
            else ""
        )
        return f"activation_memory_budget={self.setting}{saved}{moved}"

    @property
    def advice(self) -> str | None:
        """Rule 11, in a sentence: the budget that would hold less at a faster step, or
        None where no setting over the budget did."""
        over, mine = self.over, self.predicted_peak_bytes  # the plan's setting's peak
        if over is None or over.peak_bytes is None or mine is None:
            return None
        return (
            f"the budget {human_bytes(self.budget_bytes)} buys no real memory here: "
            f"activation_memory_budget={over.setting}, which keeps "
            f"{human_bytes(over.kept_bytes or 0)} (over the budget), held "
            f"{human_bytes(over.peak_bytes)} at its real peak against the plan's "
            f"{human_bytes(mine)} (activation_memory_budget={self.setting}), at a "
            f"step as fast or faster; a budget of {over.kept_bytes} bytes or more holds less "
            "at a faster step"
        )

    def table(self) -> str:
        """The plan for people: the budget, what the compiler was asked for, each trial."""
        asked = (
            "nothing: the compiled graphs keep what fits, and run untouched"
            if self.setting is None
            else self.asked
        )
        if self.saves_random:
            asked += " (dropout's draws kept; 0 is left out, as it recomputes them too)"
        lines = []
        if self.limit_bytes is not None and self.base_bytes is not None:
            room = self.limit_bytes - self.base_bytes
            growth = self.predicted_peak_bytes
            held = "" if growth is None else f"; real peak {human_bytes(self.base_bytes + growth)}"
            lines.append(
                f"limit {human_bytes(self.limit_bytes)}: {human_bytes(self.base_bytes)} held "
                f"before the step, {human_bytes(room)} left for it{held}"
            )
        lines.append(
            f"compiled code: budget {human_bytes(self.budget_bytes)} kept for backward; "
            f"the compiler is asked for {asked}" + ("" if self.settled else " (still searching)")
        )
        for trial in (*self.trials, *((self.carry,) if self.carry is not None else ())):
            kept = "-" if trial.kept_bytes is None else human_bytes(trial.kept_bytes)
            step = (
                f"{trial.step_s:.3f} s"
                if trial.step_s is not None
                else "-"
                if trial.best_s is None
                else f"~{trial.best_s:.3f} s"  # from the step that compiled it (rule 5)
            )
            peak = "-" if trial.peak_bytes is None else human_bytes(trial.peak_bytes)
            moved = " + disk" if trial is self.carry else ""
            lines.append(
                f"  activation_memory_budget={trial.setting:<5}{moved} keeps {kept:>10}  "
                f"step {step:>9}  real peak {peak:>10}"
            )
        if self.advice is not None:
            lines.append(f"  {self.advice}")
        return "\n".join(lines)


def _slower(trial: Trial, than: Trial) -> bool:
    """Whether ``trial`` steps more than ``TIE`` slower than ``than`` (rule 5): both its
    fastest and its median timing are."""
    fastest = (trial.best_s or 0.0) > (than.best_s or 0.0) * (1 + TIE)
    median = (trial.typical_s or 0.0) > (than.typical_s or 0.0) * (1 + TIE)
    return fastest and median


class CompiledSearch:
    """Rule 5: the setting a profile's compiled steps run at, for one ``Auto`` budget.

    Args:
        budget: the bytes the compiled forward may keep for backward (updated
            as the session resolves it each step: a default budget follows free
            memory).
    """

    def __init__(self, budget: int, *, limited: bool = False) -> None:
        self.budget = budget
        self.limited = limited  # rule 13: the budget comes from a memory limit
        self.limit: int | None = None  # rule 13: the limit, and the base of the last step
        self.base: int | None = None
        self.widened = 0  # rule 13: what a plan's steps went over its room, at most
        self.trials: dict[float, Trial] = {}
        self.choice: float | None = None
        self.settled = False
        self.current: float | None = 1.0
        self.random = False  # rule 7: the graphs draw random numbers
        self.device: torch.device | None = None  # where its steps ran
        self.probed: set[float] = set()  # rule 11: settings over the budget stepped for a peak
        self.warned: set[int] = set()  # rule 11: the budgets warned of
        self.carry: Trial | None = None  # rule 12: the setting over the budget, carried out
        self.carry_moving = 0  # rule 12: what the carry stows a graph
        self.carried = False  # rule 12: the plan is the carry
        self.moving = 0  # what the next step stows a graph (rule 12)
        self.untimed: list[Untimed] = []  # rule 13: steps whose device time is to be read

    def rebudget(self, budget: int) -> None:
        """The budget resolved to ``budget`` this step: choose again from the trials if
        the choice no longer fits or a setting that did not fit now does."""
        if budget == self.budget:
            return
        before = self._fitting()
        self.budget = budget
        # Rule 12: a carry that no longer fits is dropped; one that does is kept, so that
        # a budget that moves a little compiles nothing again.
        carry = self.carry
        dropped_plan = False
        if carry is not None and (carry.kept_bytes is None or carry.kept_bytes > budget):
            dropped_plan = self.carried
            self.carry, self.carry_moving, self.carried = None, 0, False
        if self.settled and (dropped_plan or self._fitting() != before):
            self.settled = False
            self.probed.clear()

    def under_limit(self, limit: int, base: int, cap: int | None = None) -> None:
        """Rule 13: the step about to run may hold ``limit`` bytes, ``base`` of them held
        before it; the budget of kept bytes is made from what the room leaves (at most
        ``cap``, a ``device_budget`` given beside the limit)."""
        self.limit, self.base = limit, base
        room = limit - base
        measured = [t for t in self.trials.values() if t.peak_bytes is not None]
        for trial in measured:  # rule 6 of NOTE [ Memory limit ]: a plan predicted short
            if trial.kept_bytes is not None and trial.room is not None:
                self.widened = max(self.widened, trial.peak_bytes - trial.room)  # type: ignore[operator]
        if measured:
            besides = max(t.peak_bytes - (t.kept_bytes or 0) for t in measured)  # type: ignore[operator]
            budget = room - _limit.margin(room, self.widened) - besides
        else:
            budget = int(_limit.FIRST_SHARE * room)
        budget = max(0, budget // _limit.ROOM_STEP * _limit.ROOM_STEP)
        self.rebudget(budget if cap is None else min(budget, cap))

    def drew(self) -> None:
        """A step's forward drew random numbers (rule 7): from now on a budget of 0,
        which recomputes random ops too, is never the plan, also where the plan was made
        before the model drew (in eval mode, say)."""
        self.random = True
        if self.settled and not self._safe(self.choice):
            self.settled = False

    def _safe(self, setting: float | None) -> bool:
        """Whether steps at ``setting`` give the gradients the user's graphs give (rule 7)."""
        return not (self.random and setting == 0.0)

    def setting_for_step(self) -> float | None:
        """The setting the next step runs at (None: push nothing); :attr:`moving` is
        what it stows a graph (rule 12)."""
        self._take_times()
        settled = self.settled
        self.moving = 0
        self.current = self._next()
        if self.settled and self.carried:
            self.moving = self.carry_moving
        if self.settled and not settled:
            self._advise()  # rule 11: once the plan is made
        return self.current

    def _take_times(self) -> None:
        """Rule 13: the device times of the steps whose backward ended: waited for while
        the search searches; a settled plan takes those the device gave, and keeps the
        rest for later (at most ``WINDOW``)."""
        waiting = []
        for step in self.untimed:
            seconds = step.span.seconds(wait=not self.settled)
            if seconds is None:
                waiting.append(step)
                continue
            self.timed(
                step.setting,
                seconds - step.compiling_s,
                step.peak,
                compiled=step.compiled,
                moving=step.moving,
            )
        self.untimed = waiting[-WINDOW:]

    def _next(self) -> float | None:
        if self.settled:
            return self.choice
        if 1.0 not in self.trials:
            return 1.0
        fits = self._fitting()
        if 1.0 in fits:
            return self._settle(None)
        for setting in self._to_compile(fits):
            if setting not in self.trials:
                return setting
        return self._walk(fits)

    def _walk(self, fits: list[float]) -> float | None:
        """Rule 5 once every setting worth it is compiled: the setting whose step the
        choice still needs, or the choice (settled)."""
        timed = sorted(
            (self.trials[s] for s in fits if self.trials[s].timable),
            key=lambda t: (t.kept_bytes or 0, t.setting),
        )
        if not timed:  # none fits, or no fitting step can be timed
            return self._settle(self._least_kept(fits))
        for trial in timed:
            if trial.best_s is None:  # its compile step was not timed
                return trial.setting
        fastest = min(timed, key=lambda t: t.best_s or 0.0)

        def as_fast(trial: Trial) -> bool:
            return trial is fastest or not _slower(trial, fastest)

        def unsure(trial: Trial) -> Trial | None:
            """What to step again before ``trial`` is left out for speed: a few slow steps
            do not rule out a setting."""
            return next((t for t in (trial, fastest) if t.timings < CHANCES), None)

        def peak(trial: Trial) -> float:
            return float("inf") if trial.peak_bytes is None else trial.peak_bytes

        candidate = fastest
        for trial in timed[: timed.index(fastest)]:  # those that keep less than the fastest
            if as_fast(trial):
                candidate = trial
                break
            short = unsure(trial)
            if short is not None:
                return short.setting
        if not candidate.peaks:
            return candidate.setting
        rest = timed[timed.index(candidate) :]  # the candidate and those that keep more
        for above in rest[1:]:
            if not above.seconds:  # its real peak, and a time taken as the candidate's was
                return above.setting
        best = min((trial for trial in rest if as_fast(trial)), key=peak)
        for above in rest[1:]:
            short = None if as_fast(above) or peak(above) >= peak(best) else unsure(above)
            if short is not None:  # it held less: left out on its time only when sure
                return short.setting
        if self.limited:  # rule 13: the budget comes from the real peaks
            return self._settle(best.setting)
        for over in self._overs():
            if not over.peaks and over.setting not in self.probed:
                self.probed.add(over.setting)  # rule 11: one step for its real peak
                return over.setting
        carried = self._carry(best)
        if carried is not None:
            return carried
        return self._settle(best.setting)

    def _carry(self, best: Trial) -> float | None:
        """Rule 12: the setting over the budget that held less than the plan (rule 11),
        with what it keeps over the budget stowed: the setting to step it at, the carry
        once settled on, or None where the plan stays ``best``."""
        base = self.trials.get(self.carry.setting) if self.carry is not None else None
        if base is not None and base.kept_bytes is not None and base.kept_bytes <= self.budget:
            self.carry, self.carry_moving = None, 0  # its setting fits now: nothing to carry
        if self.carry is None:
            over = self._cheaper_over(best.setting)
            if over is None or over.kept_bytes is None or self.device is None:
                return None
            if self.device.type != "cpu":
                return None  # on a device, what leaves it is the compiler's offload
            self.carry = Trial(over.setting)
            self.carry_moving = over.kept_bytes - self.budget
        carry = self.carry
        if not carry.peaks:
            if carry.timings >= CHANCES or not carry.timable:
                return None  # its steps give no real peak: left out
            self.moving = self.carry_moving
            return carry.setting
        fits = carry.kept_bytes is not None and carry.kept_bytes <= self.budget
        mine = best.peak_bytes
        lower = mine is not None and (carry.peak_bytes or 0) < mine * (1 - LOWER)
        slower = _slower(carry, best)
        if fits and lower and slower and carry.timings < CHANCES:
            self.moving = self.carry_moving  # rule 5: left out for speed only when sure
            return carry.setting
        if fits and lower and not slower:
            self._settle(carry.setting)
            self.carried = True  # setting_for_step gives its steps what it stows
            return carry.setting
        return None

    def _overs(self) -> list[Trial]:
        """Rule 11: the settings over the budget (safe, timable, below 1.0), those that
        keep least first."""
        over = [
            trial
            for setting, trial in self.trials.items()
            if trial.kept_bytes is not None
            and trial.kept_bytes > self.budget
            and trial.timable
            and self._safe(setting)
            and setting < 1.0
        ]
        return sorted(over, key=lambda t: (t.kept_bytes or 0, -t.setting))

    def _cheaper_over(self, setting: float | None) -> Trial | None:
        """Rule 11: of the settings over the budget that held ``LOWER`` less than the plan
        at ``setting`` (one that fits) at a step as fast, the one that keeps least."""
        mine = self.trials.get(setting) if setting is not None else None
        if mine is None or mine.peak_bytes is None or setting not in self._fitting():
            return None
        lower = mine.peak_bytes * (1 - LOWER)
        return next(
            (
                over
                for over in self._overs()
                if over.peak_bytes is not None
                and over.peak_bytes < lower
                and not _slower(over, mine)
            ),
            None,
        )

    def _advise(self) -> None:
        """Rule 11: warn, once per budget, where the plan just made has a budget that buys
        no real memory."""
        advice = self.plan().advice
        if advice is None or self.budget in self.warned:
            return
        self.warned.add(self.budget)
        warnings.warn(
            f"tensorstash.Auto: {advice}. Auto keeps to the budget. (Shown once per budget.)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _settle(self, choice: float | None) -> float | None:
        self.settled, self.choice, self.carried = True, choice, False
        return choice

    def _least_kept(self, fits: list[float]) -> float | None:
        known = [
            t for t in self.trials.values() if t.kept_bytes is not None and self._safe(t.setting)
        ]
        fitting = [t for t in known if t.setting in fits] or known
        if not fitting:
            return None
        return max(fitting, key=lambda t: (-(t.kept_bytes or 0), t.setting)).setting

    def _fitting(self) -> list[float]:
        return [
            setting
            for setting, trial in self.trials.items()
            if trial.kept_bytes is not None
            and trial.kept_bytes <= self.budget
            and self._safe(setting)
        ]

    def _to_compile(self, fits: list[float]) -> list[float]:
        """The settings still worth compiling: down to ``EXPLORE`` below the first fit."""
        order = [setting for setting in SETTINGS if self._safe(setting)]
        if not fits:
            return order
        first = order.index(max(fits))
        return order[: first + 1 + EXPLORE]

    def _trial(self, setting: float, moving: int) -> Trial | None:
        """The trial a step at ``setting`` that stowed ``moving`` bytes a graph adds to."""
        if not moving:
            return self.trials.get(setting)
        carry = self.carry
        if carry is None or carry.setting != setting or moving != self.carry_moving:
            return None  # a carry of another budget's
        return carry

    def measured(self, setting: float, kept: int, tensors: int, moving: int = 0) -> None:
        """A step at ``setting`` kept ``kept`` bytes in ``tensors`` tensors (none: its
        backward's end cannot be seen, so it is never timed). A setting keeps the most
        any of its steps kept (rule 9): a plan that a larger step outgrows is made again.
        A step that stowed ``moving`` bytes a graph is the carry's (rule 12)."""
        if moving:
            carry = self._trial(setting, moving)
            if carry is not None:
                carry.kept_bytes = max(carry.kept_bytes or 0, kept)
                carry.timable = tensors > 0
                if self.carried and kept > self.budget:
                    self.settled = False  # outgrown
            return
        trial = self.trials.setdefault(setting, Trial(setting))
        grew = trial.kept_bytes is not None and kept > trial.kept_bytes
        trial.kept_bytes = kept if trial.kept_bytes is None else max(trial.kept_bytes, kept)
        trial.timable = tensors > 0
        if self.settled and self.choice == setting and grew and kept > self.budget:
            self.settled = False  # outgrown; a plan chosen where none fits stays

    def timed(
        self,
        setting: float,
        seconds: float,
        peak: int | None,
        *,
        compiled: bool,
        moving: int = 0,
        room: int | None = None,
    ) -> None:
        """A step at ``setting`` took ``seconds`` (less its compiling) and grew real
        memory by ``peak`` (None: not taken); a step that ``compiled`` gives its time
        only. A setting keeps its last :data:`WINDOW` times; ``room``: what a memory limit
        left the step (rule 13)."""
        trial = self._trial(setting, moving)
        if trial is None:
            return
        if compiled:
            trial.compiling_s.append(seconds)
            return
        trial.seconds.append(seconds)
        del trial.seconds[:-WINDOW]
        if peak is not None:
            trial.peaks.append(peak)
            if room is not None:
                trial.room = room if trial.room is None else min(trial.room, room)

    def plan(self) -> CompilerPlan:
        """The plan of the step about to run (after :meth:`setting_for_step`)."""
        setting = self.current
        trial = self.trials.get(1.0 if setting is None else setting)
        if self.moving and self.carry is not None:
            trial = self.carry
        return CompilerPlan(
            self.budget,
            setting,
            None if trial is None else trial.kept_bytes,
            None if trial is None else trial.step_s,
            None if trial is None else trial.peak_bytes,
            tuple(self.trials[s] for s in SETTINGS if s in self.trials),
            self.settled,
            self.random,
            self._cheaper_over(setting) if self.settled and not self.carried else None,
            moving=self.moving,
            carry=self.carry,
            limit_bytes=self.limit,
            base_bytes=self.base,
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


def search_for(profile: Any, spec: Any, budget: int, *, limited: bool = False) -> CompiledSearch:
    """The search of ``profile`` for the Auto budget ``spec`` (as the user gave it),
    resolved to ``budget`` bytes now; a search never serves another spec. ``limited``:
    the spec is a memory limit, whose budget :meth:`CompiledSearch.under_limit` sets."""
    searches = known(profile).searches
    search = searches.get(spec)
    if search is None:
        search = searches[spec] = CompiledSearch(budget, limited=limited)
    if not limited:
        search.rebudget(budget)
    return search


class CompiledStep:
    """One session's step under a pair: what its compiled graphs kept, its time and peak.

    Args:
        search: the profile's search, or a function giving it from the step's
            device once the step has run (the first step: the budget depends on it).
        setting: the setting of the pair pushed.
        min_bytes: the session's floor (rule 3).
        device: where the step runs, for its time and real peak (None: not known
            yet, or not timed).
        known: the profile's steps ran compiled code before (a step that keeps
            nothing still ran it).
        pool: the cap of the session pool a step on the CPU leases (rule 10): "auto"
            for what the graphs keep at 1.0 over ``POOL_SHARE`` (at least ``POOL_LEAST``),
            bytes, or None for no lease (``Auto``'s ``trim_every``).
        peak: take the step's real peak (a settled plan's step takes its time only).
        moving: the bytes a graph stows (rule 12).
        model_device: where the model's parameters are, for a step whose graphs
            kept nothing that counts (rule 13; None: not known).
        span: the device clock of a step on ``device`` (rule 13): None times it on
            the host, the CPU's case (injected for tests).
    """

    def __init__(
        self,
        search: CompiledSearch | Callable[[torch.device], CompiledSearch],
        setting: float,
        min_bytes: int,
        device: torch.device | None,
        *,
        known: bool = False,
        pool: int | str | None = "auto",
        peak: bool = True,
        moving: int = 0,
        model_device: Callable[[], torch.device | None] = lambda: None,
        span: Callable[[torch.device], Span | None] = lambda device: device_span(device),
    ) -> None:
        self.search = search
        self.setting = setting
        self.moving = moving
        self.known = known
        self.room = (  # rule 13: what the limit left this step
            search.limit - search.base
            if isinstance(search, CompiledSearch)
            and search.limit is not None
            and search.base is not None
            else None
        )
        self.lease = _lease(search, pool) if known else None
        self.pair = hooks_for(setting, moving)
        count = _count()
        count.bytes = count.tensors = count.moved = 0
        count.devices = {}
        self.model_device = model_device
        self.generators = _generators()  # rule 7
        count.min_bytes = min_bytes
        self.count = count
        self.graphs = _graphs()
        self.compiled = False  # a graph compiled in the step (rule 5)
        self.timing = device is not None
        self.compiling_s = _CLOCK.read()
        self.backward_before = _last_backward_end()
        self.start = time.perf_counter()
        self.span = span(device) if device is not None else None  # rule 13
        if self.span is not None:
            with _PENDING_LOCK:
                _SPANS.add(self.span)
        self.meter = meter(device, sync=False) if device is not None and peak else None
        if self.meter is not None:
            self.meter.start()

    def exited(self) -> CompiledSearch | None:
        """The forward ended, the pair still pushed: note what the compiled graphs kept.

        Returns:
            The search, or None where no compiled graph ran in the step.
        """
        count = self.count
        drew = _drew(self.generators, _generators())
        self.compiled = _graphs() != self.graphs
        if count.tensors == 0 and not self.known:  # no graph of AOTAutograd's kept a tensor
            self._stop()
            self._drop_span()
            return None
        device = count.device or self.model_device()  # rule 13
        search = self.search
        if not isinstance(search, CompiledSearch):
            search = self.search = search(device or torch.device("cpu"))
        if drew:
            search.drew()
        search.device = device or search.device
        search.measured(self.setting, count.bytes, count.tensors, self.moving)
        if self.compiled:
            self._stop()  # what compiling holds is not the step's peak (rule 5)
        if not count.tensors or not (self.timing or self.lease is not None):
            self._stop()
            self._release()
            self._drop_span()
            return search
        with _PENDING_LOCK:
            ended = _ENDED[0] if _ENDED and _ENDED[0] != self.backward_before else None
            if ended is None:
                _PENDING.append(self)  # until its backward ends
        if ended is not None:  # the backward ran inside the session, before it closed
            self.finished(ended)
        return search

    def finished(self, ended: float) -> None:
        """Its backward ended at ``ended``: the step's time, less what compiling took
        (a lazy backward compile included), and its real peak (rule 5); on a device,
        its time is the device's, read later (rule 13)."""
        peak = self._stop()
        self._release()
        span = self._drop_span()
        search = self.search
        if not isinstance(search, CompiledSearch) or not self.timing:
            return
        compiling = _CLOCK.read() - self.compiling_s
        compiled = self.compiled or compiling > 0
        if span is not None:
            untimed = Untimed(span, self.setting, compiling, peak, compiled, self.moving)
            search.untimed.append(untimed)  # read at the search's next step (rule 13)
            return
        search.timed(
            self.setting,
            ended - self.start - compiling,
            peak,
            compiled=compiled,
            moving=self.moving,
            room=self.room,
        )

    def _drop_span(self) -> Span | None:
        span, self.span = self.span, None
        if span is not None:
            with _PENDING_LOCK:
                _SPANS.discard(span)
        return span

    def _stop(self) -> int | None:
        if self.meter is None:
            return None
        measuring, self.meter = self.meter, None
        return measuring.stop()

    def _release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.close()


def _lease(
    search: CompiledSearch | Callable[[torch.device], CompiledSearch], pool: int | str | None
) -> _pool.Lease | None:
    """Rule 10: the session pool's lease of a step at a setting on the CPU, or None."""
    if pool is None or _pool.compiled is None or not isinstance(search, CompiledSearch):
        return None
    if search.device is None or search.device.type != "cpu":
        return None
    if pool == "auto":
        whole = search.trials.get(1.0)
        kept = 0 if whole is None or whole.kept_bytes is None else whole.kept_bytes
        pool = max(POOL_LEAST, kept // POOL_SHARE)
    return _pool.lease(int(pool))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def handing(
    pack: Callable[[Tensor], Any],
    unpack: Callable[[Any], Tensor],
    stow: tuple[Any, Any] | None = None,
) -> None:
    """Eager tensors saved under a pair on this thread go to this session's pair (rule 2),
    and what its compiled forwards stow goes to ``stow``, a tier and the session's
    context (rule 12; None: kept in memory)."""
    stack: list[tuple[Any, Any, Any]] | None = getattr(_local, "handing", None)
    if stack is None:
        stack = _local.handing = []
    stack.append((pack, unpack, stow))


def handed() -> None:
    """The session that called :func:`handing` closed."""
    stack: list[tuple[Any, Any, Any]] = getattr(_local, "handing", None) or []
    if stack:
        stack.pop()


def stow_target() -> tuple[Any, Any] | None:
    """Rule 12: the tier and context the innermost session on this thread stows with."""
    stack: list[tuple[Any, Any, Any]] = getattr(_local, "handing", None) or []
    return stack[-1][2] if stack else None
