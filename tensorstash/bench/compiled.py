"""``tensorstash bench --compile``: variants on a compiled model, the compiler's budgets as peers.

# NOTE [ Compiled runs ]
1. With ``--compile`` every variant runs the model through ``torch.compile``
   (inductor): "none" is the compiled model alone, the baseline every ratio
   is taken against, and a stash or a peer runs around the same compiled
   model, as a user who compiles would run it.
2. The compiler's own means are peers: ``compile:<b>`` runs the model
   compiled with the partitioner's activation memory budget ``b``
   (``torch._functorch.config.activation_memory_budget``: 1.0 is the default
   partitioner, 0 recomputes all it can). Each has a backend of its own that
   sets the budget while it compiles: dynamo guards on the backend, not on
   functorch settings, so variants sharing one backend would share the first
   graphs compiled, whatever the setting was then. The peers run in any
   bench, ``--compile`` or not.
3. Compiled code is compared under ``torch.use_deterministic_algorithms``:
   inductor's CPU kernels otherwise scatter-add with atomics, and a tied
   embedding's gradient then differs by an ulp from run to run, with or
   without a stash.
4. The variants share one model, so their graphs hang off the same code
   objects: the recompile limit is raised for the run, so that no variant
   silently falls back to eager.
5. Compiling is not stepping. A step that compiled a graph is a warm-up
   step; its time beyond the variant's median timed step is counted as
   compile time, apart from step time, and the graphs each variant compiled
   are counted, those in timed steps (a recompile loop) apart.
6. "recompute" is skipped (its row says why): its regions wrap the model's
   blocks with module hooks each step, which the compiled graphs run inside,
   and wrapping and unwrapping them changes the code dynamo guards on, so
   the variants after it ran other graphs. The ``compile:<b>`` peers are
   what recomputes compiled code; "checkpoint" is the user's own
   checkpointing, which dynamo traces.
7. "checkpoint" runs a copy of the model whose checkpointing is turned on
   once, at its first step, and stays on, as a user turns it on
   (``StepRunner.model_for``): turned on and off each step on the shared
   model, HF's made a new checkpoint function the graphs guard on, and
   stacked a hook on the input embeddings that nothing took off, so every
   variant compiled again in every timed step. The copy is called through a
   forward of its own: its graphs break where checkpointing starts, before
   anything they guard on tells the copy from the shared model, and kept on
   the model's own forward they were found first for every other variant,
   which then ran other graphs than the reference's (gradients "close").
8. ``compile:offload`` is the compiler's own offload, on CUDA: the default
   partitioner with ``torch._functorch.config.enable_activation_offloading``,
   its copies on a side stream (``activation_offload_separate_stream``) and
   their waits sunk as late as they go (``activation_offload_sink_wait``).
   In torch 2.13 nothing marks what it offloads: a joint-graph pass of the
   bench's marks every node of the forward ``should_offload``, and the
   partitioner offloads those of them it keeps for backward and can
   (intermediates, contiguous, no views). On the CPU the host is the device:
   the row is skipped, with that reason; before torch 2.10 there is no such
   offload, and the row says so. It is an optional peer (rule 11 of NOTE
   [ Fair comparison ] in rounds.py): where it fails to compile or run, its
   row is skipped with its error, and the rest of the bench goes on.
9. ``--compile`` runs every ``compile:<b>`` row and ``compile:offload`` beside
   the variants, unless ``--policies`` names some of them: then those only.
   Each is a compile of its own, and on a large model a compile takes longer
   than the steps do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

COMPILE_PREFIX = "compile:"
"""``compile:<b>`` runs the model compiled with the partitioner's memory budget ``b`` (rule 2)."""
COMPILE_PEERS: tuple[str, ...] = (
    "compile:1.0", "compile:0.5", "compile:0.25", "compile:0.1", "compile:0",
)  # fmt: skip
"""The compiler's own budgets that ``--compile`` runs beside the variants."""
COMPILE_OFFLOAD = "compile:offload"
"""The compiler's own offload to the host (rule 8), beside them on CUDA."""
COMPILE_RUNS: tuple[str, ...] = (*COMPILE_PEERS, COMPILE_OFFLOAD)
"""The compiler's own rows that ``--compile`` runs."""
RECOMPILE_LIMIT = 64
"""Graphs kept per code object during a compiled run (rule 4)."""
COMPILE_MODES: tuple[str, ...] = (
    "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
)  # fmt: skip
"""The modes of ``torch.compile`` (inductor's) that ``--compile-mode`` takes."""
CUDA_GRAPH_MODES: tuple[str, ...] = ("reduce-overhead", "max-autotune")
"""The modes that record CUDA graphs: on the CPU inductor leaves the graphs out."""


@dataclass(frozen=True)
class CompileOptions:
    """How ``--compile`` compiles the model: the arguments it passes to ``torch.compile``.

    The ``compile:<b>`` peers compile with the same options under their own backend, which
    hands the mode's inductor settings to inductor (``torch.compile`` takes a mode for its
    own inductor backend only).

    Attributes:
        mode: inductor's mode, one of :data:`COMPILE_MODES`. "reduce-overhead" and
            "max-autotune" record CUDA graphs, which run on CUDA only: on the CPU
            inductor leaves them out and compiles as the mode without them does, so
            :meth:`check` refuses them there rather than report a mode that did not run.
        fullgraph: one graph per compiled function; a graph break is an error,
            raised by the variant whose code breaks it.
        dynamic: compile with dynamic shapes from the first step (None: torch's own
            choice, static until a shape changes).

    Example:
        >>> CompileOptions(mode="reduce-overhead").check(torch.device("cuda"))
    """

    mode: str = "default"
    fullgraph: bool = False
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise ValueError(
                f"tensorstash bench: compile mode {self.mode!r} is not one of torch.compile's; "
                f"pass one of {', '.join(COMPILE_MODES)}"
            )

    def check(self, device: torch.device) -> None:
        """Raise ValueError where the options cannot run as asked on ``device``."""
        if self.mode in CUDA_GRAPH_MODES and device.type != "cuda":
            raise ValueError(
                f"tensorstash bench: --compile-mode {self.mode} records CUDA graphs, which "
                f"run on CUDA only (on the {device.type} inductor leaves them out and "
                "compiles as the default mode does); pass --device cuda, or "
                "--compile-mode default"
                + (" or max-autotune-no-cudagraphs" if self.mode == "max-autotune" else "")
            )

    def describe(self) -> str:
        """The options for people, e.g. ``mode reduce-overhead, fullgraph``."""
        parts = [f"mode {self.mode}"]
        if self.fullgraph:
            parts.append("fullgraph")
        if self.dynamic is not None:
            parts.append("dynamic shapes" if self.dynamic else "static shapes")
        return ", ".join(parts)

    def inductor_settings(self) -> dict[str, Any]:
        """The inductor settings of the mode, for a backend of the bench's own."""
        from torch._inductor import list_mode_options

        return dict(list_mode_options(self.mode, self.dynamic))

    def compile(self, model: nn.Module, backend: Callable[..., Any] | None = None) -> Any:
        """``torch.compile(model)`` with these options: inductor at the mode, or ``backend``."""
        if backend is None:
            return torch.compile(
                model, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic
            )
        return torch.compile(model, backend=backend, fullgraph=self.fullgraph, dynamic=self.dynamic)


def compile_budget(name: str) -> float | None:
    """The partitioner's budget of a ``compile:<b>`` name (None for other names).

    Raises:
        ValueError: a ``compile:`` name whose budget is not a number in [0, 1].
    """
    if not name.startswith(COMPILE_PREFIX):
        return None
    if name == COMPILE_OFFLOAD:
        return 1.0  # rule 8: the default partitioner, and its offload
    spec = name.removeprefix(COMPILE_PREFIX)
    try:
        budget = float(spec)
    except ValueError:
        budget = -1.0
    if not 0.0 <= budget <= 1.0:
        raise ValueError(
            f"tensorstash bench: {name!r}: the compiler's activation memory budget is a "
            f"number from 0 (recompute all it can) to 1 (the default partitioner), e.g. "
            f"compile:0.5; got {spec!r}"
        )
    return budget


def budget_backend(budget: float, options: CompileOptions | None = None) -> Callable[..., Any]:
    """Inductor with the partitioner's memory budget set while it compiles (rule 2), at the
    mode of ``options``."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    settings = (options or CompileOptions()).inductor_settings()

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(graph, example_inputs, config_patches=settings or None)

    return backend


def offload_backend(options: CompileOptions | None = None) -> Callable[..., Any]:
    """Inductor with the compiler's own offload while it compiles (rule 8): every forward
    node marked for it, copies on a side stream where the graph's tensors are on CUDA."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    settings = (options or CompileOptions()).inductor_settings()

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        on_cuda = any(getattr(t, "is_cuda", False) for t in example_inputs)
        with functorch_config.patch(
            enable_activation_offloading=True,
            activation_offload_separate_stream=on_cuda,
            activation_offload_sink_wait=on_cuda,
            joint_custom_pass=_OffloadForward(functorch_config.joint_custom_pass),
        ):
            return compile_fx(graph, example_inputs, config_patches=settings or None)

    return backend


class _OffloadForward:
    """Rule 8: the joint-graph pass that marks every forward node ``should_offload``, then
    runs the pass that was set, if any."""

    def __init__(self, then: Callable[[torch.fx.GraphModule, Any], Any] | None) -> None:
        self.then = then

    def __call__(self, joint: torch.fx.GraphModule, inputs: Any) -> Any:
        mark_offload(joint.graph)
        return joint if self.then is None else self.then(joint, inputs)


def mark_offload(joint: torch.fx.Graph) -> int:
    """Mark every node of a joint graph's forward ``should_offload`` (rule 8): how many."""
    from tensorstash.planning.compiler import forward_nodes

    marked = 0
    for node in forward_nodes(joint):
        if node.op == "call_function":
            node.meta["should_offload"] = True
            marked += 1
    return marked


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledForwards:
    """The forward each variant calls: the model, or its compiled forms (rules 1 and 2).

    Args:
        model: the model, on the device it runs on; its compiled forms share its
            parameters.
        compile: run every variant but the ``compile:<b>`` peers on
            ``torch.compile(model)``; :class:`CompileOptions` (or True, their
            defaults) say how the model and the peers are compiled.

    Raises:
        ValueError: options that cannot run on the model's device (:meth:`CompileOptions.check`).
    """

    def __init__(self, model: nn.Module, compile: bool | CompileOptions) -> None:
        self.model = model
        self.compile = bool(compile)
        self.options = compile if isinstance(compile, CompileOptions) else CompileOptions()
        device = next(model.parameters(), torch.empty(0)).device
        self.options.check(device)
        self._made: dict[str, Callable[..., Any]] = {}

    def __call__(self, name: str) -> Callable[..., Any]:
        """The callable variant ``name``'s forward runs."""
        budget = compile_budget(name)
        key = name if budget is not None else "compiled" if self.compile else "eager"
        made = self._made.get(key)
        if made is None:
            if name == COMPILE_OFFLOAD:
                made = self.options.compile(self.model, offload_backend(self.options))
            elif budget is not None:
                made = self.options.compile(self.model, budget_backend(budget, self.options))
            elif self.compile:
                made = self.options.compile(self.model)
            else:
                made = self.model
            self._made[key] = made
        return made


@contextlib.contextmanager
def compiled_run(active: bool) -> Iterator[None]:
    """Rules 3 and 4 for the run: deterministic algorithms, a raised recompile limit."""
    if not active:
        yield
        return
    import torch._dynamo

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch._dynamo.config.patch(cache_size_limit=RECOMPILE_LIMIT):
            yield
    finally:
        torch.use_deterministic_algorithms(before)
