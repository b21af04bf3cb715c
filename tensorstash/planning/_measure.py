"""Measuring one step for a profile (NOTE [ Profile ] in profile.py): a step with hooks,
timed per module (rule 2, :class:`Step`), and a quiet step, timed whole (rule 8,
:class:`QuietStep`)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from tensorstash.core._timers import CpuTimer, CudaTimer
from tensorstash.core.stats import StashStats
from tensorstash.memory import _pool
from tensorstash.memory._memory import CudaPeak, PeakRss, faulted_since, meter, minor_faults
from tensorstash.memory._trim import release_free_heap
from tensorstash.planning._records import ALREADY_RECOMPUTED, ORDER, ModuleRecord, StepRecord
from tensorstash.session import _modules
from tensorstash.tiers.recompute import (
    in_plan_region,
    is_checkpointed,
    take_user_recompute_seconds,
    use_clock,
)

if TYPE_CHECKING:
    from tensorstash.planning.profile import Profile


class _Call:
    """A module call in progress: when it began and what it may change in place."""

    __slots__ = ("buffers", "inputs", "module", "path", "start")

    def __init__(self, module: nn.Module, path: str, start: Any) -> None:
        self.module = module
        self.path = path
        self.start = start
        self.buffers: list[tuple[Tensor, int]] = []
        self.inputs: list[tuple[Tensor, int]] = []


class Step:
    """One step being measured (rule 2): a module observer, then the backward's end.

    The session calls :meth:`end_forward` when it exits and :meth:`backward_started`
    at its first unpack; the end of that backward (an autograd callback)
    closes the step.
    """

    def __init__(
        self, profile: Profile, ctx: Any, min_bytes: int, *, measure: bool, cold: bool
    ) -> None:
        self.profile = profile
        self.ctx = ctx
        self.min_bytes = min_bytes
        self.measure = measure
        self.cold = cold and profile.measure_memory
        self.modules: dict[str, ModuleRecord] = {}
        self.recomputed: tuple[str, ...] = ()
        self.training: bool | None = None
        self.calls = 0  # module calls so far, and packs since the last one (site orders)
        self.packs = 0
        self._calls: list[_Call] = []
        self._timer: CpuTimer | CudaTimer = CpuTimer(profile.clock)
        self._meter: PeakRss | CudaPeak | None = None
        self._begun = self._timer.mark()
        self.faults = minor_faults()
        self._mapped = mapping_s()
        self._forward_end: Any = None
        self._held = 0
        self._backward = False
        self._timings: list[tuple[str, Any, Any]] = []
        self.policy_s = 0.0
        self.inputs: tuple[Any, ...] | None = None  # the model's inputs (rule 8)
        self.device = torch.device("cpu")
        self.room: int | None = None  # under a memory limit (NOTE [ Memory limit ] rule 2)
        if self.cold:
            self._start_meter()
        self._imported = len(sys.modules)  # a step that imports takes no peak (rule 6)
        self._unobserve = _modules.observe(self)

    def _start_meter(self) -> None:
        """Rule 6: from a heap handed back to the OS, or a warm heap that reuses the
        last step's pages shows a step growing by nothing."""
        if self.device.type == "cuda":
            self._meter = meter(self.device, sync=False)
        else:
            release_free_heap()
            self._meter = PeakRss()
        self._meter.start()

    def restart(self) -> None:
        """Measure from now: what ran since the step began (before any module) is not its."""
        self._begun = self._timer.mark()
        self.faults = minor_faults()
        self._mapped = mapping_s()
        self._imported = len(sys.modules)
        if self._meter is not None:
            self._meter.stop()
            self._start_meter()

    def take_peak(self) -> None:
        """Take the real peak of this step, from here on (before its forward runs): it is cold."""
        if self.cold:
            return
        self.cold = True
        self._start_meter()

    def use_device(self, device: torch.device) -> None:
        """The step runs on ``device`` (known at the first module call)."""
        self.device = device
        if device.type == "cuda" and isinstance(self._timer, CpuTimer):
            self._timer = CudaTimer(device)
            self._begun = self._timer.mark()
            if self._meter is not None:
                self._meter.stop()
                self._meter = meter(device, sync=False)
                self._meter.start()

    # Module observer (rule 2) -----------------------------------------------------------

    def entered(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        profile = self.profile
        self.calls += 1
        self.packs = 0
        path = _modules.current()
        if len(_modules._stack()) == 1 and self.training is None:  # a root: the model
            self.training = module.training
            profile.saw_root(module)
            device = _device_of(module, args)
            if device is not None:
                self.use_device(device)
        if not self.measure or not self.training:
            return
        profile._objects[path] = weakref.ref(module)
        call = _Call(module, path, self._timer.mark())
        call.buffers = [(b, b._version) for b in module._buffers.values() if b is not None]
        call.inputs = [(t, t._version) for t in args if isinstance(t, Tensor)]
        record = self.modules.get(path)
        if record is None:
            record = self.modules[path] = ModuleRecord(
                first_order=self.calls * ORDER, kind=type(module).__name__
            )
            record.input_bytes = sum(
                t.nbytes
                for t, _ in call.inputs
                if t.grad_fn is not None and t.nbytes >= self.min_bytes
            )
            record.unsafe = _already_checkpointed(module)
            if record.unsafe == ALREADY_RECOMPUTED:
                use_clock(module, profile.clock)  # its recompute, timed alike
        record.calls += 1
        self._calls.append(call)

    def left(self, module: nn.Module) -> None:
        calls = self._calls
        if not calls or calls[-1].module is not module:
            # A call inside this one that never told us it left (its module
            # stack was reset) is dropped untimed, so this call is still timed.
            inner = [i for i, call in enumerate(calls) if call.module is module]
            if not inner:
                return
            del calls[inner[-1] + 1 :]
        call = calls.pop()
        self._timings.append((call.path, call.start, self._timer.mark()))
        record = self.modules[call.path]
        if record.unsafe is None:
            if any(b._version != v for b, v in call.buffers):
                record.unsafe = "changes its buffers in forward (as BatchNorm in training)"
            elif any(t._version != v for t, v in call.inputs):
                record.unsafe = "changes its input in place"

    def cancel(self) -> None:
        """The step runs quiet (rule 8): stop observing it; it records nothing."""
        self._unobserve()
        if self._meter is not None:
            self._meter.stop()
            self._meter = None
        self.profile._finished(self, None)  # no step to finish: it lets go of this one

    # The session's calls -----------------------------------------------------------------

    def end_forward(self) -> None:
        """Forward ended: the session exited, or backward began inside it (its first unpack).

        Whichever comes first; the eligible bytes the session holds then are
        the step's held bytes.
        """
        if self._forward_end is not None:
            return
        self._unobserve()
        self._forward_end = self._timer.mark()
        self._held = device_held(self.ctx.stats, self.device)

    def session_exited(self) -> None:
        """The session exited (after its backward, or before it)."""
        self.end_forward()
        if not self._backward and not self._a_step():
            self.profile._finished(self, None)  # rule 3: not a step

    def backward_started(self) -> None:
        """The first unpack of the step: close the step when this backward ends."""
        if self._backward:
            return
        self._backward = True
        self.end_forward()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _a_step(self) -> bool:
        """Rule 3: a training forward that saved an eligible tensor, or saved only
        tensors under ``min_bytes`` in modules in training (a step with nothing to plan)."""
        if self.training is False:
            return False
        if self.profile.current:
            return True
        stats = self.ctx.stats
        hot = stats.hot
        packed = hot.tensors + hot.small_tensors + sum(t.tensors for t in stats.tiers.values())
        return self.training is True and packed > 0

    def _backward_ended(self) -> None:
        if not self._a_step():
            self.profile._finished(self, None)  # rule 3: not a step
            return
        end = self._timer.mark()
        peak = self._meter.stop() if self._meter is not None else None
        if isinstance(self._meter, PeakRss) and len(sys.modules) != self._imported:
            peak = None  # rule 6: the modules imported stay; the next step takes the peak
        stats = self.ctx.stats
        self.policy_s = stats.pack_seconds + stats.unpack_seconds + stats.wait_seconds
        moved = {tier: stats.tiers[tier].bytes for tier in ("host", "disk")}
        timer = self._timer
        for path, start, stop in self._timings:
            self.modules[path].forward_s += timer.seconds(start, stop)
        recompute_s = self.profile.take_recompute_seconds(self.recomputed)
        checkpointed_s = take_user_recompute_seconds()
        most = self.profile._most_moved
        first_move = any(nbytes > most.get(tier, 0) for tier, nbytes in moved.items())
        for tier, nbytes in moved.items():
            most[tier] = max(most.get(tier, 0), nbytes)
        record = StepRecord(
            forward_s=timer.seconds(self._begun, self._forward_end),
            backward_s=timer.seconds(self._forward_end, end),
            held_bytes=self._held,
            peak_bytes=peak,
            recomputed=self.recomputed,
            policy_s=self.policy_s,
            moved={tier: nbytes for tier, nbytes in moved.items() if nbytes},
            cold=self.cold,
            recompute_s=recompute_s,
            faulted_bytes=faulted_since(self.faults) or 0,
            trim_s=stats.returned_seconds + mapping_s() - self._mapped,
            checkpointed_s=checkpointed_s,
            first_move=first_move,
            room_bytes=self.room,
        )
        self.profile._finished(self, record)


class QuietStep:
    """A step run as plain autograd (rule 8): timed from the model's call to its backward's end.

    The end of forward is the model's output; the end of backward is an
    autograd callback queued when the gradient reaches that output (a hook on
    that one tensor). ``ended`` turns True then, or when the output is freed
    without a backward, or when two later steps began and it still waits.
    """

    def __init__(
        self,
        profile: Profile,
        root: nn.Module,
        device: torch.device,
        recomputed: tuple[str, ...],
        stats: Any = None,
        faults: int | None = None,
    ) -> None:
        # Counted from the session's start where it began a step (read there: a getrusage
        # is a system call, and on a busy 2-core machine one right after torch's kernels
        # waits for a core); none on CUDA, where the pages are host memory and not priced
        # (NOTE [ Plan ] rule 8).
        if faults is None and device.type != "cuda":
            faults = minor_faults()
        self.profile = weakref.ref(profile)
        self.recomputed = recomputed
        self.stats = stats  # the session's: its trim thread counts its calls there
        self.trims = self._returning()
        self.trim_s = 0.0
        self.timer: CpuTimer | CudaTimer = (
            CudaTimer(device) if device.type == "cuda" else CpuTimer(profile.clock)
        )
        self.begun = self.timer.mark()
        self.faults = None if device.type == "cuda" else faults
        self.faulted = 0
        self.forward_end: Any = None
        self.end: Any = None
        self.ended = False
        self.when_ended: list[Callable[[], object]] = []  # called once, as it ends
        self._queued = False
        self._handle = root.register_forward_hook(self._forward_ended)

    def _forward_ended(self, module: nn.Module, args: Any, output: Any) -> None:
        self._handle.remove()
        self.forward_end = self.timer.mark()
        tensor = next(
            (t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad),
            None,
        )
        if tensor is None:
            self._end()  # no backward goes through the model's output
            return
        tensor.register_hook(self._backward_reached)
        weakref.finalize(tensor, self._freed)

    def _backward_reached(self, grad: Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end()  # what ends with the step (Auto's lease on the session pool) is in its time
        self.end = self.timer.mark()
        self.faulted = faulted_since(self.faults) or 0
        self.trim_s = self._returning() - self.trims

    def _returning(self) -> float:
        """Seconds spent handing memory back so far: the session's trims and the session
        pool's mapping and unmapping (NOTE [ Plan ] rule 8)."""
        return (0.0 if self.stats is None else self.stats.returned_seconds) + mapping_s()

    def _freed(self) -> None:
        self._end()

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        for call in self.when_ended:
            call()
        self.when_ended = []

    def over(self) -> bool:
        """Whether nothing more will come of it: it ended, and its times were taken or lost."""
        return self.ended and self.end is None

    def abandon(self) -> None:
        self._handle.remove()
        self.ended, self.end = True, None

    def record(self, *, final: bool) -> StepRecord | None:
        """Its times, once its backward ended and (on CUDA) its events completed.

        ``final`` waits for the events instead of asking again later.
        """
        if self.end is None or self.forward_end is None:
            return None
        if not final and not self.timer.done(self.end):
            return None
        profile = self.profile()
        recompute_s = None if profile is None else profile.take_recompute_seconds(self.recomputed)
        checkpointed_s = take_user_recompute_seconds()
        timer = self.timer
        self.end, end = None, self.end
        return StepRecord(
            forward_s=timer.seconds(self.begun, self.forward_end),
            backward_s=timer.seconds(self.forward_end, end),
            held_bytes=0,
            peak_bytes=None,
            recomputed=self.recomputed,
            recompute_s=recompute_s,
            faulted_bytes=self.faulted,
            trim_s=self.trim_s,
            checkpointed_s=checkpointed_s,
        )


def read_quiet(steps: list[QuietStep], *, final: bool) -> tuple[list[StepRecord], list[QuietStep]]:
    """The times of the quiet ``steps`` whose backward ended and whose events completed,
    and the steps still waiting for theirs (the last two at most: no step waits on more
    than the two before it)."""
    records: list[StepRecord] = []
    pending: list[QuietStep] = []
    for quiet in steps:
        if quiet.forward_end is None:
            quiet.abandon()  # its forward never ended (it raised): its hook goes
            continue
        record = quiet.record(final=final)
        if record is not None:
            records.append(record)
        elif not quiet.over():
            pending.append(quiet)
    for old in pending[:-2]:
        old.abandon()
    return records, pending[-2:]


def mapping_s() -> float:
    """Seconds the session pool spent mapping and unmapping blocks so far, on every
    thread (NOTE [ Plan ] rule 8); 0.0 where it is not built."""
    pooled = _pool.counts()
    return 0.0 if pooled is None else pooled.mapping_s


def device_held(stats: StashStats, device: torch.device) -> int:
    """The eligible saved bytes a session holds on ``device`` (NOTE [ Plan ] rule 1).

    On the CPU the host is the device: bytes kept and bytes in the host tier
    (compressed, or waiting for the disk writer) are all in its RAM. On CUDA
    the host tier's bytes are in host RAM, not on the device: a step's real
    peak there (``max_memory_allocated``) holds only what stayed. Counted as
    held, they would make the real peak predicted for a plan that copies to
    the host too low by the bytes copied (docs/figures/profile.md).
    """
    tiers = stats.tiers
    held = tiers["kept"].live_bytes + stats.hot.live
    if device.type == "cpu":
        held += tiers["host"].live_bytes
    return held


def _already_checkpointed(module: nn.Module) -> str | None:
    """Why ``module`` must not be recomputed again: the user already checkpoints it or around it."""
    if is_checkpointed(module):
        return ALREADY_RECOMPUTED
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    checkpointed = getattr(top[0], "__module__", None) == "torch.utils.checkpoint" if top else False
    if checkpointed and not in_plan_region():
        return "runs inside a region already checkpointed"
    return None


def _device_of(module: nn.Module, args: tuple[Any, ...]) -> torch.device | None:
    for value in args:
        if isinstance(value, Tensor):
            return value.device
    for parameter in module.parameters():
        return parameter.device
    return None
