"""recompute(): regions whose activations are dropped in forward and recomputed in backward.

The measurements behind these rules are in docs/figures/tiers-and-memory.md.

# NOTE [ Recompute ]
1. Recompute cannot be a per-tensor pack: unpack would need the region's
   function and inputs. A region is run under non-reentrant
   ``torch.utils.checkpoint`` (RNG state preserved, so dropout repeats
   exactly; keyword arguments and tuple outputs pass through).
2. Non-reentrant checkpointing is itself a saved-tensor hook pair, pushed
   only inside the region. What the region must keep, its inputs, is saved
   outside that pair, so it goes through the enclosing stash: one model mixes
   recomputed blocks with offloaded ones.
3. A stash opened inside a region (a model that stashes its own forward,
   checkpointed from outside) passes through: it pushes no hooks, in forward
   and while backward recomputes the region, so the region's own hooks keep
   what it recomputes, and the session counts the pass in
   ``stats.inside_recompute`` (rule 8 of NOTE [ Session ] in stash.py).
   Under reentrant checkpointing the region runs without grad in forward and
   with it, outside any hooks, while backward recomputes it: a stash there
   packs the recomputation like any other forward.
4. A module keeps its identity and its ``state_dict`` keys: its ``forward`` is
   wrapped on the instance, and unwrapped by :func:`unrecompute`, which also
   undoes :func:`recompute_modules` on a whole model.
5. A module is never checkpointed twice: one that Hugging Face's gradient
   checkpointing already runs under checkpoint (``gradient_checkpointing`` set
   on it, in training) runs as it is, whichever was switched on first.
6. ``Auto`` recomputes the modules of its plan for one session (see NOTE
   [ Plan ] in plan.py): :func:`wrap_for_plan` at the start of a step,
   :func:`unwrap_for_plan` at its end. The wrapper of a module is made once and
   reused, so a compiled model sees the same ``forward`` every step and is not
   recompiled. It checkpoints only in training with grad enabled: evaluation
   and ``no_grad`` forwards run the module as it is.
7. What a plan's recompute costs is timed where it happens: each run of the
   region while backward runs adds its seconds to the module's count, which
   the profile takes at the end of the step (:func:`take_recompute_seconds`;
   counts left from a step it does not time are dropped, unread:
   :func:`drop_recompute_seconds`). On the CPU the profile's clock times it;
   on CUDA a pair of events on the current stream around it, read once the
   step's own events completed, so a step waits for nothing it would not,
   and the host's time in it where that is longer: where launching kernels
   bounds backward, the device reaches the first event late, still running
   what backward queued before it, and the pair spans only what is left of
   the host's time, which is what the step pays. On such a step the blocks'
   forward times, measured with the profile's timing of every module, summed
   to more than twice what recomputing them added, and a plan that priced
   recompute by them took a negative base. A module's forward time is a poor
   guess: forward allocates what backward's recompute lays over pages forward
   freed, so on a trimmed heap a block's recompute takes well under its
   forward, and a measured forward carries the profile's timing of every
   module in it. A module that :func:`recompute` wraps is timed alike, so a
   plan knows what the user's own recompute costs a step.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensorstash.core._timers import CpuTimer, CudaTimer

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=nn.Module)

_WRAPPED = "_tensorstash_forward"
"""The instance attribute holding a module's own forward while :func:`recompute` wraps it."""

_local = threading.local()
_plan_wrappers: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = (
    weakref.WeakKeyDictionary()
)
_plan_saved: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_recompute_s: weakref.WeakKeyDictionary[nn.Module, _Readings] = weakref.WeakKeyDictionary()
_clocks: weakref.WeakKeyDictionary[nn.Module, Callable[[], float]] = weakref.WeakKeyDictionary()
_NOTHING = object()


class _Readings:
    """What backward spent recomputing one module since last taken (rule 7): seconds,
    and the marks not yet read. A pair of marks whose end completed is read when the
    next is added, so a module recomputed by steps no profile times holds a pair or two,
    not one per step."""

    __slots__ = ("pending", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.pending: list[tuple[CpuTimer | CudaTimer, Any, Any, float]] = []

    def add(self, timer: CpuTimer | CudaTimer, start: Any, end: Any, wall: float = 0.0) -> None:
        """A pair of marks around one recompute, and the seconds the host spent in it
        (on CUDA: the reading is the longer of the two)."""
        still = []
        for reading in self.pending:
            if reading[0].done(reading[2]):
                self.seconds += _read(reading)
            else:
                still.append(reading)
        self.pending = [*still, (timer, start, end, wall)]

    def total(self) -> float:
        """The seconds, once every pair's end completed (done already where the step's own
        events are)."""
        for reading in self.pending:
            self.seconds += _read(reading)
        self.pending = []
        return self.seconds


def _read(reading: tuple[CpuTimer | CudaTimer, Any, Any, float]) -> float:
    timer, start, end, wall = reading
    return max(timer.seconds(start, end), wall)


def _checkpointed(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    return run


def _hf_checkpointed(module: nn.Module) -> bool:
    """Rule 5: Hugging Face's gradient checkpointing runs this module under checkpoint."""
    return bool(getattr(module, "gradient_checkpointing", False)) and module.training


def _module_checkpointed(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    region = _timed(module, forward)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _hf_checkpointed(module):
            return forward(*args, **kwargs)
        return checkpoint(region, *args, use_reentrant=False, **kwargs)

    return run


def _timed(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, each run while backward recomputes it timed (rule 7)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:
            return forward(*args, **kwargs)
        device = _cuda_device(args, kwargs)
        clock = _clocks.get(module, time.perf_counter)
        timer = CudaTimer(device) if device is not None else CpuTimer(clock)
        start = timer.mark()
        began = clock() if device is not None else 0.0
        try:
            return forward(*args, **kwargs)
        finally:
            end = timer.mark()
            wall = clock() - began if device is not None else 0.0
            _readings(module).add(timer, start, end, wall)

    return run


def _cuda_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of the first CUDA tensor among the arguments, or None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_cuda:
            return value.device
    return None


def _readings(module: nn.Module) -> _Readings:
    found = _recompute_s.get(module)
    if found is None:
        found = _recompute_s[module] = _Readings()
    return found


def use_clock(module: nn.Module, clock: Callable[[], float]) -> None:
    """Time ``module``'s recompute in backward with ``clock`` (a profile's: rule 7)."""
    _clocks[module] = clock


def is_checkpointed(module: nn.Module) -> bool:
    """Whether the user already recomputes ``module`` (``recompute``, or Hugging Face's)."""
    return _WRAPPED in vars(module) or bool(getattr(module, "gradient_checkpointing", False))


def recompute(module_or_fn: M | F) -> M | F:
    """Drop a region's activations in forward and recompute them in backward.

    Args:
        module_or_fn: an ``nn.Module`` (wrapped in place and returned, same
            object, same ``state_dict``) or a function (a wrapped copy is returned).

    Returns:
        The module, or the wrapped function.

    Raises:
        TypeError: neither a module nor a callable.

    Example:
        >>> blocks = [tensorstash.recompute(block) for block in model.blocks]
        >>> with tensorstash.stash("lz4"):  # the blocks' inputs are compressed
        ...     loss = model(x).sum()

    .. warning::
        The region runs twice (forward, then again in backward): side effects
        in it happen twice, and it must compute the same thing both times.
    """
    if isinstance(module_or_fn, nn.Module):
        if _WRAPPED not in vars(module_or_fn):
            original = module_or_fn.forward
            setattr(module_or_fn, _WRAPPED, original)
            module_or_fn.forward = _module_checkpointed(module_or_fn, original)
        return module_or_fn
    if not callable(module_or_fn):
        raise TypeError(
            "tensorstash.recompute: expected an nn.Module or a function; got "
            f"{type(module_or_fn).__name__} {module_or_fn!r}"
        )
    return _checkpointed(module_or_fn)  # type: ignore[return-value]


def unrecompute(module: M) -> M:
    """Undo :func:`recompute` on a module and on every submodule of it.

    So ``unrecompute(model)`` also undoes ``recompute_modules(model, ...)``.
    """
    for child in module.modules():
        original = vars(child).pop(_WRAPPED, None)
        if original is not None:
            del child.forward
    return module


Which = Callable[[str, nn.Module], bool] | str | type[nn.Module] | Iterable[str | type[nn.Module]]
"""What :func:`recompute_modules` wraps: a predicate, a name, a module class, or several
names and classes."""


def recompute_modules(model: nn.Module, which: Which) -> list[str]:
    """Recompute many submodules at once.

    Args:
        model: the model whose submodules to wrap (in place).
        which: what to wrap, as ``Auto(never_recompute=...)`` names modules: a
            submodule path (as in ``model.named_modules()``; the module and what
            is inside it) or a class name (``"Block"``), a module class, or
            several of those (a list or tuple); or a predicate
            ``(name, module) -> bool``.

    Returns:
        The paths of the wrapped submodules.

    Raises:
        ValueError: a name that is neither a submodule path nor the class name of a
            submodule.
        TypeError: ``which`` is none of the forms above (a module instance: use
            :func:`recompute` on it).

    Example:
        >>> tensorstash.recompute_modules(model, GPTBlock)  # or "GPTBlock"
        ['blocks.0', 'blocks.1', ...]
        >>> tensorstash.recompute_modules(model, ["blocks.0", "blocks.2"])
        >>> tensorstash.unrecompute(model)  # all of them again
    """
    named = dict(model.named_modules())
    if callable(which) and not isinstance(which, (type, nn.Module)):
        chosen = {name for name, module in named.items() if which(name, module)}
    else:
        chosen = _named_modules(named, _names(which))
    # A module inside one already wrapped would be checkpointed twice: skip it.
    wrapped: list[str] = []
    for name in named:
        if name not in chosen:
            continue
        if any(name.startswith(f"{outer}.") or outer == "" for outer in wrapped):
            continue
        recompute(named[name])
        wrapped.append(name)
    return wrapped


def matches(path: str, module: nn.Module | None, names: tuple[str, ...]) -> bool:
    """Whether the module at ``path`` is one of ``names``: a path names the module and
    those inside it, a class name every module of that class (``Auto``'s
    ``never_recompute`` and ``always_recompute``, :func:`recompute_modules`)."""
    if any(path == name or path.startswith(name + ".") for name in names):
        return True
    return module is not None and type(module).__name__ in names


def _names(which: object) -> list[str | type[nn.Module]]:
    """``which`` of :func:`recompute_modules` as a list of names and module classes."""
    api = "tensorstash.recompute_modules"
    if isinstance(which, nn.Module):
        raise TypeError(
            f"{api}: which is a module instance ({type(which).__name__}); pass its path or "
            "class name, its class, or recompute it alone with tensorstash.recompute(module)"
        )
    if isinstance(which, (str, type)):
        items: list[object] = [which]
    elif isinstance(which, Iterable) and not isinstance(which, bytes):
        items = list(which)
    else:
        raise TypeError(
            f"{api}: which must be a submodule path or class name (a str), a module class, "
            "a list of those, or a predicate (name, module) -> bool; got "
            f"{type(which).__name__} {which!r}"
        )
    for item in items:
        if not isinstance(item, str) and not (
            isinstance(item, type) and issubclass(item, nn.Module)
        ):
            raise TypeError(
                f"{api}: {item!r} is not a submodule path, a class name or an nn.Module "
                "class; pass names such as ['blocks.0', 'Block'] or a class such as Block"
            )
    return items  # type: ignore[return-value]


def _named_modules(named: dict[str, nn.Module], items: list[str | type[nn.Module]]) -> set[str]:
    """The paths of the submodules ``items`` name; ValueError for a name that names none."""
    chosen: set[str] = set()
    missing: list[str] = []
    for item in items:
        if isinstance(item, type):
            found = {path for path, module in named.items() if isinstance(module, item)}
        else:  # what is inside a module found is skipped by the caller
            found = {path for path, module in named.items() if matches(path, module, (item,))}
            if not found:
                missing.append(item)
        chosen |= found
    if missing:
        classes = sorted({type(module).__name__ for module in named.values()})
        raise ValueError(
            f"tensorstash.recompute_modules: {missing} name no submodule of the model, by "
            f"path or by class name; paths look like {list(named)[1:4]}, class names here "
            f"are {classes[:8]}"
        )
    return chosen


# -- the plan's recompute, for one session (rule 6) --------------------------------------


_warm = False


def warm_up() -> float:
    """Run checkpointing once in this process; the seconds it took (0 after the first time).

    The first ``torch.utils.checkpoint`` call of a process imports what it
    needs (over a second on a small CPU): a plan pays that before it times
    a recomputed module, not inside one.
    """
    global _warm
    if _warm:
        return 0.0
    _warm = True
    start = time.perf_counter()
    x = torch.zeros(1, requires_grad=True)
    checkpoint(torch.mul, x, 2.0, use_reentrant=False).sum().backward()
    return time.perf_counter() - start


def in_plan_region() -> bool:
    """Whether this thread runs inside a region that a plan recomputes."""
    return bool(getattr(_local, "depth", 0))


def saving_plan_inputs() -> bool:
    """Whether the tensors saved now are the inputs a planned region keeps.

    They are saved by checkpointing before the region runs, through the
    session's hooks; a profile does not count them as the model's own sites.
    """
    return bool(getattr(_local, "inputs", False))


def _plan_wrapper(module: nn.Module) -> Callable[..., Any]:
    found = _plan_wrappers.get(module)
    if found is not None:
        return found
    forward = module.forward  # the bound method, or a forward another wrapper set
    region = _timed(module, forward)  # rule 7

    def enter_region(*args: Any, **kwargs: Any) -> Any:
        _local.inputs = False
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return region(*args, **kwargs)
        finally:
            _local.depth -= 1

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()) or _hf_checkpointed(module):
            return forward(*args, **kwargs)
        _local.inputs = True  # until the region starts: see saving_plan_inputs
        try:
            return checkpoint(enter_region, *args, use_reentrant=False, **kwargs)
        finally:
            _local.inputs = False

    _plan_wrappers[module] = run
    return run


def take_recompute_seconds(modules: Iterable[nn.Module]) -> float | None:
    """Seconds backward spent recomputing ``modules`` since the last call (rule 7).

    None when none of them was timed (not recomputed yet).
    """
    found = [_recompute_s.pop(module) for module in modules if module in _recompute_s]
    return sum(readings.total() for readings in found) if found else None


def drop_recompute_seconds(modules: Iterable[nn.Module]) -> None:
    """Forget what backward spent recomputing ``modules``, unread (rule 7)."""
    for module in modules:
        _recompute_s.pop(module, None)


def _user_recomputed() -> list[nn.Module]:
    return [m for m in list(_recompute_s) if _WRAPPED in vars(m)]


def take_user_recompute_seconds() -> float | None:
    """Seconds backward spent recomputing the modules :func:`recompute` wraps since the
    last call (rule 7), or None where none was timed."""
    if not _recompute_s:
        return None
    return take_recompute_seconds(_user_recomputed())


def drop_user_recompute_seconds() -> None:
    """Forget, unread, what backward spent recomputing the modules :func:`recompute` wraps."""
    if _recompute_s:  # asked at every step's start
        drop_recompute_seconds(_user_recomputed())


def wrap_for_plan(module: nn.Module, clock: Callable[[], float] = time.perf_counter) -> bool:
    """Recompute ``module`` until :func:`unwrap_for_plan` (rule 6); False if it cannot be.

    A module the user already recomputes, or one a plan already wraps, is left
    as it is. ``clock`` times its recompute in backward (rule 7).
    """
    if is_checkpointed(module) or module in _plan_saved:
        return False
    use_clock(module, clock)
    _plan_saved[module] = vars(module).get("forward", _NOTHING)
    wrapper = _plan_wrapper(module)
    module.forward = wrapper
    return True


def unwrap_for_plan(module: nn.Module) -> None:
    """Give ``module`` back the ``forward`` it had before :func:`wrap_for_plan`."""
    if module not in _plan_saved:
        return
    saved = _plan_saved.pop(module)
    if vars(module).get("forward") is not _plan_wrappers.get(module):
        return  # something else replaced forward since: leave it as it is
    if saved is _NOTHING:
        del module.forward
    else:
        module.forward = saved
