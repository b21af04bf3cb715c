"""Measuring one step: its time, its memory, its gradients (NOTE [ Fair comparison ], rules 2-5)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch import Tensor, nn

import tensorstash as ts
from tensorstash.bench.variants import BASELINE, variant_context
from tensorstash.bench.workloads import Workload, checked_loss, to_device


def _current_rss() -> int:
    """The process's resident set size in bytes."""
    return int(psutil.Process().memory_info().rss)


def _high_water_rss() -> int | None:
    """Linux's VmHWM, the process's peak resident set, or None where unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_high_water_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _high_water_rss() is not None


def return_free_memory() -> None:
    """Collect garbage and hand glibc's free heap memory back to the OS (best effort)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """Measures how far the resident set grows over a region.

    Uses Linux's resettable high-water mark when it can, else samples
    ``psutil`` RSS from a thread every millisecond (which may miss short peaks).

    Example:
        >>> with PeakRss() as meter:
        ...     run_step()
        >>> meter.delta_bytes
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.delta_bytes = 0
        self._interval_s = interval_s
        self._start = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self._start = _current_rss()
        if not _reset_high_water_rss():
            self._sampled = self._start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is None:
            peak = _high_water_rss() or _current_rss()
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._sampled, _current_rss())
        self.delta_bytes = max(0, peak - self._start)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sampled = max(self._sampled, _current_rss())


TIMELINE_TIERS = ("kept", "host", "disk")


class Timeline:
    """Live bytes per tier over one step, sampled at every module's forward and backward.

    Each module's forward hook takes a sample when the module returns, and a
    hook on its output's gradient takes one when backward reaches it, just
    before its saved tensors are used and freed. A sample reads the live
    bytes per tier of the stash session (none without one) and, on CUDA,
    ``torch.cuda.memory_allocated`` above its value at the start of the step.

    Attributes:
        t_s: seconds since the step started, one per sample.
        tiers: live bytes of "kept", "host" and "disk", one list each.
        device: CUDA allocated bytes above the start, one per sample (None on the CPU).
        backward_at_s: when backward started.
        session: the stash session to read (set once it is open).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.t_s: list[float] = []
        self.tiers: dict[str, list[int]] = {tier: [] for tier in TIMELINE_TIERS}
        self.device: list[int] | None = [] if device.type == "cuda" else None
        self.backward_at_s = 0.0
        self.session: Any = None
        self._cuda = device if device.type == "cuda" else None
        self._model = model
        self._start = 0.0
        self._base = 0
        self._handles: list[Any] = []

    def __enter__(self) -> Timeline:
        self._start = time.perf_counter()
        if self._cuda is not None:
            self._base = torch.cuda.memory_allocated(self._cuda)
        self._handles = [m.register_forward_hook(self._forward) for m in self._model.modules()]
        self.sample()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def sample(self) -> None:
        """Record the live bytes now."""
        self.t_s.append(time.perf_counter() - self._start)
        tiers = None if self.session is None else self.session.stats.tiers
        for name, values in self.tiers.items():
            values.append(0 if tiers is None else int(tiers[name].live_bytes))
        if self.device is not None and self._cuda is not None:
            self.device.append(torch.cuda.memory_allocated(self._cuda) - self._base)

    def backward_starts(self) -> None:
        """Mark the end of forward."""
        self.sample()
        self.backward_at_s = self.t_s[-1]

    def _forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.sample()
        outputs = output if isinstance(output, tuple | list) else (output,)
        for value in outputs:
            if isinstance(value, Tensor) and value.requires_grad:
                value.register_hook(self._backward)

    def _backward(self, grad: Tensor) -> None:
        self.sample()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: ``t_s``, one list per tier, ``device`` and ``backward_at_s``."""
        return {
            "t_s": [round(t, 6) for t in self.t_s],
            **{name: list(values) for name, values in self.tiers.items()},
            "device": None if self.device is None else list(self.device),
            "backward_at_s": self.backward_at_s,
        }


@dataclass(frozen=True)
class StepResult:
    """What one step of one variant measured."""

    seconds: float
    grads_equal: bool
    stats: dict[str, Any] | None
    cuda_peak_bytes: int | None
    timeline: dict[str, Any] | None = None


class StepRunner:
    """The workload on its device, its weights and reference gradients, shared by every step."""

    def __init__(
        self, workload: Workload, device: torch.device, dtype: torch.dtype, seed: int
    ) -> None:
        self.workload = Workload(
            workload.model.to(device=device, dtype=dtype).train(),
            to_device(workload.batch, device, dtype),
            workload.blocks,
            workload.description,
        )
        self.model = self.workload.model
        self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.batch = self.workload.batch
        self.device = device
        self.seed = seed
        self.reference: list[Tensor | None] = []
        self.profiles: dict[str, ts.Profile] = {}

    def step(
        self, name: str, *, meter: PeakRss | None = None, timeline: bool = False
    ) -> StepResult:
        """Run one forward and backward under variant ``name`` and measure it.

        Args:
            name: the variant.
            meter: when given, free heap memory is returned to the OS first and
                the meter measures the step's resident memory (rule 3 of the NOTE).
            timeline: record live bytes per tier over the step (:class:`Timeline`).

        Returns:
            The step's time, gradient check, stash stats, CUDA peak and timeline.
        """
        self._reset()
        if meter is not None:
            return_free_memory()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        trace = Timeline(self.model, self.device) if timeline else None
        with meter or contextlib.nullcontext(), trace or contextlib.nullcontext():
            start = time.perf_counter()
            with variant_context(name, self.workload, self.device, self.profiles) as session:
                if trace is not None:
                    trace.session = session
                loss = checked_loss(self.model(*self.batch), self.workload)
                if trace is not None:
                    trace.backward_starts()
                loss.backward()
            if cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            del loss
            if trace is not None:
                trace.sample()
        stats = None if session is None else session.stats.to_dict()
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
        recorded = None if trace is None else trace.to_dict()
        return StepResult(seconds, self._grads_equal(), stats, peak, recorded)

    def take_reference(self) -> None:
        """Run plain autograd once and keep its gradients (rule 4 of the NOTE)."""
        self.step(BASELINE)
        self.reference = [_grad_copy(p) for p in self.model.parameters()]

    def _reset(self) -> None:
        """Same weights, no gradients, same RNG state (rule 2 of the NOTE)."""
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)

    def _grads_equal(self) -> bool:
        """Whether every parameter's gradient equals the reference bitwise."""
        grads = [p.grad for p in self.model.parameters()]
        if len(grads) != len(self.reference):
            return False
        return all(
            (g is None and r is None) or (g is not None and r is not None and torch.equal(g, r))
            for g, r in zip(grads, self.reference, strict=True)
        )


def _grad_copy(parameter: Tensor) -> Tensor | None:
    """A detached copy of ``parameter.grad`` (None if it has none)."""
    return None if parameter.grad is None else parameter.grad.detach().clone()


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; ValueError if it is CUDA and CUDA is missing."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"tensorstash bench: device {str(device)!r} requested but torch "
            f"{torch.__version__} sees no CUDA device; run with --device cpu or on a "
            "machine with a GPU and a CUDA build of torch"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(
            f"tensorstash bench: device {str(device)!r} is not supported; use cpu or cuda"
        )
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as a ``torch.dtype``; ValueError listing the valid names."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        dtype = str(dtype)
    if dtype not in DTYPES:
        raise ValueError(
            f"tensorstash bench: dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}"
        )
    return DTYPES[dtype]
