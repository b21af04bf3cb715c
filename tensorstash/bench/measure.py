"""One step of one variant: its time, its real memory, its gradients, the plan it ran.

Rules 2, 4, 5 and 10 of NOTE [ Fair comparison ] (rounds.py) live here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import tensorstash as ts
from tensorstash.bench.compiled import CompiledForwards, graphs_compiled
from tensorstash.bench.timeline import Timeline
from tensorstash.bench.variants import (
    BASELINE,
    NO_PLAN,
    runs_on_copy,
    variant_context,
    variant_copy,
)
from tensorstash.bench.workloads import Workload, checked_loss, to_device
from tensorstash.memory._memory import meter, return_free_memory

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``--dtype``: float32, or the forward under bfloat16 autocast (weights stay float32)."""


@dataclass(frozen=True)
class PlanReading:
    """What the planner predicted for a step (``session.plan``; rule 6 of the NOTE).

    Attributes:
        predicted_step_s: forward and backward seconds of a step with this plan.
        predicted_peak_bytes: the real peak growth of such a step.
        recompute: the module paths the plan recomputes.
        base_step_s: the plan's step with nothing recomputed or moved (what
            its prediction adds its costs to), or None.
        settled: the planner has learned its plan (rule 3 of NOTE [ Fair
            comparison ]): no step under it still has to take its real peak
            (``Profile.peak_due``), and a plan that moves nothing has run a
            quiet step, after which it is made again once.
        compiler: what a plan for compiled code asks the compiler for
            (``CompilerPlan.asked``), else None.
        advice: a plan for compiled code whose budget buys no real memory says
            which budget would (``CompilerPlan.advice``), else None.
    """

    predicted_step_s: float | None
    predicted_peak_bytes: int | None
    recompute: tuple[str, ...]
    base_step_s: float | None = None
    settled: bool = True
    compiler: str | None = None
    advice: str | None = None


def read_plan(session: Any) -> PlanReading | None:
    """The plan a stash session ran under, or None (no session, or no planner yet)."""
    plan = getattr(session, "plan", None)
    if plan is None:
        return None
    step_s = getattr(plan, "predicted_step_s", None)
    peak = getattr(plan, "predicted_peak_bytes", None)
    base = getattr(plan, "base_step_s", None)
    profile = getattr(session, "profile", None)
    quiet = bool(getattr(plan, "quiet", False))
    own = getattr(plan, "settled", None)  # a plan for compiled code says itself
    settled = profile is None or (
        bool(own)
        if own is not None
        else not profile.peak_due and (not quiet or bool(profile.quiet_history))
    )
    return PlanReading(
        None if step_s is None else float(step_s),
        None if peak is None else int(peak),
        tuple(getattr(plan, "recompute", ()) or ()),
        float(base) if base else None,
        settled,
        getattr(plan, "asked", None),
        getattr(plan, "advice", None),
    )


@dataclass(frozen=True)
class StepResult:
    """What one step of one variant measured.

    Attributes:
        seconds: forward and backward, wall clock.
        grads_equal: every gradient bitwise equal to the reference (rule 4).
        grads_close: every gradient within float tolerance of it (a compiler that
            recomputes fuses the recomputed ops its own way: NOTE [ Compiled runs ]).
        stats: the stash session's ``stats.to_dict()`` (None without a session).
        peak_bytes: the real peak growth over the step (NOTE [ Real memory ]).
        plan: the planner's prediction for the step, if it made one.
        timeline: memory over the step (``--plot``), if recorded.
        graphs: the graphs torch.compile compiled during the step (NOTE [ Compiled
            runs ] rule 5).
    """

    seconds: float
    grads_equal: bool
    stats: dict[str, Any] | None
    peak_bytes: int
    plan: PlanReading | None = None
    timeline: dict[str, Any] | None = None
    graphs: int = 0
    grads_close: bool = True


class StepRunner:
    """The workload on its device, its weights and reference gradients, shared by every step.

    Args:
        workload: what to train; its model is moved to ``device``.
        device: where it runs.
        dtype: float32, or bfloat16 for a forward under autocast (rule 10).
        seed: the RNG seed of every step (rule 2).
        compile: run every variant on the compiled model (NOTE [ Compiled runs ]
            in compiled.py); the ``compile:<b>`` peers run compiled either way.
    """

    def __init__(
        self,
        workload: Workload,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        *,
        compile: bool = False,
    ) -> None:
        model = workload.model.to(device=device).train()
        self.workload = Workload(
            model,
            to_device(workload.batch, device),
            workload.blocks,
            workload.description,
            workload.checkpointing,
            workload.library_model,
        )
        self.model = model
        self.forwards = CompiledForwards(model, compile)
        self._compile = compile
        self._copies: dict[str, tuple[Workload, CompiledForwards]] = {}
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.batch = self.workload.batch
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.reference: list[Tensor | None] = []
        self.profiles: dict[str, ts.Profile] = {}
        self.activation_bytes: int | None = None
        self.plain_growth: int | None = None
        self.session: Any = None  # the stash session of the last step (None without one)

    def step(self, name: str, *, timeline: bool = False) -> StepResult:
        """Run one forward and backward under variant ``name`` and measure it.

        Args:
            name: the variant.
            timeline: record memory over the step (:class:`~tensorstash.bench.timeline.Timeline`).

        Returns:
            The step's time, gradient check, stash stats, real peak, plan and timeline.
        """
        # The last step's session goes first: alive, it would hold its lease on the session
        # pool, and this step would begin with the pool's waiting blocks resident and not
        # count them: its growth would read as a fraction of what it is
        # (docs/figures/planning.md).
        self.session = None
        workload, forwards = self._runs(name)
        self._reset(workload.model)
        return_free_memory(self.device)  # rule 3 of NOTE [ Real memory ]
        trace = Timeline(workload.model, self.device) if timeline else None
        forward = forwards(name.removesuffix(NO_PLAN))
        graphs = graphs_compiled()
        with meter(self.device, reset=True) as measured, trace or contextlib.nullcontext():
            start = time.perf_counter()
            with self.variant(name, base=measured.start_bytes) as session:
                if trace is not None:
                    trace.session = session
                with self.autocast():
                    loss = checked_loss(forward(*self.batch), workload)
                if trace is not None:
                    trace.backward_starts()
                loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            del loss
            if trace is not None:
                trace.sample()
        self.session = session
        equal = self._grads_equal(workload.model)
        return StepResult(
            seconds,
            equal,
            None if session is None else session.stats.to_dict(),
            measured.delta_bytes,
            read_plan(session),
            None if trace is None else trace.to_dict(),
            graphs_compiled() - graphs,
            equal or self._grads_equal(workload.model, close=True),
        )

    def model_for(self, name: str) -> Workload:
        """The workload variant ``name`` runs, under :meth:`variant` (a copy of the
        model for "checkpoint" and HF's peers, :meth:`_runs`)."""
        return self._runs(name)[0]

    def _runs(self, name: str) -> tuple[Workload, CompiledForwards]:
        """The workload a variant's step runs and its forwards.

        "checkpoint" and HF's peers (``runs_on_copy``) each run a copy of the model
        whose checkpointing was turned on once, at the variant's first step, and stays
        on, as a user turns it on (NOTE [ Compiled runs ] rule 7, NOTE [ HF peers ]
        rule 3), called through code of its own (:class:`_OwnCode`).
        """
        if not runs_on_copy(name):
            return self.workload, self.forwards
        if name not in self._copies:
            workload = variant_copy(name, self.workload)  # the copy is this variant's alone
            forwards = CompiledForwards(_OwnCode(workload.model), self._compile)
            self._copies[name] = (workload, forwards)
        return self._copies[name]

    def take_reference(self) -> None:
        """Plain autograd's gradients, and the activation bytes of one step (rule 4 of the NOTE).

        The activation bytes are what a ``Keep`` session counts as its kept
        tier's peak: the eligible saved bytes (parameters, buffers and tensors
        under ``min_bytes`` are skipped, not counted).
        """
        self.step(BASELINE)
        self.reference = [_grad_copy(p) for p in self.model.parameters()]
        # The base of a limit given as a share: what a plain step grows by, its first
        # run's one-time work left out (the process's first step imports and sets up).
        self.plain_growth = self.step(BASELINE).peak_bytes
        stats = self.step("keep").stats
        if stats is None:
            raise RuntimeError("tensorstash bench: a keep step had no session (a bug)")
        self.activation_bytes = int(stats["tiers"]["kept"]["peak_bytes"])

    def variant(
        self, name: str, *, base: int | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """The context variant ``name``'s step runs in, around :meth:`model_for`'s model:
        its session, or none ("checkpoint", HF's peers: that model checkpoints already);
        ``base``: what the device holds as the step begins (an ``auto:<limit>``'s base)."""
        if runs_on_copy(name):
            return contextlib.nullcontext()
        return variant_context(
            name,
            self.workload,
            self.device,
            self.profiles,
            activation_bytes=self.activation_bytes,
            plain_growth=self.plain_growth,
            base=base,
        )

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Rule 10: the forward under bfloat16 autocast, unless the run is float32."""
        if self.dtype == torch.float32:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def _reset(self, model: nn.Module) -> None:
        """Same weights, no gradients, same RNG state (rule 2 of the NOTE)."""
        model.load_state_dict(self.initial)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)

    def _grads_equal(self, model: nn.Module, *, close: bool = False) -> bool:
        """Whether every parameter's gradient of ``model`` (the workload's, or a copy of
        it) equals the reference bitwise (or, with ``close``, within float tolerance)."""
        grads = [p.grad for p in model.parameters()]
        if len(grads) != len(self.reference):
            return False
        same = (_close_bf16 if self.dtype == torch.bfloat16 else _close) if close else torch.equal
        return all(
            (g is None and r is None) or (g is not None and r is not None and same(g, r))
            for g, r in zip(grads, self.reference, strict=True)
        )


class _OwnCode(nn.Module):
    """A model called through a forward of its own (NOTE [ Compiled runs ] rule 7).

    Dynamo keeps compiled graphs by code object. The checkpointing copy's graphs
    break where checkpointing starts, before anything they guard on tells the copy
    from the shared model; kept on the model's own forward, they were found first
    for the shared model too, whose variants then ran other graphs than the
    reference's, and their gradients differed from it in the last bit.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        return self.model(*args)


def _close(a: Tensor, b: Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6)


BF16_CLOSE = 1.6e-2
"""Under bfloat16 autocast, gradients are close whose difference's norm is within this
share of the reference's (twice bfloat16's epsilon). Inductor computes a bf16 region in
float32 and rounds where it stores: a recomputed op fused into backward skips a rounding
its forward made, which moves an HF GPT-2's gradients by 5e-3 of their norm; dropout
recomputed with other random values moves them by 0.76."""


def _close_bf16(a: Tensor, b: Tensor) -> bool:
    reference = b.float()
    return bool((a.float() - reference).norm() <= BF16_CLOSE * reference.norm() + 1e-12)


def _grad_copy(parameter: Tensor) -> Tensor | None:
    """A detached copy of ``parameter.grad`` (None if it has none)."""
    return None if parameter.grad is None else parameter.grad.detach().clone()


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


def dtype_name(dtype: torch.dtype) -> str:
    """The ``--dtype`` name of ``dtype`` ("float32", "bfloat16")."""
    return next(name for name, value in DTYPES.items() if value == dtype)
